"""`kestrel serve --quantization gguf` as users start it, on the tiny llama GGUF of
tests/gguf_tiny.py (Q4_0 / Q4_1 / Q4_K / Q8_0 weights) converted by `kestrel fetch-model --gguf`.

Truth: transformers on the converted folder (every tensor dequantized to fp32 by the `gguf`
package), scoring the same prompt. The server's prompt logprobs (/v1/completions, echo) come
from the int4 blocks with bf16 activations, int8 for the Q8_0 weights and the tied head.
Measured: |logprob - transformers'| max 0.26, mean 0.09 over the 47 scored tokens (their
logprobs span -21.7 .. -3.3: an arbitrary token sequence); bounds 0.5 and 0.2. A loader bug
moves the logits by several units (tests/parity/test_gguf_weights.py: 66-79% of their range).
"""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from tests.e2e.server import KestrelServer
from tests.gguf_tiny import tiny_model_folder

transformers = pytest.importorskip("transformers")

PROMPT = [(11 * j + 5) % 270 for j in range(48)]
MAX_ERR, MEAN_ERR = 0.5, 0.2


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return tiny_model_folder(str(tmp_path_factory.mktemp("gguf-e2e")))


def test_served_gguf_scores_the_prompt_as_the_fp32_model(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
    want = [lp[j - 1, PROMPT[j]].item() for j in range(1, len(PROMPT))]
    with KestrelServer(folder, "--device", "cpu", "--quantization", "gguf", "--kv-cache-gib", "0.05") as srv:
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
        r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        # the supervisor prints the startup report once /health first answers: it may come
        # after this request's answer, so wait for it (a deadline against a hang only)
        deadline = time.monotonic() + 120
        while "gguf tensors: " not in (log := srv.log_tail(400)) and time.monotonic() < deadline:
            time.sleep(0.2)
    got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert got[0] is None and len(got) == len(PROMPT)
    errs = [abs(a - b) for a, b in zip(got[1:], want)]
    facts = f"|logprob error| max {max(errs):.4f} mean {sum(errs) / len(errs):.4f}; logprobs " \
            f"{min(want):.2f} .. {max(want):.2f}"
    assert max(errs) <= MAX_ERR and sum(errs) / len(errs) <= MEAN_ERR, facts
    assert "gguf tensors: " in log and "int4 Q4_K x5" in log, log
