"""Launch-parameter sweep of the decode-path kernels on one GPU, for choosing defaults.

1. Skinny linear (`kernels.linear`; --skinny picks the K-loop kernel, whose SKINNY_TUNING it
   sweeps, or the one-tile one, whose SKINNY_PDL_TUNING it sweeps): every projection of every layer of a model shape
   (Qwen3-0.6B, Llama-3.1-8B) at M rows, distinct weights per layer (so the weights
   stream from HBM as in decode, not from L2), captured in one CUDA graph and replayed:
   time per pass, and bytes (weights + activations) / time in TB/s. cuBLAS (`F.linear`)
   is the baseline of the same run; the lm_head is timed alone the same way.
2. Fused decoder-layer linear work (`kernels.linear` prologues/epilogue, --only fused): the
   linear part of every layer of Qwen3-0.6B at M = 1 (and 4, 16) rows, distinct weights
   per layer, in one CUDA graph: the unfused sequence the models ran before (fused_add_
   rms_norm, qkv, o_proj, fused_add_rms_norm, gate_up, silu_and_mul, down; skinny kernels
   with their split-K sum kernels: `unfused_us`; with the in-kernel split sum:
   `unfused_atomic_split_us`) against the fused one (norm+qkv, o_proj+residual,
   norm+gate_up, silu+down+residual), its K splits summed in-kernel (`fused_us`, the
   default) and by the 2-kernel path (`fused_2kernel_split_us`). Attention is left out (a
   fixed [M, 2048] input of o_proj). `speedup` = unfused_us / fused_us.
3. Paged decode attention (`kernels.attention_triton`): one layer's cache, block tables
   over shuffled blocks, cases b=256 at 1K context, b=256 at mixed contexts U[100, 2048],
   b=1 at 1K; `triton.testing.do_bench` medians; KV bytes read / time in TB/s.
4. The MLP's SiLU-and-mul in the down projection's kernel against its own kernel (--only
   silu), per shape at M = 1..16 rows: which row counts the dispatcher should fuse it at.
5. (--only rows, not in the default run) the projections of 2..16 rows (verify steps at batch 1):
   the one-tile skinny kernel and the gemv kernel a row at a time, the one-row gemv as the floor
   (`sweep_rows`).
Copy bandwidth (device-to-device, read + write) is measured first, as the ceiling.
Writes JSON to --out; prints the best variants last.

Usage: python benchmarks/kernel_sweep.py [--out FILE] [--quick] [--only linear|fused|attention|silu|rows]
       [--skinny k_loop|one_tile]   (the 2..16-row kernel: kernels/linear.py SKINNY_PDL; default k_loop)
       [--shapes qwen3-0.6b ...] [--ms 1 4 16]   (the linear part's model shapes and rows)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from benchmarks.common import device_name  # noqa: E402
from benchmarks.decode_latency import copy_bandwidth  # noqa: E402
from kernels import attention_triton as at  # noqa: E402
from kernels import activation, linear, norm  # noqa: E402

SHAPES = {  # (layers, [(N, K) of qkv, o, gate_up, down], lm_head (N, K))
    "qwen3-0.6b": (28, [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)], (151936, 1024)),
    "llama-3.1-8b": (32, [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)], (128256, 4096)),
    # the MoE model's dense projections: qkv, o and the router (its experts run in kernels/moe_triton.py)
    "qwen3-30b-a3b": (48, [(5120, 2048), (2048, 4096), (128, 2048)], (151936, 2048)),
}


def graph_time(fn, reps: int = 20) -> float:
    """Median seconds of one replay of a CUDA graph of fn()."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up: compiles
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for i in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    del g
    return statistics.median(times)


def layer_weights(layers: int, mats: list[tuple[int, int]]) -> tuple[list[list[torch.Tensor]], int]:
    """Distinct random bf16 weights [N, K] of every projection (`mats`) of every layer (so a pass
    streams them from HBM, as decode does, not from L2), and their bytes."""
    ws = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for n, k in mats]
          for _ in range(layers)]
    return ws, sum(w.numel() * 2 for lw in ws for w in lw)


