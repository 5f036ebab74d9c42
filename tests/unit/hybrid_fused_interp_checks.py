"""The hybrids' fused layer path through `kernels.gemv` under TRITON_INTERPRET=1: tiny random
Qwen3-Next (a dense MLP layer among the MoE ones) and Qwen3.5-MoE checkpoints
(tests/hybrid_checkpoint.py), projections stacked and apart, whose one-row decode steps run
the fused layer path with every projection on the gemv kernel (the zero-centred norms' scale
as the prologue's weight, xn_out, the residual epilogue), against the same runner's unfused
path on the reference ops. Prints one JSON object {case: {err, gemv, norm, xn_out, residual}}
on a line starting "RESULT ": err the largest relative norm error of the 3 decode steps'
logits, the others the gemv launches of those steps and how many carried each fused step.

Run by tests/unit/test_hybrid_fused_interp.py in a subprocess (the interpreter switch is read
when triton is first imported). As tests/unit/test_fused_linear.py's model checks: the weights
made dense and row-major (as on the GPU), `kernels.linear.skinny_applies` made to accept CPU
tensors, the prefill unfused (the fusion plan fuses one-row steps only).
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import tempfile

import torch  

from kernels import gemv  
from kernels import linear as L  
from services.worker.fusion import FusionPlan  
from services.worker.layers.linear import Linear, unpack_cpu_weights  
from services.worker.model_runner import ModelRunner  
from services.worker.models import qwen3_next  
from shared.config import build_config  
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  
from tests.hybrid_checkpoint import write_tiny_qwen3_next  
from tests.runner_driver import step_logits  

VOCAB = 101
GREEDY = SamplingParams(temperature=0.0)
# (arch, stacked, dtype): fp32 everywhere, fp16 once (the interpreter's bf16 casts are not torch's)
CASES = [(a, s, "float32") for a, s in itertools.product(("qwen3_next", "qwen3_5_moe"), (True, False))] + \
        [("qwen3_5_moe", True, "float16")]


def case_name(arch: str, stacked: bool, dtype: str) -> str:
    return f"{arch}_{'stacked' if stacked else 'apart'}_{dtype}"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_steps(r: ModelRunner) -> list[torch.Tensor]:
    """Logits of 3 decode steps after a 7-token prefill (state slot 0, from zeros)."""
    prompt = torch.randint(1, VOCAB, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    table = list(range(8))
    logits = step_logits(r, StepPlan(0, [ScheduledSeq("a", prompt, 0, table, True, GREEDY, state_slot=0)]))
    out = []
    for i in range(3):
        tok = int(logits[0].argmax())
        logits = step_logits(r, StepPlan(1 + i, [ScheduledSeq("a", [tok], 7 + i, table, True, GREEDY, 1 + i,
                                                              state_slot=0)]))
        out.append(logits)
    return out


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    out: dict = {}
    calls = {"gemv": 0, "norm": 0, "xn_out": 0, "residual": 0}
    real_gemv = gemv.gemv_triton

    def counting(x, weight, *a, **kw):
        calls["gemv"] += 1
        calls["norm"] += kw.get("norm_weight") is not None
        calls["xn_out"] += kw.get("xn_out") is not None
        calls["residual"] += kw.get("residual") is not None
        return real_gemv(x, weight, *a, **kw)

    gemv.TUNING.update(max_block_k=32)  # K ranges of at most 32 columns: hidden 64 splits in 2
    with tempfile.TemporaryDirectory() as tmp:
        paths = {arch: write_tiny_qwen3_next(pathlib.Path(tmp) / arch, vocab=VOCAB, arch=arch,
                                             mlp_only_layers=(3,) if arch == "qwen3_next" else ())
                 for arch in ("qwen3_next", "qwen3_5_moe")}
        for arch, stacked, dtype in CASES:
            qwen3_next.STACK_PROJECTIONS = stacked  # read when the model is built
            r = ModelRunner(build_config(cli={"model": str(paths[arch]), "device": "cpu", "dtype": dtype,
                                              "kv_cache_gib": 0.02, "block_size": 4, "max_model_len": 64}, env={}))
            unpack_cpu_weights(r.model)  # the kernel wants dense row-major weights (as on the GPU)
            for mod in r.model.modules():
                if isinstance(mod, Linear):
                    mod.weight.data = mod.weight.data.contiguous()
            unfused = run_steps(r)
            saved = (L.skinny_applies, gemv.gemv_triton)
            L.skinny_applies = lambda x, w: x.dim() == 2 and 0 < x.shape[0] <= L.SKINNY_MAX_ROWS
            gemv.gemv_triton = counting
            r.fusion = FusionPlan(frozenset({1}))  # decode steps fused, the prefill not
            calls.update(gemv=0, norm=0, xn_out=0, residual=0)
            try:
                fused = run_steps(r)
            finally:
                L.skinny_applies, gemv.gemv_triton = saved
            out[case_name(arch, stacked, dtype)] = {"err": max(_rel(a, b) for a, b in zip(fused, unfused)),
                                                    **calls}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
