"""FP8 weights of `Linear` layers (`kernels.fp8_linear.Fp8Weight`; docs/ARCHITECTURE.md §6.3).

A Linear gets its `Fp8Weight` (`qweight`) after loading, in one of two ways, by
`kernels.fp8_linear.MODE`:
- "checkpoint": the loader hands each fp8 checkpoint tensor of the layer, already as per-row
  e4m3 values and fp32 scales (`kernels.fp8_linear.checkpoint_rows`), to `stash_fp8_rows`;
  the layer's model-dtype parameter is replaced by a meta-device placeholder at the first
  one (its memory is never filled). `process_fp8` then builds the weight from the stash,
  exactly the checkpoint's values, and fails when a stacked weight got some shards as fp8
  and others unquantized.
- "quantize" (a bf16 checkpoint with --quantization fp8): `process_fp8` quantizes the loaded
  weight per row (`Fp8Weight.quantize`) when the layer is `quantizable` (not a MoE router).
Either way the parameter stays as a meta-device placeholder of W's shape (and
`shard_sizes`), and the layer remembers it is fp8 (`fp8_layer`), so that after
`loader.dense_weights` (dequantized for a test to write) it is quantized again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from kernels import fp8_linear
from kernels.fp8_linear import Fp8Weight


@dataclass
class Fp8Stash:
    """A layer's checkpoint fp8 rows while loading: q float8_e4m3fn [N, K], scale fp32 [N],
    and the shard indexes filled (None: an unstacked weight)."""

    q: torch.Tensor
    scale: torch.Tensor
    filled: set[int | None] = field(default_factory=set)


def takes_fp8_rows(module: nn.Module, attr: str) -> bool:
    """Whether the loader gives `module.<attr>`'s fp8 checkpoint tensors to `stash_fp8_rows`
    (MODE "checkpoint", a Linear's weight) rather than dequantizing them into the parameter."""
    return fp8_linear.MODE == "checkpoint" and attr == "weight" and hasattr(module, "fp8_stash")


def _meta_like(old: torch.Tensor) -> nn.Parameter:
    """A frozen meta-device parameter of old's shape and dtype, with its `shard_sizes`."""
    p = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device="meta"), requires_grad=False)
    if hasattr(old, "shard_sizes"):
        setattr(p, "shard_sizes", getattr(old, "shard_sizes"))  # noqa: B009, B010 (as in Linear.__init__)
    return p


def stash_fp8_rows(module: nn.Module, shard: int | None, q: torch.Tensor, scale: torch.Tensor) -> nn.Parameter:
    """Keep the fp8 rows q [rows, K] and scale [rows] of `module.weight`'s shard (None: the
    whole weight) until `process_fp8`. The first call allocates the stash on the weight's
    device and replaces the weight by a meta placeholder, which it returns (the loader's
    view of the parameter). Raises ValueError when q does not fit the shard's rows."""
    w = cast(torch.Tensor, module.weight)
    st = getattr(module, "fp8_stash", None)
    if st is None:
        n, k = w.shape
        st = Fp8Stash(torch.empty(n, k, dtype=fp8_linear.FP8_DTYPE, device=w.device),
                      torch.empty(n, dtype=torch.float32, device=w.device))
        setattr(module, "fp8_stash", st)  # noqa: B010
        w = _meta_like(w)
        setattr(module, "weight", w)  # noqa: B010
    sizes = getattr(w, "shard_sizes", None)
    lo, rows = (0, w.shape[0]) if shard is None or sizes is None else (sum(sizes[:shard]), sizes[shard])
    if q.shape != (rows, w.shape[1]) or scale.shape != (rows,):
        raise ValueError(f"fp8 rows {tuple(q.shape)} / scale {tuple(scale.shape)} do not fit shard {shard} "
                         f"({rows} rows of {w.shape[1]} columns)")
    st.q[lo:lo + rows].copy_(q)
    st.scale[lo:lo + rows].copy_(scale)
    st.filled.add(shard)
    return cast(nn.Parameter, w)


def process_fp8(module: nn.Module) -> bool:
    """After loading, give `module` (a Linear) its `Fp8Weight` when it has one to get (module
    docstring): from the stash, or by quantizing the loaded weight (MODE "quantize" and
    `quantizable`, or a layer that was fp8 before `dense_weights`). Returns whether the layer
    holds fp8 weights now. Raises ValueError for a stash with shards missing (a stacked
    weight whose checkpoint tensors are partly unquantized)."""
    if isinstance(getattr(module, "qweight", None), Fp8Weight):
        return True  # processed already
    st: Fp8Stash | None = getattr(module, "fp8_stash", None)
    w = cast(torch.Tensor, module.weight)
    if st is not None:
        sizes = getattr(w, "shard_sizes", None)
        want: set[int | None] = {None} if sizes is None else set(range(len(sizes)))
        if st.filled != want:
            raise ValueError(f"{type(module).__name__} weight {tuple(w.shape)}: shards "
                             f"{sorted(want - st.filled, key=str)} are not fp8 in the checkpoint while "
                             f"shards {sorted(st.filled, key=str)} are; a stacked weight must be one format")
        setattr(module, "qweight", Fp8Weight.from_rows(st.q, st.scale))  # noqa: B010
        setattr(module, "fp8_stash", None)  # noqa: B010
        setattr(module, "fp8_layer", True)  # noqa: B010
        return True
    again = getattr(module, "fp8_layer", False)
    if not (again or (fp8_linear.MODE == "quantize" and getattr(module, "quantizable", True))):
        return False
    if w.device.type == "meta" or w.dim() != 2 or not w.is_floating_point() or w.numel() == 0:
        return False
    setattr(module, "qweight", Fp8Weight.quantize(w.data))  # noqa: B010
    setattr(module, "weight", _meta_like(w))  # noqa: B010
    setattr(module, "fp8_layer", True)  # noqa: B010
    return True
