"""The layer-fusion plan: which steps run the fused decoder-layer path (docs/ARCHITECTURE.md §6).

Two layer paths exist (`services.worker.models.llama`):
- unfused (CPU, prefill, batches over 16): the norms and residual adds are their own ops
  (fused_add_rms_norm);
- fused (CUDA, bf16/fp16, every projection on our kernels; FP8 weights too at one row): the
  layer carries the residual stream alone, and the norms, the SiLU-and-mul and the residual
  adds run inside the projections' kernels (`kernels.linear`, `kernels.gemv`,
  `kernels.fp8_gemv.fp8_gemv_fused`): 4 projection launches and the attention a layer. Same rounding op by op, so the outputs equal the unfused path's up to
  summation order.

The runner chooses once at load, from the model's projection weights, the device and the
dtype, which step sizes (tokens per step) take the fused path, and passes the choice to the
model's forward each step; a CUDA graph keeps the choice made at its capture.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import linear as linear_kernels

# One row on the gemv kernel (kernels.gemv: the norm in its prologue, the residual add in its
# epilogue): 4 projection launches and the attention a layer, no norm kernels. False keeps
# batch 1 on the unfused path (benchmarks/decode_latency.py --fused-layers off).
FUSE_ONE_ROW = True
# The fused path at 2..16 rows (verify steps of 1 + k rows a seq, small decode batches).
# None: on exactly when the one-tile skinny kernel is (`kernels.linear.SKINNY_PDL`), whose
# prologues run on the x tile while its W tile streams in. On the K-loop kernel the fused
# path measured slower than the unfused sequence (H200, Qwen3-0.6B b=1 linear stack in one
# CUDA graph, benchmarks/kernel_sweep.py --only fused: 1,302 against 851 us), so with
# SKINNY_PDL off those steps stay unfused. True / False force it.
FUSE_SMALL_BATCHES: bool | None = None
# One row of FP8-weight layers on the fused path too (kernels.fp8_gemv.fp8_gemv_fused: the norm,
# SiLU-and-mul and residual add inside kernels.gemv's kernel on e4m3 bytes). False keeps
# quantized models unfused (benchmarks/decode_latency.py's fuse_quantized knob). Off: on the H200
# (Llama-3.1-8B, 2026-12-03) fused 2.99 ms a token against 2.97 unfused on the same kernel, and
# its bf16 roundings move the logits (2.2% of the max apart).
FUSE_QUANTIZED_ONE_ROW = False


class FusionPlan:
    """Which step sizes take the fused layer path.

    rows: the token counts of steps that take it; None = every step (tests force the path
    with it, e.g. on the CPU, where it equals the unfused one bit for bit).
    fused(num_tokens) -> bool, one set lookup (called once per step).
    """

    __slots__ = ("rows",)

    def __init__(self, rows: frozenset[int] | None):
        self.rows = rows

    def fused(self, num_tokens: int) -> bool:
        return self.rows is None or num_tokens in self.rows

    @classmethod
    def choose(cls, projections: Sequence[object], device: torch.device, dtype: torch.dtype,
               one_row: bool | None = None, small_batches: bool | None = None,
               quantized: bool | None = None) -> FusionPlan:
        """The plan of a model whose decoder layers' projection weights are `projections`
        (one layer's: every layer has the same shapes; a tensor, or a quantized weight such as
        `kernels.fp8_linear.Fp8Weight` for a quantized layer), on `device` in `dtype`: a step
        of T tokens is fused when T == 1 with one_row (default FUSE_ONE_ROW) and the gemv
        kernel on (`kernels.gemv.ENABLED`), or 1 <= T <= SKINNY_MAX_ROWS with small_batches
        (default FUSE_SMALL_BATCHES; None follows `kernels.linear.SKINNY_PDL`), and
        `kernels.linear.skinny_applies` takes every dense projection at T rows (CUDA, bf16/fp16, weights up to SKINNY_MAX_WEIGHT). Quantized
        projections fuse at T == 1 only, with quantized (default FUSE_QUANTIZED_ONE_ROW) and
        when each one's `fuses_one_row(device, dtype)` says its kernel runs the prologues and
        epilogue (FP8 on `kernels.gemv`'s kernel); one without it (W4A16, the CPU schemes)
        keeps the layer unfused (its prologues and epilogue would be separate ops, which the
        unfused path does in fewer kernels). Never on the CPU. A dense weight on the meta
        device (a quantized layer's placeholder) keeps it unfused.
        Read the module flags, SKINNY_PDL and gemv.ENABLED now: set them before the runner is
        built (or choose again: `ModelRunner.recapture_graphs`)."""
        one_row = FUSE_ONE_ROW if one_row is None else one_row
        small_batches = FUSE_SMALL_BATCHES if small_batches is None else small_batches
        if small_batches is None:
            small_batches = linear_kernels.SKINNY_PDL
        quantized = FUSE_QUANTIZED_ONE_ROW if quantized is None else quantized
        dense = [w for w in projections if isinstance(w, torch.Tensor)]
        quant = [w for w in projections if not isinstance(w, torch.Tensor)]
        if device.type != "cuda" or not projections or any(w.device.type == "meta" for w in dense):
            return cls(frozenset())
        if quant and not (quantized and all(_fuses_one_row(w, device, dtype) for w in quant)):
            return cls(frozenset())
        rows = set()
        for t in range(1, linear_kernels.SKINNY_MAX_ROWS + 1):
            if not ((t == 1 and one_row and linear_kernels.gemv.ENABLED) or (small_batches and not quant)):
                continue
            x = torch.empty((t, 1), dtype=dtype, device=device) if dense else None  # skinny_applies reads
            if x is None or all(linear_kernels.skinny_applies(x, w) for w in dense):  # rows, device, dtype
                rows.add(t)
        return cls(frozenset(rows))


def _fuses_one_row(w: object, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether quantized weight w's one-row kernel runs the fused steps (its `fuses_one_row`)."""
    fn = getattr(w, "fuses_one_row", None)
    return bool(fn is not None and fn(device, dtype))
