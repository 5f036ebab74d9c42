"""GGUF tensor names and row order of the llama architecture, against Hugging Face's.

One home for what `kestrel fetch-model` (fetch_model.py, which converts a GGUF into a HF
folder) and the GGUF weight loader (gguf_loader.py, `--quantization gguf`) both undo:
- names: llama.cpp's gguf-py tensor map (`blk.<i>.attn_q.weight` ->
  `model.layers.<i>.self_attn.q_proj.weight`, ...);
- the Q/K rotary row permutation: llama.cpp's convert_hf_to_gguf.py stores each head's q
  and k rows interleaved (pairs of rotary halves) for its rope kernel; HF keeps them as
  [first half; second half]. It permutes whole output rows, so it applies as well to the
  rows of quantized blocks (each row's blocks run along K) as to dequantized weights.
"""

from __future__ import annotations

import numpy as np
import torch

# GGUF per-block tensor name -> HF LlamaForCausalLM name (llama.cpp's gguf-py tensor map).
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str:
    """The HF name of a llama GGUF tensor. Raises ValueError for a name not in the map."""
    if gguf_name in TOP_NAMES:
        return TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def rotary_heads(name: str, n_heads: int, n_kv_heads: int) -> int | None:
    """The head count whose rotary permutation `name` (a HF name) carries: n_heads for a
    q_proj weight, n_kv_heads for a k_proj weight, None for every other tensor."""
    if name.endswith("q_proj.weight"):
        return n_heads
    if name.endswith("k_proj.weight"):
        return n_kv_heads
    return None


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: w [n_heads * head_dim, ...] (any dtype) -> the
    same rows in HF order. Inverse of reshape(h, 2, d/2).swapaxes(1, 2) over the rows."""
    rows = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def rotary_row_order(rows: int, n_heads: int) -> torch.Tensor:
    """int64 [rows]: HF row r is GGUF row order[r] (`unpermute_rotary` as an index), for
    tensors that are not one array of values (a quantized weight's codes, scales, zeros).
    Raises ValueError when rows is not a multiple of 2 * n_heads."""
    if n_heads <= 0 or rows % (2 * n_heads):
        raise ValueError(f"rotary rows {rows} are not a multiple of 2 x {n_heads} heads")
    return torch.from_numpy(unpermute_rotary(np.arange(rows), n_heads))
