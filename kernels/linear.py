"""Linear layer matmul, y = x @ W.T (+ b), with a skinny-batch kernel for decode.

`linear` (the dispatcher) calls `linear_ref` (torch's `F.linear`: cuBLAS on the GPU, MKL on
the CPU) except for CUDA inputs with few rows, where `skinny_linear_triton` is used.

Why a kernel of our own: at decode batch 1..16 a linear layer is a matrix-vector product
bound by reading W once. cuBLAS picks tiles meant for larger M there and reaches about a
quarter of the copy bandwidth on the small projections of a 0.6B model (H200, Qwen3-0.6B
shapes: 20 MB of qkv + gate_up weights in 10.5 us per layer, ~1.9 TB/s; step_profile in
benchmarks/results/). The kernel below streams W in [BLOCK_N, BLOCK_K] tiles, each program
owning BLOCK_N output columns of every row (so each W element is read exactly once), with
the rows of x padded to 16 for the tensor-core dot (the multiply is free: the time is the
W read). When N / BLOCK_N programs would not fill the GPU, the K dimension is split in
SPLIT_K parts that write fp32 partials, summed by a second small kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.device_info import num_sms

skinny_linear_triton = None  # set below when Triton imports: same signature as linear_ref
SKINNY_MAX_ROWS = 16  # rows of x up to which CUDA inputs take the skinny kernel
# weights of at most this many elements take it: larger ones (Llama-3.1-8B's) stream at
# 3.7 TB/s through cuBLAS already, against 3.5 here (benchmarks/kernel_sweep.py, H200)
SKINNY_MAX_WEIGHT = 16 << 20
_HALF = (torch.bfloat16, torch.float16)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias.

    x: [M, K]; weight: [N, K]; bias: [N] or None; one dtype (fp32/bf16/fp16).
    Returns [M, N] in x's dtype.
    """
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatcher for `linear_ref` (see there for shapes): the skinny kernel for CUDA x
    with at most SKINNY_MAX_ROWS rows, bf16/fp16, a row-major weight of at most
    SKINNY_MAX_WEIGHT elements, torch otherwise
    (fp32 stays on cuBLAS: the kernel's dot would run as tf32)."""
    if (x.is_cuda and skinny_linear_triton is not None and x.dim() == 2
            and 0 < x.shape[0] <= SKINNY_MAX_ROWS and weight.stride(1) == 1
            and x.dtype in _HALF and weight.dtype == x.dtype
            and weight.numel() <= SKINNY_MAX_WEIGHT):
        return skinny_linear_triton(x, weight, bias)
    return linear_ref(x, weight, bias)


# ---------------------------------------------------------------- Triton (CUDA)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the dispatcher keeps the reference
    triton = None

# launch defaults of the skinny kernel (benchmarks/kernel_sweep.py sweeps them): K tile,
# the programs per SM that the K split aims for, warps and software-pipeline stages
SKINNY_TUNING: dict = {"block_k": 256, "programs_per_sm": 1, "num_warps": 4, "num_stages": 3}

if triton is not None:

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, sx_m, sw_n, sy_m, k_per_split,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        nmask = rn < N
        mmask = rm < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * sw_n
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < k_hi
            w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            x = tl.load(x_ptr + rm[:, None] * sx_m + rk[None, :], mask=mmask[:, None] & kmask[None, :],
                        other=0.0)
            acc += tl.dot(x, tl.trans(w))
        out_mask = mmask[:, None] & nmask[None, :]
        if SPLIT:
            tl.store(ws_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=out_mask)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + rm[:, None] * sy_m + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit(do_not_specialize=["M", "n_splits"])
    def _split_sum_kernel(ws_ptr, b_ptr, y_ptr, M, N, sy_m, n_splits, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr):
        m = tl.program_id(0)
        rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        nmask = rn < N
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(0, n_splits):
            acc += tl.load(ws_ptr + (s * M + m) * N + rn, mask=nmask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * sy_m + rn, acc.to(y_ptr.dtype.element_ty), mask=nmask)


    def skinny_plan(m: int, n: int, k: int, device: torch.device, block_n: int | None = None,
                    block_k: int | None = None, split_k: int | None = None) -> tuple[int, int, int]:
        """(BLOCK_N, BLOCK_K, SPLIT_K) for an [m, k] x [n, k]^T product: BLOCK_N 16..64 by the
        width (wider tiles for wide layers such as an lm_head), then split K (in whole
        BLOCK_K tiles) until there are SKINNY_TUNING["programs_per_sm"] programs per SM, at
        most 8 splits.
        Explicit arguments override (the benchmark sweeps them)."""
        bn = block_n or (64 if n >= 32768 else 32 if n >= 8192 else 16)
        bk = block_k or SKINNY_TUNING["block_k"]
        if split_k is None:
            programs = triton.cdiv(n, bn)
            split_k = 1
            max_split = max(1, min(8, triton.cdiv(k, bk)))
            target = SKINNY_TUNING["programs_per_sm"] * num_sms(device)
            while programs * split_k < target and split_k < max_split:
                split_k *= 2
            split_k = min(split_k, max_split)
        return bn, bk, split_k

    def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                             block_n: int | None = None, block_k: int | None = None,
                             split_k: int | None = None, num_warps: int | None = None,
                             num_stages: int | None = None) -> torch.Tensor:
        """Triton `linear_ref` for x with M <= 64 rows (same shapes and dtypes).

        weight must have unit stride along K; x may be a row-strided view. The tile
        arguments default to `skinny_plan`. Raises ValueError for M > 64 or a weight whose
        last stride is not 1.
        """
        m, k = x.shape
        n = weight.shape[0]
        if m > 64 or weight.stride(1) != 1:
            raise ValueError(f"skinny kernel: M={m} (max 64), weight stride {tuple(weight.stride())}")
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if m == 0 or n == 0:
            return y
        if k == 0:
            return y.zero_() if bias is None else y.copy_(bias.expand(m, n))
        bn, bk, split = skinny_plan(m, n, k, x.device, block_n, block_k, split_k)
        bm = max(16, triton.next_power_of_2(m))
        k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
        split = triton.cdiv(k, k_per)  # no empty trailing split
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
        b = bias if bias is not None else y
        _skinny_kernel[(triton.cdiv(n, bn), split)](
            x, weight, b, y, ws, m, n, k, x.stride(0), weight.stride(0), y.stride(0), k_per,
            HAS_BIAS=bias is not None, SPLIT=split > 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            num_warps=num_warps or SKINNY_TUNING["num_warps"],
            num_stages=num_stages or SKINNY_TUNING["num_stages"])
        if split > 1:
            blk = 1024
            _split_sum_kernel[(m, triton.cdiv(n, blk))](ws, b, y, m, n, y.stride(0), split,
                                                        HAS_BIAS=bias is not None, BLOCK=blk)
        return y
