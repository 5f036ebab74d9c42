"""Batch-1 decode kernels on one GPU: the one-row matrix-vector kernel (`kernels.gemv`)
against the skinny kernel, and programmatic dependent launch (`kernels.pdl`) on and off.

1. check: y = gemv(rms_norm(h)) captured in a CUDA graph with PDL, replayed on new h,
   against `linear_ref` of the same rms_norm (relative error; PDL ordering bugs show here).
2. shapes: for each projection shape of Qwen3-0.6B (or --config's, kernel_sweep.SHAPES), 28 distinct weights (as the 28 layers:
   they stream from HBM, not L2) launched back to back in one CUDA graph; time per launch
   for the skinny kernel (the baseline of the same run) and every gemv plan (BLOCK_N,
   SPLIT, num_warps) without PDL, then the best plans with PDL. Bytes / time in TB/s.
3. stack: the 28-layer unfused decode sequence without attention (rms_norm, qkv, o_proj of
   a fixed attention output, fused_add_rms_norm, gate_up, silu_and_mul, down) in one graph:
   skinny, gemv (best plans), gemv + PDL.
4. attention: decode attention at b=1, 1K context, 28 layers' distinct caches in one graph,
   by split count, with and without PDL.
5. rope_attention: the decode attention with the rotary fused in (`kernels.rope_decode`)
   against the rotary kernel + attention, at b=1 (by tile, split, warps, programs per SM,
   in-kernel merge), 64 and 256, with --config's heads (`ROPE_HEADS`).
Writes JSON (with "plans": the best (block_n, split, num_warps) per shape, with and without
PDL, for decode_latency.py --gemv-plans) to --out.

Usage: python benchmarks/gemv_sweep.py [--out FILE] [--plans-out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.common import device_name, emit_json  # noqa: E402
from benchmarks.decode_latency import copy_bandwidth  # noqa: E402
from benchmarks.kernel_sweep import SHAPES, attention_case, graph_time  # noqa: E402
from kernels import activation, gemv, linear, norm, pdl, rope_decode, rotary  # noqa: E402
from kernels import attention_triton as at  # noqa: E402

DT = torch.bfloat16


def check_pdl_in_graph() -> dict:
    """gemv(rms_norm(h)) in a graph with PDL on, replayed on fresh h: relative error."""
    h = torch.randn(1, 1024, device="cuda", dtype=DT)
    nw = (1 + 0.1 * torch.randn(1024, device="cuda")).to(DT)
    ws = [torch.randn(n, k, device="cuda", dtype=DT) * k ** -0.5 for n, k in ((4096, 1024), (1024, 4096))]
    out = {}

    def chain():
        x = norm.rms_norm(h, nw, 1e-6)
        y = gemv.gemv_triton(x, ws[0], pdl=True)
        return gemv.gemv_triton(activation.silu_and_mul(y), ws[1][:, :2048], pdl=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        res = chain()
    errs = []
    for _ in range(5):
        h.copy_(torch.randn_like(h))
        g.replay()
        torch.cuda.synchronize()
        x = linear.linear_ref(norm.rms_norm_ref(h, nw, 1e-6).float(), ws[0].float()).to(DT)
        ref = linear.linear_ref(activation.silu_and_mul_ref(x).float(), ws[1][:, :2048].float())
        errs.append(float((res.double() - ref.double()).norm() / ref.double().norm()))
    out["max_rel_err"] = max(errs)
    return out


def plan_space(n: int, k: int, quick: bool) -> list[tuple[int, int, int]]:
    plans = []
    for bn, split, warps in itertools.product((2, 4, 8, 16, 32), (1, 2, 3, 4, 8), (2, 4, 8)):
        if split == 3 and k % 3:
            continue
        bk = triton.next_power_of_2(-(-k // split))
        if not 2048 <= bn * bk <= 32768 or bk > 8192 or bk < 128:
            continue
        if bn * bk // (32 * warps) > 256 or bn * bk // (32 * warps) < 16:
            continue
        plans.append((bn, split, warps))
    return plans[:6] if quick else plans


def sweep_shapes(quick: bool, config: str = "qwen3-0.6b") -> tuple[dict, dict]:
    layers, mats, _ = SHAPES[config]
    res, best = {}, {"nopdl": {}, "pdl": {}}
    for n, k in mats:
        ws = [torch.randn(n, k, device="cuda", dtype=DT) * k ** -0.5 for _ in range(layers)]
        x = torch.randn(1, k, device="cuda", dtype=DT)
        nbytes = layers * n * k * 2
        row = {"skinny_us": graph_time(lambda: [linear.skinny_linear_triton(x, w) for w in ws]) * 1e6 / layers}
        for p in plan_space(n, k, quick):
            key = "bn{}_s{}_w{}".format(*p)
            try:
                row[key] = graph_time(lambda: [gemv.gemv_triton(x, w, block_n=p[0], split=p[1], num_warps=p[2],
                                                                pdl=False) for w in ws]) * 1e6 / layers
            except Exception as e:  # a plan that fails to compile is reported, not fatal
                row[key] = f"error: {type(e).__name__}: {str(e)[:100]}"
        timed = sorted((v, kk) for kk, v in row.items() if kk.startswith("bn") and isinstance(v, float))
        top = [kk for _, kk in timed[:5]]
        for kk in top:
            p = tuple(int(s[1:] if s[0] != "b" else s[2:]) for s in kk.split("_"))
            row[kk + "_pdl"] = graph_time(lambda: [gemv.gemv_triton(x, w, block_n=p[0], split=p[1],
                                                                    num_warps=p[2], pdl=True) for w in ws]) * 1e6 / layers
        bn_key = min((kk for kk in row if kk.startswith("bn") and not kk.endswith("_pdl")
                      and isinstance(row[kk], float)), key=row.get)
        bp_key = min((kk for kk in row if kk.endswith("_pdl")), key=row.get)
        parse = lambda kk: [int(s.lstrip("bnsw")) for s in kk.removesuffix("_pdl").split("_")]  # noqa: E731
        best["nopdl"][f"{n}x{k}"], best["pdl"][f"{n}x{k}"] = parse(bn_key), parse(bp_key)
        summary = {"skinny_us": row["skinny_us"], "best": bn_key, "best_us": row[bn_key],
                   "best_pdl": bp_key, "best_pdl_us": row[bp_key],
                   "skinny_TBps": nbytes / layers / row["skinny_us"] / 1e6,
                   "best_pdl_TBps": nbytes / layers / row[bp_key] / 1e6}
        res[f"{n}x{k}"] = {"summary": {kk: round(v, 3) if isinstance(v, float) else v for kk, v in summary.items()},
                           "all_us": {kk: round(v, 2) if isinstance(v, float) else v for kk, v in row.items()}}
        print(n, k, res[f"{n}x{k}"]["summary"], flush=True)
        del ws
        torch.cuda.empty_cache()
    return res, best


def apply_plans(plans: dict) -> None:
    gemv.PLANS.clear()
    for key, p in plans.items():
        n, k = (int(v) for v in key.split("x"))
        gemv.PLANS[(n, k)] = tuple(p)


def stack(best: dict) -> dict:
    """The layer stack without attention, in one graph, three ways."""
    layers, mats, _ = SHAPES["qwen3-0.6b"]
    ws = [[torch.randn(n, k, device="cuda", dtype=DT) * k ** -0.5 for n, k in mats] for _ in range(layers)]
    lns = [[(1 + 0.1 * torch.randn(1024, device="cuda")).to(DT) for _ in range(2)] for _ in range(layers)]
    emb = torch.randn(1, 1024, device="cuda", dtype=DT)
    attn = torch.randn(1, 2048, device="cuda", dtype=DT)

    def run():
        x, r = norm.rms_norm(emb, lns[0][0], 1e-6), emb
        for i, (wqkv, wo, wgu, wd) in enumerate(ws):
            if i:
                x, r = norm.fused_add_rms_norm(x, r, lns[i][0], 1e-6)
            linear.linear(x, wqkv)
            x, r = norm.fused_add_rms_norm(linear.linear(attn, wo), r, lns[i][1], 1e-6)
            x = linear.linear(activation.silu_and_mul(linear.linear(x, wgu)), wd)
        return x

    out = {}
    for name, use_gemv, use_pdl, plans in (("skinny", False, False, {}), ("skinny_pdl", False, True, {}),
                                           ("gemv_heuristic", True, False, {}),
                                           ("gemv", True, False, best["nopdl"]),
                                           ("gemv_pdl", True, True, best["pdl"])):
        gemv.ENABLED, pdl.ENABLED = use_gemv, use_pdl
        apply_plans(plans)
        out[name + "_us"] = round(graph_time(run) * 1e6, 1)
        print("stack", name, out[name + "_us"], flush=True)
    gemv.ENABLED, pdl.ENABLED = True, True
    gemv.PLANS.clear()
    out["weight_bytes"] = sum(w.numel() * 2 for lw in ws for w in lw)
    return out


def attention(quick: bool) -> dict:
    layers = 28
    cases = [attention_case(1, [1024]) for _ in range(layers)]
    out = {}
    for splits in ((16, 66) if quick else (8, 16, 32, 66)):
        for bn in (16, 32, 64):
            for use in (False, True):
                pdl.ENABLED = use
                cfg = {"splits": splits, "block_n": bn}
                try:
                    t = graph_time(lambda: [at.paged_attention_triton(*a, 128 ** -0.5, max_q_len=1, max_seq_len=4096,
                                                                      decode_config=cfg) for a, _ in cases])
                    out[f"s{splits}_bn{bn}{'_pdl' if use else ''}_us"] = round(t * 1e6 / layers, 2)
                except Exception as e:
                    out[f"s{splits}_bn{bn}{'_pdl' if use else ''}_us"] = f"error: {type(e).__name__}: {str(e)[:100]}"
    pdl.ENABLED = True
    print("attention", out, flush=True)
    return out


# attention heads (query, KV, head dim) and layers of the configs section 'rope' knows
ROPE_HEADS = {"qwen3-0.6b": (16, 8, 128, 28), "qwen3-30b-a3b": (32, 4, 128, 48), "llama-3.1-8b": (32, 8, 128, 32)}


def rope_attention(quick: bool, config: str = "qwen3-0.6b") -> dict:
    """Decode attention with the rotary + KV write fused in (`kernels.rope_decode`) against
    the separate rotary kernel + paged attention, per layer, with `config`'s heads
    (`ROPE_HEADS`): b=1 at 1K context (one cache per layer in one graph; graphs sized for a
    4K max_seq_len, as the decode graphs), b=64 and b=256 at 1K (one layer's cache, 8
    launches). At b=1 also the launch parameters: num_warps, programs_per_sm, splits,
    fused_merge, min_split_tiles (each row's key names them; the first variant is the
    defaults, `ROPE_DECODE_DEFAULTS`)."""
    hq, hk, d, n_layers = ROPE_HEADS[config]
    table = rotary.rope_cos_sin(rotary.rope_inv_freq(d, 1e6), 4096).cuda()
    qn, kn = (1 + 0.1 * torch.randn(d, device="cuda")).to(DT), (1 + 0.1 * torch.randn(d, device="cuda")).to(DT)
    out = {}
    for b, layers in ((1, n_layers), (64, 8), (256, 8)):
        cases = []
        for _ in range(layers):
            (q, kc, vc, cu, sl, bt), _ = attention_case(b, [1024] * b, kvh=hk, h=hq, d=d)
            qkv = torch.randn(b, (hq + 2 * hk) * d, device="cuda", dtype=DT)
            slots = (bt[:, 1023 // 16].long() * 16 + 1023 % 16)
            cases.append((qkv, kc, vc, cu, sl, bt, slots, (sl - 1).long()))

        def run(fused, cfg):
            for qkv, kc, vc, cu, sl, bt, slots, pos in cases:
                q, k, v = (t.view(b, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], -1))
                if fused:
                    rope_decode.rope_decode_triton(q, k, v, pos, table, kc, vc, slots, sl, bt, d ** -0.5, 4096,
                                                   qn, kn, 1e-6, cfg)
                else:
                    rotary.rotary_and_store_kv(q, k, v, pos, table, kc, vc, slots, qn, kn, 1e-6)
                    at.paged_attention_triton(q, kc, vc, cu, sl, bt, d ** -0.5, max_q_len=1, max_seq_len=4096)
        variants = [("separate", False, {})]
        for bn in ((32, 64) if b > 1 else (16, 32, 64)):
            for splits in ((None,) if b > 1 or quick else (None, 16, 64)):
                variants.append((f"fused_bn{bn}_s{splits or 'auto'}", True, {"block_n": bn, "splits": splits}))
        if b == 1:
            variants.insert(1, ("fused_defaults", True, {}))
            variants.append(("fused_bn32_sauto_noprefetch", True, {"block_n": 32, "prefetch": False}))
            if not quick:
                for nw in (1, 2, 8):
                    variants.append((f"fused_w{nw}", True, {"num_warps": nw}))
                for pps in (1, 4):
                    variants.append((f"fused_pps{pps}", True, {"programs_per_sm": pps}))
                for splits in (4, 8, 32):
                    variants.append((f"fused_s{splits}", True, {"splits": splits}))
                for tiles in (2, 4):
                    variants.append((f"fused_minTiles{tiles}", True, {"min_split_tiles": tiles}))
                variants.append(("fused_merge", True, {"fused_merge": True}))
                variants.append(("fused_s8_w2", True, {"splits": 8, "num_warps": 2}))
                variants.append(("fused_s8_merge", True, {"splits": 8, "fused_merge": True}))
        for name, fused, cfg in variants:
            for use in (False, True):
                pdl.ENABLED = use
                key = f"b{b}_{name}{'_pdl' if use else ''}_us"
                try:
                    out[key] = round(graph_time(lambda: run(fused, cfg)) * 1e6 / layers, 2)
                except Exception as e:
                    out[key] = f"error: {type(e).__name__}: {str(e)[:100]}"
        del cases
        torch.cuda.empty_cache()
    pdl.ENABLED = True
    print("rope_attention", out, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--plans-out", default=None, help="write the best plans (for decode_latency --gemv-plans)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--config", default="qwen3-0.6b", choices=sorted(SHAPES),
                    help="the shapes of section 'shapes' and the heads of 'rope' (ROPE_HEADS; the other "
                         "sections are Qwen3-0.6B's)")
    ap.add_argument("--only", default=None, help="comma-separated sections: check,shapes,stack,attention,rope")
    a = ap.parse_args()
    only = set(a.only.split(",")) if a.only else {"check", "shapes", "stack", "attention", "rope"}
    res = {"benchmark": "gemv_sweep", "device": device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "copy_bandwidth_TBps": round(copy_bandwidth() / 1e12, 3)}
    if "check" in only:
        res["check"] = check_pdl_in_graph()
        print("check", res["check"], flush=True)
    if only & {"shapes", "stack"}:
        res["shapes"], res["plans"] = sweep_shapes(a.quick, a.config)
        res["config"] = a.config
        if a.plans_out:
            with open(a.plans_out, "w") as fh:
                json.dump(res["plans"], fh)
    if "stack" in only:
        res["stack"] = stack(res["plans"])
    if "attention" in only:
        res["attention_b1"] = attention(a.quick)
    if "rope" in only:
        res["rope_attention"] = rope_attention(a.quick, a.config if a.config in ROPE_HEADS else "qwen3-0.6b")
        res["rope_config"] = a.config if a.config in ROPE_HEADS else "qwen3-0.6b"
    emit_json(res, a.out)


if __name__ == "__main__":
    main()
