"""A hybrid model (Qwen3-Next: gated DeltaNet + gated attention + MoE) end to end on CUDA:
the GPU path (fla's chunked gated delta rule for prefill, kernels/gdn_decode.py's in-place
decode kernels, the fused MoE Triton kernel, the Triton attention) against Kestrel's CPU path (torch references), which the CI
parity tests hold to transformers (tests/parity/test_qwen3_next_parity.py). Transformers
is not the truth here because, with fla-core installed, its Qwen3-Next takes fla's Triton
kernels on CPU tensors too.

A tiny seeded random checkpoint (written with transformers' save_pretrained), fp32 on both
devices. Shown: logits at every chunk end and 4 decode steps close (relative max error <
3e-2: fla's kernels multiply fp32 operands in TF32, 1.5e-3 relative a layer in issue 16's
check; through 3 recurrent layers and the head the H200 measured 6.1e-3 for a whole 270-token
prefill and 1.03e-2 with chunks cut at 17, 130 and 131, while a wrong gate, state or chunk
carry moves logits by tens of percent),
for a whole and a chunked prefill (the state carried across chunks); greedy 16 tokens of 8
requests run together on the GPU equal to the CPU's; 8 together equal each alone on the GPU;
speculative decoding (n-gram, and forced half-wrong drafts) on the GPU equal to plain greedy. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from services.worker.model_runner import ModelRunner  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  # noqa: E402
from tests.parity.hf_checks import assert_speculation_is_lossless  # noqa: E402
from tests.runner_driver import generate, step_logits  # noqa: E402

VOCAB = 512
GREEDY = SamplingParams(temperature=0.0)
LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
REL = 3e-2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("qwen3_next_gpu"))


def write_tiny(path):
    """Write the seeded random tiny Qwen3-Next checkpoint into the folder `path`; returns it."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, layer_types=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128,
        intermediate_size=256, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    model = transformers.Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5) if "linear_attn.norm" in name else p.uniform_(-0.5, 0.5)
            elif name.endswith(("A_log", "dt_bias")):
                p.uniform_(-1.0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    return path


def _runner(path, device: str, **kw) -> ModelRunner:
    cli = {"model": str(path), "device": device, "dtype": "float32", "block_size": 16, "max_num_seqs": 8,
           "max_model_len": 1024}
    cli.update({"gpu_memory_utilization": 0.1} if device == "cuda" else {"kv_cache_gib": 0.05})
    cli.update(kw)
    return ModelRunner(build_config(cli=cli, env={}))


@pytest.fixture(scope="module")
def runners(tiny):
    return _runner(tiny, "cuda"), _runner(tiny, "cpu")


def _prompts(n: int, lengths=(5, 190, 33, 80, 270, 12, 64, 3)) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def _chunk_logits(runner, prompt: list[int], ends: list[int], decode: list[int]) -> list[torch.Tensor]:
    """Logits at each chunk end, then after each of the given decode tokens (slot 0)."""
    table = list(range(-(-(len(prompt) + len(decode)) // runner.block_size)))
    out, start = [], 0
    for end in ends:
        out.append(step_logits(runner, StepPlan(0, [ScheduledSeq("r", prompt[start:end], start, table, True,
                                                                 GREEDY, state_slot=0)]))[0].cpu())
        start = end
    for i, tok in enumerate(decode):
        seq = ScheduledSeq("r", [tok], len(prompt) + i, table, True, GREEDY, i + 1, state_slot=0)
        out.append(step_logits(runner, StepPlan(0, [seq]))[0].cpu())
    return out


@pytest.mark.parametrize("cuts", [[], [64, 100], [17, 130, 131]])
def test_gpu_logits_match_the_cpu_references_whole_and_chunked(runners, cuts):
    gpu, cpu = runners
    prompt = _prompts(5)[4]  # 270 tokens: several fla chunks of 64
    ends = [c for c in cuts if c < len(prompt)] + [len(prompt)]
    decode = [7, 300, 42, 511]
    for got, ref in zip(_chunk_logits(gpu, prompt, ends, decode), _chunk_logits(cpu, prompt, ends, decode)):
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < REL, f"cuts {ends}: relative max error {err}"


def test_gpu_greedy_of_8_together_equals_the_cpu_and_each_alone(runners):
    gpu, cpu = runners
    prompts = _prompts(8)
    together = generate(gpu, prompts, 16, chunk=96)
    assert together == generate(cpu, prompts, 16, chunk=96)
    assert together == [generate(gpu, [p], 16)[0] for p in prompts]


def test_speculation_on_the_gpu_equals_plain_greedy(tiny, runners):
    """n-gram drafts, and forced drafts with the second one wrong: accepted drafts and
    rolled-back ones through fla's per-token decode path."""
    import json

    prompts = [p + p[:20] for p in _prompts(4)]  # repeats, so the n-gram proposer finds drafts
    # the truth with the prefill chunks the speculative runs take (chunks of 9): fla's chunked
    # kernel rounds differently from one whole prefill (TF32), which can flip a near-tie
    plain = generate(runners[0], prompts, 24, chunk=9)
    # a second CUDA runner in this process: gpu_memory_utilization is the process's share
    # (vLLM's meaning), and the module's runner already holds 0.1 of the device
    runner = _runner(tiny, "cuda", speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 3}),
                     gpu_memory_utilization=0.2)
    assert_speculation_is_lossless(runner, plain, prompts, 24, 3, VOCAB)
