"""Batch-1 decode latency (TPOT) at 1K context, against the memory roofline.

Model: a config of benchmarks/configs with dummy weights (default Qwen3-0.6B, bf16).
One sequence: a 1024-token random prompt is prefilled, then `--steps` tokens are decoded
(greedy). TPOT = median wall time of one `ModelRunner.execute` decode step (host prepare,
forward, logits, sampling, the copy of the token back), with CUDA graphs and eager on
the same runner; also the median GPU time (CUDA events) of the forward + logits alone.
Roofline: bytes per token = every parameter once (a tied embedding once, read whole by the
lm_head; a MoE's expert weights at the share num_experts_per_tok / num_experts that one token
reads) + the KV cache read at the context length + a hybrid model's recurrent state, read and
written once per recurrent layer (its conv window and its fp32 matrix, `state_specs`); time =
bytes / copy bandwidth, the bandwidth measured in this run (device-to-device copy of 2 GiB,
read + write bytes). Writes JSON to --out and stdout.

Hybrid models (gated DeltaNet + attention, e.g. --config qwen3.5-35b-a3b with
--gpu-memory-utilization 0.8) decode on state slot 0; the GPU-time replay of each step runs on
slot 1 with a table of its own, so it never advances the measured sequence's state or
rewrites its KV.

--pdl off / --gemv off measure without programmatic dependent launch / the one-row kernel;
--fused-layers off keeps the norms as their own kernels at one row;
--gemv-plans takes the plans gemv_sweep.py found (--w4-plans those of w4a16_sweep.py, for the
W4A16 decode kernels; --fp8-plans those of qgemv_sweep.py, for the FP8 one-row kernel); --rope-decode off runs the rotary kernel
and attention apart; --attn overrides the attention kernel's launch defaults.
--ab A B ... [--ab-rounds 2] and --variants A B ... time graphs TPOT only, in one process
and one model load, the decode graphs captured again for each variant
(`ModelRunner.recapture_graphs`; the switches are read at capture); the eager mode is then
not run. Both take the names of `VARIANTS`, one dict of variants whose knobs (`KNOB_NAMES`)
override the run's baseline (the knobs' values after the command line's settings) and are
set back to it after: --ab runs the named variants in turn --ab-rounds times (A B A B),
each checked by the logits of one graph step against the first variant's
(`check_logits_rel_vs_first`, `check_argmax_same`; not for a hybrid), the JSON's "ab"
listing every round, "ab_median" the median per variant and "ab_variants" each variant's
moe_decode_fused, fused_merge and programs_per_sm (None: not set by the variant), the file
rewritten after each round; --variants runs each named variant once, in the order given,
the JSON's "variants" one row each with every knob's value. These JSON fields are the ones
the two flags wrote before they shared `VARIANTS` (--variants' rows now also carry
fused_merge and programs_per_sm), so older results compare.
Variants: old = the MoE block's five launches after the router projection and decode
attention's second merge launch (the path before the decode fusion), new = the three-launch
MoE decode path (`kernels.moe.DECODE_FUSED`) and the in-kernel merge (fused_merge), moe /
merge = one of the two alone, pps1 / pps2 = the MoE path with the rotary decode kernel's
programs_per_sm (its split count) set to 1 / 2; "in_place" (the defaults: a hybrid's decode
updates its state slots in place, kernels/gdn_decode.py, with the gated-norm kernel; one-row
projections up to kernels.linear.GEMV_MAX_WEIGHT on the gemv), "gathered" (the earlier path:
the step's states gathered and scattered back around fla's recurrent kernel, the torch glue
and gated norm, and one-row projections over SKINNY_MAX_WEIGHT on cuBLAS), "in_place_cublas"
(in place, the earlier projection routing) and "in_place_bv32" (in place, the recurrent
kernel's fixed launch with 32 value columns and 4 warps, the 3-D order, instead of
gdn_decode.REC_LAUNCH, which takes 8 columns and 1 warp at batch 1); for a hybrid (Qwen3-Next,
Qwen3.5-MoE) "glue_off" / "glue_on" (qwen3_next_blocks.FUSED_GLUE: the attention's output gate and
the shared expert's combine in one kernel each, the residual adds inside the norms; with
kernels.moe.DECODE_FUSED on, its default, the shared expert is added in the MoE down kernel)
and "moe_fused_glue_on_apart" (glue on, its combine as its own kernel, kernels.moe.SHARED_IN_DOWN
off). (The former "moe_fused_glue_off" / "moe_fused_glue_on" were glue_off / glue_on with
DECODE_FUSED forced on; since it is on by default they are gone.) "hybrid_unfused" / "hybrid_fused"
(qwen3_next.FUSE_LAYERS, glue on in both: a hybrid's layers on the fused layer path at one row, the
zero-centred norms in the first projections' gemv prologues and the residual adds in the output
projections and the MoE down kernel, two launches fewer a layer; JSON fused_one_row says which
path the batch-1 graph took): `--config qwen3.5-35b-a3b --ab hybrid_unfused hybrid_fused --ab-rounds 2`.
The quantized decode products (scripts/gpu_qgemv.sh, with --quantization fp8 / awq): q_old (the
FP8 legacy one-row kernel, unfused layers, heuristic plans, the W4A16 one-row split sum 8
partials a load), q_unfused (the FP8 one-row product on kernels.gemv's kernel, the sweeps'
plans, 16 partials a load) and q_new (q_unfused with FP8 layers on the fused layer path).
--stack off builds a hybrid with its projections apart (qwen3_next.STACK_PROJECTIONS: the
layout is fixed at load, so that A/B is two runs; the JSON's "stacked_projections" says which).
--variants and --ab are exclusive.
--quantization fp8 quantizes the dummy bf16 weights at load (kernels/fp8_linear.py: e4m3,
per-channel scales; batch 1 runs the fp8-weight Triton kernel); the roofline then counts the
bytes held (fp8 projections, the bf16 embedding, lm_head and norms). --quantization awq / gptq
fills every projection with random packed 4-bit values of its shape (group 128, as vLLM's dummy
loader fills quantized parameters; kernels/w4a16_linear.py), batch 1 on the W4A16 GEMV.

Usage: python benchmarks/decode_latency.py [--config qwen3-0.6b] [--context 1024] [--steps 128] [--out FILE]
       [--gpu-memory-utilization 0.3] [--pdl on|off] [--gemv on|off] [--fused-layers on|off] [--gemv-plans FILE]
       [--w4-plans FILE] [--fp8-plans FILE]
       [--rope-decode on|off] [--attn JSON] [--quantization none|fp8|awq|gptq] [--moe-launches one|torch]
       [--ab old new ...] [--ab-rounds 2] [--variants gathered in_place gathered in_place] [--stack on|off]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import device_name, model_dir  # noqa: E402
from kernels import attention_triton as at  # noqa: E402
from kernels import fp8_gemv, gdn_decode, gemv, linear, moe, moe_decode_triton, norm, pdl, rope_decode  # noqa: E402
from kernels import w4a16_gemv  # noqa: E402
from services.worker.layers import gated_deltanet  # noqa: E402
from services.worker.layers.linear import quantized_weight_bytes  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from services.worker import fusion  # noqa: E402
from services.worker.models import qwen3_moe, qwen3_next, qwen3_next_blocks  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  # noqa: E402
from tests.runner_driver import step_logits  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
# --ab and --variants: each variant is the knobs it changes (VARIANTS); the others keep the
# run's baseline, their values after the command line's settings (`read_knobs`; --moe-launches
# torch turns moe_decode_fused off, --attn may set fused_merge and programs_per_sm). The knobs,
# read when the decode graphs are captured: in_place_decode (gated_deltanet.IN_PLACE_DECODE),
# gated_norm_triton (norm.GATED_TRITON), gemv_max_weight (linear.GEMV_MAX_WEIGHT), gdn_decode.TUNING's
# rec_table, block_v, rec_warps and rec_order (rec_table True takes gdn_decode.REC_LAUNCH by rows,
# False the fixed three), fused_glue (qwen3_next_blocks.FUSED_GLUE), moe_decode_fused
# (kernels.moe.DECODE_FUSED), shared_in_down (kernels.moe.SHARED_IN_DOWN), fused_merge (both
# decode kernels' in-kernel merge: rope_decode.ROPE_DECODE_DEFAULTS' and
# attention_triton.DECODE_DEFAULTS'; read from the one in use), programs_per_sm (the rotary
# decode kernel's) and moe_decode_tuned (kernels.moe_decode_triton.USE_TUNED: the MoE decode
# path's swept gate_up configs and down plans, off: the untuned defaults); the quantized
# decode products: fp8_one_row (kernels.fp8_gemv.ONE_ROW), fuse_quantized
# (services.worker.fusion.FUSE_QUANTIZED_ONE_ROW: FP8 layers on the fused path at one row;
# the runner chooses its FusionPlan again at each recapture), fp8_tuned / w4_tuned
# (fp8_gemv.USE_PLANS / w4a16_gemv.USE_PLANS: the plans of --fp8-plans / --w4-plans, off:
# the heuristics), w4_sum_chunk (w4a16_gemv.GEMV1_DEFAULTS' sum_chunk: the K-split partials
# the one-row kernel's summing program loads at a time; 8 before 2026-12-03); fuse_one_row
# (services.worker.fusion.FUSE_ONE_ROW: one-row steps on the fused layer path, for Qwen3-MoE
# since 2026-12-07: the MoE layers' norm in the router's gemv and the residual add in the
# experts' down kernel), fuse_moe_layers (services.worker.models.qwen3_moe.FUSE_MOE_LAYERS: whether
# Qwen3-MoE offers its layers to that path at all); moe_gate_up (kernels.moe_decode_triton.GATE_UP: the MoE decode path's gate_up
# as the grouped GEMM after the router + alignment program, or as a one-row kernel that routes
# each token itself, with the down kernel routing too: two launches); fuse_hybrid_layers
# (services.worker.models.qwen3_next.FUSE_LAYERS: whether a hybrid, Qwen3-Next / Qwen3.5-MoE,
# offers its layers to the fused layer path: the zero-centred norms in the first projections'
# prologues, the residual adds in the output projections and the MoE down kernel).
KNOB_NAMES = ("in_place_decode", "gated_norm_triton", "gemv_max_weight", "rec_table", "block_v", "rec_warps",
              "rec_order", "fused_glue", "moe_decode_fused", "shared_in_down", "fused_merge", "programs_per_sm",
              "moe_decode_tuned", "fp8_one_row", "fuse_quantized", "fp8_tuned", "w4_tuned", "w4_sum_chunk",
              "fuse_one_row", "fuse_moe_layers", "moe_gate_up", "fuse_hybrid_layers")
VARIANTS: dict[str, dict] = {
    # the MoE decode fusion's A/B (scripts/gpu_moe_check.sh ab): old = the five MoE launches and
    # decode attention's merge launch, new = the three-launch MoE path and the in-kernel merge
    "old": {"moe_decode_fused": False, "fused_merge": False},
    "new": {"moe_decode_fused": True, "fused_merge": True},
    "moe": {"moe_decode_fused": True, "fused_merge": False},
    "merge": {"moe_decode_fused": False, "fused_merge": True},
    "pps1": {"moe_decode_fused": True, "fused_merge": False, "programs_per_sm": 1},
    "pps2": {"moe_decode_fused": True, "fused_merge": False, "programs_per_sm": 2},
    # a hybrid's decode (scripts/gpu_hybrid_check.sh)
    "in_place": {},
    "gathered": {"in_place_decode": False, "gated_norm_triton": False, "gemv_max_weight": linear.SKINNY_MAX_WEIGHT},
    "in_place_cublas": {"gemv_max_weight": linear.SKINNY_MAX_WEIGHT},
    "in_place_bv32": {"rec_table": False, "block_v": 32, "rec_warps": 4},  # 1 warp would spill (sm90)
    # the hybrid's decode glue in fused kernels (qwen3_next_blocks.FUSED_GLUE), on the three-launch MoE
    # decode path (kernels.moe.DECODE_FUSED, on by default); _apart: the shared expert's combine
    # as its own kernel instead of in the MoE down kernel
    "glue_off": {"fused_glue": False}, "glue_on": {"fused_glue": True},
    "moe_fused_glue_on_apart": {"moe_decode_fused": True, "fused_glue": True, "shared_in_down": False},
    # the MoE decode path's swept launch choices (benchmarks/moe_decode_sweep.py) against the defaults
    "moe_tuned": {"moe_decode_tuned": True}, "moe_untuned": {"moe_decode_tuned": False},
    # the quantized one-row products (scripts/gpu_qgemv.sh): q_old = the FP8 legacy kernel
    # (no PDL, a second split-sum kernel), unfused layers, heuristic plans for FP8 and W4A16;
    # q_new = FP8 on kernels.gemv's kernel with the fused layer path, and the swept plans
    # (--fp8-plans / --w4-plans) for both, the one-row W4A16 split sum 16 partials a load (8
# before); q_unfused = q_new's kernels and plans, layers unfused
    "q_old": {"fp8_one_row": "legacy", "fuse_quantized": False, "fp8_tuned": False, "w4_tuned": False,
              "w4_sum_chunk": 8},
    "q_new": {"fp8_one_row": "gemv", "fuse_quantized": True, "fp8_tuned": True, "w4_tuned": True,
              "w4_sum_chunk": 16},
    "q_unfused": {"fp8_one_row": "gemv", "fuse_quantized": False, "fp8_tuned": True, "w4_tuned": True,
                  "w4_sum_chunk": 16},
    # the fused layer path at one row (a MoE model's too) against the unfused layers
    # (the MoE decode path's gate_up: grouped GEMM after the router + alignment program, three
    # launches; or routed one-row kernels, two; set in each, so that none depends on the defaults)
    "layers_fused": {"fuse_one_row": True, "fuse_moe_layers": True, "moe_gate_up": "grouped"},
    "layers_unfused": {"fuse_one_row": False, "fuse_moe_layers": False, "moe_gate_up": "grouped"},
    "moe_gate_up_grouped": {"moe_gate_up": "grouped"}, "moe_gate_up_gemv": {"moe_gate_up": "gemv"},
    "layers_fused_gemv": {"fuse_one_row": True, "fuse_moe_layers": True, "moe_gate_up": "gemv"},
    # a hybrid's layers (Qwen3-Next, Qwen3.5-MoE) on the fused layer path at one row, against
    # the unfused layers (both with the fused glue, its default; scripts/gpu_hybrid_fused.sh)
    "hybrid_fused": {"fuse_one_row": True, "fuse_hybrid_layers": True, "fused_glue": True},
    "hybrid_unfused": {"fuse_one_row": True, "fuse_hybrid_layers": False, "fused_glue": True}}
assert all(set(v) <= set(KNOB_NAMES) for v in VARIANTS.values())


def _merge_defaults() -> dict:
    """The launch defaults of the decode attention kernel in use (rotary-fused or not: --attn's
    target)."""
    return rope_decode.ROPE_DECODE_DEFAULTS if rope_decode.ENABLED else at.DECODE_DEFAULTS


def read_knobs() -> dict:
    """The knobs' current values (KNOB_NAMES, module comment above), e.g. the run's baseline."""
    return {"in_place_decode": gated_deltanet.IN_PLACE_DECODE, "gated_norm_triton": norm.GATED_TRITON,
            "gemv_max_weight": linear.GEMV_MAX_WEIGHT,
            **{k: gdn_decode.TUNING[k] for k in ("rec_table", "block_v", "rec_warps", "rec_order")},
            "fused_glue": qwen3_next_blocks.FUSED_GLUE, "moe_decode_fused": moe.DECODE_FUSED,
            "shared_in_down": moe.SHARED_IN_DOWN, "fused_merge": _merge_defaults()["fused_merge"],
            "programs_per_sm": rope_decode.ROPE_DECODE_DEFAULTS["programs_per_sm"],
            "moe_decode_tuned": moe_decode_triton.USE_TUNED, "fp8_one_row": fp8_gemv.ONE_ROW,
            "fuse_quantized": fusion.FUSE_QUANTIZED_ONE_ROW, "fp8_tuned": fp8_gemv.USE_PLANS,
            "w4_tuned": w4a16_gemv.USE_PLANS, "w4_sum_chunk": w4a16_gemv.GEMV1_DEFAULTS["sum_chunk"],
            "fuse_one_row": fusion.FUSE_ONE_ROW, "fuse_moe_layers": qwen3_moe.FUSE_MOE_LAYERS,
            "moe_gate_up": moe_decode_triton.GATE_UP, "fuse_hybrid_layers": qwen3_next.FUSE_LAYERS}


def variant_knobs(name: str, baseline: dict) -> dict:
    """Every knob's value under variant `name`: its VARIANTS entry over `baseline`. KeyError
    for an unknown name."""
    return {**baseline, **VARIANTS[name]}


def set_knobs(k: dict) -> None:
    """Set every knob (a dict of all KNOB_NAMES, as `read_knobs` / `variant_knobs` give)."""
    gated_deltanet.IN_PLACE_DECODE, norm.GATED_TRITON = k["in_place_decode"], k["gated_norm_triton"]
    linear.GEMV_MAX_WEIGHT = k["gemv_max_weight"]
    gdn_decode.TUNING.update(rec_table=k["rec_table"], block_v=k["block_v"], rec_warps=k["rec_warps"],
                             rec_order=k["rec_order"])
    qwen3_next_blocks.FUSED_GLUE, moe.DECODE_FUSED, moe.SHARED_IN_DOWN = k["fused_glue"], k["moe_decode_fused"], \
        k["shared_in_down"]
    rope_decode.ROPE_DECODE_DEFAULTS["fused_merge"] = at.DECODE_DEFAULTS["fused_merge"] = k["fused_merge"]
    rope_decode.ROPE_DECODE_DEFAULTS["programs_per_sm"] = k["programs_per_sm"]
    moe_decode_triton.USE_TUNED = k["moe_decode_tuned"]
    fp8_gemv.ONE_ROW, fusion.FUSE_QUANTIZED_ONE_ROW = k["fp8_one_row"], k["fuse_quantized"]
    fp8_gemv.USE_PLANS, w4a16_gemv.USE_PLANS = k["fp8_tuned"], k["w4_tuned"]
    w4a16_gemv.GEMV1_DEFAULTS["sum_chunk"] = k["w4_sum_chunk"]
    fusion.FUSE_ONE_ROW, qwen3_moe.FUSE_MOE_LAYERS = k["fuse_one_row"], k["fuse_moe_layers"]
    moe_decode_triton.GATE_UP = k["moe_gate_up"]
    qwen3_next.FUSE_LAYERS = k["fuse_hybrid_layers"]


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of reps."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def active_expert_share(hf_config) -> float:
    """num_experts_per_tok / num_experts of a MoE config.json (the share of its expert
    weights one token reads), 1.0 for a dense model."""
    e = int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)
    return int(hf_config.get("num_experts_per_tok", e)) / e if e > 1 else 1.0


def roofline_bytes(runner, tokens_in_cache: int) -> dict[str, int]:
    """Bytes one decode token reads and writes at batch 1 with `tokens_in_cache` tokens of
    KV: weights (each parameter once; stacked MoE experts at the share k / E), the KV read,
    and a hybrid model's recurrent state, read and written in every recurrent layer (0 for
    a model without one). Keys: weight_bytes, kv_bytes, state_bytes, total."""
    active = active_expert_share(runner.spec.text_config)
    # (quantized layers count their fp8 bytes: their parameters are meta placeholders)
    params = {p.data_ptr(): p.numel() * p.element_size() * (active if hasattr(p, "num_experts") else 1)
              for p in runner.model.parameters() if p.device.type != "meta"}
    weights = int(sum(params.values())) + quantized_weight_bytes(runner.model)
    kv = runner.kv_layout.block_bytes // runner.kv_layout.block_size * tokens_in_cache
    state = 2 * sum(s.slot_bytes for s in runner.model.state_specs())
    return {"weight_bytes": weights, "kv_bytes": kv, "state_bytes": state, "total": weights + kv + state}


def decode_steps(runner, prompt, table, steps, replay_table) -> tuple[list[float], list[float]]:
    """Prefill prompt, decode `steps` tokens. Returns (wall seconds per step, GPU seconds of
    forward + logits per step). replay_table: the blocks of the GPU-time replay of each step
    (a hybrid's replay also runs on state slot 1; a dense model's could share the table)."""
    slot, replay_slot = (0, 1) if runner.state_cache is not None else (-1, -1)
    runner.execute(StepPlan(0, [ScheduledSeq("r", prompt, 0, table, True, GREEDY, state_slot=slot)]))
    tok, pos, walls, gpus = 1, len(prompt), [], []
    for i in range(steps):
        plan = StepPlan(i + 1, [ScheduledSeq("r", [tok], pos, table, True, GREEDY, i + 1, state_slot=slot)])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tok = runner.execute(plan).sampled_token_ids[0]
        walls.append(time.perf_counter() - t0)
        replay = StepPlan(i + 1, [ScheduledSeq("t", [tok], pos, replay_table, True, GREEDY, i + 1,
                                               state_slot=replay_slot)])
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step_logits(runner, replay)  # the same step's work on other blocks (and state slot)
        b.record()
        b.synchronize()
        gpus.append(a.elapsed_time(b) / 1e3)
        pos += 1
    return walls, gpus


def time_variant(runner, knobs: dict, prompt, table, replay_table, steps: int, roof: float) -> dict:
    """Set `knobs` (`set_knobs`), capture the decode graphs again (the old ones and their pool
    freed first), warm up 8 steps and time `steps`. Returns capture_s, tpot_ms and
    gpu_forward_ms (medians, ms), fraction_of_roofline, gpu_fraction_of_roofline and fused_one_row
    (whether the recaptured batch-1 graph took the fused layer path; None for a runner without
    a plan)."""
    set_knobs(knobs)
    torch.cuda.synchronize()
    cap = runner.recapture_graphs()
    plan = getattr(runner, "fusion", None)
    decode_steps(runner, prompt, table, 8, replay_table)  # warm-up
    walls, gpus = decode_steps(runner, prompt, table, steps, replay_table)
    tpot, gpu = statistics.median(walls), statistics.median(gpus)
    return {"capture_s": round(cap, 3), "tpot_ms": round(tpot * 1e3, 4), "gpu_forward_ms": round(gpu * 1e3, 4),
            "fraction_of_roofline": round(roof / tpot, 3), "gpu_fraction_of_roofline": round(roof / gpu, 3),
            "fused_one_row": None if plan is None else bool(plan.fused(1))}


def run_variants(runner, names, baseline: dict, prompt, table, replay_table, steps, roof) -> list[dict]:
    """--variants: graphs TPOT per variant of `VARIANTS`, in the order named (`time_variant`).
    One row each: variant, every knob's value, capture_seconds, tpot_ms, gpu_forward_ms and
    the two roofline fractions. The knobs are set back to `baseline` after."""
    out = []
    try:
        for name in names:
            knobs = variant_knobs(name, baseline)
            t = time_variant(runner, knobs, prompt, table, replay_table, steps, roof)
            out.append({"variant": name, **knobs, "capture_seconds": t.pop("capture_s"), **t})
            print(json.dumps(out[-1]), flush=True)
    finally:
        set_knobs(baseline)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen3-0.6b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--moe-launches", choices=["one", "torch"], default="one",
                    help="MoE routing, alignment and the sum over k: one Triton launch each (kernels.moe_triton's "
                         "topk_softmax_triton, moe_align_triton, _sum_k_kernel) or the torch ops (the A/B baseline; "
                         "also turns the three-launch decode path off, kernels.moe.DECODE_FUSED)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                    help="the runner's share of GPU memory (weights, state and KV); 0.3 suits the dense "
                         "configs, a 61 GB MoE shape needs about 0.75, qwen3.5-35b-a3b (69 GB) 0.8")
    ap.add_argument("--pdl", choices=["on", "off"], default="on",
                    help="programmatic dependent launch of the decode kernels (kernels.pdl)")
    ap.add_argument("--gemv", choices=["on", "off"], default="on",
                    help="the one-row matrix-vector kernel (kernels.gemv) for batch-1 projections")
    ap.add_argument("--gemv-plans", default=None,
                    help="JSON {'NxK': [block_n, split, num_warps]} (gemv_sweep.py --plans-out)")
    ap.add_argument("--w4-plans", default=None,
                    help="JSON whose 'plans' are {'M,N,K': config} for kernels.w4a16_gemv.PLANS (w4a16_sweep.py --out)")
    ap.add_argument("--fp8-plans", default=None,
                    help="JSON whose 'plans' are {'NxK': [block_n, split, num_warps]} for kernels.fp8_gemv.PLANS "
                         "(qgemv_sweep.py --out)")
    ap.add_argument("--fused-layers", choices=["on", "off"], default="on",
                    help="the fused decoder layer at one row (services.worker.fusion.FUSE_ONE_ROW: norms and residual "
                         "adds inside the gemv projections)")
    ap.add_argument("--rope-decode", choices=["on", "off"], default="on",
                    help="decode attention with the rotary fused in (kernels.rope_decode)")
    ap.add_argument("--attn", default=None,
                    help="JSON overrides of kernels.rope_decode.ROPE_DECODE_DEFAULTS (or of the unfused "
                         "kernel's DECODE_DEFAULTS with --rope-decode off)")
    ap.add_argument("--ab", nargs="+", choices=sorted(VARIANTS), default=None,
                    help="graphs-only A/B in one process: these variants (VARIANTS) in turn, --ab-rounds times, "
                         "the graphs captured again before each (module doc)")
    ap.add_argument("--ab-rounds", type=int, default=2)
    ap.add_argument("--quantization", choices=["none", "fp8", "awq", "gptq"], default="none",
                    help="weights: bf16 (none), fp8 e4m3 quantized at load (kernels/fp8_linear.py), or awq / "
                         "gptq: random packed 4-bit weights, group 128 (W4A16, kernels/w4a16_linear.py)")
    ap.add_argument("--stack", choices=["on", "off"], default="on",
                    help="a hybrid model's stacked projections (qwen3_next.STACK_PROJECTIONS; the weight layout "
                         "is chosen at load, so an A/B of it is two runs)")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=None,
                    help="graphs TPOT once per variant (VARIANTS, as --ab's), in this order, recapturing the "
                         "graphs (e.g. gathered in_place gathered in_place: an A/B in one model load); no eager "
                         "run then")
    a = ap.parse_args()
    if a.ab and a.variants:
        ap.error("--ab and --variants are exclusive")
    pdl.ENABLED, gemv.ENABLED, rope_decode.ENABLED = a.pdl == "on", a.gemv == "on", a.rope_decode == "on"
    if a.moe_launches == "torch":
        from kernels import moe_triton
        moe_triton.ROUTER_TRITON, moe_triton.ALIGN_MAX_PAIRS, moe_triton.SUM_K_TRITON = False, 0, False
        moe.DECODE_FUSED = False  # the three-launch decode path has none of those torch ops
    fusion.FUSE_ONE_ROW = a.fused_layers == "on"  # read when the runner chooses its FusionPlan
    qwen3_next.STACK_PROJECTIONS = a.stack == "on"  # read when the model is built
    if a.attn:
        _merge_defaults().update(json.loads(a.attn))
    if a.gemv_plans:
        with open(a.gemv_plans) as fh:
            for key, plan in json.load(fh).items():
                gemv.PLANS[tuple(int(v) for v in key.split("x"))] = tuple(plan)
    if a.fp8_plans:
        with open(a.fp8_plans) as fh:
            for key, plan in json.load(fh)["plans"].items():
                fp8_gemv.PLANS[tuple(int(v) for v in key.split("x"))] = tuple(plan)
    if a.w4_plans:
        with open(a.w4_plans) as fh:
            for key, cfg in json.load(fh)["plans"].items():
                m, n, k = (int(v) for v in key.split(","))
                w4a16_gemv.PLANS[(m, n, k)] = cfg
    cli = {"model": model_dir(a.config), "load_format": "dummy", "device": "cuda", "dtype": "bfloat16",
           "max_num_seqs": 8, "max_num_batched_tokens": 2048, "max_model_len": 4096,
           "gpu_memory_utilization": a.gpu_memory_utilization, "quantization": a.quantization}
    runner = ModelRunner(build_config(cli=cli, env={}))
    report = runner.report()
    bw = copy_bandwidth()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 10000, (a.context,), generator=g).tolist()
    nb = -(-(a.context + a.steps + 1) // runner.block_size)
    table, replay_table = list(range(nb)), list(range(nb, 2 * nb))
    res = {"benchmark": "decode_latency", "device": device_name(), "config": a.config,
           "weights": "dummy", "context": a.context, "steps": a.steps, "runner": report,
           "copy_bandwidth_TBps": round(bw / 1e12, 3), "torch": torch.__version__,
           "quantization": a.quantization, "pdl": a.pdl, "moe_launches": a.moe_launches, "gemv": a.gemv,
           "fused_layers": a.fused_layers, "rope_decode": a.rope_decode, "attn": a.attn,
           "moe_decode_fused": moe.DECODE_FUSED, "stack": a.stack,
           "stacked_projections": bool(getattr(runner.model, "stacked", False)), "fused_glue": qwen3_next_blocks.FUSED_GLUE,
           "fused_merge": _merge_defaults()["fused_merge"],
           "gemv_plans": {f"{n}x{k}": p for (n, k), p in gemv.PLANS.items()},
           "w4_plans": {",".join(map(str, key)): c for key, c in w4a16_gemv.PLANS.items()},
           "fp8_plans": {f"{n}x{k}": p for (n, k), p in fp8_gemv.PLANS.items()},
           "fused_one_row": runner.fusion.fused(1)}
    # roofline: params once (a MoE's experts at k / E, fp8 layers at their bytes) + KV of the
    # mean context (K and V, every attention layer) + a hybrid's recurrent state, read and
    # written per layer
    roof_bytes = roofline_bytes(runner, a.context + a.steps // 2)
    bytes_per_token = roof_bytes["total"]
    roof = bytes_per_token / bw
    res.update(bytes_per_token=bytes_per_token, roofline_bytes=roof_bytes, roofline_ms=round(roof * 1e3, 4))
    baseline = read_knobs()  # after the command line's settings (VARIANTS' comment)
    if a.ab:
        run_ab(runner, a, res, baseline, prompt, table, replay_table, roof)
        return
    if a.variants:
        if runner.graphs is None:
            raise SystemExit("--variants needs CUDA graphs")
        res["variants"] = run_variants(runner, a.variants, baseline, prompt, table, replay_table,
                                       a.steps, roof)
    graphs = runner.graphs
    for mode in ((["graphs"] if graphs else []) + ["eager"]) if not a.variants else []:
        runner.graphs = graphs if mode == "graphs" else None
        decode_steps(runner, prompt, table, 8, replay_table)  # warm-up
        walls, gpus = decode_steps(runner, prompt, table, a.steps, replay_table)
        tpot, gpu = statistics.median(walls), statistics.median(gpus)
        res[mode] = {"tpot_ms": round(tpot * 1e3, 4), "tok_per_s": round(1 / tpot, 1),
                     "gpu_forward_ms": round(gpu * 1e3, 4),
                     "fraction_of_roofline": round(roof / tpot, 3),
                     "gpu_fraction_of_roofline": round(roof / gpu, 3)}
    runner.graphs = graphs
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


def run_ab(runner, a, res: dict, baseline: dict, prompt, table, replay_table, roof: float) -> None:
    """--ab (module doc): per round and variant of `VARIANTS`, `time_variant`; res["ab"] gets
    one row each (round, variant, capture_s, the times, the logits check), res["ab_median"]
    the median TPOT / GPU time per variant, res["ab_variants"] each variant's
    moe_decode_fused, fused_merge and programs_per_sm (None: the baseline's, not set by the
    variant). Writes a.out after every round; the knobs are set back to `baseline` after."""
    if runner.graphs is None:
        raise SystemExit("--ab needs decode graphs (CUDA, not --enforce-eager)")
    knobs = {v: variant_knobs(v, baseline) for v in a.ab}
    res["ab"], res["ab_variants"] = [], {v: {"moe_decode_fused": knobs[v]["moe_decode_fused"],
                                             "fused_merge": knobs[v]["fused_merge"],
                                             "programs_per_sm": VARIANTS[v].get("programs_per_sm")} for v in a.ab}
    # a correctness check per round: the graph step's logits for token 1 right after the prompt
    # (the same inputs for every variant: the prompt's KV comes from the prefill, which no
    # variant changes) against the first variant's; not for a hybrid (its state moves on)
    check = StepPlan(10 ** 6, [ScheduledSeq("chk", [1], len(prompt), table, True, GREEDY, 1)])
    first: torch.Tensor | None = None
    try:
        for rnd in range(a.ab_rounds):
            for v in a.ab:
                row = {"round": rnd, "variant": v,
                       **time_variant(runner, knobs[v], prompt, table, replay_table, a.steps, roof)}
                if runner.state_cache is None:
                    lg = step_logits(runner, check).float()
                    first = lg if first is None else first
                    row["check_logits_rel_vs_first"] = float((lg - first).norm() / first.norm().clamp_min(1e-30))
                    row["check_argmax_same"] = bool(torch.equal(lg.argmax(-1), first.argmax(-1)))
                res["ab"].append(row)
                print(json.dumps(res["ab"][-1]), flush=True)
            res["ab_median"] = {v: {k: round(statistics.median(r[k] for r in res["ab"] if r["variant"] == v), 4)
                                    for k in ("tpot_ms", "gpu_forward_ms", "fraction_of_roofline")} for v in a.ab}
            if a.out:
                with open(a.out, "w") as fh:
                    json.dump(res, fh, indent=1)
    finally:
        set_knobs(baseline)
    print(json.dumps(res["ab_median"], indent=1))


if __name__ == "__main__":
    main()
