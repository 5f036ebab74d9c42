"""SiLU-and-mul, the gate of a SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer").

Dispatcher `silu_and_mul` picks the torch reference on the CPU (Kestrel's C++ op for fp32 rows
with `kernels.ref_fast.CPU_CXX_OPS`, `kernels.cpu_decode`) and `silu_and_mul_triton` (bottom of
this file) on CUDA tensors when Triton imports.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_decode, ref_fast

silu_and_mul_triton = None  # set by the GPU issue: same signature as silu_and_mul_ref


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where x = cat([gate, up], -1).

    x: [num_tokens, 2 * intermediate] (fp32/bf16/fp16). Returns [num_tokens, intermediate],
    x's dtype.
    """
    if ref_fast.FEWER_OPS:  # the same two views by slicing (chunk: 8 ATen calls)
        h = x.shape[-1] // 2
        return F.silu(x[..., :h]) * x[..., h:]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Dispatcher for `silu_and_mul_ref` (see there for shapes): Triton on CUDA, the C++ op
    (`kernels.cpu_decode.silu_and_mul`) for fp32 [T, 2n] CPU rows with `ref_fast.CPU_CXX_OPS`."""
    if x.is_cuda:
        if silu_and_mul_triton is not None:
            return silu_and_mul_triton(x)
    elif ref_fast.CPU_CXX_OPS and x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1:
        ext = cpu_decode.extension()
        if ext is not None:
            return ext.silu_and_mul(x)
    return silu_and_mul_ref(x)


# ---------------------------------------------------------------- Triton (CUDA)
try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the dispatcher keeps the reference
    triton = None

if triton is not None:
    from kernels.pdl import launch_args, pdl_release, pdl_wait, use_pdl

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, n, USE_PDL: tl.constexpr, BLOCK: tl.constexpr):
        pdl_wait(USE_PDL)
        pdl_release(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < n
        g = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0)
        u = tl.load(x_ptr + row * x_stride + n + cols, mask=m, other=0.0)
        gf = g.to(tl.float32)
        # torch rounds silu(gate) to the dtype before the product: do the same
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        tl.store(out_ptr + row * n + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)

    def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
        """Triton `silu_and_mul_ref` (same shapes); x's last dim must have unit stride."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        n = x.shape[-1] // 2
        x2 = x.reshape(-1, 2 * n)
        out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
        block = min(1024, triton.next_power_of_2(n))
        if x2.shape[0]:
            pdl = use_pdl(x.device)
            _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, x2.stride(0), n, USE_PDL=pdl,
                                                                      BLOCK=block, **launch_args(pdl))
        return out.view(*x.shape[:-1], n)
