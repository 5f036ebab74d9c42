"""Kestrel's logprobs against transformers' log_softmax of its own logits.

A tiny random Llama (written with save_pretrained, as in test_llama_parity) runs through
`ModelRunner.execute` with hand-made plans: the prompt in chunks with `prompt_logprobs`
(scored across chunk boundaries), then greedy decode steps with `logprobs`. For every
prompt token and every generated token, the chosen logprob and the top-k (ids and values)
equal transformers' `log_softmax(logits)` at the position before it.
Tolerance: 1e-4 absolute on fp32 logprobs (logits match within 1e-4 in test_llama_parity;
log_softmax does not amplify absolute errors).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from services.worker.model_runner import ModelRunner  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  # noqa: E402

ATOL = 1e-4
TOPK = 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    path = tmp_path_factory.mktemp("tiny_lp")
    model.save_pretrained(path)
    runner = ModelRunner(build_config(cli={"model": str(path), "device": "cpu", "dtype": "float32",
                                           "kv_cache_gib": 0.01}, env={}))
    return runner, model


def _check(lp, ref_row: torch.Tensor, token: int, k: int):
    assert lp.token_id == token
    assert abs(lp.logprob - ref_row[token].item()) < ATOL
    assert lp.rank == int((ref_row > ref_row[token] + ATOL).sum()) + 1
    top = torch.topk(ref_row, k)
    assert lp.top_ids == top.indices.tolist()
    assert torch.allclose(torch.tensor(lp.top_logprobs), top.values, atol=ATOL)


@pytest.mark.parametrize("cuts", [[23], [5, 6, 17, 23]], ids=["whole", "chunked"])
def test_prompt_and_greedy_logprobs_equal_transformers(tiny, cuts):
    runner, model = tiny
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 97, (23,), generator=g).tolist()
    n_out = 6
    sp = SamplingParams(temperature=0.0, logprobs=TOPK, prompt_logprobs=TOPK, max_tokens=n_out)
    table = list(range(-(-(len(prompt) + n_out) // runner.block_size)))
    prompt_lps, out_lps, toks, start = [], [], [], 0
    for end in cuts:
        seq = ScheduledSeq("lp", prompt[start:end], start, table, end == len(prompt), sp, 0,
                           num_prompt_tokens=len(prompt))
        res = runner.execute(StepPlan(0, [seq]))
        prompt_lps += res.prompt_logprobs.get("lp", [])
        if seq.sample:
            toks += res.sampled_token_ids
            out_lps += res.logprobs
        start = end
    for i in range(n_out - 1):
        seq = ScheduledSeq("lp", [toks[-1]], len(prompt) + i, table, True, sp, i + 1)
        res = runner.execute(StepPlan(0, [seq]))
        toks += res.sampled_token_ids
        out_lps += res.logprobs
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + toks])).logits[0].float(), dim=-1)
    assert len(prompt_lps) == len(prompt) - 1  # token 0 has none
    for i, lp in enumerate(prompt_lps):
        _check(lp, ref[i], prompt[i + 1], TOPK)
    assert len(out_lps) == n_out
    for j, lp in enumerate(out_lps):
        row = ref[len(prompt) - 1 + j]
        assert toks[j] == int(row.argmax())  # greedy token is the argmax of its own list
        assert lp.rank == 1 and lp.top_ids[0] == toks[j]
        _check(lp, row, toks[j], TOPK)


def test_logprobs_zero_gives_chosen_token_only(tiny):
    runner, model = tiny
    prompt = [3, 14, 15, 92, 65]
    sp = SamplingParams(temperature=1.0, seed=3, logprobs=0, prompt_logprobs=0)
    seq = ScheduledSeq("z", prompt, 0, [0], True, sp, 0, num_prompt_tokens=len(prompt))
    res = runner.execute(StepPlan(0, [seq]))
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    (lp,) = res.logprobs
    assert lp.top_ids == [] and abs(lp.logprob - ref[-1, res.sampled_token_ids[0]].item()) < ATOL
    assert [p.token_id for p in res.prompt_logprobs["z"]] == prompt[1:]
