"""Where a decode step's time goes, on the GPU: per-kernel GPU time (torch.profiler) of an
eager batch-1 step at 1K context and of a CUDA-graph batch-256 step at 1K context, the
phases of the batch-1 graph step (host prepare, graph replay, logits, sampling) timed with
events, and the sampler alone (per-row torch.Generator draws, the old way, against the
hashed-noise torch reference and the Triton kernel) at 256 x vocab rows.

Diagnostic, not a target benchmark. Writes JSON to --out and prints a table. With
programmatic dependent launch (`kernels.pdl`, on by default) a kernel starts before the one
before it ends and waits inside, so its profiled time includes that wait: `--pdl off` gives
each kernel's own time.
--decode-fusion on profiles the MoE decode path and the in-kernel split merge, off neither, default the
module defaults (the MoE decode path on, the merge off).
--glue on|off profiles a hybrid with its decode glue fused or not (qwen3_next_blocks.FUSED_GLUE; default: the
module's, on); --quantization fp8 and --kv-cache-dtype fp8_e4m3 profile quantized weights / KV.
--stack off builds it with its projections apart (qwen3_next.STACK_PROJECTIONS, on by default).
Usage: python benchmarks/step_profile.py [--config qwen3-0.6b] [--pdl on|off] [--parts all|b1]
       [--decode-fusion on|off|default] [--glue on|off|default] [--stack on|off]
       [--quantization none|fp8] [--kv-cache-dtype auto|fp8_e4m3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import device_name, model_dir  # noqa: E402
from kernels import attention_triton as at  # noqa: E402
from kernels import moe, pdl, rope_decode, sampling, sampling_noise  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from services.worker.models import qwen3_next, qwen3_next_blocks  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  # noqa: E402

SAMP = SamplingParams(temperature=0.6, seed=1)


def plan(b: int, ctx: int, blocks_per_seq: int) -> StepPlan:
    """A decode step of b seqs at context ctx, seq i on its own blocks and (a hybrid model's)
    state slot i; a dense model ignores the slots."""
    return StepPlan(0, [ScheduledSeq(f"r{i}", [i + 1], ctx, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                                     True, SAMP, 1, state_slot=i) for i in range(b)])


def kernel_table(fn, top: int = 14) -> list[dict]:
    """GPU time per kernel name of one call of fn (after a warm-up call)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append({"name": e.key[:70], "calls": e.count, "us": round(t, 1)})
    rows.sort(key=lambda r: -r["us"])
    total = round(sum(r["us"] for r in rows), 1)
    return [{"name": "TOTAL", "calls": sum(r["calls"] for r in rows), "us": total}] + rows[:top]


def median_ms(fn, reps: int = 30) -> float:
    ts = []
    for _ in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts[3:])


def old_generator_sample(logits, temp, seeds):
    """The round-1 draw: one seeded torch.Generator call per row (kept here to time it)."""
    probs = torch.softmax(logits.float() / temp[:, None], dim=-1)
    noise = torch.empty_like(probs)
    gen = torch.Generator(device=logits.device)
    for j, s in enumerate(seeds):
        gen.manual_seed(s)
        noise[j].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)


