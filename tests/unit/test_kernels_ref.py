"""The torch reference kernels against independent formulas.

Paged attention vs dense causal SDPA on contiguous K/V; RMSNorm vs a float64 formula;
rotary vs complex-number rotation; sampling vs argmax and independently computed allowed
sets.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul_ref
from kernels.attention import paged_attention_ref, store_kv_ref
from kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary import apply_rotary_ref, rope_cos_sin, rope_inv_freq
from kernels.sampling import filtered_probs, sample_ref
from kernels.sampling_noise import mix_seed

# ---------------------------------------------------------------- paged attention


def _dense_causal(q, k, v, prefix, scale):
    """Reference: q [L, H, D] at positions prefix..prefix+L-1 over k/v [prefix+L, KVH, D]."""
    h, kvh = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // kvh, dim=1)
    v = v.repeat_interleave(h // kvh, dim=1)
    s = k.shape[0]
    mask = torch.arange(s)[None, :] <= (prefix + torch.arange(q.shape[0]))[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1).double(), k.transpose(0, 1).double(),
                                       v.transpose(0, 1).double(), attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def _run_paged(seqs, heads, kv_heads, head_dim, block_size, seed=0):
    """seqs: list of (cached_prefix_len, new_tokens). Writes every sequence's full K/V into
    a shuffled block pool (prefix before the step, the new tokens through store_kv), runs the
    ref, and compares each sequence with dense attention."""
    g = torch.Generator().manual_seed(seed)
    total_blocks = sum(-(-(p + n) // block_size) for p, n in seqs) + 3
    perm = torch.randperm(total_blocks, generator=g).tolist()
    kc = torch.randn(total_blocks, block_size, kv_heads, head_dim, generator=g)  # garbage
    vc = torch.randn(total_blocks, block_size, kv_heads, head_dim, generator=g)
    tables, ks, vs, qs, slots, cu, lens = [], [], [], [], [], [0], []
    for p, n in seqs:
        nb = -(-(p + n) // block_size)
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        k = torch.randn(p + n, kv_heads, head_dim, generator=g)
        v = torch.randn(p + n, kv_heads, head_dim, generator=g)
        ks.append(k), vs.append(v)
        slot = torch.tensor([table[i // block_size] * block_size + i % block_size for i in range(p + n)])
        kc.view(-1, kv_heads, head_dim)[slot[:p]] = k[:p]  # the cached prefix
        vc.view(-1, kv_heads, head_dim)[slot[:p]] = v[:p]
        slots.append(slot[p:])
        qs.append(torch.randn(n, heads, head_dim, generator=g))
        cu.append(cu[-1] + n)
        lens.append(p + n)
    width = max(len(t) for t in tables) + 1
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    new_k = torch.cat([k[p:] for k, (p, _) in zip(ks, seqs)])
    new_v = torch.cat([v[p:] for v, (p, _) in zip(vs, seqs)])
    store_kv_ref(new_k, new_v, kc, vc, torch.cat(slots))
    scale = head_dim ** -0.5
    out = paged_attention_ref(torch.cat(qs), kc, vc, torch.tensor(cu, dtype=torch.int32),
                              torch.tensor(lens, dtype=torch.int32), bt, scale)
    assert out.shape == (cu[-1], heads, head_dim)
    for i, (p, n) in enumerate(seqs):
        ref = _dense_causal(qs[i], ks[i], vs[i], p, scale)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]].double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("seqs", [
    [(0, 1)], [(0, 7)], [(0, 16)], [(0, 17)], [(0, 33)],  # odd and block-boundary prefills
])
def test_paged_prefill_matches_dense_causal_attention(seqs):
    _run_paged(seqs, heads=4, kv_heads=4, head_dim=32, block_size=16)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (9, 3), (8, 1)])
def test_paged_attention_with_gqa_matches_dense(heads, kv_heads):
    _run_paged([(0, 13), (5, 1), (31, 1)], heads, kv_heads, head_dim=16, block_size=8)


def test_prefill_chunk_on_cached_prefix_matches_dense():
    _run_paged([(16, 5), (7, 9), (32, 16)], heads=6, kv_heads=2, head_dim=16, block_size=16)


@pytest.mark.parametrize("seqs", [[(37, 70)], [(200, 130), (0, 65), (16, 64)], [(5, 64), (63, 1), (100, 99)]])
def test_long_chunks_after_a_prefix_take_the_split_path_and_match_dense(seqs):
    """Chunks of >= SPLIT_MIN_Q queries after a cached prefix run as prefix + causal parts
    merged by log-sum-exp (kernels.attention._prefix_then_causal); awkward prefix lengths,
    GQA, a chunk at position 0 and a decode in the same step."""
    from kernels import attention

    assert attention._FLASH_CPU is not None and attention.SPLIT_MIN_Q <= 64
    _run_paged(seqs, heads=6, kv_heads=2, head_dim=16, block_size=16)


def test_decode_batch_of_unequal_lengths_matches_dense():
    _run_paged([(0, 1), (15, 1), (16, 1), (47, 1), (3, 1)], heads=4, kv_heads=2, head_dim=8, block_size=4)


def test_mixed_prefill_and_decode_batch_matches_dense():
    _run_paged([(10, 1), (0, 11), (20, 1), (4, 6), (63, 1)], heads=6, kv_heads=3, head_dim=16, block_size=16)


def test_block_size_one_and_long_tables():
    _run_paged([(9, 1), (2, 3)], heads=2, kv_heads=1, head_dim=4, block_size=1)


# ---------------------------------------------------------------- norm, activation


def test_rms_norm_matches_float64_formula():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 96, generator=g)
    w = torch.randn(96, generator=g)
    eps = 1e-5
    xd = x.double()
    ref = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps) * w.double()
    torch.testing.assert_close(rms_norm_ref(x, w, eps).double(), ref, atol=1e-5, rtol=1e-5)


def test_fused_add_rms_norm_returns_norm_of_sum_and_the_sum():
    g = torch.Generator().manual_seed(2)
    x, r = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    w = torch.randn(64, generator=g)
    out, res = fused_add_rms_norm_ref(x, r, w, 1e-6)
    s = x.double() + r.double()
    ref = s / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(res.double(), s)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_silu_and_mul_matches_formula():
    x = torch.randn(3, 10, dtype=torch.float64)
    gate, up = x[:, :5], x[:, 5:]
    torch.testing.assert_close(silu_and_mul_ref(x), gate / (1 + torch.exp(-gate)) * up)


# ---------------------------------------------------------------- rotary


@pytest.mark.parametrize("rot_dim,head_dim", [(16, 16), (8, 16)])
def test_rotary_matches_complex_rotation(rot_dim, head_dim):
    theta = 10000.0
    g = torch.Generator().manual_seed(3)
    positions = torch.tensor([0, 1, 5, 17, 100])
    q = torch.randn(5, 3, head_dim, generator=g)
    k = torch.randn(5, 1, head_dim, generator=g)
    table = rope_cos_sin(rope_inv_freq(rot_dim, theta), 128)
    qk = apply_rotary_ref(torch.cat([q, k], dim=1), table[positions])
    qr, kr = qk[:, :3], qk[:, 3:]
    half = rot_dim // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rot_dim)
    angle = positions[:, None, None].double() * freqs  # [T, 1, half]
    for x, xr in ((q, qr), (k, kr)):
        z = torch.complex(x[..., :half].double(), x[..., half:rot_dim].double()) * torch.exp(1j * angle)
        ref = torch.cat([z.real, z.imag, x[..., rot_dim:].double()], dim=-1)
        torch.testing.assert_close(xr.double(), ref, atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_keeps_high_and_divides_low_frequencies():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    base = rope_inv_freq(128, 500000.0)
    scaled = rope_inv_freq(128, 500000.0, scaling)
    wavelen = 2 * math.pi / base
    high = wavelen < 8192 / 4.0
    low = wavelen > 8192 / 1.0
    torch.testing.assert_close(scaled[high], base[high])
    torch.testing.assert_close(scaled[low], base[low] / 8.0)
    mid = ~high & ~low
    assert bool(((scaled[mid] <= base[mid]) & (scaled[mid] >= base[mid] / 8.0)).all())


# ---------------------------------------------------------------- sampling


def _params(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    return (torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.long),
            torch.full((n,), top_p), torch.full((n,), min_p))


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(4))
    out = sample_ref(logits, *_params(6, temperature=0.0), seeds=[1] * 6)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_top_k_one_is_argmax_at_any_temperature():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(5))
    out = sample_ref(logits, *_params(6, temperature=1.5, top_k=1), seeds=list(range(6)))
    assert out.tolist() == logits.argmax(-1).tolist()


def test_same_seed_and_index_give_same_token_and_others_vary():
    logits = torch.zeros(1, 1000)  # uniform: the token depends only on the noise
    draw = lambda s, i: sample_ref(logits, *_params(1), seeds=[mix_seed(s, i)]).item()
    assert all(draw(7, i) == draw(7, i) for i in range(5))
    assert len({draw(7, i) for i in range(20)}) > 10
    assert draw(7, 3) != draw(8, 3) or draw(7, 4) != draw(8, 4)
    # a row's draw does not depend on its batch neighbours
    batch = sample_ref(torch.zeros(3, 1000), *_params(3), seeds=[mix_seed(1, 0), mix_seed(7, 3), mix_seed(2, 2)])
    assert batch[1].item() == draw(7, 3)


def test_min_p_never_picks_below_threshold():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(1, 64, generator=g) * 2
    p = torch.softmax(logits, -1)[0]
    allowed = set((p >= 0.3 * p.max()).nonzero().flatten().tolist())
    seen = {sample_ref(logits, *_params(1, min_p=0.3), seeds=[mix_seed(9, i)]).item() for i in range(400)}
    assert seen <= allowed and len(seen) > 1


def test_top_p_never_picks_outside_nucleus():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 64, generator=g) * 2
    p = torch.softmax(logits, -1)[0].double()
    order = p.argsort(descending=True)
    cum = p[order].cumsum(0)
    n_keep = int((cum < 0.6).sum()) + 1  # smallest prefix whose mass reaches top_p
    allowed = set(order[:n_keep].tolist())
    seen = {sample_ref(logits, *_params(1, top_p=0.6), seeds=[mix_seed(11, i)]).item() for i in range(400)}
    assert seen <= allowed and len(seen) > 1


def test_top_k_and_top_p_rows_filter_independently():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(2, 40, generator=g)
    temp = torch.tensor([0.7, 1.0])
    probs = filtered_probs(logits, temp, torch.tensor([3, 0]), torch.tensor([1.0, 0.5]), torch.tensor([0.0, 0.0]))
    assert int((probs[0] > 0).sum()) == 3
    assert set((probs[0] > 0).nonzero().flatten().tolist()) == set(logits[0].topk(3).indices.tolist())
    kept = (probs[1] > 0).sum().item()
    assert 1 <= kept < 40
