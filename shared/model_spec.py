"""The facts of one served model, resolved once from its folder and the settings (no torch).

A model folder is a Hugging Face folder: `config.json` (the architecture) and, when present,
`generation_config.json` (more end-of-sequence ids). `load_model_spec` reads both once and
returns a frozen `ModelSpec`; every process that needs a model fact (the engine, the worker,
the kvstore, the supervisor's checks, the settings profile) takes it from there and never
parses `config.json` itself (docs/ARCHITECTURE.md §4, §6). The spec also carries what the
settings decide about the model: the dtype of weights and activations, the KV cache dtype
actually in use and max_model_len.

Multimodal folders whose text model sits under `text_config` are read from there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from shared.weight_quant import CheckpointQuant, parse_quantization_config

if TYPE_CHECKING:  # no import at run time: shared.config imports this module's users
    from shared.config import KestrelConfig

# Bytes of one element of each dtype name Kestrel uses (weights, activations, KV cache).
DTYPE_BYTES: Mapping[str, int] = MappingProxyType(
    {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "int8": 1})
# max_model_len when the setting is unset: the model's context, capped (a KV cache for the
# full 128k context of a large model would not fit the default budgets)
MAX_MODEL_LEN_CAP = 8192
DEFAULT_MAX_POSITIONS = 2048  # max_position_embeddings when config.json has none (HF's default)
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"  # config.json layer_types


def _layer_types(text: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """`ModelSpec.layer_types` from a (text) config. Raises ValueError for a list of the
    wrong length or an unknown kind."""
    kinds = text.get("layer_types")
    if kinds is None and text.get("full_attention_interval"):
        every = int(text["full_attention_interval"])
        kinds = [FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION for i in range(num_layers)]
    if not kinds:
        return ()
    kinds = [str(k) for k in kinds]
    if len(kinds) != num_layers or not set(kinds) <= {FULL_ATTENTION, LINEAR_ATTENTION}:
        raise ValueError(f"layer_types must name {num_layers} layers, each {FULL_ATTENTION!r} "
                         f"or {LINEAR_ATTENTION!r}: {kinds}")
    return tuple(kinds)


class ModelFolderError(ValueError):
    """A model folder that cannot be served: no config.json, unreadable or malformed JSON, or
    a required field missing or of the wrong type. The message names the folder and the field."""


def default_max_model_len(max_position_embeddings: int) -> int:
    """max_model_len (tokens) when the setting is unset: min(max_position_embeddings, 8192)."""
    return min(max_position_embeddings, MAX_MODEL_LEN_CAP)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name ("float32", "bfloat16", "float16", "fp8_e4m3",
    "int8"). Raises ValueError for another name."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}") from None


QUANTIZED_KV_DTYPES = ("fp8_e4m3", "int8")  # kernels/kv_quant.py; docs/ARCHITECTURE.md §4.6


def kv_dtype_in_use(dtype: str, kv_cache_dtype: str) -> str:
    """The KV cache dtype the workers actually use for a `kv_cache_dtype` setting.

    "auto" is the model dtype; "fp8_e4m3" and "int8" are quantized caches, read by the
    torch references of the CPU path (kernels/kv_quant.py) and by the Triton kernels on CUDA
    (kernels/kv_quant_triton.py; int8's GPU tests, tests/gpu/test_int8_kv_gpu.py, passed on an
    H100 on 2026-12-07): both are served on either device. Raises ValueError for an unknown
    name.
    """
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype not in QUANTIZED_KV_DTYPES:
        raise ValueError(f"setting kv_cache_dtype: {kv_cache_dtype!r} is not one of "
                         f"{('auto', *QUANTIZED_KV_DTYPES)}")
    return kv_cache_dtype


@dataclass(frozen=True)
class ModelSpec:
    """One model's facts. Sizes are element counts; lengths are tokens.

    path: the folder, absolute. architecture: config.json `architectures[0]` ("" when the
    file names none: the worker's registry then goes by model_type).
    num_layers, hidden_size, intermediate_size (4 x hidden_size when absent), num_heads,
    num_kv_heads (num_heads when absent), head_dim (hidden_size // num_heads when absent),
    vocab_size (the lm_head width), max_position_embeddings (2048 when absent).
    tie_word_embeddings: the lm_head shares the embedding matrix. num_experts: routed experts
    per MoE layer (1 for a dense model); moe_intermediate_size: an expert's width.
    eos_token_ids: every id that ends generation (config.json and generation_config.json
    merged, in that order, without repeats). bos_token_id: None when neither file has one.
    dtype: weights and activations ("float32", "bfloat16", "float16"). kv_dtype: the KV cache
    dtype in use (`kv_dtype_in_use`). max_model_len: prompt + output tokens of one request.
    hf_config: the config.json object, read-only (for a model class's own fields, e.g. rope).
    layer_types: each decoder layer's kind, "full_attention" (paged KV) or "linear_attention"
    (a recurrent state: gated DeltaNet), from config.json `layer_types` or, without it,
    `full_attention_interval` (every interval-th layer is attention, as Qwen3-Next's config
    defines it); () when the file has neither: every layer is attention.
    """

    path: str
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int
    moe_intermediate_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str
    kv_dtype: str
    max_model_len: int
    hf_config: Mapping[str, Any] = field(compare=False, repr=False)
    layer_types: tuple[str, ...] = ()

    @property
    def text_config(self) -> Mapping[str, Any]:
        """The text model's part of config.json: its `text_config` object for a multimodal
        folder that nests it (the fields above come from there), else the whole file."""
        nested = self.hf_config.get("text_config")
        return nested if isinstance(nested, Mapping) and "hidden_size" not in self.hf_config else self.hf_config

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """The decoder layers with paged KV, in order (every layer without layer_types)."""
        if not self.layer_types:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def checkpoint_quant(self) -> CheckpointQuant | None:
        """The checkpoint's FP8 weight format, from config.json's `quantization_config`
        (`shared.weight_quant.parse_quantization_config`); None without one. Raises
        ValueError naming the folder for a quantization_config Kestrel cannot load."""
        return parse_quantization_config(self.hf_config.get("quantization_config"),
                                         os.path.join(self.path, "config.json"))

    @property
    def has_recurrent_state(self) -> bool:
        """Whether some layer keeps a per-request recurrent state (a hybrid model)."""
        return any(t != FULL_ATTENTION for t in self.layer_types)


def _ids(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v]


def _read_json(path: str, folder: str) -> dict:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except OSError as e:
        raise ModelFolderError(f"model folder {folder!r}: cannot read {os.path.basename(path)} "
                               f"({e.strerror or e})") from None
    except ValueError as e:
        raise ModelFolderError(f"model folder {folder!r}: {os.path.basename(path)} is not "
                               f"valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelFolderError(f"model folder {folder!r}: {os.path.basename(path)} is not a "
                               "JSON object")
    return data


def load_model_spec(path: str, *, dtype: str = "float32", kv_cache_dtype: str = "auto",
                    max_model_len: int | None = None) -> ModelSpec:
    """Read a model folder once.

    dtype: the resolved dtype of weights and activations (not "auto"). kv_cache_dtype: the
    setting (see `kv_dtype_in_use`). max_model_len: the setting, None for
    `default_max_model_len`.
    Raises ModelFolderError for a folder without a readable, well-formed config.json (the
    message says how to fetch the default model), ValueError for an unknown dtype or
    kv_cache_dtype (the device check of a quantized one is the config's, `kv_dtype_in_use`).
    """
    dtype_bytes(dtype)
    kv_dtype = kv_dtype_in_use(dtype, kv_cache_dtype)
    cfg_path = os.path.join(path, "config.json")
    if os.path.isfile(path):  # e.g. a .gguf, as vLLM serves one: not how Kestrel reads GGUF
        raise ModelFolderError(f"--model {path!r} is a file, not a model folder: pass a Hugging "
                               "Face folder (config.json, *.safetensors, tokenizer.json); to serve a "
                               "GGUF's quantized weights, pass the folder converted from it with "
                               "--quantization gguf (`kestrel fetch-model` makes one for the default "
                               "model and records its GGUF in it).")
    if not os.path.isfile(cfg_path):
        raise ModelFolderError(f"model folder {path!r} not found (no config.json). Run "
                               "`kestrel fetch-model` for the default model, or pass --model DIR.")
    hf = _read_json(cfg_path, path)
    gen: dict = {}
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        gen = _read_json(gen_path, path)
    text = hf["text_config"] if isinstance(hf.get("text_config"), dict) and "hidden_size" not in hf else hf
    try:
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        inter = int(text.get("intermediate_size") or 4 * hidden)
        max_pos = int(text.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS)
        archs = hf.get("architectures") or [""]
        spec = ModelSpec(
            path=os.path.abspath(path),
            architecture=str(archs[0]),
            model_type=str(hf.get("model_type", "llama")),
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=inter,
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            vocab_size=int(text["vocab_size"]),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(text.get("tie_word_embeddings", hf.get("tie_word_embeddings", False))),
            num_experts=int(text.get("num_local_experts") or text.get("num_experts") or 1),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or inter),
            eos_token_ids=tuple(dict.fromkeys(_ids(hf.get("eos_token_id"))
                                              + _ids(gen.get("eos_token_id")))),
            bos_token_id=_opt_int(hf.get("bos_token_id", gen.get("bos_token_id"))),
            dtype=dtype,
            kv_dtype=kv_dtype,
            max_model_len=max_model_len or default_max_model_len(max_pos),
            hf_config=MappingProxyType(hf),
            layer_types=_layer_types(text, int(text["num_hidden_layers"])),
        )
    except KeyError as e:
        raise ModelFolderError(f"malformed config.json in {path!r}: no field {e}") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelFolderError(f"malformed config.json in {path!r}: {e}") from None
    if spec.num_layers <= 0 or spec.num_heads <= 0 or spec.num_kv_heads <= 0 or spec.head_dim <= 0:
        raise ModelFolderError(f"malformed config.json in {path!r}: layers, heads, kv heads and "
                               "head_dim must be positive")
    return spec


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def resolved_dtype(dtype: str, device: str) -> str:
    """A dtype setting with "auto" resolved as shared.config derives it: bfloat16 on a
    "cuda" device, float32 otherwise. Other values are returned as they are."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cuda" else "float32"


def model_spec_for(cfg: KestrelConfig, *, dtype: str | None = None) -> ModelSpec:
    """The spec of the config's model under its settings (model, dtype, kv_cache_dtype,
    max_model_len). dtype: overrides cfg.dtype (a worker that resolved "auto" against its
    device). Raises as `load_model_spec`."""
    return load_model_spec(cfg.model, dtype=resolved_dtype(dtype or cfg.dtype, cfg.device), kv_cache_dtype=cfg.kv_cache_dtype,
                           max_model_len=cfg.max_model_len)
