"""A tiny llama GGUF written by the tests with the `gguf` package's writer, in the format
llama.cpp writes (tensor names, the Q/K rotary row order, a byte-level BPE tokenizer), with
the quantized types `--quantization gguf` maps:

- Q4_0, Q4_1, Q8_0: the `gguf` package's own quantizers (`gguf.quants.quantize`);
- Q4_K: it has none (only a dequantizer), so `quantize_q4_k` below writes the blocks by
  ggml's format (block_q4_K: d, dmin fp16, 12 bytes of 6-bit sub-block scales and mins packed
  as get_scale_min_k4 reads them, 128 bytes of nibbles; w = d sc_j q - dmin m_j), with plain
  min/max sub-block fits (not llama.cpp's search); the `gguf` dequantizer is the truth.

Layer 0 takes one type a linear weight, layer 1 mixes the stacked shards: q/k/v Q4_0 / Q4_1 /
Q4_K (one int4 weight from three types), gate Q4_K with up Q8_0 (a stacked weight with a Q8_0
shard: int8 after dequantizing), o_proj Q8_0. The embedding is Q8_0 (as SmolLM2's), tied to
the head, or with an untied Q4_0 output head (`tied=False`).
"""

from __future__ import annotations

import numpy as np

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2  # K = 256 and 512: whole Q4_K super-blocks
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "r e", "Ġ s", "a t", "e n", "Ġ o",
          "e s", "Ġ w", "o r", "Ġ c", "i s", "a n", "Ġ b", "Ġ f"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# GGUF tensor (per layer: "blk.{i}.<name>") -> its type in layer 0 and in layer 1
