"""Qwen3 dense (Qwen3ForCausalLM): the Llama architecture with `qk_norm` on, an RMSNorm over
each head of q and of k (weights `q_norm` / `k_norm` [head_dim], eps = rms_norm_eps) before
the rotary embedding, which the attention backend applies; no attention bias by default;
tied or untied embeddings.

Source of the architecture: Qwen team, "Qwen3 Technical Report" (2025), and Hugging Face's
`modeling_qwen3.py` (parameter names follow its checkpoints). Sliding-window attention
(`use_sliding_window: true`) is not supported and raises.
"""

from __future__ import annotations

from services.worker.models.llama import LlamaForCausalLM
from shared.model_spec import ModelSpec


class Qwen3ForCausalLM(LlamaForCausalLM):
    """The whole Qwen3 dense model; interface as `LlamaForCausalLM`.
    Raises ValueError when sliding-window attention is on."""

    qk_norm = True

    def __init__(self, spec: ModelSpec, max_positions: int | None = None):
        if spec.hf_config.get("use_sliding_window"):
            raise ValueError("Qwen3 with use_sliding_window=true is not supported")
        super().__init__(spec, max_positions)
