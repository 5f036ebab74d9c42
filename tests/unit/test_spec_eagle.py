"""The EAGLE-style head (services/worker/spec/eagle.py) on the CPU with random weights, through
the speculative loop of tests/unit/spec_head_rig.py:
- lossless: greedy output with EAGLE drafts equals greedy output without speculation
  (ModelRunner.execute), with chunked prefill, requests joining mid-batch and a preemption;
- state: after every acceptance length, preemptions and joins, each proposal's draft
  distributions equal a dense re-computation of EAGLE-3 over the context it was given
  (plain torch over whole tensors, features from a fresh prefill of the target);
- loading: a checkpoint in the documented layout round-trips (draft vocabulary with d2t,
  its own embedding, eagle_config layers), a missing or extra tensor is refused.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import save_file

from kernels.cpu_linear import dense
from services.worker.spec.eagle import EagleProposer, eagle_default_layers
from shared.protocol import SamplingParams
from shared.spec_config import SpeculativeConfig
from tests.runner_driver import generate, spec_run
from tests.unit.spec_head_dense import eagle_dense
from tests.unit.spec_head_rig import SpecRig, attach, sharpen, tiny_runner

K = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_runner(tmp_path_factory.mktemp("eagle-target"))


def _prompts(seed: int, sizes=(5, 40, 17, 1, 33, 9, 21, 2)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32, (n,), generator=g).tolist() for n in sizes]


def _proposer(target, sampling: str = "greedy", model: str | None = None, layers=()) -> EagleProposer:
    runner, cfg = target
    p = EagleProposer(cfg, SpeculativeConfig("eagle", K, model=model, draft_sampling=sampling,
                                             target_layer_ids=tuple(layers)), runner)
    attach(runner, p)
    return p


def test_default_layers_are_low_mid_high_outputs():
    assert eagle_default_layers(32) == (1, 15, 28)  # vLLM's (2, 16, 29), counted as layer inputs
    assert eagle_default_layers(8) == (1, 3, 4)
    assert eagle_default_layers(2) == (1, 0, 0)


def test_greedy_output_with_eagle_equals_output_without(target):
    runner, _ = target
    p = _proposer(target)
    assert p.target_layer_ids == (1, 3, 4) and runner.model.aux_hidden_layers == (1, 3, 4)
    assert p.kv_specs()[0].num_kv_heads == 2 and p.info().kv_bytes_per_block == 2 * 16 * 2 * 16 * 4
    prompts = _prompts(0)
    base = generate(runner, prompts, 20)
    rig = SpecRig(runner, p, K)
    # chunked prefills beside verify steps, requests arriving later, one restarted from 0
    out = rig.run(prompts, 20, chunk=16, join=[0, 0, 1, 2, 3, 0, 5, 1], preempt={6: 1, 9: 4})
    assert out == base
    assert rig.accepted > 0 and len(rig.log) > 100  # drafts were accepted, and many proposed
    assert all(len(entry.drafts) == K for entry in rig.log)
    assert p._carry == {}  # every request was forgotten at its end


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_greedy_output_through_the_runner_equals_output_without(tmp_path, arch):
    runner, _ = tiny_runner(tmp_path, '{"method": "eagle", "num_speculative_tokens": 3, "policy": "fixed"}',
                            architectures=[arch], model_type=arch[:5].lower())
    assert runner.model.aux_hidden_layers == runner.proposer.target_layer_ids == (1, 3, 4)
    prompts = _prompts(4, (3, 26, 11, 19))
    base = generate(runner, prompts, 16)
    run = spec_run(runner, prompts, 16, K, chunk=8)
    assert run.tokens == base and run.num_draft_tokens > 0
    rep = runner.report()["speculative"]
    assert rep["method"] == "eagle" and rep["kv_bytes_per_block"] == 2 * 16 * 2 * 16 * 4
    assert runner.proposer._carry == {}  # the driver's forget reached it


@pytest.mark.parametrize("sampling", ["greedy", "probabilistic"])
def test_drafts_follow_the_context_through_rollbacks_preemption_and_joins(target, sampling):
    runner, _ = target
    p = _proposer(target, sampling)
    sharpen(p.head, seed=1)
    temp = 0.0 if sampling == "greedy" else 1.0
    rig = SpecRig(runner, p, K, SamplingParams(temperature=temp, seed=5))
    lengths = iter([0, 1, 2, 3, 1, 0, 3, 2] * 100)
    rig.run(_prompts(1, (7, 30, 3, 18)), 14, chunk=8, join=[0, 2, 0, 4], preempt={5: 0, 8: 3},
            verify=lambda d: min(len(d), next(lengths)), rng=random.Random(3))
    assert rig.accepted > 20
    for entry in rig.log:
        ref = eagle_dense(p, runner, entry.context, entry.drafts, temp or 1.0, rig.blocks(len(entry.context)))
        if sampling == "probabilistic":
            assert entry.probs is not None and entry.probs.shape == (K, 32)
            torch.testing.assert_close(entry.probs, ref, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(entry.probs.sum(-1), torch.ones(K))
        else:  # point masses: each draft is the argmax of its step
            assert entry.probs is None
            assert entry.drafts == ref.argmax(-1).tolist()
        rig.next_block -= -(-len(entry.context) // runner.block_size)  # give the reference's blocks back


def test_seeded_probabilistic_drafts_repeat_and_differ_by_seed(target):
    runner, _ = target
    p = _proposer(target, "probabilistic")
    sharpen(p.head, seed=2, scale=5.0)
    runs = []
    for seed in (1, 1, 2):
        rig = SpecRig(runner, p, K, SamplingParams(temperature=1.0, seed=seed))
        rig.run(_prompts(2, (6, 11)), 9, verify=lambda d: 0, rng=random.Random(0))
        runs.append([e.drafts for e in rig.log])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def _write_checkpoint(folder, runner, with_embed: bool, draft_vocab: int = 16,
                      norm_before_residual: bool = False) -> dict[str, torch.Tensor]:
    h, kv = 64, 2 * 16
    g = torch.Generator().manual_seed(7)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    t = {"fc.weight": r(h, 3 * h), "midlayer.input_layernorm.weight": 1 + r(h),
         "midlayer.hidden_norm.weight": 1 + r(h), "midlayer.post_attention_layernorm.weight": 1 + r(h),
         "midlayer.self_attn.q_proj.weight": r(64, 2 * h), "midlayer.self_attn.k_proj.weight": r(kv, 2 * h),
         "midlayer.self_attn.v_proj.weight": r(kv, 2 * h), "midlayer.self_attn.o_proj.weight": r(h, 64),
         "midlayer.mlp.gate_proj.weight": r(96, h), "midlayer.mlp.up_proj.weight": r(96, h),
         "midlayer.mlp.down_proj.weight": r(h, 96), "norm.weight": 1 + r(h), "lm_head.weight": r(draft_vocab, h),
         "d2t": torch.arange(draft_vocab, dtype=torch.long),  # draft i -> target i + d2t[i] = 2i
         "t2d": torch.zeros(32, dtype=torch.bool)}
    if with_embed:
        t["embed_tokens.weight"] = r(32, h)
    save_file(t, str(folder / "model.safetensors"))
    conf = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": h, "intermediate_size": 96,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 32, "draft_vocab_size": draft_vocab,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 7]},
            "norm_before_residual": norm_before_residual}
    (folder / "config.json").write_text(json.dumps(conf))
    return t


@pytest.mark.parametrize("with_embed,norm_before_residual", [(False, False), (True, False), (False, True)])
def test_checkpoint_round_trip(target, tmp_path, with_embed, norm_before_residual):
    runner, _ = target
    saved = _write_checkpoint(tmp_path, runner, with_embed, norm_before_residual=norm_before_residual)
    p = _proposer(target, "probabilistic", model=str(tmp_path))
    assert p.target_layer_ids == (1, 3, 6)  # vLLM's layer inputs 2, 4, 7 as layer outputs
    params = {n: dense(w) for n, w in p.head.named_parameters()}
    stacked = {"midlayer.self_attn.kv_proj.weight": ("k_proj", "v_proj"),
               "midlayer.mlp.gate_up_proj.weight": ("gate_proj", "up_proj")}
    for name, (first, second) in stacked.items():
        a, b = (saved[name.replace(name.split(".")[-2], x)] for x in (first, second))
        torch.testing.assert_close(params[name], torch.cat([a, b]), rtol=0, atol=0)
    plain = [n for n in saved if n not in ("d2t", "t2d") and not any(x in n for x in ("k_proj", "v_proj", "gate_proj",
                                                                                      "up_proj"))]
    for name in plain:
        torch.testing.assert_close(params[name], saved[name], rtol=0, atol=0)
    assert len(params) == len(plain) + 2
    assert (p.head.embed_tokens is None) == (not with_embed)
    assert p.head.midlayer.norm_before_residual == norm_before_residual
    assert p.head.targets is not None and p.head.targets.tolist() == list(range(0, 32, 2))
    # drafts are target ids of the draft vocabulary (even ids), and q is zero outside it
    rig = SpecRig(runner, p, K, SamplingParams(temperature=1.0, seed=3))
    rig.run(_prompts(3, (9, 4)), 6, verify=lambda d: 1, rng=random.Random(1))
    for entry in rig.log:
        assert all(d % 2 == 0 for d in entry.drafts)
        assert entry.probs is not None and float(entry.probs[:, 1::2].abs().sum()) == 0.0
        ref = eagle_dense(p, runner, entry.context, entry.drafts, 1.0, rig.blocks(len(entry.context)))
        torch.testing.assert_close(entry.probs, ref, rtol=1e-4, atol=1e-6)


def test_checkpoint_with_missing_or_extra_tensors_is_refused(target, tmp_path):
    runner, _ = target
    saved = _write_checkpoint(tmp_path, runner, False)
    del saved["norm.weight"]
    save_file(saved, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="norm.weight"):
        _proposer(target, model=str(tmp_path))
    saved["norm.weight"] = torch.ones(64)
    saved["midlayer.extra.weight"] = torch.ones(3)
    save_file(saved, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="midlayer.extra.weight"):
        _proposer(target, model=str(tmp_path))
    with pytest.raises(ValueError, match="target_layer_ids"):
        _proposer(target, layers=(1, 2))  # fc reads 3 layers
