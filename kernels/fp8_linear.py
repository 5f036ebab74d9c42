"""FP8 (e4m3) linear weights with per-output-channel scales: W8A8 on the GPU
(docs/ARCHITECTURE.md §6.4).

Format: W [N, K] is held as q float8_e4m3fn [N, K] and scale fp32 [N], W ~ q * scale[:, None].
`quantize_fp8_rows` takes scale_n = max_k |W[n, k]| / 448 (448 = FP8_MAX, the largest finite
e4m3fn value; 1 for an all-zero row) and q = e4m3(W / scale), rounded to nearest even
(|W / scale| <= 448: no overflow). e4m3 has 3 mantissa bits and subnormals below 2^-6 in steps
of 2^-9, so one value's error is |W - q * scale| <= max(|W| * 2^-4, scale * 2^-10)
(`FP8_REL_ERR`, `FP8_SUBNORMAL_ERR`). The same quantizer, per row of x, gives the
activations' per-token scales.

Products (`fp8_linear`, on CUDA), picked by the rows M of x:
- M <= TRITON_MAX_ROWS (decode): `kernels.fp8_gemv.fp8_gemv_triton`: x stays bf16 (W8A16), the
  kernel reads q (half the bytes of a bf16 weight: what a batch-1 decode step's time is made
  of), accumulates in fp32 and scales once. No activation rounding.
- larger M (prefill chunks, large batches), or no Triton: W8A8: x quantized per token
  (`kernels.fp8_gemv.quant_rows_triton`, the torch quantizer without Triton), then
  `torch._scaled_mm(xq [M, K'], q.T [K', N'] column-major, scale_a [M, 1] fp32,
  scale_b [1, N'] fp32, out_dtype=bf16)`: cuBLASLt / CUTLASS row-wise scaling, fp32
  accumulation (use_fast_accum off), bias added after. Its rules: K and N multiples of 16
  (`Fp8Weight` pads q with zero rows and columns once, at build; x gets zero columns in the
  quantizer when K is padded), any M, bf16 output with row-wise scales (an fp16 x is cast).
So a decode step (<= 16 rows) and a prefill of the same tokens round differently: W8A16
against W8A8.
References (the truth for tests and for CPU tensors): `fp8_linear_ref` (dequantize W, then
x @ W.T in fp32) and `fp8_linear_w8a8_ref` (x through its per-token quantization first).

Checkpoint layouts (`checkpoint_rows`, used by the loader, services/worker/fp8_checkpoint.py):
a per-channel scale [N, 1] or [N] (compressed-tensors "channel") is taken as it is; a
per-tensor scale of one element (compressed-tensors "tensor", quant_method "fp8" without
blocks) is broadcast to the rows (exact); block scales [ceil(N / bn), ceil(K / bk)]
(quant_method "fp8" `weight_scale_inv` with `weight_block_size` [bn, bk], compressed-tensors
"block") are converted at load: the weight is dequantized in fp32 (q * its block's scale)
and quantized again per channel, one more e4m3 rounding (within the bound above of the
checkpoint's values). The block-scaled GEMMs themselves are not implemented.

`MODE` (set by the model runner before it builds the model): "off", "quantize" (every
quantizable `Linear` is quantized after loading: `--quantization fp8` on a bf16 checkpoint)
or "checkpoint" (the layers whose checkpoint tensors are fp8 keep them; the others stay in
the model dtype). `Fp8Weight` holds one layer's weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import fp8_gemv
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.norm import rms_norm, rms_norm_ref

MODE = "off"  # "off" | "quantize" | "checkpoint" (module docstring)
MODES = ("off", "quantize", "checkpoint")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_REL_ERR = 2.0 ** -4  # half an e4m3 step, relative, for normal values
FP8_SUBNORMAL_ERR = 2.0 ** -10  # half the subnormal step (2^-9), in units of the scale
ALIGN = 16  # torch._scaled_mm: K and N multiples of 16
TRITON_MAX_ROWS = 16  # rows of x up to which CUDA products take kernels.fp8_gemv
ACT_QUANT_TRITON = True  # CUDA activations quantized by fp8_gemv.quant_rows_triton (else torch ops)


def quantize_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization of w [N, K] (any float dtype and device; fp32 math):
    returns (q float8_e4m3fn [N, K], scale fp32 [N]), scale_n = max_k |w[n, k]| / 448 (1 for an
    all-zero row), q = e4m3(w / scale) (clamped to +-448 against fp32 rounding), so that
    |w - q * scale| <= max(|w| * FP8_REL_ERR, scale * FP8_SUBNORMAL_ERR)."""
    wf = w.float()
    amax = wf.abs().amax(dim=1) if wf.shape[1] else torch.zeros(wf.shape[0], device=wf.device)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q float8_e4m3fn [N, K], scale [N] (or [N, 1]) -> fp32 [N, K] = q * scale."""
    return q.float() * scale.float().reshape(-1, 1)


def fp8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The truth of the W8A16 product: x [M, K] @ dequantize_fp8_rows(q [N, K], scale [N]).T
    (+ bias [N]) in fp32, rounded to x's dtype -> [M, N]."""
    y = x.float() @ dequantize_fp8_rows(q, scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_linear_fused_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                         *, norm_weight: torch.Tensor | None = None, eps: float = 1e-6, silu_mul: bool = False,
                         residual: torch.Tensor | None = None) -> torch.Tensor:
    """The truth of the fused one-row product (`fp8_gemv.fp8_gemv_fused`), as
    `kernels.linear_ref.linear_ref` with the W8A16 product: the prologue (rms_norm_ref(x,
    norm_weight [K], eps), or silu_and_mul_ref of x [M, 2K]), `fp8_linear_ref`, then + residual
    [M, N] (torch's add in x's dtype: fp32 math, rounded) -> [M, N] in x's dtype."""
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)
    if silu_mul:
        x = silu_and_mul_ref(x)
    y = fp8_linear_ref(x, q, scale, bias)
    return y if residual is None else y + residual


