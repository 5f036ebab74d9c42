"""The startup report: what the engine and its workers found and how long each phase took,
as log lines (docs/ARCHITECTURE.md §8). The engine writes the report's facts to
`<runtime_dir>/startup_report.json`; the supervisor prints these lines once the server is
ready."""

from __future__ import annotations

from typing import Any

from shared.device import GIB


def _gib(n: Any) -> str:
    try:
        return f"{float(n) / GIB:.2f} GiB"
    except (TypeError, ValueError):
        return "?"


def _secs(v: Any) -> str:
    return f"{float(v):.2f} s" if isinstance(v, (int, float)) else "?"


_KNOWN = {"device", "dtype", "threads", "attention", "kernels", "weight_bytes", "kv_bytes",
          "quantization", "weight_bytes_held", "weight_format", "gguf_file", "gguf_tensors",
          "num_blocks", "block_size", "kv_tokens", "max_model_len", "load_seconds",
          "kv_alloc_seconds", "startup_s", "graph_sizes", "cuda_graph_sizes",
          "gpu_memory_bytes", "device_name", "rank", "pid", "kv_cache_dtype", "kv_scales"}


def format_startup_report(report: dict[str, Any]) -> list[str]:
    """The startup report as log lines (docs/ARCHITECTURE.md §8).

    report: what the engine writes to `<runtime_dir>/startup_report.json`:
      {"device": str (host description), "workers": [WorkerReady.report + rank, pid],
       "num_blocks": int, "block_size": int, "kv_tokens": int, "max_model_len": int,
       "phases": {name: seconds}}, and from the supervisor `threads_source` (how the
    worker's thread count was chosen) and the phase `ready`. Worker phases (load, kv alloc, worker startup) are
    seconds since the worker started; engine phases since the engine started; `ready`
    (added by the supervisor) since the supervisor started the processes.
    Lines: device and memory, kernels, weight and KV memory (with the KV dtype and its
    scales' source when the worker reports them), the weight format when it is FP8 (or an
    FP8 checkpoint dequantized), the GGUF file and what its tensors became (under
    --quantization gguf), KV blocks and tokens, graph
    sizes, time per phase, then any other worker facts.
    """
    lines = []
    workers = report.get("workers") or [{}]
    if report.get("device"):
        lines.append(f"device: {report['device']}")
    for w in workers:
        tag = f"worker {w.get('rank', 0)}"
        dev = w.get("device_name") or w.get("device", "?")
        mem = f", device memory {_gib(w['gpu_memory_bytes'])}" if w.get("gpu_memory_bytes") else ""
        threads = f", {w['threads']} threads" if w.get("threads") else ""
        if threads and report.get("threads_source"):
            threads += f" (num_threads {report['threads_source']})"
        lines.append(f"{tag}: {dev}, {w.get('dtype', '?')}{threads}{mem}")
        kernels = w.get("kernels")
        if isinstance(kernels, dict):
            ktxt = ", ".join(f"{k} {v}" for k, v in kernels.items())
        else:
            ktxt = f"attention {w.get('attention', '?')}" + (f", {kernels}" if kernels else "")
        lines.append(f"{tag} kernels: {ktxt}")
        kv_fmt = ""
        if w.get("kv_cache_dtype"):  # the KV dtype in use and where its scales come from (§4.6)
            kv_fmt = f" ({w['kv_cache_dtype']}" + (f", scales {w['kv_scales']})" if w.get("kv_scales") else ")")
        quant = w.get("quantization")
        held = (f" ({quant}: {_gib(w.get('weight_bytes_held'))} held)"
                if quant not in (None, "none") else "")
        lines.append(f"{tag} memory: weights {_gib(w.get('weight_bytes'))}{held}, "
                     f"KV cache {_gib(w.get('kv_bytes'))}{kv_fmt}")
        if w.get("weight_format"):  # FP8 weights, or an FP8 checkpoint dequantized (§6.3)
            lines.append(f"{tag} weights: {w['weight_format']}")
        if w.get("gguf_file"):  # the GGUF the weights came from (--quantization gguf)
            lines.append(f"{tag} gguf file: {w['gguf_file']}")
        gguf = w.get("gguf_tensors")
        if isinstance(gguf, dict):  # what each GGUF tensor became (services/worker/gguf_loader.py)
            lines.append(f"{tag} gguf tensors: " + ", ".join(f"{k} x{v}" for k, v in gguf.items()))
        graphs = w.get("graph_sizes", w.get("cuda_graph_sizes"))
        gtxt = (", ".join(str(g) for g in graphs) if graphs else
                "none (eager)" if graphs is not None or w.get("device", "cpu") != "cpu"
                else "none (cpu runs eagerly)")
        lines.append(f"{tag} graph sizes: {gtxt}")
        extra = {k: v for k, v in w.items() if k not in _KNOWN}
        if extra:
            lines.append(f"{tag} other: " + ", ".join(f"{k}={v}" for k, v in sorted(extra.items())))
    lines.append(f"KV blocks: {report.get('num_blocks', '?')} of {report.get('block_size', '?')} "
                 f"tokens = {report.get('kv_tokens', '?')} KV tokens; "
                 f"max_model_len {report.get('max_model_len', '?')}")
    phases = dict(report.get("phases") or {})
    w0 = workers[0]
    ordered = {"load": w0.get("load_seconds"), "kv alloc": w0.get("kv_alloc_seconds"),
               "worker startup": w0.get("startup_s")}
    ordered.update(phases)
    lines.append("phases: " + ", ".join(f"{k} {_secs(v)}" for k, v in ordered.items()
                                        if v is not None))
    return ["startup report: " + s for s in lines]