def b1_phases(runner, graphs, p1: StepPlan) -> dict:
    """Phases of the batch-1 graph step in ms: host prepare and launch, graph replay, logits,
    sampling (GPU, events) and the whole execute (wall)."""
    seqs = p1.seqs
    t_host = []
    for _ in range(50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner._decode_graph(seqs)
        t_host.append(time.perf_counter() - t0)
    g1 = graphs.graphs[1]
    hidden = graphs.outputs[1]
    logits = runner.model.compute_logits(hidden)
    return {
        "host_prepare_and_launch": round(statistics.median(t_host) * 1e3, 4),
        "graph_replay_gpu": round(median_ms(g1.replay), 4),
        "logits_gpu": round(median_ms(lambda: runner.model.compute_logits(hidden)), 4),
        "sample_gpu": round(median_ms(lambda: runner.sampler.sample(logits, seqs)), 4),
        "execute_wall": round(median_ms(lambda: runner.execute(p1)), 4),
    }


def report(res: dict) -> None:
    """Print the kernel tables and phases that res holds."""
    for k in ("eager_b1_kernels", "graph_b1_kernels", "graph_b256_kernels", "prefill_16x1024_kernels"):
        if k in res:
            print(f"== {k}")
            for r in res[k]:
                print(f"{r['us']:>10.1f} us {r['calls']:>5}  {r['name']}")
    for k in ("b1_phases_ms", "sampler_256_ms"):
        if k in res:
            print(k, json.dumps(res[k]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen3-0.6b")
    ap.add_argument("--out", default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                    help="the runner's share of GPU memory; a 61 GB MoE shape needs about 0.8")
    ap.add_argument("--pdl", choices=["on", "off"], default="on")
    ap.add_argument("--parts", choices=["all", "b1"], default="all")
    ap.add_argument("--decode-fusion", choices=["on", "off", "default"], default="default",
                    help="on / off: both the MoE decode path (kernels.moe.DECODE_FUSED, on by default) and the "
                         "decode kernels' in-kernel split merge (fused_merge, off by default); default: the "
                         "module defaults (docs/ARCHITECTURE.md §6.4)")
    ap.add_argument("--glue", choices=["on", "off", "default"], default="default",
                    help="on: a hybrid's decode glue in fused kernels (services.worker.models.qwen3_next_blocks.FUSED_GLUE; "
                         "default: the module's, on)")
    ap.add_argument("--quantization", choices=["none", "fp8"], default="none")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto")
    ap.add_argument("--stack", choices=["on", "off"], default="on",
                    help="a hybrid's stacked projections (qwen3_next.STACK_PROJECTIONS, read when the model is built)")
    a = ap.parse_args()
    pdl.ENABLED = a.pdl == "on"
    if a.glue != "default":
        qwen3_next_blocks.FUSED_GLUE = a.glue == "on"
    qwen3_next.STACK_PROJECTIONS = a.stack == "on"
    if a.decode_fusion != "default":  # read when the runner captures its graphs
        on = a.decode_fusion == "on"
        moe.DECODE_FUSED = on
        rope_decode.ROPE_DECODE_DEFAULTS["fused_merge"] = at.DECODE_DEFAULTS["fused_merge"] = on
    b1_only = a.parts == "b1"
    cli = {"model": model_dir(a.config), "load_format": "dummy", "device": "cuda", "dtype": "bfloat16",
           "max_num_seqs": 8 if b1_only else 256, "max_num_batched_tokens": 4096, "max_model_len": 4096,
           "gpu_memory_utilization": a.gpu_memory_utilization, "quantization": a.quantization,
           "kv_cache_dtype": a.kv_cache_dtype}
    runner = ModelRunner(build_config(cli=cli, env={}))
    res: dict = {"benchmark": "step_profile", "device": device_name(), "config": a.config, "pdl": a.pdl,
                 "parts": a.parts, "moe_decode_fused": moe.DECODE_FUSED,
                 "fused_merge": rope_decode.ROPE_DECODE_DEFAULTS["fused_merge"], "decode_fusion": a.decode_fusion,
                 "fused_glue": qwen3_next_blocks.FUSED_GLUE, "quantization": a.quantization,
                 "kv_cache_dtype": a.kv_cache_dtype,
                 "stacked_projections": bool(getattr(runner.model, "stacked", False))}
    nbps = -(-1100 // runner.block_size)
    p1 = plan(1, 1024, nbps)
    graphs = runner.graphs
    runner.graphs = None
    res["eager_b1_kernels"] = kernel_table(lambda: runner.execute(p1))
    runner.graphs = graphs
    if not b1_only:
        res["graph_b256_kernels"] = kernel_table(lambda: runner.execute(plan(256, 1024, nbps)))
    res["graph_b1_kernels"] = kernel_table(lambda: runner.execute(p1))
    if b1_only:
        res["b1_phases_ms"] = b1_phases(runner, graphs, p1)
        report(res)
        if a.out:
            with open(a.out, "w") as fh:
                json.dump(res, fh, indent=1)
        return
    # a prefill step of the offline workload's size: 16 prompts of 1024 tokens (16,384 tokens)
    pf = StepPlan(0, [ScheduledSeq(f"p{i}", list(range(1, 1025)), 0,
                                   list(range(i * nbps, (i + 1) * nbps)), True, SAMP, 0, state_slot=i)
                    for i in range(16)])
    res["prefill_16x1024_kernels"] = kernel_table(lambda: runner.execute(pf))
    res["prefill_16x1024_ms"] = round(median_ms(lambda: runner.execute(pf), reps=5), 3)
    res["b1_phases_ms"] = b1_phases(runner, graphs, p1)
    logits = runner.model.compute_logits(graphs.outputs[1])
    # the sampler alone, 256 rows of the model's vocab
    vocab = logits.shape[1]
    lg = torch.randn(256, vocab, device="cuda") * 3
    temp = torch.full((256,), 0.6, device="cuda")
    seeds = [sampling_noise.mix_seed(i, 9) for i in range(256)]
    z, o, zf = torch.zeros(256, dtype=torch.long, device="cuda"), torch.ones(256, device="cuda"), torch.zeros(256, device="cuda")
    res["sampler_256_ms"] = {
        "old_per_row_generator": round(median_ms(lambda: old_generator_sample(lg, temp, seeds), 5), 4),
        "hashed_torch_ref": round(median_ms(lambda: sampling.sample_ref(lg, temp, z, o, zf, seeds, False), 10), 4),
        "hashed_triton": round(median_ms(lambda: sampling.sample(lg, temp, z, o, zf, seeds, False)), 4),
        "top_p_0.9_path": round(median_ms(lambda: sampling.sample(lg, temp, z, torch.full((256,), 0.9, device="cuda"), zf, seeds, True), 5), 4),
    }
    report(res)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
