"""The one config object, built in one place, with the source of every value.

`FIELDS` (shared/config_fields.py) is the one list of settings (name, parser, default, help,
choices); `KestrelConfig` is the typed, frozen object built from it, one field per setting,
plus each value's source. Sources, lowest to highest precedence: `default`,
`profile:<name>`, `config file`, `env` (variables `KESTREL_<NAME>`), `cli`; `derived` marks
a value computed from others (the runtime folder under `$XDG_RUNTIME_DIR` or /tmp, the
addresses from it, the device, the timeouts by device, the worker's threads from the CPUs
available). The supervisor hands its resolved config to the child processes as a
JSON file (`--resolved-config`), which keeps each value's original source.

Code reads settings from a `KestrelConfig` (`cfg.max_num_seqs`, an `int`); only this module
reads `os.environ`. A changed copy is `dataclasses.replace(cfg, name=value)` (tests).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.chat_template_source import check_chat_template
from shared.config_fields import FIELD_BY_NAME, FIELDS, SECRET_SETTINGS, Field, parse_bool
from shared.config_generation import GenerationDefaults
from shared.config_generation import resolve as resolve_generation_defaults
from shared.cpu_budget import resolve_num_threads
from shared.gguf_source import require_gguf
from shared.model_spec import kv_dtype_in_use, load_model_spec, model_spec_for
from shared.runtime_dir import runtime_base as runtime_dir_base
from shared.spec_config import SpeculativeConfig, check_speculative
from shared.weight_quant import check_fp8_setting, check_w4a16_setting, parse_capability


@dataclass(frozen=True, kw_only=True)
class KestrelConfig:
    """The effective settings: one typed field per `FIELDS` entry, in the same order (a test
    checks both ways; building one from other names fails), and `sources` (setting name ->
    its source). Built by `build_config` or `from_json`; never mutated. Units are in the names (`_s` seconds, `_gib` GiB,
    `_bytes` bytes). Settings whose `FIELDS` default is None but whose type here has no None
    are derived by `build_config` (source `derived`)."""

    model: str
    served_model_name: str          # derived: the model folder's name
    host: str
    port: int
    device: str                     # derived from auto: "cpu" or "cuda"
    dtype: str                      # derived from auto: "float32" on cpu, "bfloat16" on cuda
    max_model_len: int | None       # None: the model's (the engine decides)
    allow_long_max_model_len: bool
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_gib: float
    enable_prefix_caching: bool
    num_threads: int                # derived from 0/unset: shared.cpu_budget
    seed: int
    instance_id: str                # derived: 8 random hex digits
    runtime_dir: str                # derived: <$XDG_RUNTIME_DIR or /tmp>/kestrel-<instance_id>
    engine_address: str             # derived: ipc://<runtime_dir>/engine.sock
    worker_address: str             # derived: ipc://<runtime_dir>/worker.sock
    ring_chunks: int
    ring_chunk_bytes: int
    keepalive_s: float
    log_level: str
    startup_timeout_s: float
    max_num_waiting: int
    max_request_body_bytes: int
    chat_template: str | None
    tool_call_parser: str | None
    reasoning_parser: str | None
    api_key: str | None
    generation_config: str          # auto, vllm or a folder (shared.config_generation)
    override_generation_config: str | None  # canonical JSON (shared.config_generation); None/"": none
    frontends: int
    shutdown_timeout: float
    header_timeout: float
    body_timeout: float
    max_incomplete_connections: int
    engine_standby: bool
    standby_idle_wait_s: float      # seconds; 0: spares made without waiting for an idle group
    restart_max: int
    restart_window_s: float
    watchdog_config: str | None
    watchdog_timeout_s: float
    watchdog_dump_dir: str          # derived: <runtime base>/kestrel-<instance_id>-dumps
    watchdog_py_spy: str
    worker_timeout_s: float         # derived by device
    step_timeout_s: float           # derived by device
    profile: str                    # derived from auto: the profile chosen
    debug_utilities: bool
    load_format: str
    enforce_eager: bool
    async_scheduling: bool
    gpu_memory_utilization: float
    kv_cache_dtype: str
    quantization: str               # none, int8, int4, gguf (weight-only, CPU), fp8, awq, gptq (CUDA): check_quantization
    speculative_config: str | None  # canonical JSON (shared.spec_config); None: off
    kv_offload_cpu_gib: float
    kv_offload_disk_dir: str | None
    kv_offload_disk_gib: float | None
    kvstore_address: str            # derived: ipc://<runtime_dir>/kvstore.sock
    kv_offload_block_bytes: int | None
    kv_offload_state_fraction: float
    # --- not settings: provenance
    sources: Mapping[str, str] = field(default_factory=dict, repr=False, hash=False)
    # why the profile was chosen (device, model size); not serialized (the supervisor logs it)
    profile_detail: str = field(default="", compare=False)
    # how a derived num_threads was chosen (shared.cpu_budget); not serialized either
    threads_detail: str = field(default="", compare=False)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed `speculative_config` (shared.spec_config), None when off."""
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """The sampling defaults of `generation_config` and `override_generation_config`
        for the model folder `model` (shared.config_generation; it reads the folder's
        generation_config.json with "auto"). Raises ValueError as `resolve` does."""
        return resolve_generation_defaults(self.generation_config, self.model,
                                           self.override_generation_config)

    def source(self, name: str) -> str:
        """The source of setting `name`. Raises KeyError for an unknown name."""
        return self.sources[name]

    def to_json(self) -> str:
        """The settings as JSON, {name: [value, source]} in `FIELDS` order (the
        `--resolved-config` file of the child processes)."""
        return json.dumps({f.name: [getattr(self, f.name), self.sources[f.name]] for f in FIELDS})

    @classmethod
    def from_json(cls, text: str) -> KestrelConfig:
        """The config of a `to_json` text. Raises ValueError when its settings are not
        exactly the `FIELDS` of this version."""
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) != set(FIELD_BY_NAME):
            got = set(data) if isinstance(data, dict) else set()
            known = set(FIELD_BY_NAME)
            raise ValueError(f"resolved config: settings differ from this version's (missing "
                             f"{sorted(known - got)}, unknown {sorted(got - known)})")
        return cls(**{k: v for k, (v, _) in data.items()}, sources={k: s for k, (_, s) in data.items()})

    def table(self) -> str:
        """The effective settings, one per line: name, value, source (secrets masked)."""
        width = max(len(f.name) for f in FIELDS)
        rows = [f"  {k:<{width}}  {_shown(k, getattr(self, k)):<40} [{self.sources[k]}]"
                for k in sorted(FIELD_BY_NAME)]
        return "\n".join(rows + [f"  {'(sampling defaults)':<{width}}  "
                                 f"{self.generation_defaults.describe()}"])


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
        if f.type is parse_bool:
            kw.update(type=parse_bool, nargs="?", const=True, metavar="{true,false}")
        else:
            kw["type"] = f.type if f.type in (int, float, str) else _cli_type(f)
        if f.choices:
            kw["choices"] = f.choices
        parser.add_argument(flag, **kw)
        if f.type is parse_bool:
            parser.add_argument("--no-" + flag[2:], dest=f.name, action="store_const", const=False,
                                default=None, help=f"set {flag} false")
    parser.add_argument("--config-file", default=None, help="JSON file of settings")
    parser.add_argument("--resolved-config", default=None, help=argparse.SUPPRESS)


