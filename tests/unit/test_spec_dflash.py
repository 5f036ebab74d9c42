"""The DFlash-style block drafter (services/worker/spec/dflash.py) on the CPU with random
weights, through the speculative loop of tests/unit/spec_head_rig.py and the runner's
`spec_generate`:
- lossless: greedy output with DFlash drafts equals greedy output without speculation, with
  chunked prefill, requests joining mid-batch and a preemption;
- state: after every acceptance length, preemptions and joins, each block's draft
  distributions equal a dense re-computation of DFlash over the context it was given
  (z-lab/dflash's forward in plain torch: context K/V from the fc-projected target
  features, the block [last token, mask..] attending to the context and to itself);
- probabilistic drafting: seeded, drawn from the q it returns (chi-square);
- loading: a checkpoint in the documented layout round-trips; a bad one is refused.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import save_file

from kernels.cpu_linear import dense
from services.worker.spec.base import ProposeRequest
from services.worker.spec.dflash import DFlashProposer
from services.worker.spec.draft_sampling import choose_drafts, draft_seed
from services.worker.spec.head_loading import spread_layers
from shared.protocol import SamplingParams
from shared.spec_config import SpeculativeConfig
from tests.runner_driver import generate, spec_run
from tests.unit.spec_head_dense import dflash_dense
from tests.unit.spec_head_rig import SpecRig, attach, sharpen, tiny_runner

K = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_runner(tmp_path_factory.mktemp("dflash-target"))


def _prompts(seed: int, sizes=(5, 40, 17, 1, 33, 9, 21, 2)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32, (n,), generator=g).tolist() for n in sizes]


def _proposer(target, sampling: str = "greedy", model: str | None = None, layers=(), depth: int = 0):
    runner, cfg = target
    p = DFlashProposer(cfg, SpeculativeConfig("dflash", K, model=model, draft_sampling=sampling,
                                              target_layer_ids=tuple(layers), draft_num_layers=depth), runner)
    attach(runner, p)
    return p


def test_default_layers_are_spread_over_the_depth(target):
    assert spread_layers(28, 4) == (1, 9, 17, 25)  # the spec_config example for Qwen3-8B's depth
    assert spread_layers(36, 5) == (1, 9, 17, 25, 33)  # z-lab/dflash's build_target_layer_ids
    p = _proposer(target)
    assert p.target_layer_ids == (1, 2, 4, 5) and len(p.kv_specs()) == 4  # one KV cache per drafter layer
    assert p.info().kv_bytes_per_block == 4 * 2 * 16 * 2 * 16 * 4


def test_greedy_output_with_dflash_equals_output_without(target):
    runner, _ = target
    p = _proposer(target, depth=2)
    prompts = _prompts(0)
    base = generate(runner, prompts, 20)
    rig = SpecRig(runner, p, K)
    out = rig.run(prompts, 20, chunk=16, join=[0, 0, 1, 2, 3, 0, 5, 1], preempt={6: 1, 9: 4})
    assert out == base
    assert rig.accepted > 0 and len(rig.log) > 100
    assert all(len(entry.drafts) == K for entry in rig.log)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_greedy_output_through_the_runner_equals_output_without(tmp_path, arch):
    runner, _ = tiny_runner(tmp_path, '{"method": "dflash", "num_speculative_tokens": 4, "policy": "fixed"}',
                            architectures=[arch], model_type=arch[:5].lower())
    assert runner.model.aux_hidden_layers == runner.proposer.target_layer_ids
    prompts = _prompts(4, (3, 26, 11, 19))
    base = generate(runner, prompts, 16)
    run = spec_run(runner, prompts, 16, K, chunk=8)
    assert run.tokens == base and run.num_draft_tokens > 0
    assert runner.report()["speculative"]["method"] == "dflash"


@pytest.mark.parametrize("sampling", ["greedy", "probabilistic"])
def test_blocks_follow_the_context_through_rollbacks_preemption_and_joins(target, sampling):
    runner, _ = target
    p = _proposer(target, sampling, depth=2)
    sharpen(p.drafter, seed=1)
    temp = 0.0 if sampling == "greedy" else 1.0
    rig = SpecRig(runner, p, K, SamplingParams(temperature=temp, seed=5))
    lengths = iter([0, 1, 4, 2, 3, 0, 4, 1] * 100)
    rig.run(_prompts(1, (7, 30, 3, 18)), 14, chunk=8, join=[0, 2, 0, 4], preempt={5: 0, 8: 3},
            verify=lambda d: next(lengths), rng=random.Random(3))
    assert rig.accepted > 20
    for entry in rig.log:
        ref = dflash_dense(p, runner, entry.context, len(entry.drafts), temp or 1.0, rig.blocks(len(entry.context)))
        if sampling == "probabilistic":
            assert entry.probs is not None and entry.probs.shape == (K, 32)
            torch.testing.assert_close(entry.probs, ref, rtol=1e-4, atol=1e-6)
        else:
            assert entry.probs is None and entry.drafts == ref.argmax(-1).tolist()
        rig.next_block -= -(-len(entry.context) // runner.block_size)


def test_the_block_is_one_shorter_where_the_requests_blocks_end(target):
    """A block of j drafts writes K/V at next_pos .. next_pos + j: the request's blocks must
    hold that slot (they cover next_pos + num_propose tokens, whole blocks)."""
    runner, _ = target
    p = _proposer(target)
    table = SpecRig(runner, p, K).blocks(16)
    with torch.inference_mode():
        for next_pos, want in ((11, 4), (12, 3), (14, 1), (15, 0)):
            req = ProposeRequest("x", 0, [9], next_pos, 0, K, table, SamplingParams(temperature=0.0), 1)
            assert len(p.propose([req], None).token_ids[0]) == want  # type: ignore[arg-type]  # no view needed


def test_probabilistic_drafts_are_drawn_from_their_q():
    """Chi-square over many seeded draws of one row: counts match q (threshold: p > 1e-4,
    df = 5, statistic < 25.7)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 6000
    seeds = [draft_seed(123, i) for i in range(n)]
    tok, q = choose_drafts(logits.expand(n, -1).contiguous(), [0.8] * n, seeds, True)
    assert q is not None
    torch.testing.assert_close(q[0], torch.softmax(logits[0] / 0.8, -1))
    counts = torch.bincount(tok, minlength=6).double()
    expected = q[0].double() * n
    assert float(((counts - expected) ** 2 / expected).sum()) < 25.7
    again, _ = choose_drafts(logits.expand(n, -1).contiguous(), [0.8] * n, seeds, True)
    assert torch.equal(tok, again)  # seeded: the same draws
    greedy, qg = choose_drafts(logits, [0.0], [seeds[0]], True)  # a greedy request: argmax, one-hot q
    assert greedy.tolist() == [0] and qg is not None and qg[0].tolist() == [1.0, 0, 0, 0, 0, 0]


