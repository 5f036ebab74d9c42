"""Elementwise glue of the hybrid models (Qwen3-Next, Qwen3.5-MoE) in one launch each,
where torch runs two or three small kernels (docs/ARCHITECTURE.md §6.3):

- `sigmoid_gate_mul(x, gate)`: x * sigmoid(gate), the gated attention's output gate; gate is
  the strided per-head half of the q projection's output (torch: a copy of the gate into a
  contiguous tensor, the sigmoid, the product: three launches);
- `shared_expert_combine(moe_out, gate, shared_out)`: moe_out + sigmoid(gate) * shared_out,
  the MoE block with a shared expert (torch: sigmoid, broadcast product, add: three launches).

Each has its torch reference (`*_ref`, the CPU path and the tests' truth) and a Triton kernel
(`*_triton`, CUDA tensors when Triton imports). Rounding follows the references op by op:
math in fp32, the sigmoid rounded to the dtype as torch rounds it, then the product rounded,
then (combine) the sum rounded, so the two paths differ only where the fp32 exp differs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def sigmoid_gate_mul_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate). x: [T, N] (fp32/bf16/fp16); gate: [T, G, D] with G * D == N (any
    strides, e.g. a per-head view of a wider projection), x's dtype. Returns [T, N] in x's
    dtype. Source: the gated attention of Qwen3-Next (Hugging Face `modeling_qwen3_next.py`:
    attn_output * sigmoid(gate))."""
    return x * torch.sigmoid(gate.reshape(x.shape[0], -1))


def shared_expert_combine_ref(moe_out: torch.Tensor, gate: torch.Tensor, shared_out: torch.Tensor) -> torch.Tensor:
    """moe_out + sigmoid(gate) * shared_out. moe_out, shared_out: [T, H]; gate: [T, 1] (any
    row stride: a column of a stacked projection's output); one dtype. Returns [T, H] in that
    dtype. Source: Qwen3-Next's sparse MoE block (Hugging Face `modeling_qwen3_next.py`)."""
    return moe_out + torch.sigmoid(gate) * shared_out


def _check(x: torch.Tensor, gate: torch.Tensor, name: str, want: tuple[int, ...]) -> None:
    if x.dim() != 2 or tuple(gate.shape) != want or gate.dtype != x.dtype:
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype}, gate {tuple(gate.shape)} {gate.dtype}: "
                         f"want gate {want} of x's dtype")


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Dispatcher of `sigmoid_gate_mul_ref` (same shapes): the Triton kernel for CUDA tensors
    when Triton imports, else the reference. Raises ValueError when gate's shape does not
    cover x's columns (3-D [T, G, D], G * D = N) or the dtypes differ."""
    if gate.dim() != 3 or gate.shape[1] * gate.shape[2] != x.shape[-1]:
        raise ValueError(f"sigmoid_gate_mul: x {tuple(x.shape)}, gate {tuple(gate.shape)}: want gate [T, G, D], "
                         "G * D = x's columns")
    _check(x, gate, "sigmoid_gate_mul", (x.shape[0], gate.shape[1], gate.shape[2]))
    if x.is_cuda and sigmoid_gate_mul_triton is not None:
        return sigmoid_gate_mul_triton(x, gate)
    return sigmoid_gate_mul_ref(x, gate)


def shared_expert_combine(moe_out: torch.Tensor, gate: torch.Tensor, shared_out: torch.Tensor) -> torch.Tensor:
    """Dispatcher of `shared_expert_combine_ref` (same shapes): the Triton kernel for CUDA
    tensors when Triton imports, else the reference. Raises ValueError on shapes or dtypes
    that differ from the reference's."""
    _check(moe_out, gate, "shared_expert_combine", (moe_out.shape[0], 1))
    if shared_out.shape != moe_out.shape or shared_out.dtype != moe_out.dtype:
        raise ValueError(f"shared_expert_combine: shared_out {tuple(shared_out.shape)} {shared_out.dtype}, "
                         f"moe_out {tuple(moe_out.shape)} {moe_out.dtype}")
    if moe_out.is_cuda and shared_expert_combine_triton is not None:
        return shared_expert_combine_triton(moe_out, gate, shared_out)
    return shared_expert_combine_ref(moe_out, gate, shared_out)


# ---------------------------------------------------------------- Triton (CUDA)
# set below when Triton imports: the references' signatures
sigmoid_gate_mul_triton: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
shared_expert_combine_triton: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the dispatchers keep the references
    triton = None

