"""The one config object, built in one place, with the source of every value.

Sources, lowest to highest precedence: `default`, `profile:<name>`, `config file`, `env`
(variables `KESTREL_<NAME>`), `cli`. The supervisor hands its resolved config to the child
processes as a JSON file (`--resolved-config`), which keeps each value's original source.

Code reads settings from a `KestrelConfig`; only this module reads `os.environ`.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

from shared.model_spec import kv_dtype_in_use


@dataclass(frozen=True)
class Field:
    """One setting: its name (snake_case), type, default and help text."""

    name: str
    type: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple | None = None


def _bool(s: str | bool) -> bool:
    if isinstance(s, bool):
        return s
    v = str(s).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {s!r}")


FIELDS: list[Field] = [
    Field("model", str, "models/SmolLM2-135M-Instruct", "Hugging Face model folder"),
    Field("served_model_name", str, None, "model name shown by the API (default: folder name)"),
    Field("host", str, "127.0.0.1", "HTTP bind address"),
    Field("port", int, 8000, "HTTP port"),
    Field("device", str, "auto", "cpu, cuda or auto", ("auto", "cpu", "cuda")),
    Field("dtype", str, "auto", "weight and activation dtype (auto: float32 on cpu, bfloat16 on cuda)",
          ("auto", "float32", "bfloat16", "float16")),
    Field("max_model_len", int, None, "max prompt + output tokens (default: model's, capped at 8192)"),
    Field("block_size", int, 16, "tokens per KV block"),
    Field("max_num_seqs", int, 64, "max requests running at once"),
    Field("max_num_batched_tokens", int, 2048, "token budget of one step (prefill chunks + decodes)"),
    Field("kv_cache_gib", float, 1.0, "KV cache memory of each worker on the CPU path, GiB"),
    Field("enable_prefix_caching", _bool, True,
          "keep freed full KV blocks and reuse them for requests sharing a prefix"),
    Field("num_threads", int, 0, "torch intra-op threads of the worker (0: all cores on the CPU, 4 with a GPU)"),
    Field("seed", int, 0, "seed of dummy weights and of engine-chosen request seeds"),
    Field("instance_id", str, None, "id of this server instance (names shm segments and sockets)"),
    Field("runtime_dir", str, None, "folder for ipc sockets (default: /tmp/kestrel-<instance>)"),
    Field("engine_address", str, None, "ZMQ address the engine binds for frontends"),
    Field("worker_address", str, None, "ZMQ address the engine binds for worker results"),
    Field("ring_chunks", int, 8, "chunks in the engine->worker plan ring"),
    Field("ring_chunk_bytes", int, 1 << 20, "bytes per ring chunk; larger plans go over ZMQ"),
    Field("keepalive_s", float, 10.0, "seconds between SSE keep-alive comments"),
    Field("log_level", str, "INFO", "logging level"),
    Field("startup_timeout_s", float, 300.0, "seconds the supervisor waits for readiness"),
    # --- API limits and behaviour (OpenAI / Anthropic issues)
    Field("max_num_waiting", int, 256, "waiting-queue bound; beyond it requests get 503 + Retry-After"),
    Field("max_request_body_bytes", int, 8 << 20, "HTTP request body limit in bytes (413 beyond)"),
    Field("chat_template", str, None, "chat template: a file path or a name under services/frontend/templates"),
    Field("tool_call_parser", str, None, "tool call parser", ("hermes", "qwen3_coder")),
    Field("reasoning_parser", str, None, "reasoning parser", ("qwen3",)),
    Field("api_key", str, None, "require this key on API routes (Bearer or x-api-key)"),
    # --- operations (supervision, watchdog, shutdown, profile)
    Field("frontends", int, 1, "frontend processes sharing the port (SO_REUSEPORT)"),
    Field("shutdown_timeout", float, 30.0, "seconds to drain in-flight requests on SIGTERM"),
    Field("restart_max", int, 5, "restarts of one process within restart_window_s before giving up"),
    Field("restart_window_s", float, 60.0, "window for restart_max, seconds"),
    Field("watchdog_config", str, None, "JSON file: timeout_s, dump_dir, processes"),
    Field("watchdog_timeout_s", float, 30.0, "seconds without progress before a stack dump"),
    Field("watchdog_dump_dir", str, None, "folder for stack dumps (default: /tmp/kestrel-<instance>-dumps)"),
    Field("worker_timeout_s", float, None,
          "engine: a step with no word from the workers this long has failed; the engine "
          "fails its requests and exits for a restart (default: 10 on cpu, 30 on cuda)"),
    Field("step_timeout_s", float, None,
          "engine: a step still running this long (workers beating, no result) is stuck; "
          "(default: 600 on cpu, where a long-context prefill chunk can take minutes, 180 on cuda)"),
    Field("profile", str, "auto", "settings profile: auto (by device and model size), cpu, sm90, "
          "gpu or none (shared/profile.py)", ("auto", "cpu", "sm90", "gpu", "none")),
    Field("debug_utilities", _bool, False, "enable debug-only utility calls (e.g. sleep in a step)"),
    # --- GPU path
    Field("load_format", str, "auto", "auto (safetensors) or dummy (seeded random weights)", ("auto", "dummy")),
    Field("enforce_eager", _bool, False, "disable CUDA graphs"),
    Field("async_scheduling", _bool, True,
          "plan step N+1 while step N runs (decodes feed the workers' own pending token)"),
    Field("gpu_memory_utilization", float, 0.9, "fraction of GPU memory for weights, activations and KV"),
    Field("kv_cache_dtype", str, "auto", "KV cache dtype (auto: the model dtype; fp8_e4m3 and int8 "
          "are refused until quantized KV is implemented)", ("auto", "fp8_e4m3", "int8")),
    # --- KV tier store (services/kvstore; DESIGN §4 "Tiers")
    Field("kv_offload_cpu_gib", float, 0.0, "CPU tier of the kvstore: shm pool size, GiB (0: no offload)"),
    Field("kv_offload_disk_dir", str, None, "disk tier folder of the kvstore (needs --kv-offload-disk-gib)"),
    Field("kv_offload_disk_gib", float, None, "size limit of the disk tier, GiB (block files included)"),
    Field("kvstore_address", str, None, "ZMQ address the kvstore binds (default: ipc://<runtime_dir>/kvstore.sock)"),
    Field("kv_offload_block_bytes", int, None,
          "bytes of one KV block across all layers and ranks (default: from the model's config.json)"),
]

FIELD_BY_NAME = {f.name: f for f in FIELDS}


@dataclass
class Setting:
    value: Any
    source: str


@dataclass
class KestrelConfig:
    """Effective settings with their sources. Attribute access gives the value."""

    settings: dict[str, Setting] = field(default_factory=dict)
    # Why the profile was chosen (device, model size); set by build_config, not serialized.
    profile_detail: str = ""

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["settings"][name].value
        except KeyError:
            raise AttributeError(name) from None

    def source(self, name: str) -> str:
        return self.settings[name].source

    def set(self, name: str, value: Any, source: str) -> None:
        self.settings[name] = Setting(value, source)

    def to_json(self) -> str:
        return json.dumps({k: [s.value, s.source] for k, s in self.settings.items()})

    @classmethod
    def from_json(cls, text: str) -> "KestrelConfig":
        data = json.loads(text)
        return cls({k: Setting(v, s) for k, (v, s) in data.items()})

    def table(self) -> str:
        """The effective settings, one per line: name, value, source."""
        width = max(len(k) for k in self.settings)
        return "\n".join(f"  {k:<{width}}  {_shown(k, s.value):<40} [{s.source}]"
                         for k, s in sorted(self.settings.items()))


SECRET_SETTINGS = frozenset({"api_key"})


def _shown(name: str, value: Any) -> str:
    """A setting's value as printed in the startup table: secrets are masked."""
    if name in SECRET_SETTINGS and value is not None:
        return "'***'"
    return repr(value)


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every setting as a `--flag` whose absence is recorded as None (not a default).

    A bool setting takes a value (`--enable-prefix-caching false`) or none (`--flag` alone
    means true), and also gets a negative flag `--no-<flag>` that sets it false.
    """
    for f in FIELDS:
        flag = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": f"{f.help} (default: {f.default})"}
        if f.type is _bool:
            kw.update(type=_bool, nargs="?", const=True, metavar="{true,false}")
        else:
            kw["type"] = f.type
        if f.choices:
            kw["choices"] = f.choices
        parser.add_argument(flag, **kw)
        if f.type is _bool:
            parser.add_argument("--no-" + flag[2:], dest=f.name, action="store_const", const=False,
                                default=None, help=f"set {flag} false")
    parser.add_argument("--config-file", default=None, help="JSON file of settings")
    parser.add_argument("--resolved-config", default=None, help=argparse.SUPPRESS)


def build_config(cli: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                 config_file: str | None = None, *, probe: Any = None) -> KestrelConfig:
    """Merge defaults, profile, config file, environment and CLI into one `KestrelConfig`.

    Precedence, lowest first: `default`, `profile:<name>`, `config file`, `env`, `cli`.
    The profile (shared/profile.py) is chosen from the merged `profile`, `device`, `model`,
    `dtype` and `max_model_len` of the explicit sources, and only fills settings that no
    explicit source set. With `profile` auto, the chosen name is stored with source
    `derived`. cli: parsed arguments (None for a flag not given). env: the environment
    (default os.environ). probe: a `shared.profile.DeviceInfo` to use instead of probing this
    host (tests). A `--resolved-config` file (from the supervisor) is returned as it is.
    Raises ValueError naming the setting for a value of the wrong type or an unknown key.
    """
    from shared.profile import choose_profile

    env = dict(os.environ) if env is None else env
    cli = cli or {}
    if cli.get("resolved_config"):
        with open(cli["resolved_config"]) as fh:
            return KestrelConfig.from_json(fh.read())
    cfg = KestrelConfig()
    for f in FIELDS:
        cfg.set(f.name, f.default, "default")
    explicit: list[tuple[str, Any, str]] = []  # (name, value, source), in precedence order
    path = config_file or cli.get("config_file")
    if path:
        with open(path) as fh:
            data = json.load(fh)
        if not isinstance(data, dict):
            raise ValueError(f"config file {path}: expected a JSON object of settings")
        for k, v in data.items():
            if k not in FIELD_BY_NAME:
                raise ValueError(f"unknown setting {k!r} in {path}")
            explicit.append((k, _convert(FIELD_BY_NAME[k], v), "config file"))
    for f in FIELDS:
        key = "KESTREL_" + f.name.upper()
        if key in env and env[key] != "":
            explicit.append((f.name, _convert(f, env[key]), "env"))
    for f in FIELDS:
        if cli.get(f.name) is not None:
            explicit.append((f.name, _convert(f, cli[f.name]), "cli"))
    merged = {f.name: f.default for f in FIELDS}
    merged.update({k: v for k, v, _ in explicit})
    profile = choose_profile(merged["profile"], merged["device"], merged["model"],
                             dtype=merged["dtype"], max_model_len=merged["max_model_len"],
                             probe=probe)
    if profile is not None:
        for k, v in profile.values.items():
            cfg.set(k, _convert(FIELD_BY_NAME[k], v), f"profile:{profile.name}")
        cfg.profile_detail = profile.reason
    for k, v, source in explicit:
        cfg.set(k, v, source)
    if profile is not None and cfg.profile == "auto":
        cfg.set("profile", profile.name, "derived")
    _validate(cfg)
    _derive(cfg)
    return cfg


def _validate(cfg: KestrelConfig) -> None:
    """Range checks of numeric settings, and no quantized KV cache (not implemented yet).
    Raises ValueError naming the setting."""
    positive = ("port", "block_size", "max_num_seqs", "max_num_batched_tokens", "ring_chunks",
                "ring_chunk_bytes", "frontends", "max_request_body_bytes")
    for name in positive:
        if getattr(cfg, name) is not None and getattr(cfg, name) <= 0:
            raise ValueError(f"setting {name}: must be positive, got {getattr(cfg, name)!r}")
    if not 0 < cfg.port < 65536:
        raise ValueError(f"setting port: {cfg.port} is not a TCP port")
    if cfg.kv_cache_gib is not None and cfg.kv_cache_gib <= 0:
        raise ValueError(f"setting kv_cache_gib: must be positive, got {cfg.kv_cache_gib!r}")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise ValueError("setting gpu_memory_utilization: must be in (0, 1], got "
                         f"{cfg.gpu_memory_utilization!r}")
    if cfg.max_model_len is not None and cfg.max_model_len <= 0:
        raise ValueError(f"setting max_model_len: must be positive, got {cfg.max_model_len!r}")
    kv_dtype_in_use(cfg.dtype, cfg.kv_cache_dtype)  # quantized KV: refused before any process starts


def _convert(f: Field, v: Any) -> Any:
    if v is None:
        return None
    try:
        out = f.type(v) if not isinstance(v, bool) or f.type is _bool else v
    except (TypeError, ValueError) as e:
        raise ValueError(f"setting {f.name}: {e}") from None
    if f.choices and out not in f.choices:
        raise ValueError(f"setting {f.name}: {out!r} is not one of {f.choices}")
    return out


def _derive(cfg: KestrelConfig) -> None:
    """Fill settings whose default depends on others (source `derived`)."""
    if cfg.instance_id is None:
        cfg.set("instance_id", uuid.uuid4().hex[:8], "derived")
    if cfg.runtime_dir is None:
        cfg.set("runtime_dir", f"/tmp/kestrel-{cfg.instance_id}", "derived")
    if cfg.engine_address is None:
        cfg.set("engine_address", f"ipc://{cfg.runtime_dir}/engine.sock", "derived")
    if cfg.worker_address is None:
        cfg.set("worker_address", f"ipc://{cfg.runtime_dir}/worker.sock", "derived")
    if cfg.kvstore_address is None:
        cfg.set("kvstore_address", f"ipc://{cfg.runtime_dir}/kvstore.sock", "derived")
    if cfg.served_model_name is None:
        cfg.set("served_model_name", os.path.basename(os.path.normpath(cfg.model)), "derived")
    if cfg.device == "auto":
        # No torch import here (the frontend and engine never need it): an NVIDIA device
        # node means a GPU host; the worker checks torch.cuda itself.
        dev = "cuda" if os.path.exists("/dev/nvidiactl") else "cpu"
        cfg.set("device", dev, "derived")
    if cfg.dtype == "auto":
        cfg.set("dtype", "bfloat16" if cfg.device == "cuda" else "float32", "derived")
    if cfg.worker_timeout_s is None:
        cfg.set("worker_timeout_s", 30.0 if cfg.device == "cuda" else 10.0, "derived")
    if cfg.step_timeout_s is None:
        cfg.set("step_timeout_s", 180.0 if cfg.device == "cuda" else 600.0, "derived")


def ring_name(instance_id: str, ring: str) -> str:
    """The /dev/shm name of one ring of an instance (DESIGN §3)."""
    return f"kestrel-{instance_id}-{ring}"