def _write_checkpoint(folder, layers: int = 2, qk_norm: bool = True) -> dict[str, torch.Tensor]:
    h, kv, inter = 64, 2 * 16, 80
    g = torch.Generator().manual_seed(9)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    t = {"fc.weight": r(h, 3 * h), "hidden_norm.weight": 1 + r(h), "norm.weight": 1 + r(h)}
    for i in range(layers):
        pre = f"layers.{i}."
        t.update({pre + "input_layernorm.weight": 1 + r(h), pre + "post_attention_layernorm.weight": 1 + r(h),
                  pre + "self_attn.q_proj.weight": r(64, h), pre + "self_attn.k_proj.weight": r(kv, h),
                  pre + "self_attn.v_proj.weight": r(kv, h), pre + "self_attn.o_proj.weight": r(h, 64),
                  pre + "mlp.gate_proj.weight": r(inter, h), pre + "mlp.up_proj.weight": r(inter, h),
                  pre + "mlp.down_proj.weight": r(h, inter)})
        if qk_norm:
            t.update({pre + "self_attn.q_norm.weight": 1 + r(16), pre + "self_attn.k_norm.weight": 1 + r(16)})
    save_file(t, str(folder / "model.safetensors"))
    conf = {"architectures": ["DFlashDraftModel"], "hidden_size": h, "intermediate_size": inter,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": layers,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 32, "block_size": 4,
            "num_target_layers": 8, "dflash_config": {"target_layer_ids": [1, 4, 6], "mask_token_id": 30}}
    (folder / "config.json").write_text(json.dumps(conf))
    return t


@pytest.mark.parametrize("qk_norm", [True, False])
def test_checkpoint_round_trip(target, tmp_path, qk_norm):
    runner, _ = target
    saved = _write_checkpoint(tmp_path, qk_norm=qk_norm)
    p = _proposer(target, "probabilistic", model=str(tmp_path))
    assert p.target_layer_ids == (1, 4, 6) and p.mask_token_id == 30 and p.max_block == 4
    params = {n: dense(w) for n, w in p.drafter.named_parameters()}
    assert len(params) == len(saved) - 2 * 2  # k/v and gate/up pairs stacked, per layer
    shards = {"k_proj": ("kv_proj", 0), "v_proj": ("kv_proj", 1), "gate_proj": ("gate_up_proj", 0),
              "up_proj": ("gate_up_proj", 1)}
    for name, ten in saved.items():
        part = name.split(".")[-2]
        if part in shards:
            stacked, i = shards[part]
            rows = params[name.replace(part, stacked)].split(ten.shape[0])[i]
            torch.testing.assert_close(rows, ten, rtol=0, atol=0)
        else:
            torch.testing.assert_close(params[name], ten, rtol=0, atol=0)
    assert (p.drafter.decoder_layers[0].self_attn.q_norm is None) == (not qk_norm)
    rig = SpecRig(runner, p, K, SamplingParams(temperature=1.0, seed=2))
    rig.run(_prompts(3, (9, 4)), 6, verify=lambda d: 1, rng=random.Random(1))
    for entry in rig.log:
        assert len(entry.drafts) == 3  # the checkpoint's block of 4 caps k
        ref = dflash_dense(p, runner, entry.context, 3, 1.0, rig.blocks(len(entry.context)))
        torch.testing.assert_close(entry.probs, ref, rtol=1e-4, atol=1e-6)


def test_a_bad_checkpoint_is_refused(target, tmp_path):
    saved = _write_checkpoint(tmp_path)
    del saved["layers.1.mlp.down_proj.weight"]
    save_file(saved, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj"):
        _proposer(target, model=str(tmp_path))
    conf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**conf, "hidden_size": 32}))
    with pytest.raises(ValueError, match="hidden_size"):
        _proposer(target, model=str(tmp_path))
    with pytest.raises(ValueError, match="outside"):
        _proposer(target, layers=(1, 8))