def _cli_type(f: Field) -> Callable[[str], Any]:
    """A setting's own parser for argparse, whose ValueError message (naming the field
    inside a JSON setting) is shown as it is, not as "invalid <parser> value"."""
    def parse(text: str) -> Any:
        try:
            return f.type(text)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def build_config(cli: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                 config_file: str | None = None, *, probe: Any = None) -> KestrelConfig:
    """Merge defaults, profile, config file, environment and CLI into one `KestrelConfig`.

    Precedence, lowest first: `default`, `profile:<name>`, `config file`, `env`, `cli`.
    The profile (shared/profiles.py) is chosen from the merged `profile`, `device`, `model`,
    `dtype` and `max_model_len` of the explicit sources, and only fills settings that no
    explicit source set. With `profile` auto, the chosen name is stored with source
    `derived`. cli: parsed arguments (None for a flag not given). env: the environment
    (default os.environ). probe: a `shared.device.DeviceInfo` to use instead of probing this
    host (tests). A `--resolved-config` file (from the supervisor) is returned as it is.
    Raises ValueError naming the setting for a value of the wrong type, out of range, null
    for a setting that cannot be unset, or an unknown key.
    """
    from shared.profiles import choose_profile

    env = dict(os.environ) if env is None else env
    cli = cli or {}
    if cli.get("resolved_config"):
        with open(cli["resolved_config"]) as fh:
            return KestrelConfig.from_json(fh.read())
    values: dict[str, Any] = {f.name: f.default for f in FIELDS}
    sources = dict.fromkeys(values, "default")
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
    _warn_unknown_env(env)
    for f in FIELDS:
        if cli.get(f.name) is not None:
            explicit.append((f.name, _convert(f, cli[f.name]), "cli"))
    merged = dict(values)
    merged.update({k: v for k, v, _ in explicit})
    profile = choose_profile(merged["profile"], merged["device"], merged["model"],
                             dtype=merged["dtype"], max_model_len=merged["max_model_len"],
                             probe=probe)
    if profile is not None:
        for k, v in profile.values.items():
            values[k], sources[k] = _convert(FIELD_BY_NAME[k], v), f"profile:{profile.name}"
    for k, v, source in explicit:
        values[k], sources[k] = v, source
    if profile is not None and values["profile"] == "auto":
        values["profile"], sources["profile"] = profile.name, "derived"
    threads_detail = _derive(values, sources, env)
    cfg = KestrelConfig(**values, sources=sources,
                        profile_detail=profile.reason if profile is not None else "",
                        threads_detail=threads_detail)
    _validate(cfg, probe)
    return cfg