def sweep_linear(quick: bool, shapes: list[str] | None = None, ms: tuple[int, ...] = (1, 4, 16),
                 save=None, limit: int | None = None) -> dict:
    """Part 1 (module doc) over the SHAPES named in `shapes` (default all) at `ms` rows; `save(res)`
    after each row (a run cut by a time limit keeps the rows done); the one-tile kernel's first
    `limit` variants only (default all 24)."""
    res: dict = {}
    if linear.SKINNY_PDL:  # the one-tile kernel (--skinny one_tile): its plan's knobs
        tuning, fmt = linear.SKINNY_PDL_TUNING, "mbk{max_block_k}_te{tile_elems}_pp{programs_per_sm}_w{num_warps}"
        # the default first, then wider K ranges (fewer split programs, as the one-row gemv's
        # 4096) and more tile elements with 8 warps, then the rest of the grid
        first = [(256, 8192, 1, 4), (512, 8192, 1, 4), (1024, 16384, 1, 8), (512, 16384, 1, 8),
                 (1024, 8192, 1, 4), (256, 8192, 2, 4), (1024, 16384, 2, 8), (512, 8192, 2, 4)]
        grid = first + [v for v in itertools.product((256, 512, 1024), (8192, 16384), (1, 2), (4, 8))
                        if v not in first]
        variants = [dict(max_block_k=bk, tile_elems=te, programs_per_sm=pp, num_warps=nw)
                    for bk, te, pp, nw in grid[:limit]]
    else:
        tuning, fmt = linear.SKINNY_TUNING, "bk{block_k}_pp{programs_per_sm}_w{num_warps}_s{num_stages}"
        variants = [dict(block_k=bk, programs_per_sm=pp, num_warps=nw, num_stages=ns)
                    for bk, pp, nw, ns in itertools.product((128, 256, 512), (1, 2, 4), (4, 8), (3, 5))]
    if quick:
        variants = variants[:4]
    default = dict(tuning)
    for name, (layers, mats, head) in SHAPES.items():
        if shapes and name not in shapes:
            continue
        ws, wbytes = layer_weights(layers, mats)
        lm = torch.randn(*head, device="cuda", dtype=torch.bfloat16) * head[1] ** -0.5
        for m in ms:
            xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, k in mats}

            def layers_fn(f):
                def run():
                    for lw in ws:
                        for w in lw:
                            f(xs[w.shape[1]], w)
                return run
            row = {"cublas_us": graph_time(layers_fn(F.linear)) * 1e6}
            for v in variants:
                tuning.update(v)
                key = fmt.format(**v)
                try:
                    row[key] = graph_time(layers_fn(linear.skinny_linear_triton)) * 1e6
                except Exception as e:  # a variant that fails to compile is reported, not fatal
                    row[key] = f"error: {type(e).__name__}: {str(e)[:120]}"
            tuning.update(default)
            best = min((k for k in row if k != "cublas_us" and isinstance(row[k], float)), key=row.get)
            row["best"] = best
            row["weight_bytes"] = wbytes
            row["best_TBps"] = round(wbytes / row[best] / 1e6, 3)
            row["cublas_TBps"] = round(wbytes / row["cublas_us"] / 1e6, 3)
            xh = torch.randn(m, head[1], device="cuda", dtype=torch.bfloat16)
            row["lm_head_cublas_us"] = graph_time(lambda: F.linear(xh, lm)) * 1e6
            row["lm_head_skinny_us"] = graph_time(lambda: linear.skinny_linear_triton(xh, lm)) * 1e6
            res[f"{name}_m{m}"] = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}
            print(name, m, "cublas", round(row["cublas_us"], 1), "best", best, round(row[best], 1),
                  "default", row.get(fmt.format(**default)),
                  "lm_head", round(row["lm_head_cublas_us"], 1), round(row["lm_head_skinny_us"], 1), flush=True)
            if save is not None:
                save(res)
        del ws, lm
        torch.cuda.empty_cache()
    return res


