"""Run the Triton kernels that write and read an fp8_e4m3 KV cache (kernels/kv_quant_triton.py
and its users) under TRITON_INTERPRET=1 on small CPU tensors against the torch references of
kernels/kv_quant.py and kernels/attention.py, and print one JSON object {check name: error}
on a line starting "RESULT ".

Run by `tests/unit/test_kv_fp8_interp.py` in a subprocess (the interpreter switch is read
when triton is first imported). q and the model dtype are fp32 and fp16 (the interpreter's
tl.dot on bf16 gives garbage, tests/unit/moe_interp_checks.py), and bf16 for the decode
kernels' fp16 dot formats (their dots take fp16 operands whatever q's dtype).

Readers (decode split-K with its merge, one split, prefetch, a graph bound; the varlen prefill;
the multi-query verify kernel; the fused rotary decode): caches quantized by the torch
reference (`quantize_fp8`, scales != 1), the kernel against `paged_attention_ref` with the
same scales (it dequantizes to fp32): relative norm error. The decode kernels run in each dot
format of `kernels.kv_quant_triton.FP8_DOTS` ("<check>_<dtype>_<format>") and with their
fp8 defaults ("..._default": `DECODE_FP8_DEFAULTS` by the launch's class, both classes
met: the interpreter counts 4 SMs), and once with q beyond fp16's range (x 1e5, fp32 and
bf16 q; "decode_q_beyond_fp16": the fp16 formats' q scaling keeps it finite).

The dot formats' pieces: "bits_codes" (0 or inf) `e4m3_fp16_bits` on all 256 codes against
torch's float8_e4m3fn -> fp32 (times 2^8; exact for the 254 finite codes, the two NaN codes
must read +-480); "q_scale_<magnitude>" the relative error of `fp8_dot_q`'s fp16 q times its
undo factor against q (fp64), "q_scale_zero" the largest |value| it gives for q = 0.

Sweep variants ("variant_<kernel>_<name>"): every variant of benchmarks/kv_quant_attention.py
--variants on both decode kernels, bf16 q, awkward lengths.

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
from kernels.kv_quant_triton import FP8_DOTS, e4m3_fp16_bits, e4m3_words_fp16, fp8_dot_q  # noqa: E402

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


@triton.jit
def _bits_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, e4m3_fp16_bits(tl.load(x_ptr + i)))


def bits_codes() -> float:
    """0.0 when `e4m3_fp16_bits` gives value * 2^-8 of every finite e4m3 code exactly (torch's
    float8_e4m3fn -> fp32 the truth) and +-480 * 2^-8 for the NaN codes 0x7F, 0xFF; else inf."""
    codes = torch.arange(256, dtype=torch.uint8)
    got = torch.empty(256, dtype=torch.float16)
    _bits_kernel[(1,)](codes, got, BLOCK=256)
    want = codes.view(F8).float()
    fin = torch.isfinite(want)
    nan_ok = torch.equal(got.float()[~fin] * 256, torch.tensor([480.0, -480.0]))
    return 0.0 if int(fin.sum()) == 254 and torch.equal(got.float()[fin] * 256, want[fin]) and nan_ok else float("inf")


@triton.jit
def _words_kernel(x_ptr, y_ptr, R: tl.constexpr, C: tl.constexpr):
    ww = tl.arange(0, R)[:, None] * (C // 4) + tl.arange(0, C // 4)[None, :]
    y = e4m3_words_fp16(tl.load(x_ptr.to(tl.pointer_type(tl.uint32)) + ww), R, C)
    tl.store(y_ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :], y)


def words_codes() -> float:
    """0.0 when `e4m3_words_fp16` gives, for all 256 codes in every byte position of a word
    (the codes in 4 rotations, [4, 256] bytes read as [4, 64] uint32 words), the fp16 of
    `e4m3_fp16_bits` (value * 2^-8, NaN codes +-480 * 2^-8) bit for bit, in its order: position t
    holds code t with bits 0 and 1 swapped (`kernels.kv_quant_triton.word_order`); else inf."""
    codes = torch.arange(256, dtype=torch.uint8)
    rows = torch.stack([codes.roll(r) for r in range(4)])  # code c at every position mod 4
    want = torch.empty(256, dtype=torch.float16)
    _bits_kernel[(1,)](codes, want, BLOCK=256)
    got = torch.empty(4, 256, dtype=torch.float16)
    _words_kernel[(1,)](rows.contiguous(), got, R=4, C=256)
    t = torch.arange(256)
    order = (t & -4) | ((t & 1) << 1) | ((t >> 1) & 1)
    ok = torch.equal(got.view(torch.int16), want[rows.long()][:, order].view(torch.int16))
    return 0.0 if ok else float("inf")


@triton.jit
def _q_kernel(q_ptr, o_ptr, u_ptr, R: tl.constexpr, C: tl.constexpr):
    rr = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    qd, undo = fp8_dot_q(tl.load(q_ptr + rr), True, 1)
    tl.store(o_ptr + rr, qd)
    tl.store(u_ptr, undo)


def q_scale(q: torch.Tensor) -> tuple[float, float]:
    """`fp8_dot_q` on fp32 q [R, C]: (relative error of its fp16 q times the undo factor against
    q, in fp64; its largest |fp16 value|)."""
    o = torch.empty(q.shape, dtype=torch.float16)
    u = torch.empty(1)
    _q_kernel[(1,)](q.contiguous(), o, u, R=q.shape[0], C=q.shape[1])
    back = o.double() * float(u)
    err = float((back - q.double()).norm() / q.double().norm()) if bool((q != 0).any()) else float(back.abs().max())
    return err, float(o.float().abs().max())


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


DECODE_READERS = {  # (seqs, heads, kv heads, head_dim, block_size, kwargs) of the decode kernel
    "decode_gqa_splitk": ([(40, 1), (0, 1), (16, 1), (130, 1)], 4, 2, 16, 16, {}),
    "decode_one_split": ([(40, 1), (7, 1)], 4, 2, 16, 16, {"decode_config": {"splits": 1}}),
    "decode_prefetch": ([(40, 1), (0, 1), (15, 1), (130, 1)], 4, 2, 16, 16,
                        {"decode_config": {"prefetch": True, "block_n": 16}}),
    "decode_graph_bound_hd24": ([(20, 1), (5, 1)], 6, 3, 24, 16, {"max_seq_len": 256}),
    "decode_long_tiles": ([(300, 1), (129, 1)], 8, 2, 16, 16, {"decode_config": {"block_n": 128}}),
    # head_dim 18: rows of no whole words, the word formats fall back to byte loads (fp8_dot_code)
    "decode_odd_hd18": ([(40, 1), (7, 1), (130, 1)], 4, 2, 18, 16, {}),
}
ROPE_CASES = (([40, 16, 1, 131], 16, True, {}), ([300], 32, False, {"splits": 3}),
              ([17, 0], 16, True, {"block_n": 16, "splits": 1}),
              ([40, 16, 1, 131, 0], 16, True, {"block_n": 16, "prefetch": True}),
              ([300, 33], 16, False, {"splits": 2, "prefetch": True, "fused_merge": True}))


def _with_dot(kw: dict, dot: str | None, key: str = "decode_config") -> dict:
    """kw with fp8_dot set in its decode config (None: the kernel's fp8 defaults)."""
    if dot is None:
        return kw
    return {**kw, key: {**kw.get(key, {}), "fp8_dot": dot}}


def _dots(dt: torch.dtype) -> list[str | None]:
    """The dot formats checked with q in dt: all of them and the defaults, bf16 q without "q"
    (its bf16 dots are the interpreter's garbage)."""
    return [d for d in [*FP8_DOTS, None] if not (dt == torch.bfloat16 and d == "q")]


def decode_readers(out: dict, gen: torch.Generator, ks: torch.Tensor, vs: torch.Tensor) -> None:
    """The decode kernel and the fused rotary decode in every dot format, fp32 / fp16 / bf16 q."""
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        name = str(dt).removeprefix("torch.")
        for dot in _dots(dt):
            tag = dot or "default"
            for cname, (seqs, h, kvh, d, bs, kw) in DECODE_READERS.items():
                q, kc, vc, cu, sl, bt, ref = fp8_paged_case(seqs, h, kvh, d, bs, dt, gen, ks, vs)
                got = at.paged_attention_triton(q, kc, vc, cu, sl, bt, d ** -0.5, **_with_dot(kw, dot),
                                                k_scale=ks, v_scale=vs)
                out[f"attn_{cname}_{name}_{tag}"] = rel(got, ref)
            if dt != torch.float16:  # q beyond fp16's range (1e5 > 65504), the softmax scale 1e5 smaller
                q, kc, vc, cu, sl, bt, _ = fp8_paged_case([(40, 1), (130, 1)], 4, 2, 16, 16, dt, gen, ks, vs)
                q = (q.float() * 1e5).to(dt)
                sc = 16 ** -0.5 / 1e5
                ref = attention.paged_attention_ref(q.float(), kc, vc, cu, sl, bt, sc, None, ks, vs)
                got = at.paged_attention_triton(q, kc, vc, cu, sl, bt, sc, **_with_dot({}, dot), k_scale=ks, v_scale=vs)
                out[f"attn_decode_q_beyond_fp16_{name}_{tag}"] = rel(got, ref)
            errs, werrs = [], []
            for lens, bs, norm_on, kw in ROPE_CASES:
                e, we, r = rope_decode_fp8_case(lens, bs, norm_on, kw if dot is None else {**kw, "fp8_dot": dot},
                                                dt, gen, ks, vs)
                errs += [e, r]
                werrs.append(we)
            out[f"rope_decode_attn_{name}_{tag}"] = max(errs)
            if dt != torch.bfloat16:
                out[f"rope_decode_write_{name}_{tag}"] = max(werrs)


def sweep_variants(out: dict, gen: torch.Generator, ks: torch.Tensor, vs: torch.Tensor) -> None:
    """Every fp8 variant benchmarks/kv_quant_attention.py --variants times, both decode kernels,
    bf16 q, awkward lengths (a partition boundary inside a block, a 1-token context, a partial
    last tile): "variant_<kernel>_<name>" (the interpreter ignores warps, stages and register
    caps; block_n, the format and the split count are what it checks)."""
    from benchmarks.kv_quant_attention import fp8_variants

    for name, cfg in fp8_variants("decode_kernel").items():
        q, kc, vc, cu, sl, bt, ref = fp8_paged_case([(300, 1), (0, 1), (77, 1), (129, 1)], 8, 2, 16, 16,
                                                    torch.bfloat16, gen, ks, vs)
        got = at.paged_attention_triton(q, kc, vc, cu, sl, bt, 16 ** -0.5, 1, 301, cfg, k_scale=ks, v_scale=vs)
        out[f"variant_decode_kernel_{name}"] = rel(got, ref)
    for name, cfg in fp8_variants("rope_decode_kernel").items():
        e, we, r = rope_decode_fp8_case([300, 1, 77, 129], 16, False, cfg, torch.bfloat16, gen, ks, vs)
        out[f"variant_rope_decode_kernel_{name}"] = max(e, r)


def main() -> None:
    gen = torch.Generator().manual_seed(7)
    out: dict[str, float] = {"cast_ok": float(cast_ok()), "bits_codes": bits_codes(), "words_codes": words_codes()}
    for mag in (1e-30, 1e-3, 1.0, 3e4, 1e30):
        out[f"q_scale_{mag:g}"], out[f"q_scale_{mag:g}_max"] = q_scale(torch.randn(16, 32, generator=gen) * mag)
    out["q_scale_zero"] = q_scale(torch.zeros(16, 32))[1]
    ks, vs = torch.tensor(0.0625), torch.tensor(0.03)  # real = stored * scale; stored up to ~100
    decode_readers(out, gen, ks, vs)
    sweep_variants(out, gen, ks, vs)
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
        # the other readers (they widen to q's dtype)
        cases = {
            "prefill_varlen_prefix": ([(0, 7), (16, 20), (33, 70)], 4, 2, 16, 16, {}),
            "mixed_prefill_decode": ([(10, 1), (0, 19), (48, 5)], 6, 3, 24, 16, {}),
            "multi_query_verify": ([(40, 5), (0, 3), (130, 5), (16, 1)], 4, 2, 16, 16, {}),
            "multi_query_one_split": ([(40, 5), (7, 2)], 8, 2, 16, 16, {"decode_config": {"splits": 1}}),
        }
        for cname, (seqs, h, kvh, d, bs, kw) in cases.items():
            q, kc, vc, cu, sl, bt, ref = fp8_paged_case(seqs, h, kvh, d, bs, dt, gen, ks, vs)
            got = at.paged_attention_triton(q, kc, vc, cu, sl, bt, d ** -0.5, **kw, k_scale=ks, v_scale=vs)
            out[f"attn_{cname}_{name}"] = rel(got, ref)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