# KESTREL_* variables that are not settings: the supervisor's to its children, compose's build
# arguments, the e2e scripts'
OTHER_ENV = ("KESTREL_SUPERVISOR_PID", "KESTREL_BASE_IMAGE", "KESTREL_TORCH_SPEC", "KESTREL_PIP_ARGS",
             "KESTREL_CXX_TOOLCHAIN", "KESTREL_DEBIAN_MIRROR", "KESTREL_E2E_")


def _warn_unknown_env(env: Mapping[str, str]) -> list[str]:
    """Log a warning for each KESTREL_* variable that names no setting (a typo such as
    KESTREL_MAX_NUM_SEQ would otherwise be ignored without a word), with the closest
    setting's variable when one is close. Returns the names warned about."""
    import difflib

    known = ["KESTREL_" + f.name.upper() for f in FIELDS]
    unknown = sorted(k for k in env if k.startswith("KESTREL_") and k not in known
                     and not k.startswith(OTHER_ENV))
    for k in unknown:
        close = difflib.get_close_matches(k, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        logging.getLogger("kestrel.config").warning(
            "environment variable %s is not a Kestrel setting and is ignored%s", k, hint)
    return unknown


# names /dev/shm/kestrel-<id>-*, the runtime folder and the 32-byte field of every segment's preamble
INSTANCE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,31}")


