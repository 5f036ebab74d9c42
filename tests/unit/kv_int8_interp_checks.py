"""Run the Triton kernels that write and read an int8 KV cache (kernels/kv_quant_triton.py and
its users) under TRITON_INTERPRET=1 on small CPU tensors against the torch references of
kernels/kv_quant.py and kernels/attention.py, and print one JSON object {check name: error}
on a line starting "RESULT ".

Run by `tests/unit/test_kv_int8_interp.py` in a subprocess (the interpreter switch is read
when triton is first imported). q and the model dtype are fp32 and fp16 (the interpreter's
tl.dot on bf16 gives garbage, tests/unit/moe_interp_checks.py); the store kernel also bf16.

Writers:
- "store_kv_<dtype>" (0 or inf): `store_kv_triton` writes the codes and the scales
  `kv_quant.store_quantized` writes, bit for bit (same fp32 math: IEEE divisions, round half
  to even), at an awkward token count with a padding row (slot -1), an all-zero row (scale
  0) and a row of exact ties (amax 127: scale 1, x.5 values), every other slot untouched.
- "rotary_store_<dtype>": the rotary + store kernel (full and partial rotary, with and
  without the q/k norm) against the rotary reference: the largest |dequantized kernel value -
  dequantized reference value| over the row's reference scale, in steps (0 when the rotated
  values agree bit for bit; a rotation rounding that crosses a rounding edge moves a code by
  one step); "rotary_store_scale_<dtype>" the largest relative scale difference.
- "rope_decode_write_<dtype>": the fused rotary decode's token rows, as "rotary_store".

Readers (decode split-K with its merge: several splits, one split, prefetch, a graph bound,
long tiles, head_dim 18; the varlen prefill with a cached prefix; prefill and decode mixed;
the multi-query verify kernel at mixed q_len, with several splits and one; the fused rotary
decode): caches quantized by the torch reference (`quantize_int8` of N(0, 1) K/V, per token
and head), the kernel against `paged_attention_ref` over the same cache (it dequantizes to
fp32): "attn_<case>_<dtype>" relative norm error (summation order, the scales folded into
the score and probability columns; fp16: the fp16 rounding of q . k8's q and of the scaled
probabilities). "quant_<case>_<dtype>": the same kernel output against attention over the
unquantized fp32 K/V: the int8 rounding's own error (each element within scale / 2 =
amax / 254 of its value).
"""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from kernels import attention, kv_quant, rope_decode, rotary  # noqa: E402
from kernels import attention_triton as at  # noqa: E402

