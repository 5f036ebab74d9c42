"""Kestrel's Qwen3 dense model against Hugging Face transformers' Qwen3ForCausalLM.

Tiny seeded random checkpoints (GQA, q/k RMSNorm with non-unit weights; tied and untied
embeddings), written with save_pretrained: logits at every compared position match
transformers' within 1e-4 (fp32) for whole and chunked prefills and decode steps, and
batched greedy generation with mixed chunks equals transformers' `generate`.
Also: `--load-format dummy` builds the published Qwen3 shape's model with finite outputs.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from services.worker.model_runner import ModelRunner  # noqa: E402
from tests.runner_driver import generate, step_logits  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  # noqa: E402

ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0)
VARIANTS = {"untied_gqa": dict(tie_word_embeddings=False, num_key_value_heads=2),
            "tied_gqa1": dict(tie_word_embeddings=True, num_key_value_heads=1)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny_qwen3(request, tmp_path_factory):
    """(folder, transformers model) of a seeded random tiny Qwen3."""
    cfg = transformers.Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **VARIANTS[request.param])
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # larger than the default init so attention is not uniform, and
        for name, p in model.named_parameters():  # q/k norm weights that are not all ones
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "q_norm" in name or "k_norm" in name:
                p.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path, model


def _runner(path, **kw) -> ModelRunner:
    cli = {"model": str(path), "device": "cpu", "dtype": "float32", "kv_cache_gib": 0.02, **kw}
    return ModelRunner(build_config(cli=cli, env={}))


def test_tiny_qwen3_logits_match_transformers_whole_and_chunked_prefill_and_decode(tiny_qwen3):
    path, hf = tiny_qwen3
    runner = _runner(path, block_size=4)
    prompt = torch.randint(0, 97, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    table = list(range(10))
    for cuts in ([23], [4, 9, 23]):
        ours, start, toks = {}, 0, []
        for end in cuts:
            plan = StepPlan(0, [ScheduledSeq("r", prompt[start:end], start, table, True, GREEDY)])
            ours[end - 1] = step_logits(runner, plan)[0]
            start = end
        for i in range(5):
            toks.append(int(ours[max(ours)].argmax()))
            pos = len(prompt) + i
            ours[pos] = step_logits(runner, StepPlan(0, [ScheduledSeq("r", [toks[-1]], pos, table, True, GREEDY, i + 1)]))[0]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + toks])).logits[0].float()
        for pos, logits in ours.items():
            diff = (logits - ref[pos]).abs().max().item()
            assert diff < ATOL, f"cuts {cuts}, position {pos}: max abs diff {diff}"


def test_tiny_qwen3_batched_greedy_with_mixed_chunks_matches_transformers_generate(tiny_qwen3):
    path, hf = tiny_qwen3
    runner = _runner(path, block_size=16)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 17, 40)]
    for prompt, got in zip(prompts, generate(runner, prompts, 8, chunk=7)):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                              do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == ref, (prompt, got, ref)


def test_dummy_weights_of_a_qwen3_shape_give_finite_logits_and_are_seeded(tmp_path):
    import json

    cfg = json.loads((pathlib.Path(__file__).resolve().parents[2] / "benchmarks/configs/qwen3-0.6b.json").read_text())
    cfg.update(num_hidden_layers=2, vocab_size=1000)  # the published shape, cut to CI size
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    outs = []
    for _ in range(2):
        runner = _runner(tmp_path, load_format="dummy", seed=7, kv_cache_gib=0.01)
        plan = StepPlan(0, [ScheduledSeq("r", list(range(1, 40)), 0, list(range(3)), True, GREEDY)])
        outs.append(step_logits(runner, plan)[0])
    assert torch.isfinite(outs[0]).all() and outs[0].std() > 0
    assert torch.equal(outs[0], outs[1])
