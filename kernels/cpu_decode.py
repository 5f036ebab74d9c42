"""Kestrel's CPU decode ops, a C++ extension (kernels/csrc/cpu_decode.cpp): the RMS norm with the
residual add fused, and the decode attention (rotary on q and k, the KV store, paged attention over
each sequence's blocks) as one call each (docs/ARCHITECTURE.md §6.4 "CPU decode ops").

Why: a batch-1 CPU decode step of SmolLM2 is mostly Python and small ATen calls; the references
take ~9 ATen calls a norm and ~40 for a layer's rotary, KV store and SDPA.

Who calls them (with `kernels.ref_fast.CPU_CXX_OPS` on, CPU tensors only, where `available()`):
- the `kernels.norm.rms_norm` / `fused_add_rms_norm` and `kernels.activation.silu_and_mul`
  dispatchers for fp32 [T, hidden] CPU rows (prefill too; the unfused layers' norms and the fused
  path's prologues alike, so the two stay bit-equal);
- `services.worker.layers.attention.ReferenceAttention` on decode-only steps (one new token a
  sequence) for layers with an fp32 KV cache and no q/k norm (`AttentionLayer.cxx`); prefill,
  mixed steps, fp8 / int8 KV caches and Qwen3's q/k norm keep the torch path.

Flavours: the C++ is plain loops written for the vectoriser, built once per process for the CPU's
widest set (`flavour()`): "avx512" (AVX-512 F/BW/VL + FMA), "avx2" (AVX2 + FMA), else "generic"
(no ISA flags). Built on first use by `kernels.cpu_ext.build`; where the build fails `available()`
is False after one warning and the callers keep the torch references.

References (the torch paths they replace): `kernels.norm.rms_norm_ref` / `fused_add_rms_norm_ref`
(the same up to the order of the sum of squares, a few fp32 ulps), `kernels.activation.
silu_and_mul_ref` (the exp differs by ulps), `kernels.rope_decode.rope_paged_decode` on CPU tensors
(the rotary bit-equal, -ffp-contract=off; the attention in fp32 with a two-pass softmax, within fp32
rounding of `paged_attention_ref`'s SDPA).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

from kernels import cpu_ext

log = logging.getLogger(__name__)

_SOURCE = os.path.join(cpu_ext.CSRC, "cpu_decode.cpp")
_BASE = ["-O3", "-ffp-contract=off"]  # each product and sum rounded once, as torch's ops round them
FLAVOURS: dict[str, tuple[tuple[str, ...], list[str]]] = {  # name -> (/proc/cpuinfo flags needed, cflags)
    "avx512": (("avx512f", "avx512bw", "avx512vl", "avx2", "fma"),
               [*_BASE, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mprefer-vector-width=512"]),
    "avx2": (("avx2", "fma"), [*_BASE, "-mavx2", "-mfma"]),
    "generic": ((), list(_BASE)),
}


@functools.cache
def flavour() -> str:
    """The widest of FLAVOURS this CPU runs ("generic" where /proc/cpuinfo says nothing)."""
    flags = cpu_ext.cpu_flags()
    return next(name for name, (need, _) in FLAVOURS.items() if all(f in flags for f in need))


def _make(name: str) -> Any:
    need, cflags = FLAVOURS[name]
    return cpu_ext.build(f"kestrel_cpu_decode_{name}", _SOURCE, cflags, f"CPU decode ops ({name})",
                         "the CPU path keeps the torch references", required=need, logger=log)


_loaders = {name: cpu_ext.Loader(functools.partial(_make, name)) for name in FLAVOURS}


def extension(name: str | None = None) -> Any:
    """The loaded extension of flavour `name` (default `flavour()`), built on first use; None where
    it cannot be had (one warning)."""
    return _loaders[name or flavour()].get()


def available() -> bool:
    """Whether the ops run here: this CPU's flavour built and loaded."""
    return extension() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of rows: x [T, hidden] fp32 CPU (unit column stride; any row stride), weight
    [hidden] fp32 contiguous -> new contiguous [T, hidden] fp32, x * rsqrt(mean(x^2) + eps) * w
    (`kernels.norm.rms_norm_ref`). Raises RuntimeError (from the extension) for other shapes or
    dtypes, AttributeError where `available()` is False."""
    return extension().rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """r = x + residual; returns (rms_norm(r), r), both new contiguous [T, hidden] fp32
    (`kernels.norm.fused_add_rms_norm_ref`). x, residual: [T, hidden] fp32 CPU, unit column
    stride; weight [hidden] fp32. Raises as `rms_norm`."""
    out, res = extension().fused_add_rms_norm(x, residual, weight, eps)
    return out, res


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One decode token a sequence, fp32 on the CPU: the rotary embedding of q and k (neox layout,
    `kernels.rotary`; dims past the table's rot_dim pass through), k and v stored in the paged
    cache, and attention of each q head over its sequence's cached tokens (GQA: query head h reads
    KV head h // (heads / kv_heads)), softmax(q k^T scale) v with fp32 accumulation.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] (views of the fused qkv output are
        fine: unit last stride); q and k are not modified (the rotated k goes to the cache only).
    positions: [T] int64, each token's row of cos_sin, the whole `rope_cos_sin` table, fp32
        [max_positions, rot_dim <= head_dim], contiguous.
    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim] fp32, contiguous.
    slot_mapping: [T] int64, the new token's slot (block * block_size + offset; < 0: not stored).
    block_tables: [T, max_blocks] int32 (-1 past each table's end); seq_lens: [T] int32, cached
        tokens of each sequence including the new one (its keys are positions 0 .. seq_len - 1).
    scale: the softmax scale (head_dim ** -0.5).
    Returns [T, heads * head_dim] fp32: the reference is `kernels.rope_decode.rope_paged_decode` on
    CPU tensors (`rotary_and_store_kv_ref`, then `paged_attention_ref`), reshaped.
    Raises RuntimeError (from the extension) when heads is not a multiple of kv_heads, for other
    dtypes or shapes, a seq_len outside 1 .. max_blocks * block_size, a position past the table,
    a slot past the cache or a block id of a sequence's used blocks outside the cache (checked
    before anything is written); AttributeError where `available()` is False.
    """
    return extension().decode_attention(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
                                        block_tables, seq_lens, scale)


def decode_attention_qkv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, positions: torch.Tensor,
                         cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """`decode_attention` on the fused projection's output: qkv [T, (heads + 2 kv_heads) *
    head_dim] fp32 (unit column stride), q, k and v its column ranges in that order (not
    modified). Returns [T, heads * head_dim] fp32. Raises as `decode_attention`, and
    RuntimeError when qkv's width is not (heads + 2 kv_heads) * head_dim."""
    return extension().decode_attention_qkv(qkv, heads, kv_heads, head_dim, positions, cos_sin, k_cache, v_cache,
                                            slot_mapping, block_tables, seq_lens, scale)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :n]) * x[:, n:] for x [T, 2n] fp32 CPU (unit column stride) -> new [T, n] fp32,
    silu(a) = a / (1 + exp(-a)) (`kernels.activation.silu_and_mul_ref`, within a few fp32 ulps:
    the exp differs). Raises RuntimeError for an odd width or other dtypes, AttributeError where
    `available()` is False."""
    return extension().silu_and_mul(x)
