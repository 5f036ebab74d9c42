"""Decode attention over a bf16 KV cache against an fp8_e4m3 one (issue 17; docs/ARCHITECTURE.md
§4.6, §6.4), on the device: Llama-3.1-8B's attention shape (32 query heads, 8 KV heads,
head_dim 128, block_size 16), contexts 8K and 32K, batch 1 and 64.

Per (context, batch, KV dtype), two kernels: the plain split-K decode kernel
(`kernels.attention_triton.paged_attention_triton`, with its split merge) and the fused
rotary + KV-write decode kernel the model's decode steps run (`kernels.rope_decode`, Qwen3's
q/k norm off). Each is timed as a CUDA graph of `--reps` rounds over `layers` layers, each
layer its own cache (enough layers that a round reads >= 512 MiB, so L2 does not hold the
cache between calls, as in a model step), replayed `--replays` times between CUDA events;
the median replay gives microseconds per layer call. Also: the KV bytes read per call and
the bandwidth that implies, the ratio bf16 / fp8 (the issue's target: >= 1.6x at 32K), the
fp8 output's relative error against the bf16 one on the same K/V (quantization only, scales
1.0 on N(0, 1) data), and the KV capacity in tokens of `--kv-gib` GiB for Llama-3.1-8B
(`shared.kv_layout.KVLayout`, all 32 layers).

The fp8 kernels run with their fp8 defaults (`DECODE_FP8_DEFAULTS`,
`ROPE_DECODE_FP8_DEFAULTS`: a config by the launch's class, seqs x kv_heads below the SMs
"few", else "many"). --variants also times every fp8 variant in the same run, each kernel's
fp8 dot format of SWEEP_DOTS (`kernels.kv_quant_triton.FP8_DOTS`: "fp16" the hardware
widening, "fp16_words" / "fp16_vwords" the word widening of both tiles / of V) crossed with
key tiles (TILES: block_n / num_warps / num_stages / programs_per_sm), and REFERENCE (register
caps and the in-kernel split merge, CAPPED), each with its bf16 / fp8 ratio and its output's relative error against the bf16 one (a wrong variant stands out from the ~4% of the e4m3 rounding), and picks per
kernel and class the variant of the best geometric-mean ratio ("best": what to put in the
FP8 defaults tables), and prints one line per kernel and variant ("SUMMARY ...": its ratio
at each context x batch).

Writes <--out>/kv_quant_attention.json (--out: a folder, made if missing; rewritten after each
case with "partial": true until the run ends) and prints it.
Usage: python benchmarks/kv_quant_attention.py [--out DIR] [--contexts 8192 32768]
       [--batches 1 64] [--reps 10] [--replays 5] [--kv-gib 40] [--variants]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import device_name, emit_json, model_dir  # noqa: E402

H, KVH, D, BS = 32, 8, 128, 16
MIN_ROUND_BYTES = 512 << 20
KERNELS = ("decode_kernel", "rope_decode_kernel")
# the --variants sweep: each dot format of SWEEP_DOTS (`kernels.kv_quant_triton.FP8_DOTS`) with
# each key tile of TILES, (block_n, num_warps, num_stages, programs_per_sm or None for the
# kernel's own: the split count at batch 1), and the REFERENCE variants. Pruned by the
# 2026-12-02 sweep (benchmarks/results/2026-12-02_h200_kv_quant_attention_variants.json):
# 8 warps (0.55-0.68), 3 stages and the kernels' bf16 tiles ("base", 0.70-0.93) lost
# everywhere, 2 stages at 128 keys (0.89-1.17) but for the rope kernel's "many" default; "q"
# (0.98-1.00) and "fp16_bits" (0.98-1.17) below "fp16" at the same tile: not swept (both stay
# selectable and tested).
SWEEP_DOTS = ("fp16", "fp16_words", "fp16_vwords")
# Smaller tiles for occupancy (sm_90 compiles, 4 warps: "fp16" at 128 keys takes 195 registers,
# 2 programs an SM; the word formats 94-128 registers but 40-68 KB of shared memory at 128 keys,
# 22-37 KB at 64: 5 programs; docs/ARCHITECTURE.md §4.6).
TILES: dict = {"n32w4s1": (32, 4, 1, None), "n64w4s1": (64, 4, 1, None), "n128w4s1": (128, 4, 1, None),
               "n64w4s2": (64, 4, 2, None), "n32w2s1": (32, 2, 1, None), "n64w4s1p8": (64, 4, 1, 8)}
# register caps (maxnreg, "r<n>"): sm_90 compiles, registers -> programs an SM (spill instructions):
# fp16 n128 195 -> 128: 2 -> 4 (100), fp16 n64 137 -> 128: 3 -> 4 (14), fp16_vwords n128 128 -> 96:
# 4 -> 5 (59), the word formats n64 94 -> 80: 5 -> 6 (18-30)
# "fm": the split merge in the decode kernel (fused_merge: no merge launch; at batch 1, 32K, the
# kernel is ~20-40 us and a launch a few): tiles of these, (block_n, num_warps, num_stages,
# programs_per_sm, maxnreg, fused_merge), are timed in the formats REFERENCE names only
CAPPED: dict = {"n128w4s1r128": (128, 4, 1, None, 128, False), "n64w4s1r128": (64, 4, 1, None, 128, False),
                "n128w4s1r96": (128, 4, 1, None, 96, False), "n64w4s1r80": (64, 4, 1, None, 80, False),
                "n128w4s1fm": (128, 4, 1, None, None, True), "n64w4s1fm": (64, 4, 1, None, None, True),
                # around the 2026-12-03 default (fp16/n128w4s1r128): the in-kernel merge, two stages,
                # caps of 112 / 144 registers, split targets of 3 / 6 programs an SM
                "n128w4s1r128fm": (128, 4, 1, None, 128, True), "n128w4s2r128": (128, 4, 2, None, 128, False),
                "n128w4s1r112": (128, 4, 1, None, 112, False), "n128w4s1r144": (128, 4, 1, None, 144, False),
                "n128w4s1r128p3": (128, 4, 1, 3, 128, False), "n128w4s1r128p6": (128, 4, 1, 6, 128, False)}
REFERENCE = ("fp16/n128w4s1r128", "fp16/n64w4s1r128", "fp16_vwords/n128w4s1r96", "fp16_words/n64w4s1r80",
             "fp16_vwords/n64w4s1r80", "fp16/n128w4s1fm", "fp16_words/n64w4s1fm", "fp16_vwords/n64w4s1fm",
             "fp16/n128w4s1r128fm", "fp16/n128w4s2r128", "fp16/n128w4s1r112", "fp16/n128w4s1r144",
             "fp16/n128w4s1r128p3", "fp16/n128w4s1r128p6", "fp16_vwords/n128w4s1r128")


def fp8_variants(kname: str) -> dict[str, dict]:
    """name ("format/tile") -> the decode_config of each fp8 variant of a kernel (module doc)."""
    from kernels import attention_triton as at
    from kernels import rope_decode

    base = at.DECODE_DEFAULTS if kname == "decode_kernel" else rope_decode.ROPE_DECODE_DEFAULTS
    names = [f"{dot}/{t}" for dot in SWEEP_DOTS for t in TILES] + list(REFERENCE)
    out = {}
    for name in names:
        dot, tname = name.split("/")
        bn, nw, ns, pps, mr, fm = (*TILES[tname], None, False) if tname in TILES else CAPPED[tname]
        out[name] = {"fp8_dot": dot, "block_n": bn, "num_warps": nw, "num_stages": ns,
                     "programs_per_sm": pps or base["programs_per_sm"], "maxnreg": mr, "fused_merge": fm}
    return out


def _capacity(kv_gib: float) -> dict:
    """KV tokens of kv_gib GiB for Llama-3.1-8B, bf16 and fp8_e4m3 (KVLayout's block bytes)."""
    from shared.kv_layout import KVLayout
    from shared.model_spec import load_model_spec

    d = model_dir("llama-3.1-8b")
    out = {}
    for name, kv in (("bf16", "auto"), ("fp8_e4m3", "fp8_e4m3")):
        lay = KVLayout.for_model(load_model_spec(d, dtype="bfloat16", kv_cache_dtype=kv), BS)
        blocks = int(kv_gib * 2**30) // lay.block_bytes
        out[name] = {"block_bytes": lay.block_bytes, "tokens": blocks * BS}
    out["fp8_over_bf16"] = round(out["fp8_e4m3"]["tokens"] / out["bf16"]["tokens"], 3)
    return out


def _time_graph(fn, reps: int, replays: int) -> float:
    """Median milliseconds of one replay of a graph of `reps` calls of fn."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return statistics.median(times)


def _case(ctx: int, batch: int, reps: int, replays: int, variants: bool) -> dict:
    from kernels import kv_quant, rope_decode, rotary
    from kernels import attention_triton as at

    dev = torch.device("cuda")
    nb_seq = -(-ctx // BS)
    per_layer_bf16 = 2 * batch * nb_seq * BS * KVH * D * 2
    layers = max(1, -(-MIN_ROUND_BYTES // (per_layer_bf16 // 2)))  # the fp8 round reads >= 512 MiB too
    g = torch.Generator(device=dev).manual_seed(0)
    bt = torch.arange(batch * nb_seq, dtype=torch.int32, device=dev).view(batch, nb_seq)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    q = torch.randn(batch, H, D, device=dev, generator=g).bfloat16()
    k_new = torch.randn(batch, KVH, D, device=dev, generator=g).bfloat16()
    v_new = torch.randn(batch, KVH, D, device=dev, generator=g).bfloat16()
    pos = (sl - 1).long()
    slots = bt[:, -1].long() * BS + (ctx - 1) % BS
    table = rotary.rope_cos_sin(rotary.rope_inv_freq(D, 500000.0), ctx).to(dev)
    one = torch.tensor(1.0, device=dev)
    res: dict = {"context": ctx, "batch": batch, "layers": layers, "reps": reps,
                 "kv_bytes_per_call": {"bf16": per_layer_bf16, "fp8_e4m3": per_layer_bf16 // 2}}
    outs = {}
    shape = (batch * nb_seq, BS, KVH, D)
    bf16 = [(torch.randn(shape, device=dev, generator=g, dtype=torch.bfloat16),
             torch.randn(shape, device=dev, generator=g, dtype=torch.bfloat16)) for _ in range(layers)]

    def call(kname, kc, vc, scales, cfg):
        if kname == "decode_kernel":
            return at.paged_attention_triton(q, kc, vc, cu, sl, bt, D ** -0.5, 1, ctx, cfg, *scales)
        return rope_decode.rope_decode_triton(q, k_new, v_new, pos, table, kc, vc, slots, sl, bt, D ** -0.5, ctx,
                                              None, None, 1e-6, cfg, *scales)

    def timed(kname, name, caches, scales, cfg=None) -> dict:
        def fn():
            for kc, vc in caches:
                call(kname, kc, vc, scales, cfg)
        us = 1000 * _time_graph(fn, reps, replays) / (reps * layers)
        return {"us_per_call": round(us, 2), "gb_per_s": round(res["kv_bytes_per_call"][name] / us / 1e3, 1)}

    # the fp8 caches hold the bf16 ones' values, rounded to e4m3 (scale 1.0: N(0, 1) data)
    fp8 = [(kv_quant.quantize_fp8(k, one), kv_quant.quantize_fp8(v, one)) for k, v in bf16]
    for name, caches, scales in (("bf16", bf16, (None, None)), ("fp8_e4m3", fp8, (one, one))):
        outs[name] = call("decode_kernel", *caches[0], scales, None).float()
        for kname in KERNELS:
            res.setdefault(kname, {})[name] = timed(kname, name, caches, scales)
    for kname in KERNELS:
        r = res[kname]
        r["bf16_over_fp8"] = round(r["bf16"]["us_per_call"] / r["fp8_e4m3"]["us_per_call"], 3)
        ref = outs["bf16"] if kname == "decode_kernel" else call(kname, *bf16[0], (None, None), None).float()
        if variants:
            r["variants"] = {}
            for vname, cfg in fp8_variants(kname).items():
                try:  # a variant that fails to compile or launch is recorded, the sweep goes on
                    v = timed(kname, "fp8_e4m3", fp8, (one, one), cfg)
                    v["bf16_over_fp8"] = round(r["bf16"]["us_per_call"] / v["us_per_call"], 3)
                    got = call(kname, *fp8[0], (one, one), cfg).float()
                    v["rel_err_vs_bf16"] = round(float((got - ref).norm() / ref.norm()), 5)
                except Exception as e:  # noqa: BLE001 (any compiler or launch error)
                    torch.cuda.synchronize()
                    v = {"error": f"{type(e).__name__}: {e}"[:400]}
                r["variants"][vname] = v
    del bf16, fp8
    torch.cuda.empty_cache()
    # the caches differ only by the fp8 rounding of the same N(0, 1) values
    res["fp8_vs_bf16_output_rel_err"] = float((outs["fp8_e4m3"] - outs["bf16"]).norm() / outs["bf16"].norm())
    return res


def _best(cases: list[dict]) -> dict:
    """Per kernel and launch class (seqs x kv_heads below the SMs: "few", else "many"), the
    variant of the best geometric mean of bf16 / fp8 over the class's cases, with its
    ratios, and the defaults' geometric mean beside it."""
    from kernels.device_info import num_sms

    sms = num_sms(torch.device("cuda"))
    out: dict = {}
    for kname in KERNELS:
        for cls in ("few", "many"):
            mine = [c for c in cases if (c["batch"] * KVH < sms) == (cls == "few") and "variants" in c[kname]]
            if not mine:
                continue

            def gmean(xs):
                return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 3)

            names = [n for n in mine[0][kname]["variants"]
                     if all("bf16_over_fp8" in c[kname]["variants"][n] for c in mine)]
            scored = {n: gmean([c[kname]["variants"][n]["bf16_over_fp8"] for c in mine]) for n in names}
            top = max(scored, key=lambda n: scored[n])
            out.setdefault(kname, {})[cls] = {
                "variant": top, "gmean_bf16_over_fp8": scored[top],
                "ratios": {f"{c['context']}x{c['batch']}": c[kname]["variants"][top]["bf16_over_fp8"] for c in mine},
                "defaults_gmean_bf16_over_fp8": gmean([c[kname]["bf16_over_fp8"] for c in mine]),
                "ranking": sorted(scored.items(), key=lambda kv: -kv[1])[:6]}
    return out