def _validate(cfg: KestrelConfig, probe: Any = None) -> None:
    """Range checks of numeric settings, no int8 KV cache on CUDA (its kernels read the model
    dtype and fp8_e4m3 only), weight quantization where it runs (`check_quantization`; probe: the
    `DeviceInfo` whose compute capability it reads, default this host's), speculative
    combinations, and sampling defaults that resolve. Raises ValueError naming the setting."""
    positive = ("port", "block_size", "max_num_seqs", "max_num_batched_tokens", "ring_chunks",
                "ring_chunk_bytes", "frontends", "max_request_body_bytes", "kv_cache_gib",
                "header_timeout", "body_timeout", "max_incomplete_connections", "keepalive_s",
                "startup_timeout_s", "restart_window_s", "watchdog_timeout_s", "worker_timeout_s")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ValueError(f"setting {name}: must be positive, got {getattr(cfg, name)!r}")
    if not 0 < cfg.port < 65536:
        raise ValueError(f"setting port: {cfg.port} is not a TCP port")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise ValueError("setting gpu_memory_utilization: must be in (0, 1], got "
                         f"{cfg.gpu_memory_utilization!r}")
    if cfg.step_timeout_s < 0:
        raise ValueError("setting step_timeout_s: must be >= 0 seconds (0: a multiple of "
                         f"worker_timeout_s), got {cfg.step_timeout_s!r}")
    if cfg.standby_idle_wait_s < 0:
        raise ValueError(f"setting standby_idle_wait_s: must be >= 0, got {cfg.standby_idle_wait_s!r}")
    if cfg.num_threads <= 0:
        raise ValueError(f"setting num_threads: must be >= 0 (0: automatic), got {cfg.num_threads!r}")
    if cfg.max_model_len is not None and cfg.max_model_len <= 0:
        raise ValueError(f"setting max_model_len: must be positive, got {cfg.max_model_len!r}")
    if not INSTANCE_ID.fullmatch(cfg.instance_id):
        raise ValueError(f"setting instance_id: {cfg.instance_id!r} cannot name shared-memory segments "
                         "and folders: use 1-32 letters, digits, '.', '_' or '-', starting with a "
                         "letter or digit (default: 8 random hex digits)")
    if not cfg.served_model_name.strip():
        raise ValueError(f"setting served_model_name: must not be empty, got {cfg.served_model_name!r}")
    if cfg.shutdown_timeout < 0:
        raise ValueError(f"setting shutdown_timeout: must be >= 0 seconds, got {cfg.shutdown_timeout!r}")
    check_max_model_len(cfg)
    check_kv_offload(cfg)
    if not 0 < cfg.kv_offload_state_fraction < 1:
        raise ValueError("setting kv_offload_state_fraction: must be in (0, 1), got "
                         f"{cfg.kv_offload_state_fraction!r}")
    check_chat_template(cfg.chat_template)  # names a file and compiles (vLLM refuses too)
    kv_dtype_in_use(cfg.dtype, cfg.kv_cache_dtype)  # an unknown kv_cache_dtype: refused before any process starts
    check_speculative(cfg)  # combinations that cannot work: refused before any process starts
    check_quantization(cfg, probe)
    check_recurrent_state(cfg)
    if cfg.generation_config != "auto" and cfg.generation_config != "vllm" and \
            not os.path.isdir(cfg.generation_config):
        raise ValueError(f"setting generation_config: {cfg.generation_config!r} is not 'auto', "
                         "'vllm' or a folder")
    # a bad generation_config.json or override: refused before any process starts
    resolve_generation_defaults(cfg.generation_config, cfg.model, cfg.override_generation_config)


def check_kv_offload(cfg: KestrelConfig) -> None:
    """The KV offload settings that make sense on their own (the kvstore sizes its tiers
    against the host when it starts: `services.kvstore.settings.resolve_setup`):
    kv_offload_cpu_gib >= 0 (0: no offload); the disk tier's folder and size limit given
    together, the limit positive, and only with a CPU tier (the disk tier sits behind it; the
    kvstore does not run without one); a CPU tier only with the prefix cache (the engine
    connects no tier without it). Raises ValueError naming the setting."""
    if cfg.kv_offload_cpu_gib < 0:
        raise ValueError("setting kv_offload_cpu_gib: must be >= 0 GiB (0: no offload), got "
                         f"{cfg.kv_offload_cpu_gib!r}")
    if cfg.kv_offload_disk_dir and cfg.kv_offload_disk_gib is None:
        raise ValueError("setting kv_offload_disk_dir requires --kv-offload-disk-gib: a disk "
                         "tier without a size limit would fill the disk")
    if cfg.kv_offload_disk_gib is not None and not cfg.kv_offload_disk_dir:
        raise ValueError("setting kv_offload_disk_gib requires --kv-offload-disk-dir (the "
                         "disk tier's folder)")
    if cfg.kv_offload_disk_gib is not None and cfg.kv_offload_disk_gib <= 0:
        raise ValueError(f"setting kv_offload_disk_gib: must be positive, got {cfg.kv_offload_disk_gib!r}")
    if cfg.kv_offload_disk_dir and cfg.kv_offload_cpu_gib == 0:
        raise ValueError("setting kv_offload_disk_dir requires --kv-offload-cpu-gib: the disk "
                         "tier sits behind the kvstore's CPU tier, which is off (0)")
    if cfg.kv_offload_cpu_gib > 0 and not cfg.enable_prefix_caching:
        raise ValueError("setting kv_offload_cpu_gib requires --enable-prefix-caching: the KV "
                         "tiers hold the prefix cache's evicted blocks, and the engine does not "
                         "use them without it; drop --no-enable-prefix-caching, or set "
                         "--kv-offload-cpu-gib 0 (no offload)")


