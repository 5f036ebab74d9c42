"""Qwen3 dense (Qwen3ForCausalLM): the Llama architecture plus an RMSNorm over each head of
q and of k (weights `q_norm` / `k_norm` [head_dim]) before the rotary embedding; no
attention bias by default; tied or untied embeddings.

Source of the architecture: Qwen team, "Qwen3 Technical Report" (2025), and Hugging Face's
`modeling_qwen3.py` (parameter names follow its checkpoints). Sliding-window attention
(`use_sliding_window: true`) is not supported and raises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.layers.norm import RMSNorm
from services.worker.layers.rotary import RotaryEmbedding
from services.worker.models.llama import LlamaArgs, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


@dataclass(frozen=True)
class Qwen3Args(LlamaArgs):
    @classmethod
    def from_hf(cls, c: dict) -> "Qwen3Args":
        """Read a Qwen3 config.json dict (see `LlamaArgs.from_hf`).
        Raises ValueError when sliding-window attention is on."""
        if c.get("use_sliding_window"):
            raise ValueError("Qwen3 with use_sliding_window=true is not supported")
        return super().from_hf(c)


class Qwen3Attention(LlamaAttention):
    """Llama attention with per-head q/k RMSNorm (eps = rms_norm_eps) before RoPE; the
    norms run inside the rotary kernel (`kernels.rotary.rotary_and_store_kv`), in place on
    the views of the fused qkv output."""

    def __init__(self, a: LlamaArgs, rotary: RotaryEmbedding):
        super().__init__(a, rotary)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    """The whole Qwen3 dense model; interface as `LlamaForCausalLM`."""

    model_cls = Qwen3Model
    args_cls = Qwen3Args
