"""Gated DeltaNet's one-token decode step, reading and writing the state slots in place.

A decode step of N sequences (one token each) updates two per-sequence states of every
gated-DeltaNet layer (docs/ARCHITECTURE.md §4.7): the short convolution's window
conv_state [S, C, W-1] (the model dtype) and the recurrent state ssm_state [S, Hv, K, V]
(fp32), both indexed by the sequence's state slot (`slots` [N]). The kernels here take the
whole cache tensors and the slot indices and update the slots where they lie: no gather
into a batch copy and no scatter back (at Qwen3.5's shape 2 MiB a sequence and layer, which the
gathered path copied four times a step: index_select, torch.where, copy_, index_copy_).

- `conv1d_update_slots`: the depthwise causal convolution of one new input a channel over
  the slot's W-1 previous inputs (`kernels.gated_delta_rule.causal_conv1d_update_ref`), the
  activation (SiLU) applied, the window shifted in place.
- `gated_delta_rule_decode_slots`: one step of the gated delta rule (Yang, Kautz &
  Hatamizadeh 2024, "Gated Delta Networks", arXiv 2412.06464; the recurrence of
  `kernels.gated_delta_rule.gated_delta_rule_recurrent_ref`) with the layer's glue in the
  same kernel: q and k L2-normalised, beta = sigmoid(b) (rounded to b's dtype, as the
  layer computes it in the model dtype), the log decay g = -exp(A_log) * softplus(a +
  dt_bias) in fp32.

A row whose `has_initial` is False starts from zeros whatever its slot holds (NaN included:
the slot is not read). Rows may share a slot only when all of them start from zeros (the
padding rows of a CUDA-graph step on the scratch slot): their outputs are then exact and
the slot keeps one of their states, whichever write lands last.

Each function has its torch reference (`*_ref`: the gathered path's math, built from
`kernels.gated_delta_rule`'s references) and a Triton kernel (`*_triton`); the dispatchers
take Triton for CUDA tensors when it imports (`triton_for`), else the reference. Neither
syncs with the host or branches on tensor values, so a CUDA graph captures them over static
slot buffers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.gated_delta_rule import (
    L2NORM_EPS,
    causal_conv1d_update_ref,
    gated_delta_rule_recurrent_ref,
)

ENABLED = True  # False: the dispatchers keep the references on CUDA too
# launch shapes. Recurrent step: a program holds the [K, block_v] fp32 slice of one (row,
# value head)'s state in num_warps warps (docs/ARCHITECTURE.md §6.4, "recurrent step's launch
# table"). Two program orders: "grid3", a grid (N rows, Hv heads, V / block_v) whose first axis
# (the fastest in launch order) is the row, so neighbouring programs touch different slots; and
# "flat", a 1-D grid of N * Hv * (V / block_v) programs, the column tile fastest, so
# neighbouring programs cover one (row, head)'s contiguous K x V block and then the next
# head's. 8 columns in one warp give 512 programs at batch 1 for Qwen3.5's 32 value heads of
# 128 and compile for sm90 at K = 128 without spilling (95 registers a thread; 32 columns in
# one warp spill: tests/unit/test_gdn_decode_compile.py). Wider tiles need more warps (a
# thread holds K * block_v / (32 num_warps) values): each of a program's K strided row
# segments is then block_v * 4 bytes (128-256 at 32-64 columns). "flat" with items > 1: a
# program loops over that many consecutive tiles in `stages` pipeline stages (the next tiles'
# state copied asynchronously into shared memory while one is computed, so more state is in
# flight than the registers hold).
# REC_LAUNCH: (max_rows, block_v, num_warps, order, items, stages), by max_rows ascending; a
# step of n rows takes the first entry with n <= max_rows (None: any n). From the H200 sweep
# (2026-12-03, benchmarks/gdn_decode_sweep.py, Qwen3.5-35B-A3B's shape, one layer; the old fixed
# config (8, 1, grid3) in the same run): 1 row 4.18 -> 3.91 us, 8 rows 15.4 -> 11.6, 32 rows
# 81 -> 40, 256 rows 1,117 -> 274 us (23% -> 93% of the copy bandwidth), outputs and states
# against the reference (benchmarks/results/2026-12-03_h200_gdn_decode_sweep.json).
REC_LAUNCH: list[tuple[int | None, int, int, str, int, int]] = [
    (1, 16, 1, "grid3", 1, 1),
    (8, 16, 1, "flat", 1, 1),
    (None, 64, 4, "flat", 1, 1),
]
REC_ORDERS = ("grid3", "flat")
# (block_v, num_warps) the sweep times in both orders, one tile a program: at most 64 state
# values a thread at K = 128, which compile for sm90 without spilling
# (tests/unit/test_gdn_decode_compile.py); and (block_v, num_warps, items, stages) it times as
# "flat" loops
REC_CANDIDATES = [(8, 1), (16, 1), (16, 2), (32, 2), (32, 4), (64, 4), (64, 8), (128, 8), (128, 16)]
REC_LOOP_CANDIDATES = [(8, 1, 4, 2), (16, 2, 4, 2), (32, 4, 4, 2), (32, 4, 4, 3), (32, 4, 8, 3), (64, 8, 2, 2),
                       (64, 8, 4, 2), (64, 4, 4, 2)]
# rec_table False: every step takes block_v, rec_warps, rec_order, rec_items, rec_stages below
# (the config before the table: 8, 1, "grid3", 1, 1). Convolution: block_c channels a program, at least 32 a warp (each
# element then has one owning thread, `_conv_update_kernel`).
TUNING: dict = {"block_v": 8, "rec_warps": 1, "rec_order": "grid3", "rec_items": 1, "rec_stages": 1,
                "rec_table": True, "block_c": 512, "conv_warps": 4}


RecLaunch = tuple[int, int, str, int, int]  # (block_v, num_warps, order, items, stages)


def check_launch(launch: RecLaunch) -> RecLaunch:
    """launch as ints and a str; raises ValueError on an unknown order, items or stages < 1, or
    grid3 with items > 1 (one tile a program)."""
    bv, warps, order, items, stages = int(launch[0]), int(launch[1]), str(launch[2]), int(launch[3]), int(launch[4])
    if order not in REC_ORDERS or bv < 1 or warps < 1 or items < 1 or stages < 1 or (order == "grid3" and items > 1):
        raise ValueError(f"bad recurrent-step launch {launch!r}: (block_v, num_warps, order in {REC_ORDERS}, "
                         f"items, stages), items 1 for grid3")
    return bv, warps, order, items, stages


def rec_launch(n: int) -> RecLaunch:
    """(block_v, num_warps, order, items, stages) of the recurrent step's launch for a step of
    n rows: the first `REC_LAUNCH` entry whose max_rows is None or >= n when
    TUNING["rec_table"], else TUNING's block_v, rec_warps, rec_order, rec_items, rec_stages.
    block_v is an upper bound (the launch caps it at V's next power of two). Raises ValueError
    when no entry covers n, and `check_launch`'s."""
    if not TUNING["rec_table"]:
        return check_launch((TUNING["block_v"], TUNING["rec_warps"], TUNING["rec_order"], TUNING["rec_items"],
                             TUNING["rec_stages"]))
    row = next((e for e in REC_LAUNCH if e[0] is None or n <= e[0]), None)
    if row is None:
        raise ValueError(f"no REC_LAUNCH entry covers {n} rows: {REC_LAUNCH}")
    return check_launch(row[1:])


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the dispatchers keep the references
    triton = None


def triton_for(x: torch.Tensor) -> bool:
    """Whether the dispatchers run the Triton kernels for x: a CUDA tensor, Triton
    importable, `ENABLED`."""
    return ENABLED and triton is not None and x.is_cuda


def _check_slots(slots: torch.Tensor, has_initial: torch.Tensor, n: int, s: int) -> None:
    if slots.shape != (n,) or has_initial.shape != (n,) or has_initial.dtype != torch.bool:
        raise ValueError(f"slots {tuple(slots.shape)} and has_initial {tuple(has_initial.shape)} "
                         f"{has_initial.dtype} must be [{n}] (int, bool)")
    if slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int32 or int64, not {slots.dtype}")
    if s < 1:
        raise ValueError("the state cache has no slot")


# ---------------------------------------------------------------- references

def _gathered(state: torch.Tensor, slots: torch.Tensor, has_initial: torch.Tensor) -> torch.Tensor:
    """The rows' states [N, *shape]: a copy of their slots, zeros where has_initial is False."""
    g = state.index_select(0, slots.long())
    keep = has_initial.to(g.device).view(-1, *([1] * (g.dim() - 1)))
    return torch.where(keep, g, torch.zeros((), dtype=g.dtype, device=g.device))


def conv1d_update_slots_ref(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None, slots: torch.Tensor, has_initial: torch.Tensor,
                            activation: str | None = "silu") -> torch.Tensor:
    """One input token per row through the short causal convolution, its slot's window
    updated in place.

    x: [N, C] (any strides); conv_state: [S, C, W-1], the slots' last W-1 inputs, oldest
    first, written in place; weight: [C, W]; bias: [C] or None; slots: [N] int32/int64 in
    0..S-1; has_initial: [N] bool (False: the row's window starts as zeros);
    activation: "silu" or None. Returns y [N, C] in x's dtype (`causal_conv1d_update_ref`'s
    math, fp32). Raises ValueError on shapes or index dtypes.
    """
    n = x.shape[0]
    _check_slots(slots, has_initial, n, conv_state.shape[0])
    y, new = causal_conv1d_update_ref(x, _gathered(conv_state, slots, has_initial), weight, bias, activation)
    conv_state.index_copy_(0, slots.long(), new.to(conv_state.dtype))
    return y


def _decay_and_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                    dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [N, Hv] fp32 = -exp(A_log) * softplus(a + dt_bias), beta [N, Hv] = sigmoid(b) in
    b's dtype): the gated-DeltaNet layer's own expressions (services/worker/layers/gated_deltanet.py)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def gated_delta_rule_decode_slots_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                                      b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                                      ssm_state: torch.Tensor, slots: torch.Tensor, has_initial: torch.Tensor,
                                      scale: float | None = None, use_qk_l2norm: bool = True) -> torch.Tensor:
    """One gated-delta-rule step per row, its slot's state updated in place.

    q, k: [N, Hk, K]; v: [N, Hv, V] (Hv a multiple of Hk: value head h reads key head
    h // (Hv / Hk)); a, b: [N, Hv] (the layer's projections: log-decay input and beta
    logit); A_log, dt_bias: [Hv]; ssm_state: [S, Hv, K, V] fp32, written in place; slots,
    has_initial: as `conv1d_update_slots_ref`; scale: the query scale (None: K ** -0.5);
    use_qk_l2norm: L2-normalise q and k (in fp32). With g, beta from `_decay_and_beta`:
    S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T (scale q).
    Returns o [N, Hv, V] in v's dtype. Raises ValueError on shapes or index dtypes.
    """
    n = v.shape[0]
    _check_slots(slots, has_initial, n, ssm_state.shape[0])
    g, beta = _decay_and_beta(a, b, A_log, dt_bias)
    h0 = _gathered(ssm_state, slots, has_initial)
    o, final = gated_delta_rule_recurrent_ref(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                              h0, scale, use_qk_l2norm)
    ssm_state.index_copy_(0, slots.long(), final)
    return o[:, 0]


