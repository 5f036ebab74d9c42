"""Kestrel's Qwen3-MoE model against Hugging Face transformers' Qwen3MoeForCausalLM (5.24).

Tiny seeded random checkpoints written with save_pretrained (per-expert tensors, as the
published checkpoints store them), two variants: renormalised top-k with a dense layer
(`mlp_only_layers`), and unnormalised top-k with every other layer dense
(`decoder_sparse_step` 2). Shown, in fp32 on the CPU:
- logits of 3 prompts, at every prompt position and over 4 decode steps, within 1e-4 of
  transformers', for a whole prefill and a chunked one (chunk boundaries inside the prompt);
- greedy 32 tokens equal to transformers' `generate`;
- 8 requests run together (mixed chunks and decodes in one step) equal to each alone;
- speculative decoding (n-gram, and the model as its own draft model) gives the plain
  greedy output, with drafts that are partly right (rejections roll back);
- the loader refuses a checkpoint with an expert missing, naming it;
- `--load-format dummy` builds the published Qwen3-30B-A3B shape (cut to 2 layers and 8
  experts) with finite, seeded outputs.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from services.worker.model_runner import ModelRunner  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  # noqa: E402
from tests.parity.hf_checks import (assert_greedy_matches_generate, assert_logits_match,  # noqa: E402
                                    assert_speculation_is_lossless, assert_together_equals_alone)
from tests.runner_driver import generate, spec_run, step_logits  # noqa: E402

ATOL = 1e-4
VOCAB = 101
GREEDY = SamplingParams(temperature=0.0)
VARIANTS = {
    "renorm_dense_layer": dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                               num_experts=8, num_experts_per_tok=2),
    "sparse_step2": dict(norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[],
                         num_experts=6, num_experts_per_tok=3),
}


def _config(**kw):
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, moe_intermediate_size=24,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **kw)


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny_moe(request, tmp_path_factory):
    """(folder, transformers model) of a seeded random tiny Qwen3-MoE."""
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(_config(**VARIANTS[request.param])).eval()
    with torch.no_grad():  # larger than the default init: non-uniform attention and routing
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif p.dim() >= 2:
                p.normal_(0, 0.15)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path, model


def _runner(path, **kw) -> ModelRunner:
    cli = {"model": str(path), "device": "cpu", "dtype": "float32", "kv_cache_gib": 0.02, **kw}
    return ModelRunner(build_config(cli=cli, env={}))


def _prompts(n: int, lengths=(5, 19, 33, 8, 27, 12, 40, 3)) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def test_the_checkpoint_has_per_expert_tensors_and_both_layer_kinds(tiny_moe):
    path, hf = tiny_moe
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in names)
    assert any(".mlp.gate_up_proj.weight" in n or ".mlp.gate_proj.weight" in n for n in names)


def test_logits_of_3_prompts_match_transformers_whole_and_chunked_prefill_and_decode(tiny_moe):
    path, hf = tiny_moe
    assert_logits_match(_runner(path, block_size=4), hf, _prompts(3, (23, 9, 31)), [[], [4, 7]], ATOL)


def test_greedy_32_tokens_equal_transformers_generate(tiny_moe):
    path, hf = tiny_moe
    assert_greedy_matches_generate(_runner(path, block_size=16), hf, _prompts(3), 32, chunk=11)


def test_8_requests_together_equal_each_alone(tiny_moe):
    path, _ = tiny_moe
    assert_together_equals_alone(_runner(path, block_size=8), _prompts(8), 12, chunk=9)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_on_moe_gives_the_plain_greedy_output(tiny_moe, method):
    path, _ = tiny_moe
    prompts, n, k = _prompts(3), 16, 3
    plain = generate(_runner(path, block_size=8), prompts, n)
    spec = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        spec["model"] = str(path)
    runner = _runner(path, block_size=8, max_model_len=256, speculative_config=json.dumps(spec))
    if method == "draft_model":  # the target drafting itself: every draft accepted
        own = spec_run(runner, prompts, n, k, chunk=9)
        assert own.num_draft_tokens > 0 and own.num_accepted == own.num_draft_tokens
    assert_speculation_is_lossless(runner, plain, prompts, n, k, VOCAB)


def test_a_checkpoint_without_one_expert_is_refused_naming_it(tiny_moe, tmp_path):
    path, _ = tiny_moe
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    victim = min(n for n in tensors if n.endswith(".mlp.experts.2.up_proj.weight"))
    layer = victim.split(".")[2]
    del tensors[victim]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match=rf"model\.layers\.{layer}\.mlp\.experts\.w13_weight\[shard \(2, 1\)\]"):
        _runner(tmp_path)


def test_dummy_weights_of_the_qwen3_30b_a3b_shape_give_finite_seeded_logits(tmp_path):
    cfg = json.loads((pathlib.Path(__file__).resolve().parents[2]
                      / "benchmarks/configs/qwen3-30b-a3b.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts"] == 128
    cfg.update(num_hidden_layers=2, vocab_size=1000, num_experts=8)  # cut to CI size
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    outs = []
    for _ in range(2):
        runner = _runner(tmp_path, load_format="dummy", seed=7, kv_cache_gib=0.01)
        plan = StepPlan(0, [ScheduledSeq("r", list(range(1, 40)), 0, list(range(3)), True, GREEDY)])
        outs.append(step_logits(runner, plan)[0])
    assert torch.isfinite(outs[0]).all() and outs[0].std() > 0
    assert torch.equal(outs[0], outs[1])
