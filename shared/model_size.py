"""A model's size estimated from its config.json (no weights read): what a settings profile
needs to pick batch sizes and the CPU KV cache (shared/profiles.py)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

# Model size classes by estimated parameter count.
MEDIUM_PARAMS = 3e9
LARGE_PARAMS = 30e9


@dataclass(frozen=True)
class ModelSize:
    """Size facts of a model folder, estimated from config.json (no weights read).

    params: parameter count estimate (None when config.json is missing or unreadable).
    kv_elems_per_token: KV elements per token across all layers (2 * layers * kv heads
    * head dim); multiply by the KV dtype's bytes. max_position_embeddings: tokens.
    """

    params: float | None
    kv_elems_per_token: int = 0
    max_position_embeddings: int = 2048

    @property
    def size_class(self) -> str:
        """"small" (< 3B parameters or unknown), "medium" (< 30B) or "large"."""
        if self.params is None or self.params < MEDIUM_PARAMS:
            return "small"
        return "medium" if self.params < LARGE_PARAMS else "large"

    def describe(self) -> str:
        """One line for the startup log, e.g. "~0.1B parameters (small)"."""
        if self.params is None:
            return "model size unknown"
        p = self.params
        txt = f"{p / 1e9:.1f}B" if p >= 1e9 else f"{p / 1e6:.0f}M"
        return f"~{txt} parameters ({self.size_class})"


def estimate_model_size(model_dir: str) -> ModelSize:
    """Estimate the parameter count of a HF decoder from its config.json.

    Counts embeddings (and an untied lm_head), per-layer attention projections (q, k, v, o),
    the gated MLP (3 * hidden * intermediate, times the expert count for MoE configs) and
    norms. Good to a few percent for Llama-style models, which is all a profile needs.
    """
    try:
        with open(os.path.join(model_dir, "config.json")) as fh:
            c = json.load(fh)
        if "text_config" in c and "hidden_size" not in c:
            c = c["text_config"]
        h = int(c["hidden_size"])
        layers = int(c["num_hidden_layers"])
        heads = int(c.get("num_attention_heads", max(h // 64, 1)))
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or h // heads)
        inter = int(c.get("intermediate_size") or 4 * h)
        vocab = int(c.get("vocab_size", 32000))
        experts = int(c.get("num_local_experts") or c.get("num_experts") or 1)
        moe_inter = int(c.get("moe_intermediate_size") or inter)
    except (OSError, ValueError, KeyError, TypeError):
        return ModelSize(None)
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    mlp = 3 * h * (moe_inter * experts if experts > 1 else inter)
    per_layer = attn + mlp + 2 * h
    emb = vocab * h * (1 if c.get("tie_word_embeddings", False) else 2)
    return ModelSize(float(layers * per_layer + emb + h), 2 * layers * kv_heads * head_dim,
                     int(c.get("max_position_embeddings", 2048)))
