"""Accuracy of the int4 products' variants on SmolLM2-135M-Instruct against fp32, with the measures
of tests/parity/test_cpu_quant_accuracy.py (mean / max KL of the next-token distributions after 16
prompts, top-1 agreement, identical greedy 64-token continuations, mean common prefix): tinygemm
(`cpu_quant_linear.INT4_VNNI` off: bf16 activations) and the VNNI kernel with one and two int8
planes of x (`cpu_int4_vnni.X_PLANES`), for --quantization int4 and gguf.

Usage: .venv/bin/python benchmarks/cpu_int4_accuracy.py [--schemes int4 gguf] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import emit_json  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--schemes", nargs="+", default=["int4", "gguf"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import transformers

    from kernels import cpu_int4_vnni
    from kernels import cpu_quant_linear as cq
    from tests.parity.test_cpu_quant_accuracy import NEW_TOKENS, PROMPTS, _run

    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    ref_logits, ref_tokens = _run(a.model, "none", ids)
    lp_ref = ref_logits.log_softmax(-1)
    res: dict = {"benchmark": "cpu_int4_accuracy", "date": time.strftime("%Y-%m-%d"), "variants": {}}
    for scheme in a.schemes:
        for name, vnni_on, planes in (("tinygemm", False, 0), ("vnni_1plane", True, 1), ("vnni_2planes", True, 2)):
            cq.INT4_VNNI = vnni_on
            cpu_int4_vnni.X_PLANES = planes or 2
            logits, tokens = _run(a.model, scheme, ids)
            lp = logits.log_softmax(-1)
            kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
            prefix = [next((j for j, (x, y) in enumerate(zip(p, q)) if x != y), NEW_TOKENS)
                      for p, q in zip(ref_tokens, tokens)]
            res["variants"][f"{scheme} {name}"] = {
                "kl_mean": round(kl.mean().item(), 5), "kl_max": round(kl.max().item(), 5),
                "top1": (ref_logits.argmax(-1) == logits.argmax(-1)).float().mean().item(),
                "identical": sum(p == q for p, q in zip(ref_tokens, tokens)), "of": len(tokens),
                "mean_common_prefix": round(sum(prefix) / len(prefix), 1)}
            print(scheme, name, res["variants"][f"{scheme} {name}"], file=sys.stderr)
    emit_json(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
