"""Diagnostic for tests/gpu/test_hybrid_gpu.py failures (run by hand on the device): per
chunk end / decode step the relative logits error GPU vs CPU, and for speculation the first
divergence from plain greedy with the CPU logits margin (top1 - top2) there."""
import json
import sys
import tempfile


sys.path.insert(0, ".")
import tests.gpu.test_hybrid_gpu as t  # noqa: E402
from tests.runner_driver import generate, spec_run, step_logits  # noqa: E402
from shared.protocol import ScheduledSeq, StepPlan  # noqa: E402


path = t.write_tiny(tempfile.mkdtemp(prefix="tiny_next"))
gpu, cpu = t._runner(path, "cuda"), t._runner(path, "cpu")
prompt = t._prompts(5)[4]
for cuts in ([], [64, 100]):
    ends = [c for c in cuts if c < len(prompt)] + [len(prompt)]
    a = t._chunk_logits(gpu, prompt, ends, [7, 300, 42, 511])
    b = t._chunk_logits(cpu, prompt, ends, [7, 300, 42, 511])
    print("cuts", ends, [round(((x - y).abs().max() / y.abs().max()).item(), 5) for x, y in zip(a, b)],
          "ref max", [round(y.abs().max().item(), 2) for y in b])
prompts = [p + p[:20] for p in t._prompts(4)]
plain = generate(gpu, prompts, 24)
plain_cpu = generate(cpu, prompts, 24)
print("plain gpu == cpu", plain == plain_cpu)
sr = t._runner(path, "cuda", speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 3}))
got = spec_run(sr, prompts, 24, 3, chunk=9)
print("spec drafts", got.num_draft_tokens, "accepted", got.num_accepted)
for i, (p, g) in enumerate(zip(plain, got.tokens)):
    if p != g:
        j = next(k for k in range(len(p)) if p[k] != g[k])
        ctx = prompts[i] + p[:j]
        table = list(range(-(-len(ctx) // cpu.block_size) + 1))
        lg = step_logits(cpu, StepPlan(0, [ScheduledSeq("r", ctx, 0, table, True, t.GREEDY, state_slot=0)]))[0]
        top = lg.topk(2)
        print(f"prompt {i}: first divergence at {j}: plain {p[j]} spec {g[j]}; cpu top2 {top.indices.tolist()} "
              f"margin {float(top.values[0] - top.values[1]):.5f}")
    else:
        print(f"prompt {i}: equal")
plain9 = generate(gpu, prompts, 24, chunk=9)
print("plain chunk=9 equal to whole-prompt plain:", plain9 == plain)
