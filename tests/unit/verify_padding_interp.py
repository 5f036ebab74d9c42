"""The Triton attention kernels over a padded mixed-k verify step (tests/unit/verify_padding_case.py)
under TRITON_INTERPRET=1: prints one JSON object {kernel: relative error of the real rows
against `paged_attention_ref` over the eager layout}. The varlen prefill kernel always; the
split-K multi-query kernel (`kernels.attention_multi_query`) when the tree has it, at the
split count a graph captures (from max_model_len) and at 1 and 3 splits. Launched like a
graph launches them: host bounds max_q_len = 1 + K, max_seq_len = max_model_len (a padded
seq_len may pass it). Run by tests/unit/test_verify_layout.py; exit 3 without triton."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

if importlib.util.find_spec("triton") is None:
    sys.exit(3)

import torch  # noqa: E402

from kernels import attention_triton as at  # noqa: E402
from kernels.attention import paged_attention_ref  # noqa: E402
from kernels.device_info import num_sms  # noqa: E402
from tests.unit import verify_padding_case as case  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; inf on NaN."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    lay, (q, cu, lens, tables), (qp, cup, lensp, staged), (kc, vc) = case.build(torch.float32)
    scale = case.D ** -0.5
    want = paged_attention_ref(q, kc, vc, cu, lens, tables, scale)
    bounds = (1 + lay.k, case.MAX_MODEL_LEN)
    out = {}
    got = at.paged_attention_triton(qp, kc, vc, cup, lensp, staged, scale, *bounds, {"multi_query": False})
    out["prefill"] = rel(case.real_rows(lay, got), want)
    mq = importlib.util.find_spec("kernels.attention_multi_query")
    if mq is not None and os.path.dirname(mq.origin or "") == os.path.dirname(at.__file__ or ""):  # this tree's
        from kernels.attention_multi_query import multi_query_attention_triton
        for splits in (None, 1, 3):
            got = multi_query_attention_triton(qp, kc, vc, cup, lensp, staged, scale, *bounds, num_sms(qp.device),
                                               {"splits": splits})
            out[f"multi_query_splits_{splits}"] = rel(case.real_rows(lay, got), want)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