I8 = torch.int8


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; inf on NaN or a shape mismatch."""
    if a.shape != b.shape or not torch.isfinite(a.double()).all():
        return float("inf")
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def int8_cache(nb: int, bs: int, kvh: int, d: int, gen: torch.Generator):
    """(raw fp32 [nb, bs, kvh, d], codes int8, scales fp32 [nb, bs, kvh]) quantized by the reference."""
    raw = torch.randn(nb, bs, kvh, d, generator=gen)
    codes, scales = kv_quant.quantize_int8(raw)
    return raw, codes, scales.contiguous()


def int8_paged_case(seqs, h, kvh, d, bs, dt, gen):
    """seqs: (cached prefix, new tokens) each. An int8 cache of reference-quantized random K/V,
    q in dt, the reference attention over it and over the unquantized K/V."""
    total = sum(-(-(p + n) // bs) for p, n in seqs) + 3
    kraw, kc, ks = int8_cache(total, bs, kvh, d, gen)
    vraw, vc, vs = int8_cache(total, bs, kvh, d, gen)
    perm = torch.randperm(total, generator=gen).tolist()
    width = max(-(-(p + n) // bs) for p, n in seqs)
    tables, cu, lens = [], [0], []
    for p, n in seqs:
        nb = -(-(p + n) // bs)
        tables.append([perm.pop() for _ in range(nb)] + [-1] * (width - nb))
        cu.append(cu[-1] + n)
        lens.append(p + n)
    q = torch.randn(cu[-1], h, d, generator=gen).to(dt)
    bt = torch.tensor(tables, dtype=torch.int32)
    cu_t, sl = torch.tensor(cu, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    ref = attention.paged_attention_ref(q.float(), kc, vc, cu_t, sl, bt, d ** -0.5, None, ks, vs)
    exact = attention.paged_attention_ref(q.float(), kraw, vraw, cu_t, sl, bt, d ** -0.5)
    return q, (kc, vc, ks, vs), cu_t, sl, bt, ref, exact


def row_steps(got_c, got_s, want_c, want_s) -> tuple[float, float]:
    """(largest |got dequantized - want dequantized| / want's scale, in steps; largest relative
    scale difference) of int8 rows codes [..., d] with scales [...]."""
    gd, wd = kv_quant.dequantize_int8(got_c, got_s), kv_quant.dequantize_int8(want_c, want_s)
    step = want_s.clamp_min(1e-30)[..., None]
    steps = float(((gd - wd).abs() / step).max()) if gd.numel() else 0.0
    sc = float(((got_s - want_s).abs() / want_s.clamp_min(1e-30)).max()) if got_s.numel() else 0.0
    return steps, sc


def store_checks(out: dict, gen: torch.Generator) -> None:
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        name = str(dt).removeprefix("torch.")
        kk = torch.randn(7, 3, 24, generator=gen) * 3
        vv = torch.randn(7, 3, 24, generator=gen) * 3
        kk[1, 0] = 0.0  # a zero row: scale 0, codes 0
        kk[2, 1, :7] = torch.tensor([127.0, 2.5, -3.5, 0.5, 1.5, -0.5, 126.5])  # ties to even
        kk, vv = kk.to(dt), vv.to(dt)
        sl = torch.tensor([3, 17, 0, 31, 8, -1, 20])
        kc = torch.full((3, 16, 3, 24), 5, dtype=I8)  # untouched slots keep 5 and scale 7
        vc = kc.clone()
        ks = torch.full((3, 16, 3), 7.0)
        vs = ks.clone()
        rk, rv, rks, rvs = kc.clone(), vc.clone(), ks.clone(), vs.clone()
        at.store_kv_triton(kk, vv, kc, vc, sl, ks, vs)
        w = sl >= 0
        kv_quant.store_quantized(kk[w], vv[w], rk, rv, sl[w], rks, rvs)
        same = all(torch.equal(a, b) for a, b in ((kc, rk), (vc, rv), (ks, rks), (vs, rvs)))
        out[f"store_kv_{name}"] = 0.0 if same else float("inf")


def rotary_store_checks(out: dict, gen: torch.Generator) -> None:
    for dt in (torch.float32, torch.float16):
        name = str(dt).removeprefix("torch.")
        t, hq, hk, d, bs = 9, 4, 2, 16, 16
        steps, scs = [], []
        for rot, norm_on in ((16, True), (16, False), (8, False)):
            table = rotary.rope_cos_sin(rotary.rope_inv_freq(rot, 10000.0), 64)
            qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=gen) * 2).to(dt)
            qn = (1 + 0.2 * torch.randn(d, generator=gen)).to(dt) if norm_on else None
            kn = (1 + 0.2 * torch.randn(d, generator=gen)).to(dt) if norm_on else None
            pos = torch.randint(0, 64, (t,), generator=gen)
            slots = torch.randperm(4 * bs, generator=gen)[:t]
            slots[-1] = -1
            live = slots >= 0
            rb = qkv.clone()
            q, k, v = (x.view(t, -1, d) for x in rb.split([hq * d, hk * d, hk * d], -1))
            rk, rv = torch.zeros(4, bs, hk, d, dtype=I8), torch.zeros(4, bs, hk, d, dtype=I8)
            rks, rvs = torch.zeros(4, bs, hk), torch.zeros(4, bs, hk)
            rotary.rotary_and_store_kv_ref(q, k, v, pos, table, rk, rv, slots.clamp_min(0), qn, kn, 1e-6,
                                           rks, rvs)
            # the reference wrote the padding row at slot 0 too: recompute the live rows alone
            rk.zero_(), rv.zero_(), rks.zero_(), rvs.zero_()
            kv_quant.store_quantized(k[live], v[live], rk, rv, slots[live], rks, rvs)
            tb = qkv.clone()
            q2, k2, v2 = (x.view(t, -1, d) for x in tb.split([hq * d, hk * d, hk * d], -1))
            kc, vc = torch.zeros_like(rk), torch.zeros_like(rv)
            ks, vs = torch.zeros_like(rks), torch.zeros_like(rvs)
            rotary.rotary_and_store_kv_triton(q2, k2, v2, pos, table, kc, vc, slots, qn, kn, 1e-6, ks, vs)
            rest = torch.ones(4 * bs, dtype=torch.bool)
            rest[slots[live]] = False
            if bool(kc.view(-1, hk, d)[rest].any()) or bool(ks.view(-1, hk)[rest].any()):
                steps.append(float("inf"))
            for c, s_, wc, ws in ((kc, ks, rk, rks), (vc, vs, rv, rvs)):
                st, sc = row_steps(c.view(-1, hk, d)[slots[live]], s_.view(-1, hk)[slots[live]],
                                   wc.view(-1, hk, d)[slots[live]], ws.view(-1, hk)[slots[live]])
                steps.append(st)
                scs.append(sc)
            steps.append(rel(q2, q) * 1e3)  # q rotated in place as the reference (rel. 1e-3 = 1 "step")
        out[f"rotary_store_{name}"] = max(steps)
        out[f"rotary_store_scale_{name}"] = max(scs)


DECODE_READERS = {  # (seqs, heads, kv heads, head_dim, block_size, kwargs)
    "decode_gqa_splitk": ([(40, 1), (0, 1), (16, 1), (130, 1)], 4, 2, 16, 16, {"decode_config": {"splits": 5}}),
    "decode_default_splits": ([(40, 1), (7, 1), (130, 1)], 8, 2, 16, 16, {}),
    "decode_one_split": ([(40, 1), (7, 1)], 4, 2, 16, 16, {"decode_config": {"splits": 1}}),
    "decode_prefetch": ([(40, 1), (0, 1), (15, 1), (130, 1)], 4, 2, 16, 16,
                        {"decode_config": {"prefetch": True, "block_n": 16}}),
    "decode_graph_bound_hd24": ([(20, 1), (5, 1)], 6, 3, 24, 16, {"max_seq_len": 256}),
    "decode_long_tiles": ([(300, 1), (129, 1)], 8, 2, 16, 16, {"decode_config": {"block_n": 128}}),
    "decode_fused_merge": ([(40, 1), (130, 1)], 4, 2, 16, 16, {"decode_config": {"splits": 3, "fused_merge": True}}),
    "decode_odd_hd18": ([(40, 1), (7, 1), (130, 1)], 4, 2, 18, 16, {}),
}
OTHER_READERS = {
    "prefill_varlen_prefix": ([(0, 7), (16, 20), (33, 70)], 4, 2, 16, 16, {}),
    "mixed_prefill_decode": ([(10, 1), (0, 19), (48, 5)], 6, 3, 24, 16, {}),
    "multi_query_verify": ([(40, 5), (0, 3), (130, 5), (16, 1)], 4, 2, 16, 16, {"decode_config": {"splits": 4}}),
    "multi_query_one_split": ([(40, 5), (7, 2)], 8, 2, 16, 16, {"decode_config": {"splits": 1}}),
    "multi_query_fused_merge": ([(40, 3), (130, 2)], 4, 2, 16, 16, {"decode_config": {"splits": 3,
                                                                                       "fused_merge": True}}),
}


def reader_checks(out: dict, gen: torch.Generator) -> None:
    for dt in (torch.float32, torch.float16):
        name = str(dt).removeprefix("torch.")
        for cname, (seqs, h, kvh, d, bs, kw) in {**DECODE_READERS, **OTHER_READERS}.items():
            q, (kc, vc, ks, vs), cu, sl, bt, ref, exact = int8_paged_case(seqs, h, kvh, d, bs, dt, gen)
            got = at.paged_attention_triton(q, kc, vc, cu, sl, bt, d ** -0.5, **kw, k_scale=ks, v_scale=vs)
            out[f"attn_{cname}_{name}"] = rel(got, ref)
            out[f"quant_{cname}_{name}"] = rel(got, exact)


ROPE_CASES = (([40, 16, 1, 131], 16, True, {}), ([300], 32, False, {"splits": 3}),
              ([17, 0], 16, True, {"block_n": 16, "splits": 1}),
              ([40, 16, 1, 131, 0], 16, True, {"block_n": 16, "prefetch": True}),
              ([300, 33], 16, False, {"splits": 2, "prefetch": True, "fused_merge": True}))


def rope_decode_case(lens, bs, norm_on, kw, dt, gen):
    """`rope_decode_triton` on an int8 cache: (attention error against `paged_attention_ref`
    over the cache the kernel left, (steps, scale error) of the token rows it wrote against the
    rotary reference's quantization, 0/inf: every other slot and scale unchanged)."""
    b, hq, hk, d = len(lens), 4, 2, 16
    nb = sum(-(-n // bs) for n in lens) + 3
    perm = torch.randperm(nb, generator=gen).tolist()
    width = max(1, max(-(-n // bs) for n in lens))
    tables = [[perm.pop() for _ in range(-(-n // bs))] for n in lens]
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    pos = (sl - 1).clamp_min(0).long()
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs if n else -1 for t, n in zip(tables, lens)])
    table = rotary.rope_cos_sin(rotary.rope_inv_freq(d, 10000.0), 512)
    qn = (1 + 0.2 * torch.randn(d, generator=gen)).to(dt) if norm_on else None
    kn = (1 + 0.2 * torch.randn(d, generator=gen)).to(dt) if norm_on else None
    qkv = torch.randn(b, (hq + 2 * hk) * d, generator=gen).to(dt)
    _, kc0, ks0 = int8_cache(nb, bs, hk, d, gen)
    _, vc0, vs0 = int8_cache(nb, bs, hk, d, gen)
    buf = qkv.clone()
    q, k, v = (t.view(b, -1, d) for t in buf.split([hq * d, hk * d, hk * d], -1))
    rotary.rotary_and_store_kv_ref(q, k, v, pos, table, torch.zeros(nb, bs, hk, d, dtype=dt),
                                   torch.zeros(nb, bs, hk, d, dtype=dt), torch.zeros_like(slots), qn, kn, 1e-6)
    (wk, wks), (wv, wvs) = kv_quant.quantize_int8(k), kv_quant.quantize_int8(v)
    rq = q.clone()
    buf = qkv.clone()
    q, k, v = (t.view(b, -1, d) for t in buf.split([hq * d, hk * d, hk * d], -1))
    kc, vc, ks, vs = kc0.clone(), vc0.clone(), ks0.clone(), vs0.clone()
    o = rope_decode.rope_decode_triton(q, k, v, pos, table, kc, vc, slots, sl, bt, d ** -0.5, None, qn, kn, 1e-6,
                                       kw, ks, vs)
    ok = sl > 0
    written = slots[ok]
    rest = torch.ones(nb * bs, dtype=torch.bool)
    rest[written] = False
    same = all(torch.equal(a.reshape(nb * bs, -1)[rest], b_.reshape(nb * bs, -1)[rest])
               for a, b_ in ((kc, kc0), (vc, vc0), (ks, ks0), (vs, vs0)))
    wsteps = [row_steps(c.view(-1, hk, d)[written], s_.view(-1, hk)[written], wc[ok], ws[ok])
              for c, s_, wc, ws in ((kc, ks, wk, wks), (vc, vs, wv, wvs))]
    cu = torch.arange(int(ok.sum()) + 1, dtype=torch.int32)
    ref = attention.paged_attention_ref(rq[ok].float(), kc, vc, cu, sl[ok], bt[ok], d ** -0.5, None, ks, vs)
    if not bool((o[~ok] == 0).all()):
        return float("inf"), (float("inf"), float("inf")), float("inf")
    return (rel(o[ok], ref), (max(w[0] for w in wsteps), max(w[1] for w in wsteps)),
            0.0 if same else float("inf"))


def rope_decode_checks(out: dict, gen: torch.Generator) -> None:
    for dt in (torch.float32, torch.float16):
        name = str(dt).removeprefix("torch.")
        errs, steps, scs = [], [], []
        for lens, bs, norm_on, kw in ROPE_CASES:
            e, (st, sc), r = rope_decode_case(lens, bs, norm_on, kw, dt, gen)
            errs += [e, r]
            steps.append(st)
            scs.append(sc)
        out[f"attn_rope_decode_{name}"] = max(errs)
        out[f"rope_decode_write_{name}"] = max(steps)
        out[f"rope_decode_write_scale_{name}"] = max(scs)


def main() -> None:
    gen = torch.Generator().manual_seed(17)
    out: dict[str, float] = {}
    store_checks(out, gen)
    rotary_store_checks(out, gen)
    reader_checks(out, gen)
    rope_decode_checks(out, gen)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
