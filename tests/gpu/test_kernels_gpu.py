"""Each Triton kernel against its torch reference on CUDA, random inputs of awkward sizes
(odd lengths, block-boundary lengths, batch 1..256), through the dispatchers.

Tolerances (relative norm error vs the reference run in fp32 on upcast inputs, METHOD.md):
fp32 2e-3 (tl.dot runs as tf32), bf16 2e-2, fp16 5e-3. NaN never passes. Outputs are
poisoned before the kernel runs where the kernel writes into a given tensor.
Skipped without CUDA or triton.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kernels import activation, attention, attention_triton, norm, rotary, sampling_noise  # noqa: E402

TOL = {torch.float32: 2e-3, torch.bfloat16: 2e-2, torch.float16: 5e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite output"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_dispatchers_pick_triton_on_cuda():
    assert attention.paged_attention_triton is not None and norm.rms_norm_triton is not None
    assert rotary.rotary_and_store_kv_triton is not None and activation.silu_and_mul_triton is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 1024), (7, 4096), (257, 896), (3, 128)])
def test_fused_add_rms_norm_matches_reference(dtype, rows, hidden):
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    r = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    a, b = norm.fused_add_rms_norm(x, r, w, 1e-6)
    ra, rb = norm.fused_add_rms_norm_ref(x.float(), r.float(), w.float(), 1e-6)
    assert rel(a, ra) < TOL[dtype] and rel(b, rb) < TOL[dtype]
    assert rel(norm.rms_norm(x, w, 1e-5), norm.rms_norm_ref(x.float(), w.float(), 1e-5)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 3072), (33, 14336), (256, 97)])
def test_silu_and_mul_matches_reference(dtype, rows, inter):
    x = torch.randn(rows, 2 * inter, device="cuda", dtype=dtype)
    assert rel(activation.silu_and_mul(x), activation.silu_and_mul_ref(x.float())) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hk,d,rot", [(1, 16, 8, 128, 128), (37, 32, 8, 128, 128), (300, 6, 2, 64, 32)])
def test_rotary_fused_with_kv_write_matches_reference(dtype, t, hq, hk, d, rot):
    bs, nblocks = 16, 64
    table = rotary.rope_cos_sin(rotary.rope_inv_freq(rot, 1e6), 4096).cuda()
    qkv = torch.randn(t, (hq + 2 * hk) * d, device="cuda", dtype=dtype)
    pos = torch.randint(0, 4096, (t,), device="cuda")
    slots = torch.randperm(nblocks * bs, device="cuda")[:t]
    res = []
    for fn in (rotary.rotary_and_store_kv_ref, rotary.rotary_and_store_kv):
        buf = qkv.clone()
        q, k, v = buf.split([hq * d, hk * d, hk * d], -1)
        kc = torch.full((nblocks, bs, hk, d), 7.0, device="cuda", dtype=dtype)  # poison
        vc = kc.clone()
        fn(q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d), pos, table, kc, vc, slots)
        res.append((buf, kc, vc))
    for got, ref in zip(res[1], res[0]):
        assert rel(got, ref) < TOL[dtype]


def _paged(seqs, h, kvh, d, bs, dtype):
    nb = sum(-(-(p + n) // bs) for p, n in seqs) + 5
    kc = torch.randn(nb, bs, kvh, d, device="cuda", dtype=dtype)
    vc = torch.randn(nb, bs, kvh, d, device="cuda", dtype=dtype)
    perm = torch.randperm(nb).tolist()
    width = max(-(-(p + n) // bs) for p, n in seqs)
    tables, cu, lens = [], [0], []
    for p, n in seqs:
        k = -(-(p + n) // bs)
        tables.append([perm.pop() for _ in range(k)] + [-1] * (width - k))
        cu.append(cu[-1] + n)
        lens.append(p + n)
    q = torch.randn(cu[-1], h, d, device="cuda", dtype=dtype)
    bt = torch.tensor(tables, dtype=torch.int32, device="cuda")
    cu_t = torch.tensor(cu, dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    ref = attention.paged_attention_ref(q.float(), kc.float(), vc.float(), cu_t, sl, bt, d ** -0.5)
    got = attention.paged_attention(q, kc, vc, cu_t.cuda(), sl.cuda(), bt, d ** -0.5)
    return got, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 64, 256])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("fused_merge", [True, False])  # the split merge in the kernel or a second launch
def test_paged_decode_attention_matches_reference(monkeypatch, dtype, batch, bs, fused_merge):
    monkeypatch.setitem(attention_triton.DECODE_DEFAULTS, "fused_merge", fused_merge)
    lens = torch.randint(1, 2100, (batch,)).tolist()
    lens[0] = bs  # block boundary
    if batch > 2:
        lens[1], lens[2] = 1, 4096 + 1
    got, ref = _paged([(n - 1, 1) for n in lens], 16, 8, 128, bs, dtype)
    assert rel(got, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqs", [[(0, 1000)], [(0, 17), (64, 129), (100, 3), (0, 1)],
                                  [(31, 1), (0, 256), (2047, 65), (5, 1)]])
@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (8, 8)])
def test_paged_prefill_attention_matches_reference(dtype, seqs, heads):
    got, ref = _paged(seqs, heads[0], heads[1], 128, 16, dtype)
    assert rel(got, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len", [2, 5, 9])
@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("heads", [(16, 8), (32, 8)])
def test_paged_verify_attention_matches_reference(dtype, q_len, batch, heads):
    """Verify steps (1 + k queries a seq on a long cached context) run the split-K
    multi-query kernel (`kernels.attention_multi_query`); one seq of one query among them."""
    lens = torch.randint(q_len, 2100, (batch,)).tolist()
    seqs = [(n - q_len, q_len) for n in lens]
    if batch > 1:
        seqs[1] = (lens[1] - 1, 1)
    got, ref = _paged(seqs, heads[0], heads[1], 128, 16, dtype)
    assert rel(got, ref) < TOL[dtype]


# ---------------------------------------------------------------- sampling


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 151936), (256, 151936), (33, 50257)])
def test_gumbel_sampler_matches_reference_draws(dtype, rows, vocab):
    """Same hashed noise in both: the Triton kernel draws the reference's tokens (up to a
    float-log near-tie); every output written; greedy rows are the argmax."""
    from kernels import sampling
    from kernels.sampling_triton import sample_triton

    logits = (torch.randn(rows, vocab, device="cuda") * 3).to(dtype)
    temp = torch.rand(rows, device="cuda") + 0.3
    temp[::5] = 0.0
    seeds = [sampling_noise.mix_seed(i * 7919, 3) for i in range(rows)]
    z = torch.zeros(rows, dtype=torch.long, device="cuda")
    ref = sampling.sample_ref(logits, temp, z, torch.ones(rows, device="cuda"),
                              torch.zeros(rows, device="cuda"), seeds, False)
    got = sample_triton(logits, temp, seeds)
    assert (got >= 0).all() and (got < vocab).all()
    assert (got[::5] == logits[::5].float().argmax(-1)).all()
    assert (got != ref).float().mean().item() <= 0.02


def test_gumbel_sampler_frequencies_follow_softmax():
    """10k draws of one 8-token row (different output indices): chi-square-style bound on
    the frequencies against softmax(logits / T)."""
    from kernels.sampling_triton import sample_triton

    n = 10000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3, 1.5, -0.5], device="cuda")
    temp = torch.full((n,), 0.8, device="cuda")
    got = sample_triton(base.expand(n, 8).contiguous(), temp, [sampling_noise.mix_seed(42, i) for i in range(n)])
    freq = torch.bincount(got, minlength=8).double() / n
    p = torch.softmax(base.double() / 0.8, -1)
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-3).all(), (freq, p)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 1024), (1, 1024, 3072), (3, 6144, 1024), (16, 1000, 2048), (1, 4096, 4096),
                                   (8, 151936, 1024), (5, 77, 300), (2, 128256, 4096)])
def test_skinny_linear_matches_reference(dtype, m, n, k):
    from kernels import linear
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(dtype)
    b = torch.randn(n, device="cuda", dtype=dtype)
    for bias in (None, b):
        got = linear.linear(x, w, bias)  # the dispatcher takes the skinny kernel for m <= 16
        ref = linear.linear_ref(x.double(), w.double(), None if bias is None else bias.double())
        assert rel(got, ref) < TOL[dtype], (m, n, k, bias is None)
    for split in (1, 3, 8):  # forced K splits (partial sums) agree too
        assert rel(linear.skinny_linear_triton(x, w, b, split_k=split),
                   linear.linear_ref(x.double(), w.double(), b.double())) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 7, 256])
def test_rotary_with_fused_qk_norm_matches_reference(dtype, t):
    hq, hk, d, bs = 16, 8, 128, 16
    table = rotary.rope_cos_sin(rotary.rope_inv_freq(d, 1e6).cuda(), 4096)
    qkv = torch.randn(t, (hq + 2 * hk) * d, device="cuda", dtype=dtype)
    pos = torch.randint(0, 4096, (t,), device="cuda")
    slots = torch.randperm(t + 40, device="cuda")[:t]
    qn = (1 + 0.2 * torch.randn(d, device="cuda")).to(dtype)
    kn = (1 + 0.2 * torch.randn(d, device="cuda")).to(dtype)
    outs = []
    for fn, ty in ((rotary.rotary_and_store_kv_ref, torch.float64), (rotary.rotary_and_store_kv, dtype)):
        buf = qkv.to(ty)
        q, k, v = buf.split([hq * d, hk * d, hk * d], -1)
        kc = torch.full((-(-(t + 40) // bs), bs, hk, d), float("nan"), device="cuda", dtype=ty)
        vc = kc.clone()
        fn(q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d), pos, table.to(torch.float64 if ty == torch.float64 else torch.float32),
           kc, vc, slots, qn.to(ty), kn.to(ty), 1e-6)
        outs.append((buf, kc.view(-1, hk, d)[slots], vc.view(-1, hk, d)[slots]))
    for got, ref in zip(outs[1], outs[0]):
        assert rel(got, ref) < TOL[dtype]


@pytest.mark.parametrize("n", [1, 2, 5, 64, 256])
def test_gumbel_sampler_chunked_rows_equal_reference(n):
    from kernels import sampling, sampling_triton
    vocab = 151936
    lg = torch.randn(n, vocab, device="cuda") * 4
    temp = torch.rand(n, device="cuda") + 0.2
    temp[0] = 0.0  # one greedy row
    seeds = [sampling_noise.mix_seed(1000 + i, 7) for i in range(n)]
    z = torch.zeros(n, dtype=torch.long, device="cuda")
    ref = sampling.sample_ref(lg, temp, z, torch.ones(n, device="cuda"), torch.zeros(n, device="cuda"), seeds, False)
    got = sampling_triton.sample_triton(lg, temp, seeds)
    assert torch.equal(got, ref)
