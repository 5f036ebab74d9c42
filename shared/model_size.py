"""A model's size estimated from its config.json (no weights read): what a settings profile
needs to pick batch sizes and the CPU KV cache (shared/profiles.py)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.model_spec import DEFAULT_MAX_POSITIONS, ModelFolderError, load_model_spec

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
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS

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
    """Estimate the parameter count of a HF decoder from its `ModelSpec`.

    Counts embeddings (and an untied lm_head), per-layer attention projections (q, k, v, o),
    the gated MLP (3 * hidden * intermediate, times the expert count for MoE configs) and
    norms. Good to a few percent for Llama-style models, which is all a profile needs.
    A folder that has no usable config.json gives ModelSize(None).
    """
    try:
        m = load_model_spec(model_dir)
    except ModelFolderError:
        return ModelSize(None)
    h, heads, kv_heads, head_dim = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    mlp = 3 * h * (m.moe_intermediate_size * m.num_experts if m.num_experts > 1 else m.intermediate_size)
    per_layer = attn + mlp + 2 * h
    emb = m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
    return ModelSize(float(m.num_layers * per_layer + emb + h), 2 * m.num_layers * kv_heads * head_dim,
                     m.max_position_embeddings)
