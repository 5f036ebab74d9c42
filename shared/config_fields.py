"""The one list of Kestrel's settings: name, parser, default, help and allowed values.

`shared.config.KestrelConfig` has one typed field per entry, in this order, and
`shared.config.build_config` fills them from the defaults, the profile, a config file, the
environment and the CLI. A new setting is a line here and a field there (a test checks both
ways).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.config_generation import normalize_override
from shared.spec_config import normalize_setting


@dataclass(frozen=True)
class Field:
    """One setting: its name (snake_case), parser (str -> value), default, help text and the
    allowed values (None: any). A default of None means "unset": the setting is optional
    (`int | None` in `KestrelConfig`) or derived from others by `build_config`."""

    name: str
    type: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None


def parse_bool(s: str | bool) -> bool:
    """A boolean setting's parser: 1/true/yes/on and 0/false/no/off/"" (any case).
    Raises ValueError for anything else."""
    if isinstance(s, bool):
        return s
    v = str(s).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {s!r}")


LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")  # Python logging's and uvicorn's


def parse_log_level(s: str) -> str:
    """A logging level any process understands (Python logging and uvicorn, which the
    frontend hands it to), in any case; returned upper-case. Raises ValueError otherwise."""
    v = str(s).strip().upper()
    if v not in LOG_LEVELS:
        raise ValueError(f"{s!r} is not one of {', '.join(lv.lower() for lv in LOG_LEVELS)}")
    return v


FIELDS: list[Field] = [
    Field("model", str, "models/SmolLM2-135M-Instruct", "Hugging Face model folder"),
    Field("served_model_name", str, None, "model name shown by the API (default: folder name)"),
    Field("host", str, "127.0.0.1", "HTTP bind address"),
    Field("port", int, 8000, "HTTP port"),
    Field("device", str, "auto", "cpu, cuda or auto", ("auto", "cpu", "cuda")),
    Field("dtype", str, "auto", "weight and activation dtype (auto: float32 on cpu, bfloat16 on cuda)",
          ("auto", "float32", "bfloat16", "float16")),
    Field("max_model_len", int, None, "max prompt + output tokens (default: model's, capped at 8192)"),
    Field("allow_long_max_model_len", parse_bool, False, "allow --max-model-len past the model's "
          "max_position_embeddings (as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN; refused otherwise)"),
    Field("block_size", int, 16, "tokens per KV block"),
    Field("max_num_seqs", int, 64, "max requests running at once"),
    Field("max_num_batched_tokens", int, 2048, "token budget of one step (prefill chunks + decodes)"),
    Field("kv_cache_gib", float, 1.0, "KV cache memory of each worker on the CPU path, GiB"),
    Field("enable_prefix_caching", parse_bool, True,
          "keep freed full KV blocks and reuse them for requests sharing a prefix"),
    Field("num_threads", int, 0, "torch intra-op threads of the worker (0: automatic, from the CPUs "
          "available to the process: one fewer on the CPU, capped at 32; at most 4 with a GPU)"),
    Field("seed", int, 0, "seed of dummy weights and of engine-chosen request seeds"),
    Field("instance_id", str, None, "id of this server instance (names shm segments and sockets; "
          "1-32 letters, digits, '.', '_' or '-')"),
    Field("runtime_dir", str, None, "private folder (0700, refused otherwise) for the resolved config "
          "and ipc sockets (default: $XDG_RUNTIME_DIR/kestrel-<instance> when usable, else "
          "/tmp/kestrel-<instance>)"),
    Field("engine_address", str, None, "ZMQ address the engine binds for frontends"),
    Field("worker_address", str, None, "ZMQ address the engine binds for worker results"),
    Field("ring_chunks", int, 8, "chunks in the engine->worker plan ring"),
    Field("ring_chunk_bytes", int, 1 << 20, "bytes per ring chunk; larger plans go over ZMQ"),
    Field("keepalive_s", float, 10.0, "seconds between SSE keep-alive comments"),
    Field("log_level", parse_log_level, "INFO", "logging level: critical, error, warning, info or debug"),
    Field("startup_timeout_s", float, 300.0, "seconds the supervisor waits for readiness"),
    # --- API limits and behaviour (OpenAI / Anthropic issues)
    Field("max_num_waiting", int, 256, "waiting-queue bound; beyond it requests get 503 + Retry-After"),
    Field("max_request_body_bytes", int, 8 << 20, "HTTP request body limit in bytes (413 beyond)"),
    Field("chat_template", str, None, "chat template: a Jinja file path or a bundled name (shared/chat_templates: qwen3); one that names "
          "no file or does not compile is refused at startup"),
    Field("tool_call_parser", str, None, "tool call parser", ("hermes", "qwen3_coder")),
    Field("reasoning_parser", str, None, "reasoning parser", ("qwen3",)),
    Field("api_key", str, None, "require this key on API routes (Bearer or x-api-key)"),
    Field("generation_config", str, "auto", "sampling defaults for requests that set none, as "
          "vLLM's: auto (the model folder's generation_config.json), vllm (none) or a folder "
          "(shared/config_generation.py)"),
    Field("override_generation_config", normalize_override, None, "JSON object of sampling "
          "defaults merged over --generation-config: temperature, top_p, top_k, min_p, "
          "repetition_penalty, max_new_tokens (also a ceiling on max_tokens); null removes one"),
    # --- operations (supervision, watchdog, shutdown, profile)
    Field("frontends", int, 1, "frontend processes sharing the port (SO_REUSEPORT)"),
    Field("shutdown_timeout", float, 30.0, "seconds to drain in-flight requests on SIGTERM; "
          "then they end with an error (503 / error event)"),
    Field("header_timeout", float, 10.0, "seconds a client has to send a request's headers "
          "(from its connect, or from the first byte of its next request); then 408 and closed"),
    Field("body_timeout", float, 30.0, "seconds a client has to send a request's body once its "
          "headers are in; then 408 in the API's error envelope and closed"),
    Field("max_incomplete_connections", int, 256, "connections per frontend still sending "
          "their headers; a new one beyond closes the one waiting longest"),
    Field("engine_standby", parse_bool, True, "keep a pre-imported spare engine and worker "
          "(about 0.3 GB RSS each) to restart a dead engine group without the imports"),
    Field("standby_idle_wait_s", float, 120.0, "seconds past the engine group's first 10 s that the "
          "supervisor waits for the group to be idle (services/supervisor/standby.py) before it makes "
          "the spares anyway, so that their imports do not take the cores from serving; 0: make them "
          "at 10 s, busy or not"),
    Field("restart_max", int, 5, "restarts of one process within restart_window_s before giving up"),
    Field("restart_window_s", float, 60.0, "window for restart_max, seconds"),
    Field("watchdog_config", str, None, "JSON file: timeout_s, dump_dir, processes"),
    Field("watchdog_timeout_s", float, 30.0, "seconds without progress before a stack dump"),
    Field("watchdog_dump_dir", str, None, "private folder (0700) for stack dumps, made at startup "
          "(default: kestrel-<instance>-dumps in $XDG_RUNTIME_DIR when usable, else /tmp, "
          "whatever --runtime-dir is)"),
    Field("watchdog_py_spy", str, "auto", "py-spy binary for stack dumps: auto (beside the "
          "interpreter, else on PATH), off (faulthandler only) or a path"),
    Field("worker_timeout_s", float, None,
          "engine: a step with no word from the workers this long has failed; the engine "
          "fails its requests and exits for a restart (default: 10 on cpu, 30 on cuda)"),
    Field("step_timeout_s", float, None,
          "engine: a step still running this long (workers beating, no result) is stuck; "
          "(default: 600 on cpu, where a long-context prefill chunk can take minutes, 180 on cuda)"),
    Field("profile", str, "auto", "settings profile: auto (by device and model size), cpu, sm90, "
          "gpu or none (shared/profiles.py)", ("auto", "cpu", "sm90", "gpu", "none")),
    Field("debug_utilities", parse_bool, False, "enable debug-only utility calls (e.g. sleep in a step)"),
    # --- GPU path
    Field("load_format", str, "auto", "auto (safetensors) or dummy (seeded random weights)", ("auto", "dummy")),
    Field("enforce_eager", parse_bool, False, "disable CUDA graphs"),
    Field("async_scheduling", parse_bool, True,
          "plan step N+1 while step N runs (decodes feed the workers' own pending token)"),
    Field("gpu_memory_utilization", float, 0.9, "fraction of GPU memory for weights, activations and KV"),
    Field("kv_cache_dtype", str, "auto", "KV cache dtype (auto: the model dtype; fp8_e4m3: per-layer "
          "scales, from the checkpoint or 1.0, CPU and CUDA; int8: per token and head scales, CPU only "
          "for now)", ("auto", "fp8_e4m3", "int8")),
    Field("quantization", str, "none", "weight quantization, as vLLM's --quantization: none (an FP8 "
          "checkpoint runs as FP8 on a GPU of compute capability 8.9+, else dequantized at load), "
          "int8 / int4 weight-only on the CPU (kernels/cpu_quant_linear.py), gguf on the CPU: the "
          "linear weights from the quantized blocks of the GGUF the folder records (kestrel "
          "fetch-model keeps it; Q4_0/Q4_1/Q4_K as int4 groups of 32, other types int8; "
          "services/worker/gguf_loader.py), or fp8 (W8A8 on CUDA 8.9+, bf16: a bf16 checkpoint "
          "quantized at load; kernels/fp8_linear.py), or awq / gptq (W4A16 on CUDA, bf16 / fp16: "
          "an AWQ / GPTQ checkpoint's 4-bit weights, also found from config.json with none; random "
          "packed weights with --load-format dummy; kernels/w4a16_linear.py)",
          ("none", "int8", "int4", "gguf", "fp8", "awq", "gptq")),
    Field("speculative_config", normalize_setting, None, "speculative decoding, JSON as vLLM's "
          "--speculative-config: {\"method\": \"ngram\"|\"draft_model\"|\"eagle\"|\"dflash\", "
          "\"num_speculative_tokens\": k, ...} (shared/spec_config.py; default off)"),
    # --- KV tier store (services/kvstore; docs/ARCHITECTURE.md §4 "Tiers")
    Field("kv_offload_cpu_gib", float, 0.0, "CPU tier of the kvstore: shm pool size, GiB (0: no offload)"),
    Field("kv_offload_disk_dir", str, None, "disk tier folder of the kvstore (needs --kv-offload-disk-gib)"),
    Field("kv_offload_disk_gib", float, None, "size limit of the disk tier, GiB (block files included)"),
    Field("kvstore_address", str, None, "ZMQ address the kvstore binds (default: ipc://<runtime_dir>/kvstore.sock)"),
    Field("kv_offload_block_bytes", int, None,
          "bytes of one KV block across all layers and ranks (default: from the model's config.json)"),
    Field("kv_offload_state_fraction", float, 0.5,
          "a hybrid model's share of --kv-offload-cpu-gib (and of --kv-offload-disk-gib) that holds "
          "its recurrent-state checkpoints, in (0, 1); unused for a dense model"),
]

FIELD_BY_NAME = {f.name: f for f in FIELDS}
SECRET_SETTINGS = frozenset({"api_key"})
