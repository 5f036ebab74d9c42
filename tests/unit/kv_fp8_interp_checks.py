"""Run the Triton kernels that write and read an fp8_e4m3 KV cache (kernels/kv_quant_triton.py
and its users) under TRITON_INTERPRET=1 on small CPU tensors against the torch references of
kernels/kv_quant.py and kernels/attention.py, and print one JSON object {check name: error}
on a line starting "RESULT ".

Run by `tests/unit/test_kv_fp8_interp.py` in a subprocess (the interpreter switch is read
when triton is first imported). q and the model dtype are fp32 and fp16 only (the
interpreter's tl.dot on bf16 gives garbage, tests/unit/moe_interp_checks.py).

Readers (decode split-K with its merge, one split, prefetch, a graph bound; the varlen prefill;
the multi-query verify kernel; the fused rotary decode): caches quantized by the torch
reference (`quantize_fp8`, scales != 1), the kernel against `paged_attention_ref` with the
same scales (it dequantizes to fp32): relative norm error.

Writers (the store kernel, the rotary + store kernel, the fused rotary decode's token write):
triton 3.9's interpreter casts fp32 to e4m3 wrongly at binade edges (31.7 -> 16.0; the GPU
rounds to nearest even), so the reference here is the torch reference's pre-cast value
(clamp(x / scale, +-448) in fp32) put through the interpreter's own fp32 -> e4m3 cast
(`interp_cast`): that checks the kernels' scaling, saturation, addressing and masking; the
rounding itself is checked on the GPU (tests/gpu/test_fp8_kv_gpu.py against `quantize_fp8`).
"store_kv_*" must match byte for byte (same inputs, same fp32 math); the rotary writers
compare dequantized values (relative norm error: the rotation's fp32 rounding can move a
value across an e4m3 rounding edge). "cast_ok" says whether this interpreter casts as torch
does (then the writers are also compared with `quantize_fp8` itself, "*_torch").
"""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels import attention, kv_quant, rope_decode, rotary  # noqa: E402
from kernels import attention_triton as at  # noqa: E402

F8 = torch.float8_e4m3fn


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; inf on NaN or a shape mismatch."""
    if a.shape != b.shape or not torch.isfinite(a.double()).all():
        return float("inf")
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(y_ptr + i, x.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=i < n)


def interp_cast(x: torch.Tensor) -> torch.Tensor:
    """fp32 x (already scaled and clamped) cast to e4m3 by this Triton's cast: float8_e4m3fn."""
    flat = x.float().contiguous().reshape(-1)
    out = torch.empty(flat.numel(), dtype=torch.uint8)
    if flat.numel():
        block = min(1 << 16, triton.next_power_of_2(flat.numel()))
        _cast_kernel[(triton.cdiv(flat.numel(), block),)](flat, out, flat.numel(), BLOCK=block)
    return out.view(F8).view(x.shape)


