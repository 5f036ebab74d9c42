"""Model facts derived once: `ModelSpec` (shared/model_spec.py) against transformers' own
reading of the same folder, `KVLayout` (shared/kv_layout.py) against the bytes torch
allocates and the kvstore's documented identity, and the refusal of a quantized KV cache at
configuration time, through the CLI."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import uuid

import pytest
import torch

from services.worker.kv_cache import KVCache, PagedKVSpec
from services.worker.kv_transfer import KVTransfer
from shared.config import build_config
from shared.hashing import model_identity_hash
from shared.kv_layout import KVLayout, ParallelLayout, identity_for, kv_layout_for
from shared.model_spec import (DTYPE_BYTES, ModelFolderError, kv_dtype_in_use,
                               load_model_spec, model_spec_for)

REPO = pathlib.Path(__file__).resolve().parents[2]
SMOLLM2 = REPO / "models" / "SmolLM2-135M-Instruct"
needs_smollm2 = pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(),
                                   reason="SmolLM2 not fetched (kestrel fetch-model)")


def _folder(tmp_path, cfg: dict, gen: dict | None = None) -> str:
    d = tmp_path / uuid.uuid4().hex[:8]
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    if gen is not None:
        (d / "generation_config.json").write_text(json.dumps(gen))
    return str(d)


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
         "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 131072,
         "eos_token_id": [5, 7], "bos_token_id": 1}


@needs_smollm2
def test_spec_of_the_test_model_matches_transformers_reading_of_it():
    from transformers import AutoConfig, GenerationConfig

    hf = AutoConfig.from_pretrained(SMOLLM2)
    gen = GenerationConfig.from_pretrained(SMOLLM2)
    s = load_model_spec(str(SMOLLM2))
    assert (s.num_layers, s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads,
            s.head_dim, s.vocab_size, s.max_position_embeddings, s.tie_word_embeddings) == (
        hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size, hf.num_attention_heads,
        hf.num_key_value_heads, hf.head_dim, hf.vocab_size, hf.max_position_embeddings,
        hf.tie_word_embeddings)
    eos = {hf.eos_token_id} | ({gen.eos_token_id} if isinstance(gen.eos_token_id, int)
                               else set(gen.eos_token_id or []))
    assert set(s.eos_token_ids) == eos and s.bos_token_id == hf.bos_token_id
    assert (s.architecture, s.path) == (hf.architectures[0], os.path.abspath(SMOLLM2))


def test_absent_fields_take_the_hugging_face_defaults(tmp_path):
    cfg = {k: v for k, v in LLAMA.items() if k not in ("num_key_value_heads", "max_position_embeddings")}
    s = load_model_spec(_folder(tmp_path, cfg))
    # LlamaConfig: kv heads default to the attention heads, head_dim to hidden / heads,
    # max_position_embeddings to 2048
    assert (s.num_kv_heads, s.head_dim, s.max_position_embeddings) == (8, 32, 2048)
    assert s.max_model_len == 2048 and s.num_experts == 1


def test_eos_ids_merge_config_and_generation_config_in_order_without_repeats(tmp_path):
    s = load_model_spec(_folder(tmp_path, LLAMA, {"eos_token_id": [7, 9]}))
    assert s.eos_token_ids == (5, 7, 9)


def test_max_model_len_defaults_to_the_context_capped_at_8192_and_the_setting_wins(tmp_path):
    d = _folder(tmp_path, LLAMA)
    assert load_model_spec(d).max_model_len == 8192
    assert load_model_spec(d, max_model_len=300_000).max_model_len == 300_000
    small = _folder(tmp_path, dict(LLAMA, max_position_embeddings=4096))
    assert load_model_spec(small).max_model_len == 4096


def test_a_multimodal_folder_is_read_from_its_text_config(tmp_path):
    text = {k: v for k, v in LLAMA.items() if k not in ("architectures", "eos_token_id")}
    s = load_model_spec(_folder(tmp_path, {"architectures": ["X"], "text_config": text,
                                           "eos_token_id": 3}))
    assert (s.num_layers, s.num_kv_heads, s.vocab_size, s.eos_token_ids) == (3, 2, 1000, (3,))


@pytest.mark.parametrize("content, needle", [
    (None, "no config.json"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({k: v for k, v in LLAMA.items() if k != "vocab_size"}), "vocab_size"),
    (json.dumps(dict(LLAMA, num_hidden_layers="three")), "malformed config.json"),
])
def test_a_bad_model_folder_is_a_typed_error_naming_the_folder(tmp_path, content, needle):
    d = tmp_path / "bad"
    d.mkdir()
    if content is not None:
        (d / "config.json").write_text(content)
    with pytest.raises(ModelFolderError, match=needle) as e:
        load_model_spec(str(d))
    assert str(d) in str(e.value)


def test_a_file_given_as_the_model_folder_is_named_as_a_file_with_the_way_to_serve_a_gguf(tmp_path):
    """`--model x.gguf` (how vLLM serves a GGUF) said "model folder 'x.gguf' not found"."""
    f = tmp_path / "model.Q4_1.gguf"
    f.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ModelFolderError) as e:
        load_model_spec(str(f))
    msg = str(e.value)
    assert f"--model {str(f)!r} is a file, not a model folder" in msg
    assert "--quantization gguf" in msg and "not found" not in msg


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_a_quantized_kv_cache_dtype_is_the_specs_kv_dtype_and_an_unknown_one_is_refused(tmp_path, kv):
    d = _folder(tmp_path, LLAMA)
    assert load_model_spec(d, kv_cache_dtype=kv).kv_dtype == kv
    assert kv_dtype_in_use("bfloat16", kv) == kv  # read on CUDA by kernels/kv_quant_triton.py
    with pytest.raises(ValueError, match="is not one of"):
        load_model_spec(d, kv_cache_dtype="fp4")


def test_dtype_sizes_are_torchs():
    torch_names = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
    assert set(DTYPE_BYTES) == set(torch_names)
    for name, dt in torch_names.items():
        assert DTYPE_BYTES[name] == torch.empty((), dtype=dt).element_size(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layout_block_bytes_are_what_the_worker_allocates_and_copies(tmp_path, dtype):
    name = str(dtype).removeprefix("torch.")
    spec = load_model_spec(_folder(tmp_path, LLAMA), dtype=name)
    layout = KVLayout.for_model(spec, block_size=16)
    specs = [PagedKVSpec(spec.num_kv_heads, spec.head_dim)] * spec.num_layers
    kv = KVCache(specs, 5, 16, dtype, "cpu")
    assert layout.block_bytes * 5 == sum(t.numel() * t.element_size() for t in kv.k + kv.v)
    assert layout.layer_block_bytes * 5 == kv.k[0].nbytes + kv.v[0].nbytes
    assert layout.slot_bytes == layout.block_bytes == KVTransfer(kv, layout).slot_bytes


def test_a_cache_not_laid_out_as_the_layout_says_is_refused(tmp_path):
    spec = load_model_spec(_folder(tmp_path, LLAMA), dtype="bfloat16")
    specs = [PagedKVSpec(spec.num_kv_heads, spec.head_dim)] * spec.num_layers
    kv = KVCache(specs, 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="not laid out"):
        KVTransfer(kv, KVLayout.for_model(spec, 16))


def test_identity_is_the_documented_hash_and_the_engine_and_kvstore_agree(tmp_path):
    d = _folder(tmp_path, LLAMA)
    cfg = build_config(cli={"model": d, "device": "cpu", "dtype": "bfloat16", "block_size": 32,
                            "profile": "none"}, env={})
    layout = kv_layout_for(cfg)
    want = model_identity_hash(os.path.abspath(d), "bfloat16", "bfloat16", 32, 1)
    assert layout.model_identity == want == identity_for(cfg)
    # the kvstore may be bound to a folder it never reads: the identity needs none
    gone = build_config(cli={"model": "/nonexistent/m", "device": "cpu", "dtype": "float32",
                             "profile": "none"}, env={})
    assert identity_for(gone) == model_identity_hash("/nonexistent/m", "float32", "float32", 16, 1)


def test_identity_covers_dtype_block_size_and_tp_size_but_not_the_rank(tmp_path):
    spec = load_model_spec(_folder(tmp_path, LLAMA))
    base = KVLayout.for_model(spec, 16).model_identity
    assert KVLayout.for_model(load_model_spec(spec.path, dtype="float16"), 16).model_identity != base
    assert KVLayout.for_model(spec, 32).model_identity != base
    tp2 = KVLayout.for_model(spec, 16, ParallelLayout(2, 0))
    assert tp2.model_identity != base
    assert KVLayout.for_model(spec, 16, ParallelLayout(2, 1)).model_identity == tp2.model_identity


def test_tensor_parallel_ranks_share_a_slot_in_rank_order(tmp_path):
    spec = load_model_spec(_folder(tmp_path, LLAMA))       # 2 KV heads
    one = KVLayout.for_model(spec, 16)
    r1 = KVLayout.for_model(spec, 16, ParallelLayout(2, 1))
    assert r1.kv_heads_per_rank == 1 and r1.block_bytes * 2 == one.block_bytes == r1.slot_bytes
    assert r1.rank_slot_offset == r1.block_bytes
    with pytest.raises(ValueError, match="split"):
        KVLayout.for_model(spec, 16, ParallelLayout(4, 0))
    with pytest.raises(ValueError):
        ParallelLayout(2, 2)


def test_the_worker_resolves_auto_dtype_as_the_config_does(tmp_path):
    d = _folder(tmp_path, LLAMA)
    cfg = build_config(cli={"model": d, "device": "cpu", "profile": "none"}, env={})
    assert model_spec_for(cfg).dtype == cfg.dtype == "float32"
    assert model_spec_for(cfg, dtype="bfloat16").kv_dtype == "bfloat16"


@pytest.mark.parametrize("content, needle", [(None, "kestrel fetch-model"),
                                             ("{not json", "not valid JSON")])
def test_serve_refuses_a_bad_model_folder_before_any_process_starts(tmp_path, content, needle):
    model, runtime = tmp_path / "m", tmp_path / "rt"
    model.mkdir()
    if content is not None:
        (model / "config.json").write_text(content)
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", str(model),
                        "--runtime-dir", str(runtime), "--device", "cpu",
                        "--instance-id", "kvm" + uuid.uuid4().hex[:6]],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr and str(model) in r.stderr, r.stderr
    assert not runtime.exists(), "a process started: the runtime folder was created"

