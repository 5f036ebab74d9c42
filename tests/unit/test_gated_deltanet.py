"""Gated DeltaNet on the CPU: the gated delta rule's references, the short causal convolution,
and the `GatedDeltaNet` layer against transformers' `Qwen3NextGatedDeltaNet` (its torch path).

Truths: transformers 5.24's torch functions (`torch_recurrent_gated_delta_rule`, the layer's
forward over a [1, T, H] sequence with no cache), and an explicit per-token loop for the
convolution. Tolerances, fp32 throughout: the chunked form against the recurrent one and the
layer against transformers, max abs error 2e-5 with rtol 1e-5 (measured at most ~1e-6: the two
forms sum in different orders; the layer 3e-7); states carried across steps within 1e-5 of one pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import gated_delta_rule as gdr
from services.worker.layers.gated_deltanet import GatedDeltaNet

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

TOL = dict(rtol=1e-5, atol=2e-5)


def _torch_path(fn):
    """transformers' own torch function behind its kernel wrapper (which takes fla's Triton
    kernels when fla is installed: they do not run on CPU tensors)."""
    return getattr(fn, "__wrapped__", fn)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _gdr_inputs(b, t, hk, hv, kd, vd):
    q, k = torch.randn(b, t, hk, kd), torch.randn(b, t, hk, kd)
    v = torch.randn(b, t, hv, vd)
    g = F.logsigmoid(torch.randn(b, t, hv)) * 0.5  # log decays in about (-2, 0)
    beta = torch.rand(b, t, hv)
    h0 = torch.randn(b, hv, kd, vd)
    return q, k, v, g, beta, h0


# ---------------------------------------------------------------- gated delta rule


@pytest.mark.parametrize("l2norm", [True, False])
def test_chunked_ref_equals_recurrent_ref(l2norm):
    # T = 150: two full chunks of 64 and a tail of 22; Hv = 2 * Hk; a nonzero initial state
    q, k, v, g, beta, h0 = _gdr_inputs(2, 150, 2, 4, 16, 24)
    if not l2norm:
        k = F.normalize(k, dim=-1)  # an unnormalised k makes the delta rule diverge
    o_r, s_r = gdr.gated_delta_rule_recurrent_ref(q, k, v, g, beta, h0, None, l2norm)
    o_c, s_c = gdr.gated_delta_rule_chunked_ref(q, k, v, g, beta, h0, None, l2norm)
    assert o_r.shape == (2, 150, 4, 24) and s_r.shape == (2, 4, 16, 24) and s_r.dtype == torch.float32
    torch.testing.assert_close(o_c, o_r, **TOL)
    torch.testing.assert_close(s_c, s_r, **TOL)
    # the recurrence is transformers' (an independent implementation of the same rule)
    o_h, s_h = _torch_path(hf.torch_recurrent_gated_delta_rule)(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    torch.testing.assert_close(o_r, o_h, **TOL)
    torch.testing.assert_close(s_r, s_h, **TOL)


def test_refs_keep_v_dtype_and_explicit_scale():
    q, k, v, g, beta, h0 = _gdr_inputs(1, 70, 1, 2, 8, 8)
    o, s = gdr.gated_delta_rule_chunked_ref(q, k, v.bfloat16(), g, beta, h0, 0.3, True)
    o32, s32 = gdr.gated_delta_rule_recurrent_ref(q, k, v.bfloat16().float(), g, beta, h0, 0.3, True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    torch.testing.assert_close(o.float(), o32, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(s, s32, **TOL)
    q2, k2, v3, g3, b3, _ = _gdr_inputs(1, 5, 2, 3, 8, 8)
    with pytest.raises(ValueError, match="bad shapes"):  # 3 value heads over 2 key heads
        gdr.gated_delta_rule_recurrent_ref(q2, k2, v3, g3, b3)
    with pytest.raises(ValueError, match="g "):
        gdr.gated_delta_rule_chunked_ref(q, k, v, g[:, :, :1], beta, h0)


def test_varlen_dispatch_equals_each_sequence_alone():
    lens = [1, 64, 37]
    cu = torch.tensor([0, 1, 65, 102], dtype=torch.int32)
    q, k, v, g, beta, _ = _gdr_inputs(1, sum(lens), 2, 4, 8, 16)
    h0 = torch.randn(3, 4, 8, 16)
    for fn, ref in ((gdr.gated_delta_rule_prefill, gdr.gated_delta_rule_chunked_ref),
                    (gdr.gated_delta_rule_decode, gdr.gated_delta_rule_recurrent_ref)):
        o, s = fn(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True, cu_seqlens=cu)
        for i in range(3):
            lo, hi = int(cu[i]), int(cu[i + 1])
            oi, si = ref(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], h0[i:i + 1],
                         None, True)
            torch.testing.assert_close(o[:, lo:hi], oi, **TOL)
            torch.testing.assert_close(s[i:i + 1], si, **TOL)


# ---------------------------------------------------------------- causal conv1d


def _conv_loop(x, weight, bias, state, activation=True):
    """Truth: y[t] = act(b + sum_j w[:, j] * x'[t + j]), x' = state columns then x."""
    c, w = weight.shape
    xs = torch.cat([state.T, x])  # [W-1+T, C]
    y = torch.stack([sum(weight[:, j] * xs[t + j] for j in range(w)) + bias for t in range(x.shape[0])])
    return (F.silu(y) if activation else y), xs[-(w - 1):].T


def test_causal_conv1d_varlen_with_states_matches_loop():
    c, w = 6, 4
    lens = [5, 1, 2, 9]  # two sequences shorter than W-1: their final state keeps old columns
    cu = torch.tensor([0, 5, 6, 8, 17], dtype=torch.int32)
    x = torch.randn(sum(lens), c)
    weight, bias = torch.randn(c, w), torch.randn(c)
    state = torch.randn(4, c, w - 1)
    y, final = gdr.causal_conv1d_ref(x, weight, bias, state, cu, "silu")
    assert y.shape == x.shape and final.shape == state.shape
    for i in range(4):
        lo, hi = int(cu[i]), int(cu[i + 1])
        y_t, s_t = _conv_loop(x[lo:hi], weight, bias, state[i])
        torch.testing.assert_close(y[lo:hi], y_t, **TOL)
        torch.testing.assert_close(final[i], s_t, **TOL)
        y_a, s_a = gdr.causal_conv1d_ref(x[lo:hi], weight, bias, state[i:i + 1], None, "silu")  # alone
        torch.testing.assert_close(y[lo:hi], y_a, **TOL)
        torch.testing.assert_close(final[i:i + 1], s_a, **TOL)
    y_n, _ = gdr.causal_conv1d_ref(x[:5], weight, None, state[:1], None, None)  # no bias, no activation
    torch.testing.assert_close(y_n, _conv_loop(x[:5], weight, torch.zeros(c), state[0], False)[0], **TOL)


def test_causal_conv1d_zero_state_matches_transformers():
    c, w, t = 8, 4, 11
    x, weight = torch.randn(t, c), torch.randn(c, w)
    y, _ = gdr.causal_conv1d_ref(x, weight, None, None, None, "silu")
    y_h = _torch_path(hf.causal_conv1d_fn)(x.T[None], weight, None, activation="silu")  # [1, C, T]
    torch.testing.assert_close(y, y_h[0].T, **TOL)


def test_causal_conv1d_prefill_then_update_equals_one_prefill():
    c, w, t, t1 = 5, 4, 12, 7
    x, weight, bias = torch.randn(t, c), torch.randn(c, w), torch.randn(c)
    state0 = torch.randn(1, c, w - 1)
    y_all, s_all = gdr.causal_conv1d_ref(x, weight, bias, state0)
    y1, s = gdr.causal_conv1d_ref(x[:t1], weight, bias, state0)
    ys = [y1]
    for i in range(t1, t):
        yi, s = gdr.causal_conv1d_update_ref(x[i:i + 1], s, weight, bias)
        ys.append(yi)
    torch.testing.assert_close(torch.cat(ys), y_all, **TOL)
    torch.testing.assert_close(s, s_all, **TOL)


# ---------------------------------------------------------------- the layer against transformers

CFG = dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
           linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, hidden_act="silu")


@pytest.fixture
def layers(monkeypatch):
    """(transformers' Qwen3NextGatedDeltaNet on its torch path, ours with its weights), fp32,
    random weights (decays, dt_bias and the norm weight randomised too)."""
    from transformers import Qwen3NextConfig

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        monkeypatch.setattr(hf, name, _torch_path(getattr(hf, name)))
    cfg = Qwen3NextConfig(num_hidden_layers=1, layer_types=["linear_attention"], num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=128, **CFG)
    ref = hf.Qwen3NextGatedDeltaNet(cfg, layer_idx=0).float().eval()
    with torch.no_grad():
        ref.A_log.copy_(torch.empty(4).uniform_(0.05, 1.0).log())
        ref.dt_bias.copy_(torch.randn(4))
        ref.norm.weight.copy_(1 + 0.2 * torch.randn(8))
    ours = GatedDeltaNet.from_hf_config(CFG)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _hf_out(ref, x):
    with torch.no_grad():
        return ref(x[None])[0]


def _states(layer, n, fill=float("nan")):
    """n slots of both states, filled with `fill` (NaN: a fresh sequence must not read them)."""
    conv, ssm = layer.state_shapes()
    return torch.full((n, *conv.shape), fill, dtype=conv.dtype), torch.full((n, *ssm.shape), fill, dtype=ssm.dtype)


def _cu(*lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def test_state_shapes():
    ours = GatedDeltaNet.from_hf_config(CFG)
    conv, ssm = ours.state_shapes()
    assert conv.shape == (2 * 2 * 16 + 4 * 8, 3) and conv.dtype == torch.get_default_dtype()
    assert ssm.shape == (4, 16, 8) and ssm.dtype == torch.float32 and ssm.nbytes == 4 * 16 * 8 * 4
    with pytest.raises(ValueError):
        GatedDeltaNet.from_hf_config({"hidden_size": 64})


def test_layer_matches_transformers(layers):
    ref, ours = layers
    x = torch.randn(100, 64)  # crosses a chunk boundary
    conv, ssm = _states(ours, 1)
    with torch.no_grad():
        out = ours(x, _cu(100), conv, ssm, torch.tensor([False]))
    want = _hf_out(ref, x)
    assert out.shape == (100, 64) and out.dtype == torch.float32
    torch.testing.assert_close(out, want, **TOL)
    # the conv state written in place: the last W-1 = 3 convolution inputs (q, k, v channels)
    with torch.no_grad():
        qkvz, ba = ref.in_proj_qkvz(x[None]), ref.in_proj_ba(x[None])
        hq, hk, hv, _, _, _ = ref.fix_query_key_value_ordering(qkvz, ba)
        mixed = torch.cat([t.reshape(1, 100, -1) for t in (hq, hk, hv)], dim=-1)[0]
    torch.testing.assert_close(conv[0], mixed[-3:].T, **TOL)
    assert torch.isfinite(ssm).all() and ssm.abs().sum() > 0


def test_prefill_then_decode_equals_whole_sequence(layers):
    ref, ours = layers
    t, t1 = 50, 37
    x = torch.randn(t, 64)
    conv, ssm = _states(ours, 1)
    with torch.no_grad():
        outs = [ours(x[:t1], _cu(t1), conv, ssm, torch.tensor([False]))]
        for i in range(t1, t):  # T == N == 1: the decode path
            outs.append(ours(x[i:i + 1], _cu(1), conv, ssm, torch.tensor([True])))
    torch.testing.assert_close(torch.cat(outs), _hf_out(ref, x), **TOL)
    conv1, ssm1 = _states(ours, 1)
    with torch.no_grad():
        ours(x, _cu(t), conv1, ssm1, torch.tensor([False]))
    torch.testing.assert_close(conv, conv1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm, ssm1, rtol=1e-5, atol=1e-5)


def test_varlen_batch_equals_each_sequence_alone(layers):
    ref, ours = layers
    a, b, c, d = torch.randn(29, 64), torch.randn(70, 64), torch.randn(6, 64), torch.randn(10, 64)
    conv, ssm = _states(ours, 3)
    with torch.no_grad():
        # step 1: three fresh sequences of 23, 70 and 1 tokens
        out1 = ours(torch.cat([a[:23], b, c[:1]]), _cu(23, 70, 1), conv, ssm, torch.tensor([False] * 3))
        states1 = conv.clone(), ssm.clone()
        alone = []
        for xs in (a[:23], b, c[:1]):
            s = _states(ours, 1)
            alone.append((ours(xs, _cu(xs.shape[0]), *s, torch.tensor([False])), s))
        # step 2: a and c continue; slot 1 starts d, a new sequence, over b's old state
        out2 = ours(torch.cat([a[23:28], d[:9], c[1:5]]), _cu(5, 9, 4), conv, ssm, torch.tensor([True, False, True]))
        # step 3: one token each (the decode path, N = 3)
        out3 = ours(torch.stack([a[28], d[9], c[5]]), _cu(1, 1, 1), conv, ssm, torch.tensor([True] * 3))
    want_a, want_b, want_c, want_d = (_hf_out(ref, xs) for xs in (a, b, c, d))
    torch.testing.assert_close(out1, torch.cat([want_a[:23], want_b, want_c[:1]]), **TOL)
    cu1 = _cu(23, 70, 1)
    for i, (o, (cs, ss)) in enumerate(alone):
        torch.testing.assert_close(out1[int(cu1[i]):int(cu1[i + 1])], o, **TOL)
        torch.testing.assert_close(states1[0][i:i + 1], cs, **TOL)
        torch.testing.assert_close(states1[1][i:i + 1], ss, **TOL)
    torch.testing.assert_close(out2, torch.cat([want_a[23:28], want_d[:9], want_c[1:5]]), **TOL)
    torch.testing.assert_close(out3, torch.stack([want_a[28], want_d[9], want_c[5]]), **TOL)


@pytest.mark.parametrize("layout", GatedDeltaNet.LAYOUTS)
def test_in_place_decode_equals_the_gathered_decode_on_out_of_order_slots(layout, monkeypatch):
    """`forward_step` on decode steps updating the state slots in place (kernels/gdn_decode.py's
    references here; their Triton kernels in test_gdn_decode_interp.py) against the gathered
    path (gather, decode, scatter; IN_PLACE_DECODE off), over three steps on slots not in
    order: a new sequence on a slot holding NaN, two fresh rows sharing a slot (padding), and
    slots no row names (left bit-identical)."""
    from services.worker.layers import gated_deltanet as gdn_mod
    from services.worker.state_cache import StateCache, StateSpec, StepState

    layer = GatedDeltaNet.from_hf_config(CFG, layout)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
        layer.A_log.copy_(torch.empty(4).uniform_(0.05, 1.0).log())
    shapes = layer.state_shapes()
    spec = StateSpec(tuple(s.shape for s in shapes), tuple(s.dtype for s in shapes))
    caches = [StateCache([spec], 6, "cpu") for _ in range(2)]
    for t, twin in zip(caches[0].layers[0], caches[1].layers[0]):
        t.copy_(torch.randn(t.shape))
        t[1] = t[6] = float("nan")
        twin.copy_(t)
    before = [t.clone() for t in caches[0].layers[0]]
    slots = torch.tensor([5, 1, 6, 3, 6])
    xs = [torch.randn(5, 64) for _ in range(3)]
    outs = []
    for in_place, cache in zip((True, False), caches):
        monkeypatch.setattr(gdn_mod, "IN_PLACE_DECODE", in_place)
        step_outs = []
        for step, x in enumerate(xs):
            flags = [True, step > 0, False, True, False]
            st = StepState(cache, slots, torch.tensor(flags), torch.arange(6, dtype=torch.int32), [1] * 5)
            with torch.no_grad():
                step_outs.append(layer.forward_step(x, st, 0))
        outs.append(step_outs)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, **TOL)
    for t, twin, old in zip(caches[0].layers[0], caches[1].layers[0], before):
        torch.testing.assert_close(t[[5, 1, 3]], twin[[5, 1, 3]], **TOL)
        assert torch.isfinite(t[6]).all()
        assert torch.equal(t[[0, 2, 4]], old[[0, 2, 4]])