def interp_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`kv_quant.quantize_fp8` with the interpreter's cast in place of torch's."""
    return interp_cast((x.float() / scale).clamp(-kv_quant.FP8_E4M3_MAX, kv_quant.FP8_E4M3_MAX))


def cast_ok() -> bool:
    """Whether the interpreter casts fp32 to e4m3 as torch does (round to nearest even)."""
    x = torch.tensor([31.7, 116.0, 7.97, 0.3, -21.0, 1e-3, 440.0, -0.0137])
    return bool(torch.equal(interp_cast(x).view(torch.uint8), x.to(F8).view(torch.uint8)))


def fp8_paged_case(seqs, h, kvh, d, bs, dt, gen, ks, vs):
    """seqs: (cached prefix, new tokens) each. An fp8 cache of reference-quantized random K/V
    (real values ~ N(0, 1), scales ks, vs), q in dt, and the reference attention over it."""
    total = sum(-(-(p + n) // bs) for p, n in seqs) + 3
    kc = kv_quant.quantize_fp8(torch.randn(total, bs, kvh, d, generator=gen), ks)
    vc = kv_quant.quantize_fp8(torch.randn(total, bs, kvh, d, generator=gen), vs)
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
    return q, kc, vc, cu_t, sl, bt, ref


def rope_decode_fp8_case(lens, bs, norm_on, kw, dt, gen, ks, vs):
    """`rope_decode_triton` on an fp8 cache: (attention error against `paged_attention_ref`
    over the cache the kernel left, error of the token rows it wrote against the rotary
    reference quantized with the interpreter's cast, 0/inf: every other slot unchanged)."""
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
    kc0 = kv_quant.quantize_fp8(torch.randn(nb, bs, hk, d, generator=gen), ks)
    vc0 = kv_quant.quantize_fp8(torch.randn(nb, bs, hk, d, generator=gen), vs)
    # the reference token rows: rotated (and normalised) by the rotary reference
    buf = qkv.clone()
    q, k, v = (t.view(b, -1, d) for t in buf.split([hq * d, hk * d, hk * d], -1))
    rotary.rotary_and_store_kv_ref(q, k, v, pos, table, torch.zeros(nb, bs, hk, d, dtype=dt),
                                   torch.zeros(nb, bs, hk, d, dtype=dt), torch.zeros_like(slots), qn, kn, 1e-6)
    want_k, want_v = interp_quantize(k, ks).float() * ks, interp_quantize(v, vs).float() * vs
    rq = q.clone()  # rotated by the reference
    buf = qkv.clone()
    q, k, v = (t.view(b, -1, d) for t in buf.split([hq * d, hk * d, hk * d], -1))
    kc, vc = kc0.clone(), vc0.clone()
    o = rope_decode.rope_decode_triton(q, k, v, pos, table, kc, vc, slots, sl, bt, d ** -0.5, None, qn, kn, 1e-6,
                                       kw, ks, vs)
    ok = sl > 0
    written = slots[ok]
    rest = torch.ones(nb * bs, dtype=torch.bool)
    rest[written] = False
    same = all(torch.equal(a.view(torch.uint8).view(nb * bs, -1)[rest], b_.view(torch.uint8).view(nb * bs, -1)[rest])
               for a, b_ in ((kc, kc0), (vc, vc0)))
    got_k = kv_quant.dequantize_fp8(kc.view(-1, hk, d)[written], ks)
    got_v = kv_quant.dequantize_fp8(vc.view(-1, hk, d)[written], vs)
    # the reference attention over the cache as the kernel left it (its own token rows)
    cu = torch.arange(int(ok.sum()) + 1, dtype=torch.int32)
    ref = attention.paged_attention_ref(rq[ok].float(), kc, vc, cu, sl[ok], bt[ok], d ** -0.5, None, ks, vs)
    if not bool((o[~ok] == 0).all()):
        return float("inf"), float("inf"), float("inf")
    write_err = max(rel(got_k, want_k[ok]), rel(got_v, want_v[ok]))
    return rel(o[ok], ref), write_err, 0.0 if same else float("inf")


def main() -> None:
    gen = torch.Generator().manual_seed(7)
    out: dict[str, float] = {"cast_ok": float(cast_ok())}
    ks, vs = torch.tensor(0.0625), torch.tensor(0.03)  # real = stored * scale; stored up to ~100
    for dt in (torch.float32, torch.float16):
        name = str(dt).removeprefix("torch.")
        # the store kernel: awkward token count, a padding row (slot -1), saturation (x / scale > 448)
        kk = (torch.randn(7, 3, 24, generator=gen) * 3).to(dt)
        vv = (torch.randn(7, 3, 24, generator=gen) * 3).to(dt)
        kk[2, 1, :4] = torch.tensor([40.0, -40.0, 28.0, 1e-4]).to(dt)  # 640, -640: saturate; 448; subnormal
        sl = torch.tensor([3, 17, 0, 31, 8, -1, 20])
        kc = torch.zeros(3, 16, 3, 24, dtype=F8)
        vc = torch.zeros_like(kc)
        at.store_kv_triton(kk, vv, kc, vc, sl, ks, vs)
        w = sl >= 0
        want_k = torch.zeros(48, 3, 24, dtype=torch.uint8)
        want_v = torch.zeros_like(want_k)
        want_k[sl[w]] = interp_quantize(kk[w], ks).view(torch.uint8)
        want_v[sl[w]] = interp_quantize(vv[w], vs).view(torch.uint8)
        same = torch.equal(kc.view(torch.uint8).view(48, 3, 24), want_k) and \
            torch.equal(vc.view(torch.uint8).view(48, 3, 24), want_v)
        out[f"store_kv_{name}"] = 0.0 if same else float("inf")
        if out["cast_ok"]:
            rk = torch.zeros(3, 16, 3, 24, dtype=F8)
            rv = torch.zeros_like(rk)
            kv_quant.store_quantized(kk[w], vv[w], rk, rv, sl[w], ks, vs)
            out[f"store_kv_torch_{name}"] = 0.0 if torch.equal(rk.view(torch.uint8), kc.view(torch.uint8)) \
                else float("inf")
        # rotary + store: full and partial rotary, the padding row's slot untouched
        t, hq, hk, d, bs = 9, 4, 2, 16, 16
        errs = []
        for rot in (16, 8):
            table = rotary.rope_cos_sin(rotary.rope_inv_freq(rot, 10000.0), 64)
            qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dt)
            pos = torch.randint(0, 64, (t,), generator=gen)
            slots = torch.randperm(4 * bs, generator=gen)[:t]
            slots[-1] = -1
            rb = qkv.clone()
            q, k, v = (x.view(t, -1, d) for x in rb.split([hq * d, hk * d, hk * d], -1))
            rotary.rotary_and_store_kv_ref(q, k, v, pos, table, torch.zeros(4, bs, hk, d, dtype=dt),
                                           torch.zeros(4, bs, hk, d, dtype=dt), slots.clamp_min(0))
            tb = qkv.clone()
            q2, k2, v2 = (x.view(t, -1, d) for x in tb.split([hq * d, hk * d, hk * d], -1))
            kc = torch.zeros(4, bs, hk, d, dtype=F8)
            vc = torch.zeros_like(kc)
            rotary.rotary_and_store_kv_triton(q2, k2, v2, pos, table, kc, vc, slots, None, None, 1e-6, ks, vs)
            live = slots >= 0
            got_k = kc.view(-1, hk, d)[slots[live]].float() * ks
            got_v = vc.view(-1, hk, d)[slots[live]].float() * vs
            untouched = torch.ones(4 * bs, dtype=torch.bool)
            untouched[slots[live]] = False
            if bool((kc.view(-1, hk, d)[untouched].float() != 0).any()):
                errs.append(float("inf"))
            errs += [rel(q2, q), rel(got_k, interp_quantize(k[live], ks).float() * ks),
                     rel(got_v, interp_quantize(v[live], vs).float() * vs)]
        out[f"rotary_store_{name}"] = max(errs)
        # readers
        cases = {
            "decode_gqa_splitk": ([(40, 1), (0, 1), (16, 1), (130, 1)], 4, 2, 16, 16, {}),
            "decode_one_split": ([(40, 1), (7, 1)], 4, 2, 16, 16, {"decode_config": {"splits": 1}}),
            "decode_prefetch": ([(40, 1), (0, 1), (15, 1), (130, 1)], 4, 2, 16, 16,
                                {"decode_config": {"prefetch": True, "block_n": 16}}),
            "decode_graph_bound_hd24": ([(20, 1), (5, 1)], 6, 3, 24, 16, {"max_seq_len": 256}),
            "prefill_varlen_prefix": ([(0, 7), (16, 20), (33, 70)], 4, 2, 16, 16, {}),
            "mixed_prefill_decode": ([(10, 1), (0, 19), (48, 5)], 6, 3, 24, 16, {}),
            "multi_query_verify": ([(40, 5), (0, 3), (130, 5), (16, 1)], 4, 2, 16, 16, {}),
            "multi_query_one_split": ([(40, 5), (7, 2)], 8, 2, 16, 16, {"decode_config": {"splits": 1}}),
        }
        for cname, (seqs, h, kvh, d, bs, kw) in cases.items():
            q, kc, vc, cu, sl, bt, ref = fp8_paged_case(seqs, h, kvh, d, bs, dt, gen, ks, vs)
            got = at.paged_attention_triton(q, kc, vc, cu, sl, bt, d ** -0.5, **kw, k_scale=ks, v_scale=vs)
            out[f"attn_{cname}_{name}"] = rel(got, ref)
        # the fused rotary decode: the token's write and the attention over the cache it left
        errs, werrs, rests = [], [], []
        for lens, bs, norm_on, kw in (([40, 16, 1, 131], 16, True, {}), ([300], 32, False, {"splits": 3}),
                                      ([17, 0], 16, True, {"block_n": 16, "splits": 1}),
                                      ([40, 16, 1, 131, 0], 16, True, {"block_n": 16, "prefetch": True}),
                                      ([300, 33], 16, False, {"splits": 2, "prefetch": True, "fused_merge": True})):
            e, we, r = rope_decode_fp8_case(lens, bs, norm_on, kw, dt, gen, ks, vs)
            errs.append(e)
            werrs.append(we)
            rests.append(r)
        out[f"rope_decode_attn_{name}"] = max(errs + rests)
        out[f"rope_decode_write_{name}"] = max(werrs)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
