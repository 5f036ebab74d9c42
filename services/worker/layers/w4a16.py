"""4-bit weights of `Linear` layers (`kernels.w4a16_linear.W4Weight`; docs/ARCHITECTURE.md §6.3).

A Linear gets its `W4Weight` (`qweight`) after loading, by `kernels.w4a16_linear.MODE`:
- "checkpoint": the loader hands each AWQ / GPTQ qweight of the layer (with its zeros and
  scales, as a `W4Weight`) to `stash_w4`; the layer's model-dtype parameter is replaced by a
  meta-device placeholder at the first one (its memory is never filled). `process_w4` then
  stacks the shards along N, and fails when a stacked weight got some shards 4-bit and
  others unquantized.
- "dummy" (--load-format dummy with --quantization awq / gptq): `process_w4` gives every
  `quantizable` Linear random packed values of its shape (`W4Weight.random`, group size
  `w4a16_linear.GROUP_SIZE`, or K when that does not divide K).
Either way the parameter stays a meta placeholder of W's shape (and `shard_sizes`), and the
layer remembers it was 4-bit (`w4_layer`), so that after `loader.dense_weights` (dequantized
for a test to write) it is quantized again (`W4Weight.quantize`, round to nearest).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from kernels import w4a16_linear
from kernels.w4a16_linear import W4Weight
from services.worker.layers.fp8 import _meta_like


def takes_w4(module: nn.Module, attr: str) -> bool:
    """Whether the loader gives `module.<attr>`'s 4-bit checkpoint tensors to `stash_w4`
    (MODE "checkpoint", a Linear's weight) rather than dequantizing them into the parameter."""
    return w4a16_linear.MODE == "checkpoint" and attr == "weight" and hasattr(module, "w4_stash")


def stash_w4(module: nn.Module, shard: int | None, w: W4Weight) -> nn.Parameter:
    """Keep the 4-bit weight of `module.weight`'s shard (None: the whole weight) until
    `process_w4`; the first call replaces the weight by a meta placeholder, which it returns
    (the loader's view of the parameter). Raises ValueError when w does not fit the shard."""
    p = cast(torch.Tensor, module.weight)
    st = getattr(module, "w4_stash", None)
    if st is None:
        st = {}
        setattr(module, "w4_stash", st)  # noqa: B010
        p = _meta_like(p)
        setattr(module, "weight", p)  # noqa: B010
    sizes = getattr(p, "shard_sizes", None)
    rows = p.shape[0] if shard is None or sizes is None else sizes[shard]
    if (w.out_features, w.in_features) != (rows, p.shape[1]):
        raise ValueError(f"4-bit weight ({w.out_features}, {w.in_features}) does not fit shard {shard} "
                         f"({rows} rows of {p.shape[1]} columns)")
    st[shard] = w
    return cast(nn.Parameter, p)


def process_w4(module: nn.Module) -> bool:
    """After loading, give `module` (a Linear) its `W4Weight` when it has one to get (module
    docstring). Returns whether the layer holds 4-bit weights now. Raises ValueError for a
    stash with shards missing (a stacked weight whose checkpoint tensors are partly plain)."""
    if isinstance(getattr(module, "qweight", None), W4Weight):
        return True
    st: dict[int | None, W4Weight] | None = getattr(module, "w4_stash", None)
    w = cast(torch.Tensor, module.weight)
    if st:
        sizes = getattr(w, "shard_sizes", None)
        want: list[int | None] = [None] if sizes is None else list(range(len(sizes)))
        if set(st) != set(want):
            raise ValueError(f"{type(module).__name__} weight {tuple(w.shape)}: shards "
                             f"{sorted(set(want) - set(st), key=str)} are not 4-bit in the checkpoint while "
                             f"shards {sorted(st, key=str)} are; a stacked weight must be one format")
        setattr(module, "qweight", W4Weight.cat([st[s] for s in want]))  # noqa: B010
        setattr(module, "w4_stash", None)  # noqa: B010
        setattr(module, "w4_layer", True)  # noqa: B010
        return True
    again = getattr(module, "w4_layer", False)
    if not (again or (w4a16_linear.MODE == "dummy" and getattr(module, "quantizable", True))):
        return False
    if w.device.type == "meta" or w.dim() != 2 or not w.is_floating_point() or w.numel() == 0:
        return False
    n, k = w.shape
    g = w4a16_linear.GROUP_SIZE if k % w4a16_linear.GROUP_SIZE == 0 else k
    if k % 8:
        return False  # not packable: stays in the model dtype
    qw = W4Weight.quantize(w.data, g) if again else W4Weight.random(n, k, g, w.device)
    setattr(module, "qweight", qw)  # noqa: B010
    setattr(module, "weight", _meta_like(w))  # noqa: B010
    setattr(module, "w4_layer", True)  # noqa: B010
    return True