def sweep_rows(shapes: list[str] | None, ms: tuple[int, ...], save=None) -> dict:
    """Part 5 (--only rows): the projections of 2..16 rows (verify steps at batch 1), every projection of
    every layer of a shape at M rows in one CUDA graph (distinct weights per layer), on the one-tile
    skinny kernel (`skinny`) and the gemv kernel one row after another (`gemv_loop`), with the one-row
    gemv of the same weights (`gemv_m1`) as the floor. Times in us a pass. (The gemv's rows as one
    [rows, BLOCK_N, BLOCK_K] tile were also swept here and removed: slower at every row count but 2,
    docs/ARCHITECTURE.md §5.5.)"""
    from kernels import gemv
    res: dict = {}
    for name, (layers, mats, _head) in SHAPES.items():
        if shapes and name not in shapes:
            continue
        ws, wbytes = layer_weights(layers, mats)

        def stack(f, xs):
            def run():
                for lw in ws:
                    for w in lw:
                        f(xs[w.shape[1]], w)
            return run
        x1 = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _, k in mats}
        floor = graph_time(stack(gemv.gemv_triton, x1)) * 1e6
        for m in ms:
            xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, k in mats}
            row: dict = {"gemv_m1": floor}
            row["skinny"] = graph_time(stack(linear.skinny_linear_triton, xs)) * 1e6
            row["gemv_loop"] = graph_time(stack(gemv.gemv_triton, xs)) * 1e6
            timed = {k: v for k, v in row.items() if isinstance(v, float) and k != "gemv_m1"}
            best = min(timed, key=timed.get)
            row.update(best=best, weight_bytes=wbytes, best_TBps=round(wbytes / row[best] / 1e6, 3),
                       best_over_m1=round(row[best] / floor, 3), skinny_over_m1=round(row["skinny"] / floor, 3))
            res[f"{name}_m{m}"] = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}
            print(name, m, "m1", round(floor, 1), "skinny", round(row["skinny"], 1), "loop", round(row["gemv_loop"], 1),
                  "best", best, round(row[best], 1), flush=True)
            if save is not None:
                save(res)
        del ws
        torch.cuda.empty_cache()
    return res


