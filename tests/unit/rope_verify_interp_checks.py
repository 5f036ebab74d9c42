"""The fused rotary + KV write + multi-query attention of verify steps (`kernels.rope_verify`)
under TRITON_INTERPRET=1 on small CPU tensors; prints one line `RESULT <json>`.

Run by tests/unit/test_rope_verify_interp.py in a subprocess (the interpreter switch is read
when triton is first imported). Each kernel case builds one step (q_len 1 .. 5 mixed across
seqs, a CUDA-graph padding seq: seq_len 0, 5 queries, slots -1, whose rows must come out 0;
contexts off the 16-key tile over several 8-key blocks and splits; seqs whose new tokens
straddle a partition boundary) from one qkv buffer and runs
- the kernel (`rope_verify_triton`) on copies of random caches, and
- the two-launch references: `rotary_and_store_kv_ref` on other copies, then
  `paged_attention_ref` over the cache it left (fp32 math),
and records, per case name `<case>_<kv>_<dtype>` (kv: "none" a cache in q's dtype, "fp8"
fp8_e4m3 with layer scales != 1, "int8" per-token scales):
- "attn": relative norm error of the real rows against the reference (inf if a padding row
  is not 0 or an output is not finite);
- "write": the written slots against the reference writer's: the largest difference in units
  of the element's rounding (fp32 / fp16: ulps of the reference value; fp8: e4m3 steps, the
  byte codes' distance; int8: dequantized difference over the reference scale, plus "scale",
  the largest relative difference of the scales);
- "untouched": 0 if every other slot (and scale) is bit for bit as before, else inf;
- "merge_launches": `_merge_kernel` launches of the call (one with more than one split, none
  with one split or the fused merge), "counters_zero": the merge pool back at 0 (fused).
fp32 and fp16 only: the interpreter's tl.dot on bf16 operands gives garbage.
Model case "model_qwen3": a tiny Qwen3 (tests/unit/test_fused_linear.tiny_runner, fp32) runs a
prefill, then the same verify step (two seqs, k = 3 and 1) through the reference backend and
through `VerifyAttention` with ROPE_VERIFY on (the kernel forced on CPU tensors,
`fused_verify_applies` patched): the logits' relative error, and the KV caches' after each.
"warmup": `kernels.attention_warmup.warm_up_rope_verify` on an int8 cache, switch off and on: its
launch counts against the multi-query variants, and the cache and scales untouched.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from kernels import attention, device_info, kv_quant, rotary  # noqa: E402
from kernels import decode_merge as dm  # noqa: E402
from kernels import rope_verify as rv  # noqa: E402
from tests.launch_count import LaunchCount  # noqa: E402
from tests.unit.kv_fp8_interp_checks import interp_quantize  # noqa: E402

BS, EPS = 8, 1e-6
# (cached prefix, queries): 9 + 3 keys in one tile; 14 + 4 straddles 16-key partitions (one tile
# each at 7 splits); 45 + 5 straddles them too (positions 45..47 | 48, 49)
SEQS = [(40, 5), (130, 1), (9, 3), (14, 4), (301, 2), (45, 5)]
PAD = 2  # where the padding seq goes
# name: (heads, kv heads, head dim, q/k norm, config)
CASES = {
    "splits7": (4, 2, 16, True, {"block_n": 16, "splits": 7}),
    "splits7_nonorm_prefetch": (4, 2, 16, False, {"block_n": 16, "splits": 7, "prefetch": True}),
    "gqa4_fused": (8, 2, 16, True, {"block_n": 16, "splits": 5, "fused_merge": True, "early_angles": True}),
    "one_split_hd24": (4, 1, 24, True, {"block_n": 16, "splits": 1, "prefetch": True}),
    "auto": (4, 2, 16, True, {}),
}
KVS = ("none", "fp8", "int8")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; inf on NaN or a shape mismatch."""
    if a.shape != b.shape or not torch.isfinite(a.double()).all():
        return float("inf")
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def step(h, kvh, d, norm, dt, kv, gen):
    """One verify step's inputs: a dict of the qkv buffer, metadata, caches and scales."""
    q_lens = [n for _, n in SEQS]
    lens = [p + n for p, n in SEQS]
    q_lens.insert(PAD, 5)
    lens.insert(PAD, 0)
    nb = sum(-(-n // BS) for n in lens) + 3
    perm = torch.randperm(nb, generator=gen).tolist()
    width = max(-(-n // BS) for n in lens) + 1
    tables = [[perm.pop() for _ in range(-(-n // BS))] for n in lens]
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)  # valid ids past the end
    cu = [0]
    pos, slots = [], []
    for t, n, ql in zip(tables, lens, q_lens):
        cu.append(cu[-1] + ql)
        for p in range(n - ql, n):
            pos.append(max(p, 0))
            slots.append(t[p // BS] * BS + p % BS if n else -1)
    total = cu[-1]
    raw_k = torch.randn(nb, BS, kvh, d, generator=gen)
    raw_v = torch.randn(nb, BS, kvh, d, generator=gen)
    if kv == "fp8":
        ks, vs = torch.tensor(0.0625), torch.tensor(0.03)
        kc, vc = kv_quant.quantize_fp8(raw_k, ks), kv_quant.quantize_fp8(raw_v, vs)
    elif kv == "int8":
        (kc, ks), (vc, vs) = kv_quant.quantize_int8(raw_k), kv_quant.quantize_int8(raw_v)
        ks, vs = ks.contiguous(), vs.contiguous()
    else:
        ks = vs = None
        kc, vc = raw_k.to(dt), raw_v.to(dt)
    return {"qkv": torch.randn(total, (h + 2 * kvh) * d, generator=gen).to(dt),
            "qn": (1 + 0.2 * torch.randn(d, generator=gen)).to(dt) if norm else None,
            "kn": (1 + 0.2 * torch.randn(d, generator=gen)).to(dt) if norm else None,
            "table": rotary.rope_cos_sin(rotary.rope_inv_freq(d, 10000.0), 512),
            "cu": torch.tensor(cu, dtype=torch.int32), "sl": torch.tensor(lens, dtype=torch.int32), "bt": bt,
            "pos": torch.tensor(pos, dtype=torch.long), "slots": torch.tensor(slots, dtype=torch.long),
            "kc": kc, "vc": vc, "ks": ks, "vs": vs, "h": h, "kvh": kvh, "d": d, "max_q": max(q_lens)}


def views(s):
    """q, k, v views of a fresh copy of the step's qkv buffer."""
    h, kvh, d = s["h"], s["kvh"], s["d"]
    buf = s["qkv"].clone()
    return [t.view(buf.shape[0], -1, d) for t in buf.split([h * d, kvh * d, kvh * d], -1)]


def copies(s):
    return [None if t is None else t.clone() for t in (s["kc"], s["vc"], s["ks"], s["vs"])]


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| of rows [..., D] in units of the rounding (eps) of each row's largest
    |want| (fp32 / fp16): a rotated value near 0 is a difference of two products, so a one-ulp
    difference of the normalised inputs shows there at the inputs' scale, not its own."""
    if got.numel() == 0:
        return 0.0
    w = want.double()
    sp = torch.finfo(want.dtype).eps * w.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(want.dtype).tiny)
    return float(((got.double() - w).abs() / sp).max())


def e4m3_steps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest distance between e4m3 values in codes (magnitude bytes are monotone)."""
    if got.numel() == 0:
        return 0.0
    g, w = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    gm, wm, same = g & 0x7F, w & 0x7F, (g & 0x80) == (w & 0x80)
    return float(torch.where(same, (gm - wm).abs(), gm + wm).max())


def write_errors(kv, s, got, want, new_rows):
    """(write error, scale error, untouched 0/inf): see the module doc."""
    kc0, vc0, ks0, vs0 = s["kc"], s["vc"], s["ks"], s["vs"]
    gk, gv, gks, gvs = got
    wk, wv, wks, wvs = want
    if kv == "fp8":
        wk, wv = new_rows
    nb = kc0.shape[0]
    written = s["slots"][s["slots"] >= 0]
    rest = torch.ones(nb * BS, dtype=torch.bool)
    rest[written] = False
    pairs = [(gk, kc0), (gv, vc0)] + ([(gks, ks0), (gvs, vs0)] if kv == "int8" else [])
    same = all(torch.equal(a.reshape(nb * BS, -1)[rest], b.reshape(nb * BS, -1)[rest]) for a, b in pairs)
    untouched = 0.0 if same else float("inf")
    kvh, d = kc0.shape[2], kc0.shape[3]

    def rows(c):
        return c.reshape(nb * BS, kvh, d)[written]

    def srows(c):
        return c.reshape(nb * BS, kvh)[written]

    if kv == "fp8":  # want: the rotated rows, quantized here by the interpreter's cast (module doc)
        wk8, wv8 = interp_quantize(wk, s["ks"]), interp_quantize(wv, s["vs"])
        return max(e4m3_steps(rows(gk), wk8), e4m3_steps(rows(gv), wv8)), 0.0, untouched
    if kv == "int8":
        errs = []
        for gc, gs, wc, ws in ((gk, gks, wk, wks), (gv, gvs, wv, wvs)):
            gd = kv_quant.dequantize_int8(rows(gc), srows(gs))
            wd = kv_quant.dequantize_int8(rows(wc), srows(ws))
            st = float(((gd - wd).abs() / srows(ws).clamp_min(1e-30)[..., None]).max())
            sc = float(((srows(gs) - srows(ws)).abs() / srows(ws).clamp_min(1e-30)).max())
            errs.append((st, sc))
        return max(e[0] for e in errs), max(e[1] for e in errs), untouched
    return max(ulps(rows(gk), rows(wk)), ulps(rows(gv), rows(wv))), 0.0, untouched


def counters_zero() -> bool:
    buf = device_info.TILE_COUNTERS.get((torch.device("cpu"), dm.MERGE_POOL))
    return buf is None or bool((buf == 0).all())


def kernel_case(name, kv, dt, gen) -> dict:
    h, kvh, d, norm, cfg = CASES[name]
    s = step(h, kvh, d, norm, dt, kv, gen)
    # the two-launch reference
    q, k, v = views(s)
    want = copies(s)
    real = torch.ones(q.shape[0], dtype=torch.bool)  # the padding seq's rows (slots -1) left out
    real[int(s["cu"][PAD]):int(s["cu"][PAD + 1])] = False
    q, k, v = q[real], k[real], v[real]
    rotary.rotary_and_store_kv_ref(q, k, v, s["pos"][real], s["table"], want[0], want[1], s["slots"][real], s["qn"],
                                   s["kn"], EPS, want[2], want[3])
    rows, q_ref = (k, v), q  # the rotated rows (fp8: K and V quantized below with the interpreter's cast)
    keep = s["sl"] > 0
    ql = (s["cu"][1:] - s["cu"][:-1])[keep]
    cu_r = torch.cat([torch.zeros(1, dtype=torch.int32), ql.cumsum(0).to(torch.int32)])
    quant = kv != "none"
    ref = attention.paged_attention_ref(q.float(), want[0] if quant else want[0].float(),
                                        want[1] if quant else want[1].float(), cu_r, s["sl"][keep], s["bt"][keep],
                                        d ** -0.5, None, want[2], want[3])
    # the fused kernel
    q, k, v = views(s)
    got = copies(s)
    merges = LaunchCount(dm._merge_kernel)
    dm._merge_kernel = merges
    try:
        o = rv.rope_verify_triton(q, k, v, s["pos"], s["table"], got[0], got[1], s["slots"], s["cu"], s["sl"],
                                  s["bt"], d ** -0.5, s["max_q"], 512, s["qn"], s["kn"], EPS, cfg, got[2], got[3])
    finally:
        dm._merge_kernel = merges.kernel
    attn = rel(o[real], ref)
    if not bool((o[~real] == 0).all()):
        attn = float("inf")
    if kv == "fp8":  # the interpreter's e4m3 cast differs from torch's: attend over the kernel's own writes
        ref = attention.paged_attention_ref(q_ref.float(), got[0], got[1], cu_r, s["sl"][keep], s["bt"][keep],
                                            d ** -0.5, None, got[2], got[3])
        attn = rel(o[real], ref) if bool((o[~real] == 0).all()) else float("inf")
    w, sc, untouched = write_errors(kv, s, got, want, rows)
    return {"attn": attn, "write": w, "scale": sc, "untouched": untouched, "merge_launches": merges.n,
            "counters_zero": counters_zero()}


def model_case(tmp: pathlib.Path) -> dict:
    """The tiny Qwen3's verify-step logits through `VerifyAttention` (the kernel under the
    interpreter) against the reference backend's, from the same prefilled cache."""
    from shared.protocol import SamplingParams, ScheduledSeq, StepPlan
    from tests.runner_driver import step_logits
    from tests.unit.test_fused_linear import tiny_runner

    runner = tiny_runner(tmp / "qwen3", "qwen3", "float32")
    greedy = SamplingParams(temperature=0.0)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (13, 6)]
    tables = [list(range(0, 6)), list(range(6, 12))]
    step_logits(runner, StepPlan(0, [ScheduledSeq(f"r{i}", p, 0, t, True, greedy)
                                     for i, (p, t) in enumerate(zip(prompts, tables))]))
    k_before = [t.clone() for t in runner.kv.k]
    v_before = [t.clone() for t in runner.kv.v]
    drafts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 1)]
    plan = StepPlan(1, [ScheduledSeq(f"r{i}", [p[-1], *d], len(p), t, True, greedy, 1, num_draft=len(d))
                        for i, (p, d, t) in enumerate(zip(prompts, drafts, tables))])
    want = step_logits(runner, plan)
    k_want = [t.clone() for t in runner.kv.k]
    v_want = [t.clone() for t in runner.kv.v]
    for t, b in zip(runner.kv.k + runner.kv.v, k_before + v_before):
        t.copy_(b)
    calls = {"n": 0}
    real_applies = rv.fused_verify_applies

    def applies(q, cos_sin, max_q_len, num_kv_heads):  # the CUDA check, on CPU tensors
        calls["n"] += 1
        return rv.ROPE_VERIFY and max_q_len is not None and 1 < max_q_len
    saved = (rv.ROPE_VERIFY, runner.use_ref_attention)
    rv.fused_verify_applies, rv.ROPE_VERIFY, runner.use_ref_attention = applies, True, False
    try:
        got = step_logits(runner, plan)
    finally:
        rv.fused_verify_applies = real_applies
        rv.ROPE_VERIFY, runner.use_ref_attention = saved
    kv_err = max(rel(a, b) for a, b in zip(runner.kv.k + runner.kv.v, k_want + v_want))
    return {"logits": rel(got, want), "kv": kv_err, "fused_calls": calls["n"], "layers": len(runner.attn_layers)}


def warmup_case(gen) -> dict:
    """`kernels.attention_warmup.warm_up_rope_verify` with the switch on (its launches over a cache
    of 64-token contexts, q/k norm on) and off: launch counts, and whether the cache and the int8
    scales are left bit for bit as they were (its slots are -1)."""
    from kernels import attention_warmup

    h, kvh, d = 4, 2, 16
    (kc, ks), (vc, vs) = (kv_quant.quantize_int8(torch.randn(6, BS, kvh, d, generator=gen)) for _ in range(2))
    ks, vs = ks.contiguous(), vs.contiguous()
    before = [x.clone() for x in (kc, vc, ks, vs)]
    table = rotary.rope_cos_sin(rotary.rope_inv_freq(d, 10000.0), 64)
    w = torch.ones(d)
    n_off = attention_warmup.warm_up_rope_verify(kc, vc, h, torch.float32, 64, 64, table, w, w, ks, vs)
    saved = rv.ROPE_VERIFY
    rv.ROPE_VERIFY = True
    try:
        n_on = attention_warmup.warm_up_rope_verify(kc, vc, h, torch.float32, 64, 64, table, w, w, ks, vs)
    finally:
        rv.ROPE_VERIFY = saved
    want = [(q, sp) for q, sp in attention_warmup.variants(h, kvh, d, 64, 64, device_info.num_sms(kc.device))
            if 1 < q <= 32]
    same = all(torch.equal(a, b) for a, b in zip((kc, vc, ks, vs), before))
    return {"launches_off": n_off, "launches_on": n_on, "variants": len(want), "untouched": same}


def main() -> None:
    import tempfile

    gen = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    out: dict = {}
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    saved = dm.MERGE_CHUNK_ELEMS
    dm.MERGE_CHUNK_ELEMS = 2 * 16 * 16  # the fused merge loops over several chunks of splits
    try:
        for name in CASES:
            if only and name not in only:
                continue
            for kv in KVS:
                for dt in (torch.float32, torch.float16):
                    out[f"{name}_{kv}_{str(dt).removeprefix('torch.')}"] = kernel_case(name, kv, dt, gen)
    finally:
        dm.MERGE_CHUNK_ELEMS = saved
    if only is None or "warmup" in only:
        out["warmup"] = warmup_case(gen)
    if only is None or "model" in only:
        with tempfile.TemporaryDirectory() as tmp:
            out["model_qwen3"] = model_case(pathlib.Path(tmp))
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