def check_cpu_kv_cache(cfg: KestrelConfig) -> None:
    """On the CPU, a KV cache of kv_cache_gib that holds max_model_len tokens. The worker makes
    floor(kv_cache_gib GiB / block bytes) blocks (`shared.kv_layout.num_blocks_for`;
    a drafter's KV only adds to a block's bytes) and the engine refuses a max_model_len past
    them, but only once the weights are loaded; `kestrel serve` calls this first (not the
    config builder: a worker alone, as tests run it, needs no room for max_model_len). A
    folder that cannot be read is left to its own checks. Raises ValueError naming both
    numbers and the two ways out."""
    if cfg.device != "cpu":  # on CUDA the cache is sized from free memory after the load
        return
    from shared.kv_layout import kv_layout_for, num_blocks_for

    try:
        layout = kv_layout_for(cfg)
        max_len = model_spec_for(cfg).max_model_len
    except (OSError, ValueError):
        return
    blocks = num_blocks_for(cfg.kv_cache_gib, layout.block_bytes)
    if max_len > blocks * cfg.block_size:
        raise ValueError(f"setting kv_cache_gib: {cfg.kv_cache_gib} GiB holds {blocks * cfg.block_size} "
                         f"tokens of KV cache ({blocks} blocks of {layout.block_bytes} bytes), fewer than "
                         f"max_model_len {max_len}; raise --kv-cache-gib or lower --max-model-len")


def check_max_model_len(cfg: KestrelConfig) -> None:
    """max_model_len no longer than the model's max_position_embeddings (config.json), as
    vLLM refuses it; `allow_long_max_model_len` (KESTREL_ALLOW_LONG_MAX_MODEL_LEN=1, vLLM's
    VLLM_ALLOW_LONG_MAX_MODEL_LEN) lets it pass. A folder that cannot be read is left to its
    own checks. Raises ValueError naming both numbers."""
    if cfg.max_model_len is None or cfg.allow_long_max_model_len:
        return
    try:
        limit = load_model_spec(cfg.model).max_position_embeddings
    except (OSError, ValueError):
        return
    if cfg.max_model_len > limit:
        raise ValueError(f"setting max_model_len: {cfg.max_model_len} is longer than the model's "
                         f"max_position_embeddings ({limit} in {cfg.model}/config.json); set "
                         "KESTREL_ALLOW_LONG_MAX_MODEL_LEN=1 (--allow-long-max-model-len) to "
                         "allow it, with outputs that may be wrong past the trained context")