def sweep_fused_layer(quick: bool) -> dict:
    """Qwen3-0.6B's layer stack, linear work only: fused vs unfused, in one CUDA graph."""
    layers, mats, _ = SHAPES["qwen3-0.6b"]
    hid, eps, dt = 1024, 1e-6, torch.bfloat16
    ws = [[torch.randn(n, k, device="cuda", dtype=dt) * k ** -0.5 for n, k in mats] for _ in range(layers)]
    lns = [[(1 + 0.1 * torch.randn(hid, device="cuda")).to(dt) for _ in range(2)] for _ in range(layers)]
    final = (1 + 0.1 * torch.randn(hid, device="cuda")).to(dt)
    wbytes = sum(w.numel() * 2 for lw in ws for w in lw)
    res: dict = {}
    for m in ((1,) if quick else (1, 4, 16)):
        emb = torch.randn(m, hid, device="cuda", dtype=dt)
        attn = torch.randn(m, 2048, device="cuda", dtype=dt)  # stands in for attention's output

        def unfused():
            x, r = norm.rms_norm(emb, lns[0][0], eps), emb
            for i, (wqkv, wo, wgu, wd) in enumerate(ws):
                if i:
                    x, r = norm.fused_add_rms_norm(x, r, lns[i][0], eps)
                linear.linear(x, wqkv)
                x, r = norm.fused_add_rms_norm(linear.linear(attn, wo), r, lns[i][1], eps)
                x = linear.linear(activation.silu_and_mul(linear.linear(x, wgu)), wd)
            return norm.fused_add_rms_norm(x, r, final, eps)[0]

        def fused():
            h = emb
            for i, (wqkv, wo, wgu, wd) in enumerate(ws):
                linear.linear(h, wqkv, norm_weight=lns[i][0], eps=eps)
                h = linear.linear(attn, wo, residual=h)
                gu = linear.linear(h, wgu, norm_weight=lns[i][1], eps=eps)
                h = linear.linear(gu, wd, silu_mul=True, residual=h)
            return norm.rms_norm(h, final, eps)

        def timed(fn, split_reduce):
            linear.SKINNY_TUNING["split_reduce"] = split_reduce
            try:
                return graph_time(fn) * 1e6
            finally:
                linear.SKINNY_TUNING["split_reduce"] = "atomic"

        row = {"unfused_us": timed(unfused, "kernel"), "unfused_atomic_split_us": timed(unfused, "atomic"),
               "fused_us": timed(fused, "atomic"), "fused_2kernel_split_us": timed(fused, "kernel")}
        out_u, out_f = unfused(), fused()
        row["rel_diff_fused_vs_unfused"] = float((out_f.double() - out_u.double()).norm() / out_u.double().norm())
        # a launch per projection, + 3 unfused (2 norms, silu_and_mul), + 1 per K-split
        # projection with the 2-kernel split sum
        splits = sum(linear.skinny_plan(m, n, k, torch.device("cuda"))[2] > 1 for n, k in mats)
        row["launches_per_layer"] = {"unfused": 7 + splits, "unfused_atomic_split": 7, "fused": 4,
                                     "fused_2kernel_split": 4 + splits}
        row["weight_bytes"] = wbytes
        row["speedup"] = row["unfused_us"] / row["fused_us"]
        res[f"qwen3-0.6b_m{m}"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
        print("fused layer stack m", m, {k: v for k, v in res[f"qwen3-0.6b_m{m}"].items()
                                         if k.endswith("_us") or k == "speedup"}, flush=True)
    return res


def sweep_silu_down(quick: bool) -> dict:
    """The MLP's down projection with its SiLU-and-mul, per model shape and M rows: the
    prologue in the projection's kernel (`linear(gu, w, silu_mul=True)`: gemv at one row,
    the skinny kernel at 2..16) against `silu_and_mul` as its own kernel then `linear`,
    every layer's distinct weight in one CUDA graph. `speedup` = separate_us / fused_us."""
    res: dict = {}
    for name, (layers, mats, _) in SHAPES.items():
        n, k = mats[3]
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(layers)]
        for m in ((1, 4) if quick else (1, 2, 4, 8, 16)):
            gu = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
            sep = lambda: [linear.linear(activation.silu_and_mul(gu), w) for w in ws]
            fus = lambda: [linear.linear(gu, w, silu_mul=True) for w in ws]
            row = {"separate_us": graph_time(sep) * 1e6, "fused_us": graph_time(fus) * 1e6,
                   "skinny": linear.skinny_applies(gu[:, :k], ws[0])}
            row["speedup"] = row["separate_us"] / row["fused_us"]
            res[f"{name}_m{m}"] = {kk: (round(v, 3) if isinstance(v, float) else v) for kk, v in row.items()}
            print("silu+down", name, m, res[f"{name}_m{m}"], flush=True)
        del ws
        torch.cuda.empty_cache()
    return res