LAYER_TYPES = {
    "attn_q": ("Q4_K", "Q4_0"), "attn_k": ("Q4_K", "Q4_1"), "attn_v": ("Q4_K", "Q4_K"),
    "attn_output": ("Q4_0", "Q8_0"), "ffn_gate": ("Q4_1", "Q4_K"), "ffn_up": ("Q4_1", "Q8_0"),
    "ffn_down": ("Q4_K", "Q4_1"),
}


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode map (bytes 0..255 -> printable characters), in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """[..., 1] float -> [..., 2] uint8 of its fp16."""
    return x.astype(np.float16).view(np.uint8)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """w float32 [N, K] (K % 256 == 0) -> uint8 [N, K / 256 * 144] Q4_K blocks (module
    docstring): per sub-block of 32, lo = min(min, 0), step = (max - lo) / 15, then
    d = max step / 63, dmin = max(-lo) / 63, sc = round(step / d), m = round(-lo / dmin),
    q = clamp(round((w + dmin m) / (d sc)), 0, 15)."""
    n, k = w.shape
    sub = w.astype(np.float32).reshape(n * k // 256, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    step = (sub.max(-1) - lo) / 15.0
    d = (step.max(-1, keepdims=True) / 63.0).astype(np.float16).astype(np.float32)
    dmin = (-lo).max(-1, keepdims=True) / 63.0
    dmin = dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(step, d, out=np.zeros_like(step), where=d > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(np.divide(-lo, dmin, out=np.zeros_like(lo), where=dmin > 0)), 0, 63).astype(np.uint8)
    scale, mn = d * sc, dmin * m
    q = np.round(np.divide(sub + mn[..., None], scale[..., None], out=np.zeros_like(sub),
                           where=scale[..., None] > 0))
    q = np.clip(q, 0, 15).astype(np.uint8)  # [B, 8, 32]
    packed = np.empty((sub.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub-blocks 2c (low), 2c + 1 (high)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, qs], axis=1)
    return blocks.reshape(n, k // 256 * 144)


def quantized(w: np.ndarray, qtype: str) -> np.ndarray:
    """The raw GGUF rows of w float32 [N, K] in qtype (Q4_0, Q4_1, Q8_0, Q4_K, or F32)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if qtype == "Q4_K":
        return quantize_q4_k(w)
    return quantize(w.astype(np.float32), GGMLQuantizationType[qtype])


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (convert_hf_to_gguf.py's LlamaModel.permute) of HF rows."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """Random fp32 weights in HF names and order (rotary rows as HF keeps them). Linear
    weights ~ N(0, 1 / in_features) with a few outliers, norms around 1."""
    rng = np.random.default_rng(seed)
    vocab = len(byte_level_alphabet()) + len(MERGES) + len(SPECIALS)

    def lin(n: int, k: int) -> np.ndarray:
        w = rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)
        w.reshape(-1)[rng.integers(0, n * k, max(1, n * k // 200))] *= 6.0
        return w

    out = {"model.embed_tokens.weight": (0.25 * rng.standard_normal((vocab, HIDDEN))).astype(np.float32),
           "model.norm.weight": (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)}
    if not tied:
        out["lm_head.weight"] = lin(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        out[p + "post_attention_layernorm.weight"] = (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        out[p + "self_attn.q_proj.weight"] = lin(HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.k_proj.weight"] = lin(KV_HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.v_proj.weight"] = lin(KV_HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.o_proj.weight"] = lin(HIDDEN, HEADS * HEAD_DIM)
        out[p + "mlp.gate_proj.weight"] = lin(INTER, HIDDEN)
        out[p + "mlp.up_proj.weight"] = lin(INTER, HIDDEN)
        out[p + "mlp.down_proj.weight"] = lin(HIDDEN, INTER)
    return out


def write_tiny_llama_gguf(path: str, seed: int = 0, tied: bool = True) -> dict[str, str]:
    """Write the tiny llama GGUF (module docstring) to `path`. Returns {GGUF tensor name: type}."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from services.worker.gguf_names import BLOCK_NAMES

    hf = hf_weights(seed, tied)
    tokens = byte_level_alphabet() + [m.replace(" ", "") for m in MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # normal, control
    eos = tokens.index("<|im_end|>")
    wr = GGUFWriter(path, "llama")
    wr.add_name("tiny-llama-test")
    wr.add_block_count(LAYERS)
    wr.add_context_length(512)
    wr.add_embedding_length(HIDDEN)
    wr.add_feed_forward_length(INTER)
    wr.add_head_count(HEADS)
    wr.add_head_count_kv(KV_HEADS)
    wr.add_rope_freq_base(10000.0)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_rope_dimension_count(HEAD_DIM)
    wr.add_vocab_size(len(tokens))
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("smollm")
    wr.add_token_list(tokens)
    wr.add_token_merges(MERGES)
    wr.add_token_types(types)
    wr.add_bos_token_id(tokens.index("<|im_start|>"))
    wr.add_eos_token_id(eos)
    wr.add_pad_token_id(tokens.index("<|endoftext|>"))
    wr.add_add_bos_token(False)
    wr.add_chat_template(CHAT_TEMPLATE)
    by_hf = {v: k for k, v in BLOCK_NAMES.items()}
    written: dict[str, str] = {}

    def put(name: str, w: np.ndarray, qtype: str) -> None:
        data = quantized(w, qtype)
        if qtype == "F32":
            wr.add_tensor(name, data)
        else:
            wr.add_tensor(name, data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType[qtype])
        written[name] = qtype

    put("token_embd.weight", hf["model.embed_tokens.weight"], "Q8_0")
    put("output_norm.weight", hf["model.norm.weight"], "F32")
    if not tied:
        put("output.weight", hf["lm_head.weight"], "Q4_0")
    for i in range(LAYERS):
        for hf_suffix, short in by_hf.items():
            w = hf[f"model.layers.{i}.{hf_suffix}.weight"]
            if short in ("attn_q", "attn_k"):
                w = permute_rotary(w, HEADS if short == "attn_q" else KV_HEADS)
            put(f"blk.{i}.{short}.weight", w, LAYER_TYPES[short][i] if short in LAYER_TYPES else "F32")
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return written


def tiny_model_folder(root: str, tied: bool = True, seed: int = 0) -> str:
    """Write the tiny GGUF under `root` and convert it as users do (`kestrel fetch-model --gguf`,
    into `<root>/models/`, which keeps the GGUF at `models/.gguf/` and records it in the
    folder). Returns the model folder."""
    import os

    from services.worker.fetch_model import fetch_model

    os.makedirs(root, exist_ok=True)
    src = os.path.join(root, "tiny-llama.gguf")
    write_tiny_llama_gguf(src, seed=seed, tied=tied)
    return fetch_model(os.path.join(root, "models"), name="tiny-llama", gguf_path=src)
