"""What the EAGLE head and the DFlash drafter take from the target and from their folder
(docs/ARCHITECTURE.md §5.5): the target's embedding, lm_head, shapes and device
(`TargetParts`), the drafter's config.json (`HeadArgs` from it, or from the target's
shapes for dummy weights), its safetensors tensors (through `services.worker.loader`), and
the default target layers.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from kernels import attention as attn_kernels
from services.worker.layers.embedding import VocabEmbedding
from services.worker.loader import checkpoint_files, load_dummy_weights, load_weights
from services.worker.spec.head_layers import HeadArgs
from shared.spec_config import MAX_SPECULATIVE_TOKENS

if TYPE_CHECKING:
    from services.worker.models.llama import LlamaArgs


@dataclass
class TargetParts:
    """The target as a drafter sees it (read from the model runner at construction).

    embed: the target's token embedding ([vocab, hidden] weight). compute_logits: its
    lm_head ([n, hidden] -> [n, vocab] fp32). args: its `LlamaArgs` (shapes, rope, eps).
    device, dtype: the runner's. max_positions: rows a drafter's rotary table needs
    (max_model_len plus the longest block). block_size: KV block size. reference: whether
    attention runs the torch references (the CPU, or no Triton), as the runner's.
    """

    embed: VocabEmbedding
    compute_logits: Callable[[torch.Tensor], torch.Tensor]
    args: LlamaArgs
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_positions: int
    block_size: int
    reference: bool

    @classmethod
    def of(cls, cfg: Any, runner: Any) -> TargetParts:
        """The parts of `runner` (a `ModelRunner` whose model is loaded; a Llama-family
        model: `model.model.embed_tokens`, `model.args`). cfg: the `KestrelConfig`
        (block_size). Raises ValueError for a model without those."""
        model = runner.model
        inner = getattr(model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        if not isinstance(embed, VocabEmbedding) or not hasattr(model, "args"):
            raise ValueError(f"{type(model).__name__}: EAGLE / DFlash drafters need a Llama-family target")
        device = torch.device(runner.device)
        reference = getattr(runner, "use_ref_attention", None)
        if reference is None:
            reference = device.type == "cpu" or attn_kernels.paged_attention_triton is None
        mml = int(runner.max_model_len)
        return cls(embed, model.compute_logits, model.args, device, runner.dtype, mml,
                   mml + MAX_SPECULATIVE_TOKENS + 1, int(cfg.block_size), bool(reference))


def read_config(folder: str) -> dict:
    """The drafter folder's config.json. Raises FileNotFoundError naming it."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"drafter folder {folder!r} has no config.json")
    with open(path) as fh:
        return json.load(fh)


def tensor_names(folder: str) -> set[str]:
    """Every tensor name in the folder's safetensors files (`loader.checkpoint_files`)."""
    names: set[str] = set()
    for f in checkpoint_files(folder):
        with safe_open(f, framework="pt") as fh:
            names.update(fh.keys())
    return names


def tensor_shape(folder: str, name: str) -> tuple[int, ...] | None:
    """The shape of tensor `name` in the folder's safetensors files (header only), None
    when none holds it."""
    for f in checkpoint_files(folder):
        with safe_open(f, framework="pt") as fh:
            if name in fh.keys():
                return tuple(fh.get_slice(name).get_shape())
    return None


def read_tensor(folder: str, name: str) -> torch.Tensor | None:
    """Tensor `name` from the folder's safetensors files, None when none holds it."""
    for f in checkpoint_files(folder):
        with safe_open(f, framework="pt") as fh:
            if name in fh.keys():
                return fh.get_tensor(name)
    return None


def head_args(conf: dict | None, target: LlamaArgs, **over: Any) -> HeadArgs:
    """A drafter's `HeadArgs` from its config.json `conf` (Hugging Face names), each field
    missing there taken from the target's (`conf` None: the target's shape, for dummy
    weights); `over`: fields the method fixes (qk_norm, attn_in, num_hidden_layers...)."""
    c = conf or {}
    hidden = int(c.get("hidden_size", target.hidden_size))
    heads = int(c.get("num_attention_heads", target.num_attention_heads))
    rope = dict(c.get("rope_parameters") or {})
    scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if conf is None:
        scaling = target.rope_scaling
    fields: dict[str, Any] = dict(
        hidden_size=hidden,
        intermediate_size=int(c.get("intermediate_size", target.intermediate_size)),
        num_attention_heads=heads,
        num_key_value_heads=int(c.get("num_key_value_heads", target.num_key_value_heads)),
        head_dim=int(c.get("head_dim") or (target.head_dim if conf is None else hidden // heads)),
        num_hidden_layers=int(c.get("num_hidden_layers", 1)),
        vocab_size=int(c.get("vocab_size", target.vocab_size)),
        rms_norm_eps=float(c.get("rms_norm_eps", target.rms_norm_eps)),
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", target.rope_theta))),
        rope_scaling=dict(scaling) if scaling else None,
        attention_bias=bool(c.get("attention_bias", False)), mlp_bias=bool(c.get("mlp_bias", False)),
    )
    fields.update(over)
    return HeadArgs(**fields)


def fill_weights(module: nn.Module, folder: str | None, seed: int) -> int:
    """Load `module` from the drafter folder (`loader.load_weights`: every tensor taken,
    every parameter filled, else ValueError), or with folder None seeded random weights
    (`loader.load_dummy_weights`). Returns the parameters' bytes."""
    if folder is None:
        return load_dummy_weights(module, seed)
    return load_weights(module, folder)


@contextlib.contextmanager
def building(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Build modules on `device` in `dtype` (the runner's), as the runner builds the target."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def spread_layers(num_layers: int, count: int) -> tuple[int, ...]:
    """`count` target layers spread from layer 1 to layer num_layers - 3 (DFlash's default,
    z-lab/dflash `build_target_layer_ids`: round(1 + i * (L - 4) / (count - 1)); one layer:
    L // 2), each clamped to the model's layers."""
    if count == 1:
        ids = [num_layers // 2]
    else:
        span = num_layers - 4
        ids = [int(round(1 + i * span / (count - 1))) for i in range(count)]
    return tuple(min(max(i, 0), num_layers - 1) for i in ids)


def check_layers(layers: tuple[int, ...], num_layers: int, count: int, method: str) -> tuple[int, ...]:
    """`layers` when it names `count` layers of the target's num_layers, else ValueError."""
    if len(layers) != count:
        raise ValueError(f"speculative_config.target_layer_ids: {method} reads {count} target layers, "
                         f"got {list(layers)}")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"speculative_config.target_layer_ids: {bad} outside the target's {num_layers} layers")
    return layers