def check_quantization(cfg: KestrelConfig, probe: Any = None) -> None:
    """Refuse weight quantization where it does not run: int8/int4/gguf weight-only linear
    layers exist on the CPU path only (kernels/cpu_quant_linear.py); gguf needs the GGUF the
    model folder records, present (`shared.gguf_source.require_gguf`), and real weights (not
    --load-format dummy); fp8 on CUDA GPUs of
    compute capability 8.9+ with bf16 (`shared.weight_quant.check_fp8_setting`; the
    capability from probe, default `shared.device.detect_device()`, when it names one; the
    worker checks again with torch); a checkpoint whose `quantization_config` is not an FP8
    layout Kestrel loads (`ModelSpec.checkpoint_quant`; not read with --load-format dummy);
    awq / gptq, and fp8 on a 4-bit checkpoint, by `shared.weight_quant.check_w4a16_setting`
    (awq / gptq need CUDA, bf16 / fp16, and a checkpoint of that method or dummy weights).
    Raises ValueError naming the setting and what works."""
    if cfg.quantization in ("int8", "int4", "gguf") and cfg.device != "cpu":
        raise ValueError(f"setting quantization: {cfg.quantization!r} weights run on the CPU only "
                         f"for now (device {cfg.device!r}); use --quantization none on {cfg.device}, "
                         f"or --device cpu --quantization {cfg.quantization} (on a GPU of compute "
                         "capability 8.9+: --quantization fp8)")
    capability = None
    if cfg.quantization == "fp8" and cfg.device == "cuda":
        from shared.device import detect_device

        info = probe if probe is not None else detect_device()
        capability = parse_capability(info.compute_cap) if info.kind == "cuda" else None
    check_fp8_setting(cfg.quantization, cfg.device, cfg.dtype, capability)
    if cfg.quantization == "gguf":
        if cfg.load_format == "dummy":
            raise ValueError("setting quantization: 'gguf' loads the weights from a GGUF file, and "
                             "--load-format dummy loads none; use --quantization int4 or int8 with dummy "
                             "weights, or --load-format auto")
        require_gguf(cfg.model)
    if cfg.load_format == "dummy":
        check_w4a16_setting(cfg.quantization, cfg.device, cfg.dtype, None, dummy=True)
        return
    try:
        spec = load_model_spec(cfg.model)
    except (OSError, ValueError):  # a folder that cannot be read: its own check reports it
        check_w4a16_setting(cfg.quantization, cfg.device, cfg.dtype, None, dummy=True)  # device, dtype
        return
    try:
        ckpt = spec.checkpoint_quant
    except ValueError as e:
        raise ValueError(f"setting model: {e}") from None
    check_w4a16_setting(cfg.quantization, cfg.device, cfg.dtype, ckpt, dummy=False)


def _convert(f: Field, v: Any) -> Any:
    """Setting `f`'s value from a string (env, cli) or a JSON value (config file, profile).
    None (JSON null) unsets an optional or derived setting. Raises ValueError naming it."""
    if v is None:
        if f.default is not None:
            raise ValueError(f"setting {f.name}: null is not allowed (default {f.default!r})")
        return None
    try:
        out = f.type(v) if not isinstance(v, bool) or f.type is parse_bool else v
    except (TypeError, ValueError) as e:  # a JSON setting's parser names itself already
        named = str(e).startswith(f"{f.name}")
        raise ValueError(str(e) if named else f"setting {f.name}: {e}") from None
    if f.choices and out not in f.choices:
        raise ValueError(f"setting {f.name}: {out!r} is not one of {f.choices}")
    return out


def runtime_base(env: Mapping[str, str] | None = None) -> str:
    """The folder that holds runtime folders: `$XDG_RUNTIME_DIR` when usable, else /tmp
    (`shared.runtime_dir.runtime_base`). env: the environment (default os.environ)."""
    env = os.environ if env is None else env
    return runtime_dir_base(env.get("XDG_RUNTIME_DIR"))


def _derive(values: dict[str, Any], sources: dict[str, str], env: Mapping[str, str]) -> str:
    """Fill settings whose default depends on others (source `derived`), in place. Returns
    how a derived num_threads was chosen ("" when it was given)."""
    def put(name: str, value: Any) -> None:
        values[name], sources[name] = value, "derived"

    if values["instance_id"] is None:
        put("instance_id", uuid.uuid4().hex[:8])
    base = runtime_base(env)
    if values["runtime_dir"] is None:
        put("runtime_dir", os.path.join(base, f"kestrel-{values['instance_id']}"))
    if values["watchdog_dump_dir"] is None:
        put("watchdog_dump_dir", os.path.join(base, f"kestrel-{values['instance_id']}-dumps"))
    run = values["runtime_dir"]
    for name, sock in (("engine_address", "engine"), ("worker_address", "worker"),
                       ("kvstore_address", "kvstore")):
        if values[name] is None:
            put(name, f"ipc://{run}/{sock}.sock")
    if values["served_model_name"] is None:
        put("served_model_name", os.path.basename(os.path.normpath(values["model"])))
    if values["device"] == "auto":
        # No torch import here (the frontend and engine never need it): an NVIDIA device
        # node means a GPU host; the worker checks torch.cuda itself.
        put("device", "cuda" if os.path.exists("/dev/nvidiactl") else "cpu")
    cuda = values["device"] == "cuda"
    if values["dtype"] == "auto":
        put("dtype", "bfloat16" if cuda else "float32")
    if values["worker_timeout_s"] is None:
        put("worker_timeout_s", 30.0 if cuda else 10.0)
    if values["step_timeout_s"] is None:
        put("step_timeout_s", 180.0 if cuda else 600.0)
    detail = ""
    if not values["num_threads"]:  # 0 or unset: from the CPUs this process may use
        choice = resolve_num_threads(values["num_threads"], "cuda" if cuda else "cpu")
        put("num_threads", choice.threads)
        detail = choice.reason
    return detail