def _summary(cases: list[dict]) -> None:
    """One line per kernel and variant (the defaults first): bf16 / fp8 at each case."""
    for kname in KERNELS:
        rows = {"(defaults)": {f"{c['context']}x{c['batch']}": c[kname]["bf16_over_fp8"] for c in cases}}
        for c in cases:
            for vname, v in c[kname].get("variants", {}).items():
                rows.setdefault(vname, {})[f"{c['context']}x{c['batch']}"] = v.get("bf16_over_fp8")
        for vname, r in rows.items():
            cells = " ".join(f"{k}=" + ("error" if x is None else f"{x:.3f}") for k, x in r.items())
            print(f"SUMMARY {kname:18s} {vname:24s} {cells}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for kv_quant_attention.json")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--variants", action="store_true", help="time every fp8 variant too (module doc)")
    args = ap.parse_args()
    t0 = time.time()
    path = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "kv_quant_attention.json")
    result: dict = {"benchmark": "kv_quant_attention", "device": device_name(),
                    "shape": {"num_heads": H, "num_kv_heads": KVH, "head_dim": D, "block_size": BS},
                    "kv_capacity": {"kv_gib": args.kv_gib, **_capacity(args.kv_gib)}, "cases": []}
    if not torch.cuda.is_available():
        result["error"] = "no CUDA device: only the capacity is computed"
    else:
        for ctx in args.contexts:
            for b in args.batches:
                result["cases"].append(_case(ctx, b, args.reps, args.replays, args.variants))
                print({k: v for k, v in result["cases"][-1].items() if k not in KERNELS},
                      {k: result["cases"][-1][k]["bf16_over_fp8"] for k in KERNELS}, flush=True)
                if path:  # the cases so far, in case a time limit ends the run
                    with open(path, "w") as fh:
                        json.dump({**result, "partial": True}, fh, indent=1)
        if args.variants:
            result["best"] = _best(result["cases"])
            _summary(result["cases"])
        from kernels import attention_triton, rope_decode

        result["fp8_defaults"] = {"decode_kernel": attention_triton.DECODE_FP8_DEFAULTS,
                                  "rope_decode_kernel": rope_decode.ROPE_DECODE_FP8_DEFAULTS}
    result["wall_s"] = round(time.time() - t0, 1)
    emit_json(result, path)


if __name__ == "__main__":
    main()