# ---------------------------------------------------------------- dispatchers

def conv1d_update_slots(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None, slots: torch.Tensor, has_initial: torch.Tensor,
                        activation: str | None = "silu") -> torch.Tensor:
    """`conv1d_update_slots_ref` (see there for shapes): the Triton kernel on CUDA
    (`triton_for`, a window of 2..4 and contiguous state and weight), else the reference."""
    w = weight.shape[-1]
    if (triton_for(x) and 2 <= w <= 4 and conv_state.is_contiguous() and weight.is_contiguous()
            and activation in ("silu", "swish", None)):
        return conv1d_update_slots_triton(x, conv_state, weight, bias, slots, has_initial, activation)
    return conv1d_update_slots_ref(x, conv_state, weight, bias, slots, has_initial, activation)


def gated_delta_rule_decode_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                                  b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                                  ssm_state: torch.Tensor, slots: torch.Tensor, has_initial: torch.Tensor,
                                  scale: float | None = None, use_qk_l2norm: bool = True) -> torch.Tensor:
    """`gated_delta_rule_decode_slots_ref` (see there for shapes): the Triton kernel on CUDA
    (`triton_for`, a contiguous fp32 state; its launch by the number of rows, `rec_launch`),
    else the reference."""
    if triton_for(v) and ssm_state.is_contiguous() and ssm_state.dtype == torch.float32:
        return gated_delta_rule_decode_slots_triton(q, k, v, a, b, A_log, dt_bias, ssm_state, slots, has_initial,
                                                    scale, use_qk_l2norm)
    return gated_delta_rule_decode_slots_ref(q, k, v, a, b, A_log, dt_bias, ssm_state, slots, has_initial, scale,
                                             use_qk_l2norm)