def state_checkpoint_slots(cfg: KestrelConfig) -> int:
    """State checkpoint slots of a hybrid model's prefix cache (services/engine/state_slots.py),
    beyond its max_num_seqs request slots: max_num_seqs of them with the prefix cache on, else
    0. The engine and the workers both size from this."""
    return cfg.max_num_seqs if cfg.enable_prefix_caching else 0


def _has_recurrent_state(model: str) -> bool:
    """Whether the model folder's config.json names recurrent layers (`ModelSpec.
    has_recurrent_state`); False when the folder cannot be read (its own check reports it)."""
    try:
        return load_model_spec(model).has_recurrent_state
    except (OSError, ValueError):
        return False


# What a model with recurrent layers cannot run yet (heads that tap hidden states, a state
# cache for a drafter): setting -> why, when it is on. The kvstore tiers work (they store the
# state checkpoints with the blocks, §4.5, §4.7), and so do CUDA graphs (decode graphs read
# the state slots, docs/ARCHITECTURE.md §6.5).
RECURRENT_STATE_REFUSALS = {
    "speculative_config": "EAGLE and DFlash heads read the target's hidden states, which this model does not "
                          "tap, and a draft model with recurrent layers would need a state cache of its own; "
                          "use method 'ngram' or a draft_model without recurrent layers",
}


def _spec_needs_what_state_lacks(cfg: KestrelConfig) -> bool:
    """Whether speculative decoding is on with a method a hybrid target cannot serve yet:
    an EAGLE or DFlash head (they read target layers' hidden states), or a draft model that
    has recurrent layers itself. n-gram and a dense draft model work: the target's
    recurrent layers keep their state after each verified token and roll back to the
    accepted drafts (docs/ARCHITECTURE.md §4.7)."""
    spec = cfg.speculative
    if spec is None:
        return False
    if spec.method in ("eagle", "dflash"):
        return True
    # a dummy draft (no folder) takes the target's architecture: recurrent layers too
    return spec.method == "draft_model" and (spec.model is None or _has_recurrent_state(spec.model))


def check_recurrent_state(cfg: KestrelConfig) -> None:
    """Refuse settings a hybrid model (recurrent layers) cannot run with: speculative
    decoding with an EAGLE / DFlash head or a hybrid draft (`RECURRENT_STATE_REFUSALS`).
    CUDA graphs are allowed (decode steps replay them; verify and prefill steps run
    eagerly), and so are the kvstore tiers (they keep the state checkpoints). Raises
    ValueError naming the setting."""
    if not _has_recurrent_state(cfg.model):
        return
    on = {"speculative_config": _spec_needs_what_state_lacks(cfg)}
    for name, why in RECURRENT_STATE_REFUSALS.items():
        if on[name]:
            fix = {"speculative_config": "no --speculative-config"}[name]
            raise ValueError(f"setting {name}: not supported with {os.path.basename(cfg.model)!r}, a model "
                             f"with recurrent (linear-attention) layers: {why}; use {fix}")


def ring_name(instance_id: str, ring: str) -> str:
    """The /dev/shm name of one ring of an instance (docs/ARCHITECTURE.md §3)."""
    return f"kestrel-{instance_id}-{ring}"
