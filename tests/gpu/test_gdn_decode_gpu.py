"""Gated DeltaNet's in-place decode kernels (kernels/gdn_decode.py) and the gated RMSNorm kernel
(kernels/norm.py) compiled on CUDA, against their torch references on the same device, at
Qwen3.5-35B-A3B's shapes (16 key and 32 value heads of 128, conv channels 8192, window 4);
the kernels captured in a CUDA graph over static slot buffers and replayed with other slots;
and the one-row routing of that model's large projections (in_proj_qkvz [12288, 2048],
gated attention's qkv [9216, 2048], the stacked linear_attn.in_proj [12352, 2048]) to `kernels.gemv`.

The recurrent step also with each launch config of `gdn_decode.REC_LAUNCH`, the fixed one
before it (8 columns, 1 warp, the 3-D order) and a pipelined loop of 3 tiles a program, at 1,
37 and 256 rows.
Slots: N rows on a permutation of slots, a fresh row on a slot holding NaN, two fresh rows on
one slot (the graphs' padding rows), slots no row names left bit-identical.
Tolerances (relative norm error): bf16 outputs 1e-2 (summation order and one bf16 rounding);
the fp32 state 1e-5 from fp32 inputs, 2e-3 from bf16 ones (beta is rounded to bf16 as the layer
computes it, and the kernel's sigmoid and torch's may round a value near a bf16 boundary to
neighbours, 2^-8 on one head's update); the convolution's window (copies) exactly. A graph
replay against the same kernels run eagerly on the same inputs: bit-identical. The gemv
against F.linear: 1e-2 (bf16 output rounding). Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from kernels import gdn_decode, linear as linear_kernels, norm  # noqa: E402

DEV = torch.device("cuda")
HK, HV, KD, VD, W = 16, 32, 128, 128, 4
C = 2 * HK * KD + HV * VD


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite output"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _slots(n: int, s: int):
    """n rows: a permutation of slots 1..s-2, the last two rows fresh on slot s - 1 (shared),
    row 0 fresh on a NaN slot; has_initial as a graph stages it (int64 row's low bytes)."""
    slots = torch.randperm(s - 2)[:n - 2] + 1
    slots = torch.cat([slots, torch.tensor([s - 1, s - 1])]) if n >= 3 else torch.tensor([s - 1] * n)
    init = [True] * n
    init[0] = False
    if n >= 3:
        init[-1] = init[-2] = False
    flags = torch.tensor([int(f) for f in init], dtype=torch.int64, device=DEV).view(torch.bool)[::8]
    return slots.to(DEV), flags


def _poison(t: torch.Tensor, slots: torch.Tensor, flags: torch.Tensor) -> None:
    for s, f in zip(slots.tolist(), flags.tolist()):
        if not f:
            t[s] = float("nan")


def _check_slots(got, want, before, slots, flags, tol):
    """Unique continuing/fresh rows' slots equal the reference within tol; the shared slot is
    finite; slots no row names are bit-identical."""
    named = set(slots.tolist())
    counts = {s: slots.tolist().count(s) for s in named}
    unique = [s for s in named if counts[s] == 1]
    assert rel(got[unique], want[unique]) <= tol
    for s in named - set(unique):
        assert torch.isfinite(got[s]).all()
    others = [s for s in range(got.shape[0]) if s not in named]
    assert torch.equal(got[others].nan_to_num(3.0), before[others].nan_to_num(3.0))


@pytest.mark.parametrize("n", [1, 4, 64])
def test_conv_update_kernel_matches_reference_on_the_slots(n):
    s = n + 8
    x = torch.randn(n, C + HV * VD, device=DEV, dtype=torch.bfloat16)[:, :C]  # a view of qkvz, as the layer passes it
    weight = torch.randn(C, W, device=DEV, dtype=torch.bfloat16) * 0.3
    slots, flags = _slots(n, s)
    cache = torch.randn(s, C, W - 1, device=DEV, dtype=torch.bfloat16)
    _poison(cache, slots, flags)
    ref_cache, before = cache.clone(), cache.clone()
    y = gdn_decode.conv1d_update_slots(x, cache, weight, None, slots, flags, "silu")
    y_ref = gdn_decode.conv1d_update_slots_ref(x, ref_cache, weight, None, slots, flags, "silu")
    assert rel(y, y_ref) < 1e-2
    _check_slots(cache.float(), ref_cache.float(), before.float(), slots, flags, 0.0)


# the launch table's configs, the fixed config before it (8 columns, 1 warp, grid3) and a loop
# of 3 tiles a program (its tail program part empty at 37 rows: 37 * 32 * 4 tiles)
LAUNCHES = sorted({tuple(e[1:]) for e in gdn_decode.REC_LAUNCH} | {(8, 1, "grid3", 1, 1), (32, 4, "flat", 3, 2)})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 4, 64])
def test_recurrent_step_kernel_matches_reference_on_the_slots(n, dtype):
    _recurrent_step_check(n, dtype, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 37, 256])