def fp8_linear_w8a8_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """The truth of the W8A8 product (the `torch._scaled_mm` path): x [M, K] quantized per
    row (`quantize_fp8_rows`), then (xq * sx) @ (q * scale).T (+ bias) in fp32, rounded to
    x's dtype -> [M, N]."""
    xq, sx = quantize_fp8_rows(x)
    return fp8_linear_ref(dequantize_fp8_rows(xq, sx), q, scale, bias).to(x.dtype)


def checkpoint_rows(q: torch.Tensor, scale: torch.Tensor,
                    block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's fp8 weight q float8_e4m3fn [N, K] and its scale, as per-channel rows:
    (q' float8_e4m3fn [N, K], scale' fp32 [N]) on q's device, with q' * scale' ~ q * scale.

    scale: one element (per tensor: broadcast, q kept, exact), [N] or [N, 1] (per channel:
    kept, exact), or [ceil(N / bn), ceil(K / bk)] with block = (bn, bk) (block scales:
    dequantized in fp32 and quantized again per row, `quantize_fp8_rows`; the last block of
    a row or column may be partial). Raises ValueError for another scale shape or a q that
    is not float8_e4m3fn."""
    if q.dtype != FP8_DTYPE or q.dim() != 2:
        raise ValueError(f"fp8 weight: {tuple(q.shape)} {q.dtype}, want a 2-D float8_e4m3fn tensor")
    n, k = q.shape
    s = scale.to(device=q.device, dtype=torch.float32)
    if s.numel() == 1:
        return q, s.reshape(1).expand(n).contiguous()
    if block is not None and s.dim() == 2 and s.shape == (-(-n // block[0]), -(-k // block[1])):
        return quantize_fp8_rows(dequantize_checkpoint(q, s, block))
    if s.shape in ((n,), (n, 1)):
        return q, s.reshape(n).contiguous()
    raise ValueError(f"fp8 weight {tuple(q.shape)}: scale of shape {tuple(scale.shape)} is neither per tensor "
                     f"(1), per channel ({n}, 1) nor per block {block} "
                     f"({-(-n // block[0]) if block else '?'}, {-(-k // block[1]) if block else '?'})")


def dequantize_checkpoint(q: torch.Tensor, scale: torch.Tensor,
                          block: tuple[int, int] | None = None) -> torch.Tensor:
    """fp32 [N, K] values of a checkpoint's fp8 weight q [N, K] and its scale (one element,
    [N] / [N, 1], or block scales [ceil(N / bn), ceil(K / bk)] with block = (bn, bk): each
    block of q times its scale). Raises ValueError as `checkpoint_rows` for another shape."""
    n, k = q.shape
    s = scale.to(device=q.device, dtype=torch.float32)
    if block is not None and s.dim() == 2 and s.numel() > 1 and s.shape == (-(-n // block[0]), -(-k // block[1])):
        full = s.repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
        return q.float() * full
    qr, sr = checkpoint_rows(q, scale, None)
    return dequantize_fp8_rows(qr, sr)


@dataclass
class Fp8Weight:
    """One linear layer's e4m3 weight W [out_features, in_features] with per-row scales.

    qweight: float8_e4m3fn [N', K'] contiguous, N' and K' = N and K rounded up to ALIGN (the
    padding rows and columns zero); scale: fp32 [N'] (1 on padding rows). Built by
    `from_rows` (given per-row fp8 values) or `quantize` (from a float weight). `matmul` is
    the product (`fp8_linear`), `dequantize` the weight it stands for.
    """

    out_features: int
    in_features: int
    qweight: torch.Tensor
    scale: torch.Tensor
    scheme: str = "fp8"

    @classmethod
    def from_rows(cls, q: torch.Tensor, scale: torch.Tensor) -> Fp8Weight:
        """From q float8_e4m3fn [N, K] and scale [N] (any float dtype; same device): padded
        to ALIGN. Raises ValueError for an empty or non-fp8 q, or a scale of the wrong size."""
        if q.dtype != FP8_DTYPE or q.dim() != 2 or 0 in q.shape or scale.numel() != q.shape[0]:
            raise ValueError(f"Fp8Weight: q {tuple(q.shape)} {q.dtype}, scale {tuple(scale.shape)}")
        n, k = q.shape
        np_, kp = -(-n // ALIGN) * ALIGN, -(-k // ALIGN) * ALIGN
        qp = q.contiguous()
        if (np_, kp) != (n, k):  # pad through uint8 (zero bytes are +0.0 in e4m3)
            qp = torch.nn.functional.pad(q.view(torch.uint8), (0, kp - k, 0, np_ - n)).view(FP8_DTYPE)
        sp = torch.ones(np_, dtype=torch.float32, device=q.device)
        sp[:n] = scale.reshape(n).float()
        return cls(n, k, qp, sp)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Fp8Weight:
        """`quantize_fp8_rows` of a float weight w [N, K] (any strides), on w's device."""
        return cls.from_rows(*quantize_fp8_rows(w))

    @property
    def nbytes(self) -> int:
        """Bytes held (q and scales)."""
        return self.qweight.numel() + self.scale.numel() * 4

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, **fused) -> torch.Tensor:
        """x [M, in_features] ([M, 2 in_features] with silu_mul) -> [M, out_features] in x's
        dtype (`fp8_linear`, its fused keywords norm_weight, eps, silu_mul, residual)."""
        return fp8_linear(x, self, bias, **fused)

    def fuses_one_row(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a one-row product on `device` in `dtype` runs its RMSNorm / SiLU-and-mul
        prologue and residual epilogue inside the kernel (`fp8_gemv.fp8_gemv_fused`:
        CUDA, bf16 / fp16, fp8_gemv.ONE_ROW "gemv", Triton), for `services.worker.fusion`."""
        return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and fp8_gemv.ONE_ROW == "gemv"
                and fp8_gemv.fp8_gemv_fused is not None)

    def dequantize(self) -> torch.Tensor:
        """The fp32 [out_features, in_features] weight this one stands for."""
        n, k = self.out_features, self.in_features
        return dequantize_fp8_rows(self.qweight[:n, :k], self.scale[:n])


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, *,
               norm_weight: torch.Tensor | None = None, eps: float = 1e-6, silu_mul: bool = False,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """y = prologue(x) @ W.T (+ bias) (+ residual) for an `Fp8Weight` W: x [M, in_features]
    ([M, 2 in_features] with silu_mul; bf16 on CUDA; any float dtype on the CPU, where it is
    `fp8_linear_ref`), bias [out_features] or None -> [M, out_features] in x's dtype. On
    CUDA: `fp8_gemv_triton` for 1..TRITON_MAX_ROWS rows, else `scaled_mm_linear` (module
    docstring). The fused steps (`kernels.linear.linear`'s: norm_weight / eps an RMSNorm of x,
    silu_mul, residual [M, out_features] added to the output) run inside the one-row kernel
    (`fp8_gemv.fp8_gemv_fused`) for one CUDA row with fp8_gemv.ONE_ROW "gemv", else as their
    own ops around the product (`fp8_linear_fused_ref`'s order). The caller checks the fused
    arguments (`kernels.linear._check_fused`). Raises ValueError when x's width is not
    in_features (2 in_features with silu_mul)."""
    if norm_weight is not None or silu_mul or residual is not None:
        if (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and fp8_gemv.ONE_ROW == "gemv"
                and fp8_gemv.fp8_gemv_fused is not None and x.shape[1] == (2 if silu_mul else 1) * w.in_features):
            y = fp8_gemv.fp8_gemv_fused(x if x.stride(1) == 1 else x.contiguous(), w.qweight, w.scale, bias,
                                        n=w.out_features, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul,
                                        residual=residual)
            if y is not None:
                return y
        if norm_weight is not None:
            x = rms_norm(x, norm_weight, eps)
        if silu_mul:
            x = silu_and_mul(x)
        y = fp8_linear(x, w, bias)
        return y if residual is None else y.add_(residual)
    n, k = w.out_features, w.in_features
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"fp8 linear: x {tuple(x.shape)} does not fit weight ({n}, {k})")
    if not x.is_cuda:
        return fp8_linear_ref(x, w.qweight[:n, :k], w.scale[:n], bias)
    m = x.shape[0]
    if m == 0:
        return x.new_empty((0, n))
    if m <= TRITON_MAX_ROWS and fp8_gemv.fp8_gemv_triton is not None:
        return fp8_gemv.fp8_gemv_triton(x if x.stride(1) == 1 else x.contiguous(), w.qweight, w.scale, bias, n=n)
    return scaled_mm_linear(x, w, bias)


def quantize_rows(x: torch.Tensor, k_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] quantized per row for `torch._scaled_mm`: (q float8_e4m3fn [M, k_out]
    contiguous, zero columns past K; scale fp32 [M, 1]). The Triton kernel on CUDA
    (ACT_QUANT_TRITON), else `quantize_fp8_rows`."""
    if x.is_cuda and ACT_QUANT_TRITON and fp8_gemv.quant_rows_triton is not None:
        return fp8_gemv.quant_rows_triton(x if x.stride(1) == 1 else x.contiguous(), k_out)
    q, s = quantize_fp8_rows(x)
    if k_out != x.shape[1]:
        q = torch.nn.functional.pad(q.view(torch.uint8), (0, k_out - x.shape[1])).view(FP8_DTYPE)
    return q.contiguous(), s.reshape(-1, 1)


def scaled_mm_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 product on CUDA: x [M, in_features] quantized per token (`quantize_rows`,
    padded to W's K'), `torch._scaled_mm` with row-wise scales into bf16 [M, N'], the padding
    columns dropped, bias added, cast to x's dtype -> [M, out_features]."""
    n = w.out_features
    xq, sx = quantize_rows(x, w.qweight.shape[1])
    y = torch._scaled_mm(xq, w.qweight.t(), scale_a=sx, scale_b=w.scale.view(1, -1),
                         out_dtype=torch.bfloat16)
    if y.shape[1] != n:
        y = y[:, :n].contiguous()
    if bias is not None:
        y = y.add_(bias)
    return y if x.dtype == torch.bfloat16 else y.to(x.dtype)
