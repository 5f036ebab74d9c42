"""Run every Triton kernel of `kernels/` under TRITON_INTERPRET=1 on small CPU tensors and
print one JSON object {check name: relative error vs the torch reference}.

Run by `tests/unit/test_kernels_triton_interp.py` in a subprocess, because the interpreter
switch is read when triton is first imported. fp32 and fp16 only: the interpreter's
`tl.dot` on bf16 operands gives garbage (fp16 and fp32 are exact).
"""

from __future__ import annotations

import itertools
import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from kernels import activation, attention, device_info, gemv, linear, norm, pending_ids, rope_decode, rotary, sampling  # noqa: E402
from kernels import sampling_noise, sampling_triton  # noqa: E402
from kernels import attention_triton as at  # noqa: E402
from kernels import decode_merge as dm  # noqa: E402
from tests.launch_count import LaunchCount  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; inf on NaN."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def paged_case(seqs, h, kvh, d, bs, dtype, gen):
    """seqs: list of (cached prefix, new tokens). Returns q, caches, metadata, ref output."""
    total_blocks = sum(-(-(p + n) // bs) for p, n in seqs) + 3
    kc = torch.randn(total_blocks, bs, kvh, d, generator=gen).to(dtype)
    vc = torch.randn(total_blocks, bs, kvh, d, generator=gen).to(dtype)
    perm = torch.randperm(total_blocks, generator=gen).tolist()
    width = max(-(-(p + n) // bs) for p, n in seqs)
    tables, cu, lens = [], [0], []
    for p, n in seqs:
        nb = -(-(p + n) // bs)
        tables.append([perm.pop() for _ in range(nb)] + [-1] * (width - nb))
        cu.append(cu[-1] + n)
        lens.append(p + n)
    q = torch.randn(cu[-1], h, d, generator=gen).to(dtype)
    bt = torch.tensor(tables, dtype=torch.int32)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    ref = attention.paged_attention_ref(q.float(), kc.float(), vc.float(), cu_t, sl, bt, d ** -0.5)
    return q, kc, vc, cu_t, sl, bt, ref


def rope_decode_case(lens, bs, norm_on, kw, dt, gen, runs=1, hq=4, hk=2):
    """`rope_decode_triton` (decode_config kw) on sequences of lengths lens (0: a CUDA-graph
    padding row, slot -1), run `runs` times from the same caches and inputs, against
    `rotary_and_store_kv_ref` then `paged_attention_ref` over the rows of length > 0: the
    largest relative error of the output and the caches; inf if a padding row's output is
    not zero. hq / hk: query and KV heads."""
    b, d = len(lens), 16
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
    kc0 = torch.randn(nb, bs, hk, d, generator=gen).to(dt)
    vc0 = torch.randn(nb, bs, hk, d, generator=gen).to(dt)
    buf, kc, vc = qkv.clone(), kc0.clone(), vc0.clone()
    q, k, v = (t.view(b, -1, d) for t in buf.split([hq * d, hk * d, hk * d], -1))
    spare = perm[0]  # a block no table uses takes the padding row's write
    rotary.rotary_and_store_kv_ref(q, k, v, pos, table, kc, vc, torch.where(slots < 0, spare * bs, slots), qn, kn,
                                   1e-6)
    kc[spare], vc[spare] = kc0[spare], vc0[spare]
    ok = sl > 0
    cu = torch.arange(int(ok.sum()) + 1, dtype=torch.int32)
    want = (attention.paged_attention_ref(q[ok], kc, vc, cu, sl[ok], bt[ok], d ** -0.5), kc, vc)
    err = 0.0
    for _ in range(runs):
        buf, kc, vc = qkv.clone(), kc0.clone(), vc0.clone()
        q, k, v = (t.view(b, -1, d) for t in buf.split([hq * d, hk * d, hk * d], -1))
        o = rope_decode.rope_decode_triton(q, k, v, pos, table, kc, vc, slots, sl, bt, d ** -0.5, None, qn, kn,
                                           1e-6, kw)
        if not bool((o[~ok] == 0).all()):
            return float("inf")
        err = max([err] + [rel(a, b_) for a, b_ in zip((o[ok], kc, vc), want)])
    return err


def live_split_checks(dt, gen) -> float:
    """The in-kernel merge over live splits (`kernels.decode_merge._finish_fused`) at G = 4
    query heads a KV head, one split a merge chunk (MERGE_CHUNK_ELEMS lowered), so the merge
    loops over many chunks; contexts that leave most of 12 splits empty, one that fits one
    tile (stored directly), min_split_tiles 4 (a 40-token context in one live partition, 300
    tokens in 5), a padding row: both decode kernels, each run twice (counters back at 0).
    Returns the largest relative error (inf if a merge launch ran or a counter stayed set)."""
    errs, merges = [], LaunchCount(dm._merge_kernel)
    dm._merge_kernel, saved = merges, dm.MERGE_CHUNK_ELEMS
    dm.MERGE_CHUNK_ELEMS = 64
    try:
        for kw in ({"splits": 12, "block_n": 16}, {"splits": 12, "block_n": 16, "min_split_tiles": 4},
                   {"splits": 7, "block_n": 16, "prefetch": True}):
            kw = {**kw, "fused_merge": True}
            errs.append(rope_decode_case([300, 40, 0, 9], 16, True, kw, dt, gen, runs=2, hq=8, hk=2))
            q, kc, vc, _, sl, bt, ref = paged_case([(299, 1), (39, 1), (8, 1)], 8, 2, 16, 16, dt, gen)
            cu = torch.arange(4, dtype=torch.int32)
            for _ in range(2):
                errs.append(rel(at.paged_attention_triton(q, kc, vc, cu, sl, bt, 16 ** -0.5, 1, None, kw), ref))
        errs.append(0.0 if merges.n == 0 else float("inf"))
    finally:
        dm._merge_kernel, dm.MERGE_CHUNK_ELEMS = merges.kernel, saved
    return max(errs) if merge_counters_zero() else float("inf")


def merge_counters_zero() -> bool:
    """Whether the in-kernel merge's counter pool exists and every counter is back at 0."""
    pools = [key[1] for key in device_info.TILE_COUNTERS]
    return dm.MERGE_POOL in pools and all(bool((c == 0).all()) for c in device_info.TILE_COUNTERS.values())


def main() -> None:
    gen = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    out: dict[str, float] = {}
    for dt in (torch.float32, torch.float16):
        name = str(dt).removeprefix("torch.")
        x = torch.randn(7, 40, generator=gen).to(dt)
        r = torch.randn(7, 40, generator=gen).to(dt)
        w = (1 + 0.1 * torch.randn(40, generator=gen)).to(dt)
        out[f"rms_norm_{name}"] = rel(norm.rms_norm_triton(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6))
        a, b = norm.fused_add_rms_norm_triton(x, r, w, 1e-6)
        ra, rb = norm.fused_add_rms_norm_ref(x, r, w, 1e-6)
        out[f"fused_add_rms_norm_{name}"] = max(rel(a, ra), rel(b, rb))
        qh = torch.randn(5, 12, generator=gen).to(dt)[:, 4:].reshape(5, 2, 4)  # strided per-head view
        out[f"rms_norm_strided_{name}"] = rel(norm.rms_norm_triton(qh, w[:4], 1e-6), norm.rms_norm_ref(qh, w[:4], 1e-6))
        g = torch.randn(6, 2 * 37, generator=gen).to(dt)
        out[f"silu_and_mul_{name}"] = rel(activation.silu_and_mul_triton(g), activation.silu_and_mul_ref(g))
        # rotary fused with the cache write, q/k/v as views of one fused qkv tensor
        t, hq, hk, d, bs = 9, 4, 2, 16, 16
        for rot in (16, 8):  # full and partial rotary
            table = rotary.rope_cos_sin(rotary.rope_inv_freq(rot, 10000.0), 64)
            qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dt)
            pos = torch.randint(0, 64, (t,), generator=gen)
            slots = torch.randperm(4 * bs, generator=gen)[:t]
            slots_pad = slots.clone()
            slots_pad[-1] = -1  # a CUDA-graph padding row: nothing stored
            caches = []
            for fn, sl in ((rotary.rotary_and_store_kv_ref, slots), (rotary.rotary_and_store_kv_triton, slots_pad)):
                buf = qkv.clone()
                q, k, v = buf.split([hq * d, hk * d, hk * d], -1)
                q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
                kc = torch.zeros(4, bs, hk, d, dtype=dt)
                vc = torch.zeros_like(kc)
                fn(q, k, v, pos, table, kc, vc, sl)
                caches.append((buf, kc, vc))
            (b0, k0, v0), (b1, k1, v1) = caches
            k0.view(-1, hk, d)[slots[-1]] = 0  # the padded row's slot stays untouched
            v0.view(-1, hk, d)[slots[-1]] = 0
            out[f"rotary_store_kv_rot{rot}_{name}"] = max(rel(b1, b0), rel(k1, k0), rel(v1, v0))
        xr = torch.randn(5, 3, 16, generator=gen).to(dt)
        cs = rotary.rope_cos_sin(rotary.rope_inv_freq(16, 10000.0), 64)[torch.tensor([0, 3, 9, 63, 1])]
        out[f"apply_rotary_{name}"] = rel(rotary.apply_rotary_triton(xr, cs), rotary.apply_rotary_ref(xr, cs))
        kk = torch.randn(5, 2, 16, generator=gen).to(dt)
        vv = torch.randn(5, 2, 16, generator=gen).to(dt)
        sl = torch.tensor([3, 17, 0, 31, 8])
        c = [torch.zeros(2, 16, 2, 16, dtype=dt) for _ in range(4)]
        attention.store_kv_ref(kk, vv, c[0], c[1], sl)
        at.store_kv_triton(kk, vv, c[2], c[3], sl)
        out[f"store_kv_{name}"] = max(rel(c[2], c[0]), rel(c[3], c[1]))
        # paged attention: decode (split-K and one split), prefill on a cached prefix, mixed
        cases = {
            "decode_gqa_bs16": ([(40, 1), (0, 1), (16, 1), (130, 1)], 4, 2, 16, 16, {}),
            "decode_long_splitk": ([(300, 1)], 2, 1, 16, 32, {}),
            "decode_graph_bound": ([(20, 1), (5, 1)], 4, 4, 16, 16, {"max_seq_len": 256}),
            # the first key tile loaded before the (PDL) wait, the step's token reloaded after
            "decode_prefetch": ([(40, 1), (0, 1), (15, 1), (130, 1)], 4, 2, 16, 16,
                                {"decode_config": {"prefetch": True, "block_n": 16}}),
            "prefill_varlen_prefix": ([(0, 7), (16, 20), (33, 70)], 4, 2, 16, 16, {}),
            "mixed_prefill_decode_hd24": ([(10, 1), (0, 19), (48, 5)], 6, 3, 24, 16, {}),
            # verify steps (1 + k queries a seq): the split-K multi-query kernel, with its
            # partitions merged by the second launch, in one split, and the prefill kernel
            "multi_query_verify": ([(40, 5), (0, 3), (130, 5), (16, 1)], 4, 2, 16, 16, {}),
            "multi_query_one_split": ([(40, 5), (7, 2)], 8, 2, 16, 16, {"decode_config": {"splits": 1}}),
            "multi_query_graph_bound": ([(300, 4), (20, 4)], 4, 1, 32, 16,
                                        {"max_q_len": 4, "max_seq_len": 512, "decode_config": {"splits": 7}}),
            "multi_query_off": ([(40, 5), (130, 5)], 4, 2, 16, 16, {"decode_config": {"multi_query": False}}),
        }
        for cname, (seqs, h, kvh, d, bs, kw) in cases.items():
            q, kc, vc, cu, sl, bt, ref = paged_case(seqs, h, kvh, d, bs, dt, gen)
            got = at.paged_attention_triton(q, kc, vc, cu, sl, bt, d ** -0.5, **kw)
            out[f"attn_{cname}_{name}"] = rel(got, ref)
        # the plain decode kernel's split merge, in the kernel (fused_merge) and by a second
        # launch, with a padding row (length 0, zeros out) at index 1; each config run twice:
        # the second run passes only if the first left its counters at 0
        q, kc, vc, _, sl, bt, ref = paged_case([(40, 1), (130, 1), (15, 1)], 4, 2, 16, 16, dt, gen)
        q = torch.cat([q[:1], torch.randn(1, 4, 16, generator=gen).to(dt), q[1:]])
        sl = torch.cat([sl[:1], torch.zeros(1, dtype=torch.int32), sl[1:]])
        bt = torch.cat([bt[:1], torch.zeros_like(bt[:1]), bt[1:]])
        cu = torch.arange(5, dtype=torch.int32)
        ok = sl > 0
        errs, merges = [], LaunchCount(dm._merge_kernel)
        dm._merge_kernel = merges
        try:
            for fused in (True, False):
                for kw in ({"splits": 3, "block_n": 16}, {"splits": 5, "block_n": 16, "prefetch": True}):
                    merges.n = 0
                    for _ in range(2):
                        got = at.paged_attention_triton(q, kc, vc, cu, sl, bt, 16 ** -0.5, 1, None,
                                                        {**kw, "fused_merge": fused})
                        errs.append(rel(got[ok], ref) if bool((got[~ok] == 0).all()) else float("inf"))
                    errs.append(0.0 if merges.n == (0 if fused else 2) else float("inf"))
        finally:
            dm._merge_kernel = merges.kernel
        out[f"attn_decode_fused_merge_{name}"] = max(errs) if merge_counters_zero() else float("inf")
        # sampling: the Gumbel-max kernel against the torch reference, same hashed noise;
        # the "error" is the fraction of rows whose token differs (0 expected)
        lg = (torch.randn(7, 3001, generator=gen) * 3).to(dt)
        temp = torch.tensor([0.0, 0.6, 1.0, 1.7, 0.3, 0.0, 1.0])
        seeds = [sampling_noise.mix_seed(int(s), 5) for s in torch.randint(0, 1 << 30, (7,), generator=gen)]
        n7 = torch.zeros(7, dtype=torch.long)
        ref = sampling.sample_ref(lg, temp, n7, torch.ones(7), torch.zeros(7), seeds, False)
        got = sampling_triton.sample_triton(lg, temp, seeds)
        out[f"sample_gumbel_{name}"] = float((got != ref).double().mean())
        # small batches split each row's vocabulary into chunks (1 and 2 rows here)
        bad = 0.0
        for rows in ((0,), (1, 3)):
            ix = torch.tensor(rows)
            r1 = sampling.sample_ref(lg[ix], temp[ix], n7[ix], torch.ones(len(rows)), torch.zeros(len(rows)),
                                     [seeds[i] for i in rows], False)
            g1 = sampling_triton.sample_triton(lg[ix], temp[ix], [seeds[i] for i in rows])
            bad = max(bad, float((g1 != r1).double().mean()))
        out[f"sample_gumbel_chunked_{name}"] = bad
        # skinny linear: one tile, split-K with partial sums, bias, a row-strided x
        errs = []
        for m, n, k, kw in ((1, 37, 100, {}), (3, 70, 300, {"split_k": 3, "block_k": 64}),
                            (5, 16, 48, {"block_n": 16})):
            xs = torch.randn(m, k + 4, generator=gen).to(dt)[:, 2:k + 2]
            ws = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dt)
            bs_ = torch.randn(n, generator=gen).to(dt)
            for bias, one_tile in itertools.product((None, bs_), (False, True)):  # the K-loop and one-tile kernels
                errs.append(rel(linear.skinny_linear_triton(xs, ws, bias, one_tile=one_tile, **kw),
                                linear.linear_ref(xs.float(), ws.float(), None if bias is None else bias.float())))
        out[f"skinny_linear_{name}"] = max(errs)
        # one-row matrix-vector kernel: one tile, odd N and K, K split over programs that
        # sum through the shared counters (run twice: the counters must be left zeroed)
        errs = []
        for n, k, kw in ((37, 100, {}), (70, 300, {"split": 3, "block_n": 8}), (16, 48, {"block_n": 2}),
                         (9, 1000, {"split": 4})):
            xs = torch.randn(1, k, generator=gen).to(dt)
            ws = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dt)
            bs_ = torch.randn(n, generator=gen).to(dt)
            for bias in (None, bs_, bs_):
                ref = linear.linear_ref(xs.float(), ws.float(), None if bias is None else bias.float())
                errs.append(rel(gemv.gemv_triton(xs, ws, bias, **kw), ref))
            # the SiLU-and-mul of x = cat(gate, up) applied as x loads
            xg = torch.randn(1, 2 * k, generator=gen).to(dt)
            ref = linear.linear_ref(xg.float(), ws.float(), silu_mul=True)
            errs.append(rel(gemv.gemv_triton(xg, ws, silu_mul=True, **kw), ref))
            # the RMSNorm of x as it loads, and the residual add on y (the fused decoder layer)
            res = torch.randn(1, n, generator=gen).to(dt)
            nw = (1 + 0.3 * torch.randn(k, generator=gen)).to(dt)
            for fused in ({"norm_weight": nw, "eps": 1e-5}, {"residual": res},
                          {"norm_weight": nw, "eps": 1e-5, "residual": res}):
                f32 = {a: (b.float() if torch.is_tensor(b) else b) for a, b in fused.items()}
                ref = linear.linear_ref(xs.float(), ws.float(), bs_.float(), **f32)
                errs.append(rel(gemv.gemv_triton(xs, ws, bs_, **fused, **kw), ref))
            ref = linear.linear_ref(xg.float(), ws.float(), silu_mul=True, residual=res.float())
            errs.append(rel(gemv.gemv_triton(xg, ws, silu_mul=True, residual=res, **kw), ref))
        zeroed = all(bool((c == 0).all()) for c in device_info.TILE_COUNTERS.values())
        out[f"gemv_{name}"] = max(errs) if zeroed else float("inf")
        # the same kernel over M rows (verify steps at batch 1, gemv.ROWS): a row-strided x,
        # split and unsplit K, every fused step; each row must equal the one-row launch bit
        # for bit (the same tile, the same order of sums), and all of it the float reference
        errs, same = [], True
        for m, n, k, kw in ((2, 37, 100, {}), (5, 70, 300, {"split": 3, "block_n": 8}), (3, 9, 1000, {"split": 4}),
                            (16, 16, 48, {"block_n": 2})):
            xs = torch.randn(m, k + 6, generator=gen).to(dt)[:, 3:k + 3]
            xg = torch.randn(m, 2 * k, generator=gen).to(dt)
            ws = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dt)
            bs_ = torch.randn(n, generator=gen).to(dt)
            res = torch.randn(m, n, generator=gen).to(dt)
            nw = (1 + 0.3 * torch.randn(k, generator=gen)).to(dt)
            for xin, fused in ((xs, {}), (xs, {"bias": bs_}), (xg, {"silu_mul": True}),
                               (xg, {"silu_mul": True, "residual": res}),
                               (xs, {"bias": bs_, "norm_weight": nw, "eps": 1e-5, "residual": res})):
                f32 = {a: (b.float() if torch.is_tensor(b) else b) for a, b in fused.items()}
                ref = linear.linear_ref(xin.float(), ws.float(), **f32)
                got = gemv.gemv_triton(xin, ws, **fused, **kw)
                errs.append(rel(got, ref))
                for i in range(m):
                    one = {a: (b[i:i + 1] if a == "residual" else b) for a, b in fused.items()}
                    same = same and torch.equal(got[i:i + 1], gemv.gemv_triton(xin[i:i + 1], ws, **one, **kw))
        zeroed = all(bool((c == 0).all()) for c in device_info.TILE_COUNTERS.values())
        out[f"gemv_rows_{name}"] = max(errs) if zeroed and same else float("inf")
        # xn_out (a MoE layer's router, services.worker.layers.moe): the normalised rows the product
        # used, stored by the first row tile's programs over every K split into a NaN-poisoned
        # buffer; y unchanged by it, and the plain product of those rows equal to y
        errs, same = [], True
        for m, n, k, kw in ((1, 37, 100, {}), (2, 70, 300, {"split": 3, "block_n": 8}), (1, 9, 1000, {"split": 4})):
            xs = torch.randn(m, k, generator=gen).to(dt)
            ws = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dt)
            nw = (1 + 0.3 * torch.randn(k, generator=gen)).to(dt)
            xn = torch.full((m, k), float("nan")).to(dt)
            got = gemv.gemv_triton(xs, ws, norm_weight=nw, eps=1e-5, xn_out=xn, **kw)
            same = same and torch.equal(got, gemv.gemv_triton(xs, ws, norm_weight=nw, eps=1e-5, **kw))
            same = same and torch.equal(got, gemv.gemv_triton(xn, ws, **kw))
            errs.append(rel(xn, norm.rms_norm_ref(xs.float(), nw.float(), 1e-5)))
        out[f"gemv_xn_out_{name}"] = max(errs) if same else float("inf")
        # a CUDA graph's pending input ids: -(j + 1) = row j of the last draw (in place)
        ids = torch.tensor([5, pending_ids.encode_pending(2), 0, pending_ids.encode_pending(0), 7])
        last = torch.tensor([11, 12, 13])
        want = pending_ids.resolve_pending_ids_ref(ids.clone(), last)
        got = pending_ids.resolve_pending_ids_triton(ids, last)
        out[f"pending_ids_{name}"] = 0.0 if got is ids and torch.equal(got, want) and want[1] == 13 else float("inf")
        # rotary with Qwen3's per-head q/k RMSNorm fused in
        t, hq, hk, d = 6, 4, 2, 16
        table = rotary.rope_cos_sin(rotary.rope_inv_freq(d, 10000.0), 64)
        qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dt)
        pos = torch.randint(0, 64, (t,), generator=gen)
        slots = torch.randperm(2 * 16, generator=gen)[:t]
        qn = (1 + 0.2 * torch.randn(d, generator=gen)).to(dt)
        kn = (1 + 0.2 * torch.randn(d, generator=gen)).to(dt)
        res = []
        for fn in (rotary.rotary_and_store_kv_ref, rotary.rotary_and_store_kv_triton):
            buf = qkv.clone()
            q, k, v = buf.split([hq * d, hk * d, hk * d], -1)
            kc = torch.zeros(2, 16, hk, d, dtype=dt)
            vc = torch.zeros_like(kc)
            fn(q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d), pos, table, kc, vc, slots, qn, kn, 1e-6)
            res.append((buf, kc, vc))
        out[f"rotary_qk_norm_{name}"] = max(rel(a, b) for a, b in zip(res[1], res[0]))
        # decode attention with rotary, q/k norm and the KV write fused in, against the
        # rotary reference then the attention reference; a padding row (slot -1, length 0)
        errs = [rope_decode_case(lens, bs, norm_on, kw, dt, gen)
                for lens, bs, norm_on, kw in (([40, 16, 1, 131], 16, True, {}), ([300], 32, False, {"splits": 3}),
                                              ([17, 0], 16, True, {"block_n": 16}),
                                              ([40, 16, 1, 131, 0], 16, True, {"block_n": 16, "prefetch": True}),
                                              ([300, 33], 16, False, {"splits": 2, "prefetch": True}))]
        out[f"rope_decode_{name}"] = max(errs)
        # the split merge by the kernel's last program per (seq, kv_head) (fused_merge, no
        # merge launch) and by a second launch; several splits, empty partitions, batch 1 and
        # batch > 1 with padding rows. Each case runs twice from the same state: the second
        # run passes only if the first left its counters at 0
        errs, merges = [], LaunchCount(dm._merge_kernel)
        dm._merge_kernel = merges
        try:
            for fused in (True, False):
                for lens, bs, norm_on, kw in (([40, 0, 131, 16], 16, True, {"splits": 3, "block_n": 16}),
                                              ([300], 32, False, {"splits": 4}),
                                              ([17, 0, 1], 16, True, {"splits": 5, "block_n": 16, "prefetch": True})):
                    merges.n = 0
                    errs.append(rope_decode_case(lens, bs, norm_on, {**kw, "fused_merge": fused}, dt, gen, runs=2))
                    errs.append(0.0 if merges.n == (0 if fused else 2) else float("inf"))
        finally:
            dm._merge_kernel = merges.kernel
        out[f"rope_decode_fused_merge_{name}"] = max(errs) if merge_counters_zero() else float("inf")
        out[f"decode_live_split_merge_{name}"] = live_split_checks(dt, gen)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
