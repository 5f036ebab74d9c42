"""RMSNorm, alone, fused with the residual add, and gated (`rms_norm_gated`, gated DeltaNet).

Dispatchers `rms_norm`, `fused_add_rms_norm` and `rms_norm_gated` pick the torch references
(`*_ref`) on the CPU and `*_triton` (bottom of this file) on CUDA tensors when Triton imports
(`rms_norm_gated`: also `GATED_TRITON`); `rms_norm` and `fused_add_rms_norm` take Kestrel's C++
ops for fp32 CPU rows with `kernels.ref_fast.CPU_CXX_OPS` (`kernels.cpu_decode`).

Algorithm: RMSNorm (Zhang & Sennrich 2019), y = x / sqrt(mean(x^2) + eps) * w, computed in
fp32 and cast back before the weight multiply, in the order of Hugging Face's LlamaRMSNorm
so that fp32 and bf16 outputs match it bit for bit on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_decode, ref_fast

rms_norm_triton = None  # set by the GPU issue: same signature as rms_norm_ref
fused_add_rms_norm_triton = None  # same signature as fused_add_rms_norm_ref
rms_norm_gated_triton = None  # same signature as rms_norm_gated_ref
GATED_TRITON = True  # False: rms_norm_gated keeps the reference on CUDA (the A/B baseline)


_SCALARS: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}


def _scalars(n: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d fp32 CPU tensors of n and eps, made once: a Python number in div_ / add_ becomes
    such a tensor on every call (three ATen calls each); the arithmetic is the same."""
    t = _SCALARS.get((n, eps))
    if t is None:
        t = _SCALARS[(n, eps)] = (torch.tensor(float(n)), torch.tensor(eps))
    return t


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension.

    x: [..., hidden] (fp32/bf16/fp16); weight: [hidden], same dtype as x.
    Returns [..., hidden] in x's dtype.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if ref_fast.FEWER_OPS and x.device.type == "cpu":  # F.rms_norm's CPU fp32 composite, no casts
            n, e = _scalars(x.shape[-1], eps)  # mean = sum / n, as torch's mean; + eps
            return x.mul(x.pow(2).sum(-1, keepdim=True).div_(n).add_(e).rsqrt_()).mul_(weight)
        # the same formula in one torch op (no casts happen in fp32): fewer small kernels
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual').

    x, residual: [num_tokens, hidden], same dtype; weight: [hidden].
    The add runs in the model dtype (as in Hugging Face's decoder layer); the norm in fp32.
    """
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def rms_norm_gated_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm (gated DeltaNet's output norm): rms_norm(x) * silu(gate), norm first.

    x, gate: [..., dim], same dtype; weight: [dim]. Returns [..., dim] in x's dtype. Order as
    Hugging Face's Qwen3NextRMSNormGated: x normalised in fp32 and cast back, times the weight
    in the dtype, times silu(gate) in fp32, cast once at the end.
    """
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Dispatcher for `rms_norm_gated_ref` (see there): `rms_norm_gated_triton` on CUDA
    tensors (when Triton imports and `GATED_TRITON`; weight in x's dtype), else the reference."""
    if x.is_cuda and GATED_TRITON and rms_norm_gated_triton is not None and weight.dtype == x.dtype:
        return rms_norm_gated_triton(x, gate, weight, eps)
    return rms_norm_gated_ref(x, gate, weight, eps)


def _cxx(x: torch.Tensor, weight: torch.Tensor):
    """The C++ CPU ops' module when they take this norm (`kernels.cpu_decode`: CPU_CXX_OPS on, fp32
    [T, hidden] CPU rows with unit column stride, a contiguous fp32 weight, the extension built),
    else None."""
    if (ref_fast.CPU_CXX_OPS and x.is_cpu and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous()):
        return cpu_decode.extension()
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Dispatcher for `rms_norm_ref` (see there for shapes): Triton on CUDA, the C++ op
    (`kernels.cpu_decode.rms_norm`) for fp32 CPU rows with `ref_fast.CPU_CXX_OPS`."""
    if x.is_cuda:
        if rms_norm_triton is not None:
            return rms_norm_triton(x, weight, eps)
    else:
        ext = _cxx(x, weight)
        if ext is not None:
            return ext.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher for `fused_add_rms_norm_ref` (see there for shapes): Triton on CUDA, the C++ op
    (`kernels.cpu_decode.fused_add_rms_norm`) for fp32 CPU rows with `ref_fast.CPU_CXX_OPS`."""
    if x.is_cuda:
        if fused_add_rms_norm_triton is not None:
            return fused_add_rms_norm_triton(x, residual, weight, eps)
    else:
        ext = _cxx(x, weight)
        if ext is not None and residual.dtype == torch.float32 and residual.shape == x.shape \
                and residual.stride(1) == 1:
            return ext.fused_add_rms_norm(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


# ---------------------------------------------------------------- Triton (CUDA)
# One program per row; the row (hidden <= 16384) fits one tile. Same arithmetic order as the
# reference: fp32 sum of squares, x * rsqrt(mean + eps) cast to the dtype, then times w
# (rounded once more to the dtype, as torch does for a bf16 product).

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the dispatchers keep the references
    triton = None

if triton is not None:
    from kernels.pdl import launch_args, pdl_release, pdl_wait, use_pdl

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, x_stride, res_stride,
                         n_cols, eps, HAS_RES: tl.constexpr, USE_PDL: tl.constexpr,
                         BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < n_cols
        w = tl.load(w_ptr + cols, mask=m, other=0.0)  # a weight: no kernel writes it
        pdl_wait(USE_PDL)
        pdl_release(USE_PDL)
        x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * res_stride + cols, mask=m, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the add in the model dtype
            tl.store(res_out_ptr + row * n_cols + cols, x, mask=m)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
        tl.store(out_ptr + row * n_cols + cols, (y.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=m)

    def _rows(x: torch.Tensor) -> torch.Tensor:
        """x as [rows, hidden] with unit column stride (copies only when it must)."""
        x2 = x.reshape(-1, x.shape[-1])
        return x2 if x2.stride(-1) == 1 else x2.contiguous()

    def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Triton `rms_norm_ref` (same shapes). x may be a strided view (e.g. per-head q)."""
        x2 = _rows(x)
        out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        if x2.shape[0]:
            pdl = use_pdl(x.device)
            _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, out, out, x2.stride(0), 0, x2.shape[1],
                                             eps, HAS_RES=False, USE_PDL=pdl,
                                             BLOCK=triton.next_power_of_2(x2.shape[1]), **launch_args(pdl))
        return out.view(x.shape)

    def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Triton `fused_add_rms_norm_ref`: one pass reads x and residual, writes both outputs."""
        x2, r2 = _rows(x), _rows(residual)
        out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        res_out = torch.empty_like(out)
        if x2.shape[0]:
            pdl = use_pdl(x.device)
            _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0),
                                             x2.shape[1], eps, HAS_RES=True, USE_PDL=pdl,
                                             BLOCK=triton.next_power_of_2(x2.shape[1]), **launch_args(pdl))
        return out.view(x.shape), res_out.view(x.shape)

    @triton.jit
    def _rms_norm_gated_kernel(x_ptr, g_ptr, w_ptr, out_ptr, sx_t, sx_h, sg_t, sg_h, n_cols, eps,
                               H: tl.constexpr, BLOCK: tl.constexpr):
        # grid (tokens, heads): one head's row of x [T, H, D] and gate (strided), out [T, H, D]
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        m = cols < n_cols
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        x = tl.load(x_ptr + t * sx_t + h * sx_h + cols, mask=m, other=0.0)
        xf = x.to(tl.float32)
        y = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)).to(x.dtype)
        y = (y.to(tl.float32) * w.to(tl.float32)).to(x.dtype)  # weight * normed, in the dtype
        g = tl.load(g_ptr + t * sg_t + h * sg_h + cols, mask=m, other=0.0).to(tl.float32)
        out = y.to(tl.float32) * (g / (1.0 + tl.exp(-g)))  # times silu(gate) in fp32, one rounding
        tl.store(out_ptr + (t * H + h) * n_cols + cols, out.to(x.dtype), mask=m)

    def _heads(x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] as [rows, heads, dim] with unit column stride: [T, H, D] as it is, a
        2-D x as [T, 1, D], more dimensions flattened into the rows (copies only when they must)."""
        if x.dim() == 3:
            x3 = x
        elif x.dim() == 2:
            x3 = x[:, None]
        elif x.dim() == 1:
            x3 = x.view(1, 1, -1)
        else:
            x3 = x.reshape(-1, x.shape[-2], x.shape[-1])
        return x3 if x3.stride(-1) == 1 else x3.contiguous()

    def rms_norm_gated_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Triton `rms_norm_gated_ref` (same shapes and rounding), a program per (token, head).
        x and gate [..., dim] of one shape may be strided views (e.g. the gate z sliced out of
        a projection's output); weight [dim] in x's dtype (the product with it is rounded to
        that dtype, as the reference's is then). Returns a contiguous tensor of x's shape.
        Raises ValueError when x and gate differ in shape or weight is not [dim]."""
        if x.shape != gate.shape or weight.shape != (x.shape[-1],):
            raise ValueError(f"rms_norm_gated: x {tuple(x.shape)}, gate {tuple(gate.shape)}, "
                             f"weight {tuple(weight.shape)}")
        x3, g3 = _heads(x), _heads(gate)
        t, h, d = x3.shape
        out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
        if t and h and d:
            _rms_norm_gated_kernel[(t, h)](x3, g3, weight, out, x3.stride(0), x3.stride(1), g3.stride(0),
                                           g3.stride(1), d, eps, H=h, BLOCK=triton.next_power_of_2(d))
        return out.view(x.shape)
