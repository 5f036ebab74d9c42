"""A seeded random tiny Qwen3-Next checkpoint (gated DeltaNet + gated attention + MoE with a
shared expert), written with transformers' save_pretrained, for the tests of the hybrid
decode graphs (tests/unit/test_hybrid_decode_graphs.py on the CPU,
tests/gpu/test_hybrid_graphs_gpu.py on CUDA). Weights are drawn as in
tests/parity/test_qwen3_next_parity.py (norm scales in 0.5..1.5, A_log and dt_bias in -1..1,
matrices N(0, std^2)), so that the recurrent state moves the logits visibly: a slot mix-up
changes them by far more than rounding does."""

from __future__ import annotations

import pathlib

import torch

LAYERS = ("linear_attention", "full_attention", "linear_attention", "linear_attention")


def write_tiny_qwen3_next(path: pathlib.Path, *, vocab: int = 101, hidden: int = 64, head_dim: int = 16,
                          linear_dim: int = 16, moe: int = 24, shared: int = 32, std: float = 0.15,
                          layers: tuple[str, ...] = LAYERS, seed: int = 0,
                          bf16_exact: bool = False, arch: str = "qwen3_next",
                          mlp_only_layers: tuple[int, ...] = ()) -> pathlib.Path:
    """Write the checkpoint into the folder `path` (config.json and model.safetensors) and
    return it. hidden: hidden size; head_dim: the attention heads' (4 query, 2 KV heads);
    linear_dim: the gated DeltaNet's key and value head dim (2 key, 4 value heads); in every
    layer 6 experts (2 a token) of intermediate size `moe` and a shared expert of `shared`.
    bf16_exact: every weight rounded to a bfloat16 value (still saved in fp32), so that an
    fp32 run of the checkpoint has exactly a bf16 run's weights (a truth for bf16 rounding).
    arch: "qwen3_next" (Qwen3NextForCausalLM; mlp_only_layers: the layers with a dense MLP of
    80) or "qwen3_5_moe" (the text model of Qwen3.5-MoE, Qwen3_5MoeForCausalLM: every layer
    MoE, Qwen3.5's gated-DeltaNet projections in_proj_qkv / z / b / a).
    Needs transformers."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=len(layers), layer_types=list(layers),
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=linear_dim,
        linear_value_head_dim=linear_dim, linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=moe, shared_expert_intermediate_size=shared, norm_topk_prob=True,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    if arch == "qwen3_5_moe":
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**common)).eval()
    else:
        cfg = transformers.Qwen3NextConfig(intermediate_size=80, decoder_sparse_step=1,
                                           mlp_only_layers=list(mlp_only_layers), **common)
        model = transformers.Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # zero-centred norms: scales 1 + w in 0.5..1.5 (the gated norm: w)
                p.uniform_(0.5, 1.5) if "linear_attn.norm" in name else p.uniform_(-0.5, 0.5)
            elif name.endswith(("A_log", "dt_bias")):
                p.uniform_(-1.0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0, std)
            if bf16_exact:
                p.copy_(p.bfloat16().float())
    model.save_pretrained(path)
    return path