if triton is not None:
    from kernels.pdl import launch_args, pdl_release, pdl_wait, use_pdl

    @triton.jit
    def _sigmoid_gate_mul_kernel(x_ptr, g_ptr, out_ptr, sx_t, sg_t, sg_g, D, USE_PDL: tl.constexpr,
                                 BLOCK_D: tl.constexpr):
        # grid (T rows, G groups): row t's group g, D columns. x: [T, G*D] (row stride sx_t,
        # unit columns), gate [T, G, D] (strides sg_t, sg_g, 1), out [T, G*D] contiguous
        pdl_wait(USE_PDL)
        pdl_release(USE_PDL)
        t = tl.program_id(0).to(tl.int64)
        grp = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        m = d < D
        x = tl.load(x_ptr + t * sx_t + grp * D + d, mask=m, other=0.0)
        g = tl.load(g_ptr + t * sg_t + grp * sg_g + d, mask=m, other=0.0)
        s = tl.sigmoid(g.to(tl.float32)).to(x.dtype)  # torch rounds the sigmoid to the dtype
        n = tl.num_programs(1).to(tl.int64) * D
        tl.store(out_ptr + t * n + grp * D + d, (x.to(tl.float32) * s.to(tl.float32)).to(x.dtype), mask=m)

    def _sigmoid_gate_mul_triton(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Triton `sigmoid_gate_mul_ref` (same shapes; x needs a unit column stride, gate a
        unit last stride: copied otherwise). One program per (row, group)."""
        if x.stride(1) != 1:
            x = x.contiguous()
        if gate.stride(2) != 1:
            gate = gate.contiguous()
        t, g, d = gate.shape
        out = torch.empty((t, g * d), dtype=x.dtype, device=x.device)
        if t:
            pdl = use_pdl(x.device)
            _sigmoid_gate_mul_kernel[(t, g)](x, gate, out, x.stride(0), gate.stride(0), gate.stride(1), d,
                                             USE_PDL=pdl, BLOCK_D=triton.next_power_of_2(d), **launch_args(pdl))
        return out

    @triton.jit
    def _shared_expert_combine_kernel(m_ptr, g_ptr, s_ptr, out_ptr, sm_t, sg_t, ss_t, H, USE_PDL: tl.constexpr,
                                      BLOCK: tl.constexpr):
        # grid (T rows, H / BLOCK). moe_out, shared_out: [T, H] (row strides, unit columns);
        # gate: [T, 1] (row stride sg_t); out [T, H] contiguous
        pdl_wait(USE_PDL)
        pdl_release(USE_PDL)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < H
        mo = tl.load(m_ptr + t * sm_t + cols, mask=m, other=0.0)
        sh = tl.load(s_ptr + t * ss_t + cols, mask=m, other=0.0)
        g = tl.load(g_ptr + t * sg_t)
        s = tl.sigmoid(g.to(tl.float32)).to(mo.dtype)  # rounded as torch's sigmoid output
        p = (s.to(tl.float32) * sh.to(tl.float32)).to(mo.dtype)  # the product, rounded
        tl.store(out_ptr + t * H + cols, (mo.to(tl.float32) + p.to(tl.float32)).to(mo.dtype), mask=m)

    def _shared_expert_combine_triton(moe_out: torch.Tensor, gate: torch.Tensor,
                                      shared_out: torch.Tensor) -> torch.Tensor:
        """Triton `shared_expert_combine_ref` (same shapes; unit column strides, copied
        otherwise). Programs of up to 1024 columns a row."""
        moe_out, shared_out = (v if v.stride(1) == 1 else v.contiguous() for v in (moe_out, shared_out))
        t, h = moe_out.shape
        out = torch.empty((t, h), dtype=moe_out.dtype, device=moe_out.device)
        block = min(1024, triton.next_power_of_2(h))
        if t:
            pdl = use_pdl(moe_out.device)
            _shared_expert_combine_kernel[(t, triton.cdiv(h, block))](
                moe_out, gate, shared_out, out, moe_out.stride(0), gate.stride(0), shared_out.stride(0), h,
                USE_PDL=pdl, BLOCK=block, **launch_args(pdl))
        return out

    sigmoid_gate_mul_triton = _sigmoid_gate_mul_triton
    shared_expert_combine_triton = _shared_expert_combine_triton
