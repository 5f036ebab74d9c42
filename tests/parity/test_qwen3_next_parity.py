"""Kestrel's hybrid models (gated DeltaNet + gated attention, MoE with a shared expert)
against Hugging Face transformers 5.24: Qwen3NextForCausalLM and the text model of
Qwen3.5-MoE (Qwen3_5MoeForCausalLM), on the CPU in fp32.

Tiny seeded random checkpoints written with save_pretrained: linear and full attention
layers interleaved, partial rotary, zero-centred norms; Qwen3-Next with a dense layer among
the MoE ones, Qwen3.5 with its own gated-DeltaNet projections (in_proj_qkv / z / b / a).
Shown:
- logits of 3 prompts at every prompt position and over 4 decode steps within 1e-4 of
  transformers', for a whole prefill and for chunked ones (the recurrent state carried
  across chunks through the runner's state cache);
- greedy 32 tokens equal to transformers' `generate` (its own recurrent cache);
- 8 requests run together (mixed chunks and decodes, each on its own state slot) equal to
  each alone, and a slot reused by a new request (start_pos 0) starts from zeros;
- the startup report names the state cache's bytes and slots;
- speculative decoding (n-gram, and a dense draft model) gives the plain greedy output, with
  drafts partly rejected: the recurrent layers keep their state after each verified token
  and roll back to the accepted drafts.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from services.worker.model_runner import ModelRunner  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  # noqa: E402
from tests.parity.hf_checks import (assert_greedy_matches_generate, assert_logits_match,  # noqa: E402
                                    assert_speculation_is_lossless, assert_together_equals_alone)
from tests.runner_driver import generate, step_logits  # noqa: E402

ATOL = 1e-4
VOCAB = 101
GREEDY = SamplingParams(temperature=0.0)
LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=len(LAYERS), layer_types=LAYERS,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
    shared_expert_intermediate_size=32, norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _build(arch: str):
    """A transformers model of `arch`: Qwen3-Next (a dense layer among the MoE ones) or the
    text model of Qwen3.5-MoE (every layer MoE, Qwen3.5's gated-DeltaNet projections)."""
    if arch == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(intermediate_size=80, decoder_sparse_step=1, mlp_only_layers=[2],
                                           **COMMON)
        return transformers.Qwen3NextForCausalLM(cfg)
    cfg = transformers.Qwen3_5MoeTextConfig(**COMMON)
    return transformers.Qwen3_5MoeForCausalLM(cfg)


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def tiny_next(request, tmp_path_factory):
    """(folder, transformers model) of a seeded random tiny hybrid of each architecture."""
    torch.manual_seed(0)
    model = _build(request.param).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # zero-centred norms: scales 1 + w in 0.5..1.5 (the gated norm: w)
                p.uniform_(0.5, 1.5) if "linear_attn.norm" in name else p.uniform_(-0.5, 0.5)
            elif name.endswith(("A_log", "dt_bias")):
                p.uniform_(-1.0, 1.0)
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


def test_logits_of_3_prompts_match_transformers_whole_and_chunked_prefill_and_decode(tiny_next):
    path, hf = tiny_next
    runner = _runner(path, block_size=4)
    rep = runner.report()
    assert rep["state_slots"] == runner.state_cache.num_slots > 0 and rep["state_bytes"] == runner.state_cache.bytes
    assert_logits_match(runner, hf, _prompts(3, (23, 9, 31)), [[], [4, 7], [1, 2]], ATOL, with_slots=True)


def test_greedy_32_tokens_equal_transformers_generate(tiny_next):
    path, hf = tiny_next
    assert_greedy_matches_generate(_runner(path, block_size=16), hf, _prompts(3), 32, chunk=11)


def test_8_requests_together_equal_each_alone_and_a_reused_slot_starts_from_zeros(tiny_next):
    path, _ = tiny_next
    # each alone runs on slot 0, used before: a new request there starts from zeros
    assert_together_equals_alone(_runner(path, block_size=8), _prompts(8), 12, chunk=9)


def test_dummy_weights_of_the_qwen3_next_80b_shape_give_finite_seeded_logits(tmp_path):
    import json
    import pathlib

    cfg = json.loads((pathlib.Path(__file__).resolve().parents[2]
                      / "benchmarks/configs/qwen3-next-80b-a3b.json").read_text())
    assert cfg["full_attention_interval"] == 4 and "layer_types" not in cfg
    # the published shape cut to CI size: one period of 3 linear + 1 full layer, 16 experts (10 a token)
    cfg.update(num_hidden_layers=4, vocab_size=1000, num_experts=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    outs = []
    for _ in range(2):
        runner = _runner(tmp_path, load_format="dummy", seed=7, kv_cache_gib=0.01, max_num_seqs=2)
        assert len(runner.kv.k) == 1 and len(runner.state_cache.layers) == 3
        seq = ScheduledSeq("r", list(range(1, 40)), 0, list(range(3)), True, GREEDY, state_slot=1)
        outs.append(step_logits(runner, StepPlan(0, [seq]))[0])
    assert torch.isfinite(outs[0]).all() and outs[0].std() > 0
    assert torch.equal(outs[0], outs[1])


def test_dummy_weights_of_the_qwen3_5_35b_shape_load_and_decode_latency_counts_its_state(tmp_path):
    """benchmarks/configs/qwen3.5-35b-a3b.json (the published checkpoint's layout: the text
    model under text_config) cut to CI size loads with dummy weights and gives finite
    logits; benchmarks/decode_latency.py's roofline counts its active experts (k / E) and
    each recurrent layer's state read and written."""
    import json
    import pathlib

    from benchmarks.decode_latency import roofline_bytes

    cfg = json.loads((pathlib.Path(__file__).resolve().parents[2]
                      / "benchmarks/configs/qwen3.5-35b-a3b.json").read_text())
    text = cfg["text_config"]
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and len(text["layer_types"]) == 40
    assert (text["hidden_size"], text["num_experts"], text["num_experts_per_tok"]) == (2048, 256, 8)
    # one period of 3 linear + 1 full layer, 16 experts (8 a token), a small vocabulary
    text.update(num_hidden_layers=4, layer_types=text["layer_types"][:4], vocab_size=1000, num_experts=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    runner = _runner(tmp_path, load_format="dummy", seed=7, kv_cache_gib=0.01, max_num_seqs=2)
    assert len(runner.kv.k) == 1 and len(runner.state_cache.layers) == 3
    seq = ScheduledSeq("r", list(range(1, 20)), 0, list(range(2)), True, GREEDY, state_slot=1)
    logits = step_logits(runner, StepPlan(0, [seq]))[0]
    assert torch.isfinite(logits).all() and logits.std() > 0
    roof = roofline_bytes(runner, 100)
    conv, ssm = (2 * 16 * 128 + 32 * 128) * 3 * 4, 32 * 128 * 128 * 4  # fp32 on the CPU
    assert roof["state_bytes"] == 2 * 3 * (conv + ssm)  # 3 recurrent layers, read + written
    experts = 4 * 16 * 3 * 2048 * 512 * 4
    everything = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert roof["weight_bytes"] == everything - experts + experts * 8 // 16
    assert roof["kv_bytes"] == 100 * 2 * 2 * 256 * 4  # one attention layer: K and V, 2 heads of 256
    assert roof["total"] == roof["weight_bytes"] + roof["kv_bytes"] + roof["state_bytes"]


@pytest.fixture(scope="module")
def dense_draft(tmp_path_factory):
    """A tiny random Qwen3 dense model with the hybrids' vocabulary (a draft model)."""
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=512, tie_word_embeddings=True,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("dense_draft")
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_on_a_hybrid_gives_the_plain_greedy_output(tiny_next, dense_draft, method):
    import json

    path, _ = tiny_next
    prompts, n, k = _prompts(3), 16, 3
    plain = generate(_runner(path, block_size=8), prompts, n)
    spec = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        spec["model"] = str(dense_draft)
    runner = _runner(path, block_size=8, max_model_len=256, speculative_config=json.dumps(spec))
    assert_speculation_is_lossless(runner, plain, prompts, n, k, VOCAB)


def test_a_published_style_qwen3_5_checkpoint_loads_its_text_model(tiny_next, tmp_path):
    """Qwen3_5MoeForConditionalGeneration's layout (config with text_config, the language
    model under model.language_model., a vision tower and an MTP head beside it) serves the
    same logits as the text-only checkpoint it was made from."""
    import json

    from safetensors.torch import load_file, save_file

    path, hf = tiny_next
    text_cfg = json.loads((path / "config.json").read_text())
    if text_cfg["architectures"] != ["Qwen3_5MoeForCausalLM"]:
        pytest.skip("the Qwen3.5 variant only")
    tensors = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in load_file(str(path / "model.safetensors")).items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": {k: v for k, v in text_cfg.items() if k != "architectures"}, "vision_config": {"depth": 1}}))
    seq = ScheduledSeq("r", _prompts(1, (21,))[0], 0, list(range(8)), True, GREEDY, state_slot=0)
    want = step_logits(_runner(path), StepPlan(0, [seq]))[0]
    got = step_logits(_runner(tmp_path), StepPlan(0, [seq]))[0]
    assert torch.equal(got, want)


@pytest.mark.parametrize(("stack", "glue"), [(False, False), (True, True), (False, True)])
def test_logits_match_transformers_with_projections_stacked_or_apart_and_glue_fused_or_not(
        tiny_next, monkeypatch, stack, glue):
    """qwen3_next.STACK_PROJECTIONS (one Linear per group of projections of one input) and
    FUSED_GLUE (the glue dispatchers, the residual adds inside the norms) leave the logits
    transformers' (the default, stacked without the glue, is the test above)."""
    from services.worker.models import qwen3_next, qwen3_next_blocks

    monkeypatch.setattr(qwen3_next, "STACK_PROJECTIONS", stack)
    monkeypatch.setattr(qwen3_next_blocks, "FUSED_GLUE", glue)
    path, hf = tiny_next
    runner = _runner(path, block_size=4)
    names = {n for n, _ in runner.model.named_parameters()}
    assert runner.model.stacked == stack
    assert ("model.layers.0.linear_attn.in_proj.weight" in names) == stack
    assert ("model.layers.0.mlp.in_proj.weight" in names) == stack
    assert ("model.layers.0.mlp.gate.weight" in names) != stack
    assert_logits_match(runner, hf, _prompts(3, (23, 9, 31)), [[], [4, 7], [1, 2]], ATOL, with_slots=True)


def test_stacked_projections_hold_the_concatenated_checkpoint_tensors(tiny_next, monkeypatch):
    """The loader fills each stacked weight from the checkpoint's separate tensors, in shard
    order: linear_attn.in_proj = cat(in_proj_qkvz, in_proj_ba) (Qwen3.5: in_proj_qkv, z, b,
    a), mlp.in_proj = cat(gate, shared_expert.gate_proj, shared_expert.up_proj,
    shared_expert_gate), read back from the safetensors file."""
    from safetensors.torch import load_file

    from services.worker.loader import dense_weights
    from services.worker.models.qwen3_next_blocks import SharedExpertMoeBlock

    from services.worker.models import qwen3_next

    monkeypatch.setattr(qwen3_next, "STACK_PROJECTIONS", True)  # read when the model is built
    path, _ = tiny_next
    ckpt = load_file(str(path / "model.safetensors"))
    runner = _runner(path)
    assert runner.model.stacked
    qwen3_5 = "model.layers.0.linear_attn.in_proj_qkv.weight" in ckpt
    gdn = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a") if qwen3_5 else ("in_proj_qkvz", "in_proj_ba")
    moe = ("gate", "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert_gate")
    checked = 0
    with dense_weights(runner.model) as model:
        params = dict(model.named_parameters())
        for i, layer in enumerate(model.model.decoder_layers):
            pre = f"model.layers.{i}."
            groups = [("mlp.in_proj", [f"mlp.{m}" for m in moe])] if isinstance(layer.mlp, SharedExpertMoeBlock) else []
            if layer.linear_attn is not None:
                groups.append(("linear_attn.in_proj", [f"linear_attn.{g}" for g in gdn]))
            for ours, theirs in groups:
                want = torch.cat([ckpt[f"{pre}{t}.weight"] for t in theirs])
                assert torch.equal(params[f"{pre}{ours}.weight"].detach().contiguous(), want), (i, ours)
                checked += 1
    assert checked >= 5  # every layer's MoE group (one dense layer in Qwen3-Next) and the linear layers'