# ---------------------------------------------------------------- Triton

conv1d_update_slots_triton = None  # set below when Triton imports (same signature as the reference)
gated_delta_rule_decode_slots_triton = None

if triton is not None:

    @triton.jit(do_not_specialize=["slot_ptr", "init_ptr", "init_stride"])
    def _conv_update_kernel(x_ptr, s_ptr, w_ptr, b_ptr, y_ptr, slot_ptr, init_ptr, sx_n, init_stride, C,
                            W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                            BLOCK_C: tl.constexpr):
        # grid (N rows, C / BLOCK_C). s: [S, C, W-1] contiguous; w: [C, W]; y: [N, C].
        # Every value below is a [BLOCK_C] vector of one layout, so each channel's window is
        # loaded and stored by the same thread: the in-place shift needs no barrier.
        n = tl.program_id(0).to(tl.int64)
        rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = rc < C
        slot = tl.load(slot_ptr + n).to(tl.int64)
        init = tl.load(init_ptr + n * init_stride + 0 * rc) != 0  # the row's flag, as a [BLOCK_C] mask
        sp = s_ptr + slot * C * (W - 1) + rc * (W - 1)
        lm = cm & init  # a fresh row reads no state: zeros, whatever the slot holds
        xin = tl.load(x_ptr + n * sx_n + rc, mask=cm, other=0.0)
        s0 = tl.load(sp, mask=lm, other=0.0)
        acc = s0.to(tl.float32) * tl.load(w_ptr + rc * W, mask=cm, other=0.0).to(tl.float32)
        if W > 2:
            s1 = tl.load(sp + 1, mask=lm, other=0.0)
            acc += s1.to(tl.float32) * tl.load(w_ptr + rc * W + 1, mask=cm, other=0.0).to(tl.float32)
        if W > 3:
            s2 = tl.load(sp + 2, mask=lm, other=0.0)
            acc += s2.to(tl.float32) * tl.load(w_ptr + rc * W + 2, mask=cm, other=0.0).to(tl.float32)
        acc += xin.to(tl.float32) * tl.load(w_ptr + rc * W + (W - 1), mask=cm, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rc, mask=cm, other=0.0).to(tl.float32)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(y_ptr + n * C + rc, acc.to(y_ptr.dtype.element_ty), mask=cm)
        # the window shifted by one: the oldest input out, x in
        new_last = xin.to(s_ptr.dtype.element_ty)
        if W == 2:
            tl.store(sp, new_last, mask=cm)
        if W == 3:
            tl.store(sp, s1, mask=cm)
            tl.store(sp + 1, new_last, mask=cm)
        if W == 4:
            tl.store(sp, s1, mask=cm)
            tl.store(sp + 1, s2, mask=cm)
            tl.store(sp + 2, new_last, mask=cm)

    @triton.jit
    def _gdr_step(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, s_ptr, o_ptr, slot_ptr, init_ptr,
                  sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sa_n, sb_n, init_stride, scale, n, hv, vt, item, total,
                  HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, CHECK: tl.constexpr, L2NORM: tl.constexpr, EPS: tl.constexpr):
        # One item: row n (int64), value head hv, column tile vt. CHECK (a loop's tail): the item
        # exists when item < total; else (n, hv, vt) are item 0's, so the scalar
        # loads stay in bounds, and every vector access is masked by item < total (as vectors:
        # Triton's interpreter rejects a scalar bool in a vector mask).
        # s: [S, HV, K, V] fp32 contiguous; o: [N, HV, V]. The state slice [BK, BV] is loaded,
        # updated and stored in one layout (each element by its own thread): in place without
        # a barrier.
        hk = hv // GROUP
        rk = tl.arange(0, BK)
        rv = vt * BV + tl.arange(0, BV)
        km = rk < K
        vm = rv < V
        slot = tl.load(slot_ptr + n).to(tl.int64)
        if CHECK:
            km = km & ((item + 0 * rk) < total)
            vm = vm & ((item + 0 * rv) < total)
            init = tl.load(init_ptr + n * init_stride + 0 * rv, mask=vm, other=0) != 0
        else:
            init = tl.load(init_ptr + n * init_stride + 0 * rv) != 0  # the row's flag, as a [BV] mask
        bl = tl.load(b_ptr + n * sb_n + hv)
        x = tl.load(a_ptr + n * sa_n + hv).to(tl.float32)
        q = tl.load(q_ptr + n * sq_n + hk * sq_h + rk, mask=km, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + n * sk_n + hk * sk_h + rk, mask=km, other=0.0).to(tl.float32)
        if L2NORM:  # x / sqrt(sum(x^2) + eps), the reference's _l2norm
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + EPS)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + EPS)
        q = q * scale
        v = tl.load(v_ptr + n * sv_n + hv * sv_h + rv, mask=vm, other=0.0).to(tl.float32)
        bf = bl.to(tl.float32)
        beta = (1.0 / (1.0 + tl.exp(-bf))).to(bl.dtype).to(tl.float32)  # sigmoid in b's dtype
        x = x + tl.load(dtb_ptr + hv).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold 20
        decay = tl.exp(-tl.exp(tl.load(alog_ptr + hv).to(tl.float32)) * softplus)
        ptrs = s_ptr + (slot * HV + hv) * (K * V) + rk[:, None] * V + rv[None, :]
        m2 = km[:, None] & vm[None, :]
        h = tl.load(ptrs, mask=m2 & init[None, :], other=0.0)  # a fresh row reads no state: zeros
        h = h * decay
        delta = (v - tl.sum(h * k[:, None], axis=0)) * beta
        h = h + k[:, None] * delta[None, :]
        o = tl.sum(h * q[:, None], axis=0)
        tl.store(ptrs, h, mask=m2)
        tl.store(o_ptr + (n * HV + hv) * V + rv, o.to(o_ptr.dtype.element_ty), mask=vm)

    @triton.jit(do_not_specialize=["slot_ptr", "init_ptr", "init_stride", "total"])
    def _gdr_decode_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, s_ptr, o_ptr, slot_ptr,
                           init_ptr, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sa_n, sb_n, init_stride, scale, total,
                           HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr, NVT: tl.constexpr, FLAT: tl.constexpr,
                           ITEMS: tl.constexpr, STAGES: tl.constexpr, L2NORM: tl.constexpr, EPS: tl.constexpr):
        # FLAT: a 1-D grid over the total = N * HV * NVT items, item = (row n, head hv, column
        # tile vt) with vt fastest, then hv; a program takes ITEMS consecutive items (ITEMS > 1:
        # a loop of STAGES pipeline stages, which Triton's pipeliner turns into asynchronous
        # copies of the next items' state into shared memory while this one computes). Else the
        # grid (N rows, HV value heads, NVT = V / BV), one item a program.
        if FLAT:
            if ITEMS == 1:
                p = tl.program_id(0)
                _gdr_step(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, s_ptr, o_ptr, slot_ptr, init_ptr,
                          sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sa_n, sb_n, init_stride, scale,
                          (p // (NVT * HV)).to(tl.int64), (p // NVT) % HV, p % NVT, p, total,
                          HV, GROUP, K, V, BK, BV, False, L2NORM, EPS)
            else:
                for i in tl.range(0, ITEMS, num_stages=STAGES):
                    p = tl.program_id(0) * ITEMS + i
                    c = tl.where(p < total, p, 0)  # a tail item reads item 0's scalars, stores nothing
                    _gdr_step(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, s_ptr, o_ptr, slot_ptr,
                              init_ptr, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sa_n, sb_n, init_stride, scale,
                              (c // (NVT * HV)).to(tl.int64), (c // NVT) % HV, c % NVT, p, total,
                              HV, GROUP, K, V, BK, BV, True, L2NORM, EPS)
        else:
            _gdr_step(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, s_ptr, o_ptr, slot_ptr, init_ptr,
                      sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sa_n, sb_n, init_stride, scale,
                      tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2), 0, total,
                      HV, GROUP, K, V, BK, BV, False, L2NORM, EPS)

    def _init_bytes(has_initial: torch.Tensor) -> torch.Tensor:
        """has_initial [N] bool (possibly strided, e.g. a graph's low-byte view) as uint8."""
        return has_initial.view(torch.uint8)

    def conv1d_update_slots_triton(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                                   bias: torch.Tensor | None, slots: torch.Tensor, has_initial: torch.Tensor,
                                   activation: str | None = "silu") -> torch.Tensor:
        """Triton `conv1d_update_slots_ref` (same arguments): a program per (row, BLOCK_C
        channels). x may be row-strided (unit column stride); conv_state [S, C, W-1] and
        weight [C, W] contiguous, W in 2..4. Raises ValueError otherwise."""
        n, c = x.shape
        w = weight.shape[-1]
        _check_slots(slots, has_initial, n, conv_state.shape[0])
        if (not 2 <= w <= 4 or weight.shape != (c, w) or tuple(conv_state.shape[1:]) != (c, w - 1)
                or not conv_state.is_contiguous() or not weight.is_contiguous()):
            raise ValueError(f"conv update kernel: x {tuple(x.shape)}, conv_state {tuple(conv_state.shape)}, "
                             f"weight {tuple(weight.shape)} (contiguous, W in 2..4)")
        if activation not in ("silu", "swish", None):
            raise ValueError(f"unsupported activation {activation!r} (silu or None)")
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty((n, c), dtype=x.dtype, device=x.device)
        if n == 0:
            return y
        bc = TUNING["block_c"]
        _conv_update_kernel[(n, triton.cdiv(c, bc))](
            x, conv_state, weight, y if bias is None else bias, y, slots, _init_bytes(has_initial), x.stride(0),
            has_initial.stride(0), c, W=w, HAS_BIAS=bias is not None, SILU=activation is not None,
            BLOCK_C=bc, num_warps=TUNING["conv_warps"])
        return y

    def gated_delta_rule_decode_slots_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                                             b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                                             ssm_state: torch.Tensor, slots: torch.Tensor,
                                             has_initial: torch.Tensor, scale: float | None = None,
                                             use_qk_l2norm: bool = True,
                                             launch: RecLaunch | None = None) -> torch.Tensor:
        """Triton `gated_delta_rule_decode_slots_ref` (same arguments): programs over the (row,
        value head, block_v value columns) tiles, launched as `launch` = (block_v, num_warps,
        order, items, stages) (None: `rec_launch(N)`; block_v capped at V's next power of two;
        order "grid3" or "flat", items tiles a program, see `REC_LAUNCH`). q, k, v, a, b may be
        strided views with a unit last stride; ssm_state [S, Hv, K, V] contiguous fp32. Raises
        ValueError otherwise and on a bad launch (`check_launch`)."""
        n, hk, kd = q.shape
        hv, vd = v.shape[1], v.shape[2]
        _check_slots(slots, has_initial, n, ssm_state.shape[0])
        if (k.shape != q.shape or v.shape[0] != n or hv % hk or a.shape != (n, hv) or b.shape != (n, hv)
                or tuple(ssm_state.shape[1:]) != (hv, kd, vd) or ssm_state.dtype != torch.float32
                or not ssm_state.is_contiguous()):
            raise ValueError(f"decode kernel: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                             f"a {tuple(a.shape)} b {tuple(b.shape)} state {tuple(ssm_state.shape)} "
                             f"{ssm_state.dtype}")
        block_v, warps, order, items, stages = rec_launch(n) if launch is None else check_launch(launch)
        q, k, v, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, a, b))
        o = torch.empty((n, hv, vd), dtype=v.dtype, device=v.device)
        if n == 0:
            return o
        bv = min(triton.next_power_of_2(vd), block_v)
        nvt = triton.cdiv(vd, bv)
        total = n * hv * nvt
        grid = (triton.cdiv(total, items),) if order == "flat" else (n, hv, nvt)
        _gdr_decode_kernel[grid](
            q, k, v, a, b, A_log, dt_bias, ssm_state, o, slots, _init_bytes(has_initial),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0),
            b.stride(0), has_initial.stride(0), kd ** -0.5 if scale is None else scale, total,
            HV=hv, GROUP=hv // hk, K=kd, V=vd, BK=triton.next_power_of_2(kd), BV=bv, NVT=nvt,
            FLAT=order == "flat", ITEMS=items, STAGES=stages, L2NORM=use_qk_l2norm, EPS=L2NORM_EPS,
            num_warps=warps)
        return o