@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda c: f"bv{c[0]}_w{c[1]}_{c[2]}_i{c[3]}_s{c[4]}")
def test_recurrent_step_launch_configs_match_reference(launch, n, dtype):
    """Each REC_LAUNCH entry (and the old fixed config) at any row count, not only its own."""
    _recurrent_step_check(n, dtype, launch)


def _recurrent_step_check(n: int, dtype: torch.dtype, launch) -> None:
    s = n + 8
    mixed = torch.randn(n, C, device=DEV, dtype=dtype)
    q = mixed[:, :HK * KD].view(n, HK, KD)
    k = mixed[:, HK * KD:2 * HK * KD].view(n, HK, KD)
    v = mixed[:, 2 * HK * KD:].view(n, HV, VD)
    ba = torch.randn(n, 2 * HV, device=DEV, dtype=dtype) * 2
    b, a = ba[:, :HV], ba[:, HV:]
    a_log = torch.empty(HV, device=DEV).uniform_(0.05, 1.0).log().to(dtype)
    dt_bias = torch.randn(HV, device=DEV).to(dtype)
    slots, flags = _slots(n, s)
    cache = 0.1 * torch.randn(s, HV, KD, VD, device=DEV)
    _poison(cache, slots, flags)
    ref_cache, before = cache.clone(), cache.clone()
    if launch is None:  # the dispatcher, its launch by rec_launch(n)
        o = gdn_decode.gated_delta_rule_decode_slots(q, k, v, a, b, a_log, dt_bias, cache, slots, flags)
    else:
        o = gdn_decode.gated_delta_rule_decode_slots_triton(q, k, v, a, b, a_log, dt_bias, cache, slots, flags,
                                                            launch=launch)
    o_ref = gdn_decode.gated_delta_rule_decode_slots_ref(q, k, v, a, b, a_log, dt_bias, ref_cache, slots, flags)
    assert o.shape == (n, HV, VD) and o.dtype == dtype
    assert rel(o, o_ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    _check_slots(cache, ref_cache, before, slots, flags, 2e-3 if dtype == torch.bfloat16 else 1e-5)


def test_gated_rms_norm_kernel_matches_reference():
    x = torch.randn(5, HV, VD, device=DEV, dtype=torch.bfloat16)
    z = torch.randn(5, C + HV * VD, device=DEV, dtype=torch.bfloat16)[:, C:].view(5, HV, VD)
    w = (1 + 0.2 * torch.randn(VD, device=DEV)).bfloat16()
    out = norm.rms_norm_gated(x, z, w, 1e-6)
    assert rel(out, norm.rms_norm_gated_ref(x, z, w, 1e-6)) < 1e-2


@pytest.mark.parametrize("entry", [None, (None, 64, 8, "flat", 1, 1), (None, 32, 4, "flat", 3, 2)],
                         ids=["table", "flat_bv64", "loop_bv32_i3"])
def test_kernels_replay_in_a_cuda_graph_over_static_slots(entry, monkeypatch):
    """Capture the convolution and the recurrent step over static slot / flag buffers, then
    restage other slots and flags and replay: each replay equals the same kernels run eagerly
    on the new slots from the same states, bit for bit (nothing in the captured region depends
    on the values at capture), and those new slots only change. entry: the one REC_LAUNCH
    entry the step takes (None: the table as it is)."""
    if entry is not None:
        monkeypatch.setattr(gdn_decode, "REC_LAUNCH", [entry])
    n, s = 4, 12
    mixed_in = torch.randn(n, C, device=DEV, dtype=torch.bfloat16)
    ba = torch.randn(n, 2 * HV, device=DEV, dtype=torch.bfloat16)
    weight = torch.randn(C, W, device=DEV, dtype=torch.bfloat16) * 0.3
    a_log = torch.zeros(HV, device=DEV, dtype=torch.bfloat16)
    dt_bias = torch.zeros(HV, device=DEV, dtype=torch.bfloat16)
    conv = torch.randn(s, C, W - 1, device=DEV, dtype=torch.bfloat16)
    ssm = 0.1 * torch.randn(s, HV, KD, VD, device=DEV)
    header = torch.zeros(2, n, dtype=torch.int64, device=DEV)
    slots, flags = header[0], header[1].view(torch.bool)[::8]

    def body():
        y = gdn_decode.conv1d_update_slots(mixed_in, conv, weight, None, slots, flags, "silu")
        q, k = y[:, :HK * KD].view(n, HK, KD), y[:, HK * KD:2 * HK * KD].view(n, HK, KD)
        v = y[:, 2 * HK * KD:].view(n, HV, VD)
        return y, gdn_decode.gated_delta_rule_decode_slots(q, k, v, ba[:, HV:], ba[:, :HV], a_log, dt_bias, ssm,
                                                           slots, flags)

    header[0] = torch.tensor([11, 11, 11, 11])  # warm-up (compiles) on one slot from zeros
    body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y_g, o_g = body()
    for step_slots, step_flags in (([3, 0, 7, 5], [1, 0, 1, 1]), ([5, 7, 2, 9], [1, 1, 0, 1])):
        conv_e, ssm_e = conv.clone(), ssm.clone()
        header[0] = torch.tensor(step_slots)
        header[1] = torch.tensor(step_flags)
        sl, fl = torch.tensor(step_slots, device=DEV), torch.tensor(step_flags, device=DEV, dtype=torch.bool)
        y_e = gdn_decode.conv1d_update_slots(mixed_in, conv_e, weight, None, sl, fl, "silu")
        q, k = y_e[:, :HK * KD].view(n, HK, KD), y_e[:, HK * KD:2 * HK * KD].view(n, HK, KD)
        o_e = gdn_decode.gated_delta_rule_decode_slots(q, k, y_e[:, 2 * HK * KD:].view(n, HV, VD), ba[:, HV:],
                                                       ba[:, :HV], a_log, dt_bias, ssm_e, sl, fl)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_g, y_e) and torch.equal(o_g, o_e)
        assert torch.equal(conv, conv_e) and torch.equal(ssm, ssm_e)  # the step's slots, and no other


# in_proj_qkvz, the gated attention's qkv, and the stacked in_proj_qkvz + in_proj_ba
# (services/worker/models/qwen3_next.py STACK_PROJECTIONS)
@pytest.mark.parametrize("shape", [(12288, 2048), (9216, 2048), (12352, 2048)])
def test_qwen3_5_projections_take_the_gemv_at_one_row(shape, monkeypatch):
    w = torch.randn(*shape, device=DEV, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, shape[1], device=DEV, dtype=torch.bfloat16)
    assert w.numel() > linear_kernels.SKINNY_MAX_WEIGHT and linear_kernels.skinny_applies(x, w)
    calls = []
    real = linear_kernels.gemv.gemv_triton
    monkeypatch.setattr(linear_kernels.gemv, "gemv_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    y = linear_kernels.linear(x, w)
    assert calls == [1]
    assert rel(y, F.linear(x.float(), w.float())) < 1e-2
    assert not linear_kernels.skinny_applies(torch.randn(2, shape[1], device=DEV, dtype=torch.bfloat16), w)