def attention_case(b: int, lens: list[int], kvh=8, h=16, d=128, bs=16):
    total = sum(-(-n // bs) for n in lens) + 8
    kc = torch.randn(total, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    perm = torch.randperm(total).tolist()
    width = max(-(-n // bs) for n in lens)
    tables = []
    for n in lens:
        nb = -(-n // bs)
        tables.append([perm.pop() for _ in range(nb)] + [0] * (width - nb))
    q = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16)
    bt = torch.tensor(tables, dtype=torch.int32, device="cuda")
    cu = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kv_bytes = sum(lens) * kvh * d * 2 * 2
    return (q, kc, vc, cu, sl, bt), kv_bytes


def sweep_attention(quick: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    cases = {
        "b256_ctx1024": [1024] * 256,
        "b256_mixed": torch.randint(100, 2049, (256,), generator=g).tolist(),
        "b64_mixed": torch.randint(100, 2049, (64,), generator=g).tolist(),
        "b1_ctx1024": [1024],
    }
    variants = [dict(block_n=bn, num_warps=nw, num_stages=ns)
                for bn, nw, ns in itertools.product((32, 64, 128), (4, 8), (1, 2, 3, 4))]
    if quick:
        variants = variants[:3]
    res = {}
    for cname, lens in cases.items():
        args, kvb = attention_case(len(lens), lens)
        row = {}
        for v in [{}] + variants:
            key = "default" if not v else "bn{block_n}_w{num_warps}_s{num_stages}".format(**v)
            try:
                t = triton.testing.do_bench(lambda: at.paged_attention_triton(
                    *args, 128 ** -0.5, max_q_len=1, max_seq_len=4096, decode_config=v),
                    warmup=25, rep=100, return_mode="median") / 1e3
                row[key] = round(t * 1e6, 2)
            except Exception as e:
                row[key] = f"error: {type(e).__name__}: {str(e)[:120]}"
        best = min((k for k in row if isinstance(row[k], float)), key=row.get)
        row["best"] = best
        row["kv_bytes"] = kvb
        row["best_TBps"] = round(kvb / row[best] / 1e6, 3)
        row["default_TBps"] = round(kvb / row["default"] / 1e6, 3) if isinstance(row["default"], float) else None
        res[cname] = row
        print(cname, "default", row["default"], "best", best, row[best], row["best_TBps"], "TB/s", flush=True)
        del args
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="a few variants only (a smoke run)")
    ap.add_argument("--only", choices=["linear", "fused", "attention", "silu", "rows"], default=None)
    ap.add_argument("--skinny", choices=["k_loop", "one_tile"], default="k_loop",
                    help="the 2..16-row kernel the linear, fused and silu parts time (kernels/linear.py SKINNY_PDL): "
                         "the K-loop kernel, whose launch parameters (SKINNY_TUNING) the linear part sweeps, or "
                         "the one-tile kernel with PDL (its own plan, SKINNY_PDL_TUNING)")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None,
                    help="the linear part: these model shapes only (default all)")
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16], help="the linear part: rows of x")
    ap.add_argument("--limit", type=int, default=None, help="the linear part, one-tile kernel: first N variants")
    a = ap.parse_args()
    linear.SKINNY_PDL = a.skinny == "one_tile"
    res = {"benchmark": "kernel_sweep", "device": device_name(), "torch": torch.__version__, "skinny": a.skinny,
           "triton": triton.__version__, "copy_bandwidth_TBps": round(copy_bandwidth() / 1e12, 3)}
    if a.only in (None, "attention"):
        res["attention"] = sweep_attention(a.quick)
    def save(part: dict) -> None:
        if a.out:
            with open(a.out, "w") as fh:
                json.dump({**res, "linear": part, "complete": False}, fh, indent=1)

    if a.only in (None, "linear"):
        res["linear"] = sweep_linear(a.quick, a.shapes, tuple(a.ms), save, a.limit)
    if a.only == "rows":  # not part of the default run
        def save_rows(part: dict) -> None:
            if a.out:
                with open(a.out, "w") as fh:
                    json.dump({**res, "rows": part, "complete": False}, fh, indent=1)
        res["rows"] = sweep_rows(a.shapes, tuple(a.ms), save_rows)
    if a.only in (None, "fused"):
        res["fused_layer"] = sweep_fused_layer(a.quick)
    if a.only in (None, "silu"):
        res["silu_down"] = sweep_silu_down(a.quick)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    print("== best")
    for k, v in res.get("attention", {}).items():
        print(f"attention {k}: default {v['default']} us ({v['default_TBps']} TB/s), "
              f"best {v['best']} {v[v['best']]} us ({v['best_TBps']} TB/s)")
    for k, v in res.get("linear", {}).items():
        print(f"linear {k}: cublas {v['cublas_us']} us ({v['cublas_TBps']} TB/s), best {v['best']} "
              f"{v[v['best']]} us ({v['best_TBps']} TB/s); lm_head cublas {v['lm_head_cublas_us']} "
              f"skinny {v['lm_head_skinny_us']}")
    for k, v in res.get("fused_layer", {}).items():
        print(f"fused layer stack {k}: unfused {v['unfused_us']} us ({v['launches_per_layer']['unfused']} "
              f"launches/layer), fused {v['fused_us']} us ({v['launches_per_layer']['fused']}), "
              f"fused with 2-kernel split {v['fused_2kernel_split_us']} us "
              f"({v['launches_per_layer']['fused_2kernel_split']}); speedup {v['speedup']:.2f}x, "
              f"rel diff {v['rel_diff_fused_vs_unfused']:.1e}")


if __name__ == "__main__":
    main()
