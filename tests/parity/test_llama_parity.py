"""Kestrel's Llama model runner against Hugging Face transformers (the numerical reference).

1. Tiny random LlamaForCausalLM checkpoints (GQA; untied, tied, and Llama 3 rope scaling),
   written with save_pretrained: logits at every compared position match transformers'
   within 1e-4 (fp32), for whole and chunked prefills, mixed batches and decode steps.
2. The real SmolLM2-135M-Instruct: Kestrel on the converted folder (`smollm2_dir`) against
   transformers loading the GGUF (`smollm2_gguf`) directly. Last-position logits match
   within 5e-4 abs (fp32; logits are O(20), measured diffs about 5e-5 from summing in other
   orders over 30 layers), and greedy continuations of chat prompts are equal.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from services.worker.model_runner import ModelRunner  # noqa: E402
from tests.runner_driver import generate, greedy_generate, step_logits  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  # noqa: E402

TINY_ATOL = 1e-4
SMOL_ATOL = 5e-4
GREEDY = SamplingParams(temperature=0.0)


def _runner(path, **kw) -> ModelRunner:
    cli = {"model": str(path), "device": "cpu", "dtype": "float32", "kv_cache_gib": 0.02, **kw}
    return ModelRunner(build_config(cli=cli, env={}))


def _chunked_logits(runner, prompt, cuts, n_decode, block_base=0):
    """Prefill `prompt` in chunks ending at `cuts` (each sampled), then greedy-decode
    n_decode tokens. Returns ({position: logits [vocab]}, generated token ids)."""
    bs = runner.block_size
    table = list(range(block_base, block_base + -(-(len(prompt) + n_decode) // bs)))
    out, toks, start = {}, [], 0
    for end in cuts:
        plan = StepPlan(0, [ScheduledSeq("r", prompt[start:end], start, table, True, GREEDY)])
        out[end - 1] = step_logits(runner, plan)[0]
        start = end
    for i in range(n_decode):
        toks.append(int(out[max(out)].argmax()))
        pos = len(prompt) + i
        plan = StepPlan(0, [ScheduledSeq("r", [toks[-1]], pos, table, True, GREEDY, i + 1)])
        out[pos] = step_logits(runner, plan)[0]
    return out, toks


# ---------------------------------------------------------------- tiny random checkpoints

TINY_VARIANTS = {
    "untied_gqa": dict(tie_word_embeddings=False, num_key_value_heads=2),
    "tied_gqa": dict(tie_word_embeddings=True, num_key_value_heads=1),
    "llama3_rope": dict(tie_word_embeddings=False, num_key_value_heads=2, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}


@pytest.fixture(scope="module", params=list(TINY_VARIANTS))
def tiny(request, tmp_path_factory):
    """(folder, transformers model) of a seeded random tiny Llama."""
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,  # generate runs all tokens
        **TINY_VARIANTS[request.param])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger than the default init, so attention is not uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path, model


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_tiny_llama_logits_match_transformers_whole_and_chunked_prefill(tiny):
    path, hf = tiny
    runner = _runner(path, block_size=4)
    prompt = torch.randint(0, 97, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    for cuts in ([29], [5, 6, 13, 16, 29], [1, 2, 3, 28, 29]):
        ours, toks = _chunked_logits(runner, prompt, cuts, n_decode=6)
        ref = _hf_logits(hf, prompt + toks)
        for pos, logits in ours.items():
            diff = (logits - ref[pos]).abs().max().item()
            assert diff < TINY_ATOL, f"cuts {cuts}, position {pos}: max abs diff {diff}"


def test_tiny_llama_batched_greedy_with_mixed_chunks_matches_transformers_generate(tiny):
    path, hf = tiny
    runner = _runner(path, block_size=16)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 17, 40, 1)]
    ours = generate(runner, prompts, 10, chunk=7)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            ids = torch.tensor([prompt])  # explicit mask: token 0 is no padding here
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                              do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == ref, (prompt, got, ref)
        assert greedy_generate(runner, prompt, 10) == ref


def test_seeded_sampling_is_reproducible_across_batches_and_chunking(tiny):
    path, _ = tiny
    runner = _runner(path, block_size=8)
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, min_p=0.02, seed=1234)
    g = torch.Generator().manual_seed(4)
    a, b = (torch.randint(0, 97, (n,), generator=g).tolist() for n in (11, 23))
    alone = generate(runner, [b], 12, sampling=sp)[0]
    assert generate(runner, [a, b], 12, sampling=sp, chunk=5)[1] == alone  # recompute-exact
    other = generate(runner, [b], 12, sampling=SamplingParams(temperature=0.9, seed=99))[0]
    assert other != alone


# ---------------------------------------------------------------- SmolLM2-135M-Instruct

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in two sentences.",
]
RAW_PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    ", "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def smol(smollm2_dir, hf_smollm2):
    """(tokenizer, transformers model from the GGUF, Kestrel runner on the converted folder)."""
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    return tok, hf_smollm2[1], _runner(smollm2_dir, kv_cache_gib=0.1)


def _chat_ids(tok, text):
    rendered = tok.apply_chat_template([{"role": "user", "content": text}],
                                       add_generation_prompt=True, tokenize=False)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def test_smollm2_last_position_logits_match_transformers_gguf(smol):
    tok, hf, runner = smol
    for text in RAW_PROMPTS:
        ids = tok(text)["input_ids"]
        plan = StepPlan(0, [ScheduledSeq("r", ids, 0, list(range(8)), True, GREEDY)])
        diff = (step_logits(runner, plan)[0] - _hf_logits(hf, ids)[-1]).abs().max().item()
        assert diff < SMOL_ATOL, f"{text!r}: max abs diff {diff}"


def test_smollm2_greedy_chat_continuations_equal_transformers_generate(smol):
    tok, hf, runner = smol
    prompts = [_chat_ids(tok, t) for t in CHAT_PROMPTS]
    ours = generate(runner, prompts, 32)  # one batch of 4
    eos = set(hf.generation_config.eos_token_id if isinstance(hf.generation_config.eos_token_id, list)
              else [hf.generation_config.eos_token_id])
    for text, prompt, got in zip(CHAT_PROMPTS, prompts, ours):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                              do_sample=False)[0, len(prompt):].tolist()
        assert len(ref) == 32 or ref[-1] in eos
        assert got[:len(ref)] == ref, f"{text!r}: {tok.decode(got)!r} != {tok.decode(ref)!r}"
    assert tok.decode(ours[0], skip_special_tokens=True).startswith("The capital of France is Paris.")


# ---------------------------------------------------------------- loader


@pytest.fixture(scope="module")
def tiny_untied(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_untied")
    model.save_pretrained(path)
    return path, model


def _reshard_into_subfolder(src, dst, drop_shard=False):
    """Copy a single-file checkpoint into two shards under dst/sub/ with an index."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    (dst / "sub").mkdir()
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"sub/model-{i + 1:05d}-of-00002.safetensors"
        if not (drop_shard and i == 1):
            save_file({n: tensors[n] for n in part}, str(dst / fname))
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_sharded_checkpoint_in_subfolder_loads_every_shard(tiny_untied, tmp_path):
    path, hf = tiny_untied
    _reshard_into_subfolder(path, tmp_path)
    runner = _runner(tmp_path, block_size=8)
    prompt = [5, 17, 3, 90, 42]
    plan = StepPlan(0, [ScheduledSeq("r", prompt, 0, [0], True, GREEDY)])
    diff = (step_logits(runner, plan)[0] - _hf_logits(hf, prompt)[-1]).abs().max().item()
    assert diff < TINY_ATOL


def test_missing_listed_shard_fails_naming_the_file(tiny_untied, tmp_path):
    _reshard_into_subfolder(tiny_untied[0], tmp_path, drop_shard=True)
    with pytest.raises(FileNotFoundError, match="sub/model-00002-of-00002.safetensors"):
        _runner(tmp_path)


def test_unused_checkpoint_tensor_fails_naming_it(tiny_untied, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tiny_untied[0]
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match="model.layers.0.mlp.extra_proj.weight"):
        _runner(tmp_path)


def test_unloaded_parameter_fails_naming_it(tiny_untied, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tiny_untied[0]
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"], tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.qkv_proj.weight\[shard 1\].*lm_head.weight"):
        _runner(tmp_path)
