"""`--speculative-config` (shared/spec_config.py): parsing as vLLM spells it, and the
combinations refused at configuration time, before any process starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from shared.config import build_config
from shared.spec_config import SpeculativeConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOLLM2 = os.path.join(REPO, "models", "SmolLM2-135M-Instruct")


def test_ngram_defaults_and_the_canonical_json_round_trip():
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert spec is not None
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
            spec.policy) == ("ngram", 4, 2, 4, "adaptive")
    assert SpeculativeConfig.parse(spec.to_json()) == spec
    # vLLM: one of min/max given alone bounds the other
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                    "prompt_lookup_max": 1}).prompt_lookup_min == 1
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None


@pytest.mark.parametrize("body, field", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "dflash", "num_speculative_tokens": 2, "draft_sampling": "beam"}, "draft_sampling"),
    ({"method": "eagle", "num_speculative_tokens": 2, "target_layer_ids": [1, "x"]}, "target_layer_ids"),
    ({"method": "ngram", "num_speculative_tokens": 2, "policy": "always"}, "policy"),
])
def test_bad_fields_are_refused_naming_the_field(body, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(json.dumps(body))


def test_the_setting_comes_from_cli_env_or_config_file_with_its_source(tmp_path):
    text = '{"method": "ngram", "num_speculative_tokens": 3}'
    cfg = build_config({"speculative_config": text}, env={})
    assert cfg.speculative.num_speculative_tokens == 3 and cfg.source("speculative_config") == "cli"
    cfg = build_config({}, env={"KESTREL_SPECULATIVE_CONFIG": text})
    assert cfg.speculative.method == "ngram" and cfg.source("speculative_config") == "env"
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"speculative_config": {"method": "ngram", "num_speculative_tokens": 5}}))
    cfg = build_config({}, env={}, config_file=str(path))
    assert cfg.speculative.num_speculative_tokens == 5 and cfg.source("speculative_config") == "config file"
    assert build_config({}, env={}).speculative is None


def test_a_draft_model_needs_a_folder_and_the_targets_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="needs the drafter's folder"):
        build_config({"speculative_config": '{"method": "draft_model", "num_speculative_tokens": 2}'}, env={})
    with pytest.raises(ValueError, match="no config.json"):
        build_config({"speculative_config": json.dumps(
            {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2})}, env={})
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 1000,
                                                       "hidden_size": 64, "num_hidden_layers": 1,
                                                       "num_attention_heads": 2, "intermediate_size": 128}))
    with pytest.raises(ValueError, match="vocab"):
        build_config({"model": SMOLLM2, "speculative_config": json.dumps(
            {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2})}, env={})


def test_the_cli_refuses_a_bad_speculative_config_before_any_process_starts(tmp_path):
    runtime = tmp_path / "rt"
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", SMOLLM2, "--device", "cpu",
                        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}',
                        "--runtime-dir", str(runtime), "--instance-id", "spc" + uuid.uuid4().hex[:6]],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "num_speculative_tokens" in r.stderr, r.stderr
    assert not runtime.exists(), "a process started: the runtime folder was created"


def _tiny_llama_folder(path, **over) -> str:
    """A Llama config.json with SmolLM2's vocabulary (and no weights unless written)."""
    conf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 128, "max_position_embeddings": 2048, "tie_word_embeddings": True, **over}
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(conf))
    return str(path)


def test_drafter_folders_and_layers_that_cannot_load_are_refused(tmp_path):
    folder = _tiny_llama_folder(tmp_path / "noweights")
    for method in ("draft_model", "eagle", "dflash"):
        with pytest.raises(ValueError, match="model.safetensors"):
            build_config({"model": SMOLLM2, "speculative_config": json.dumps(
                {"method": method, "model": folder, "num_speculative_tokens": 2})}, env={})
    with pytest.raises(ValueError, match="past the target's 30 layers"):
        build_config({"model": SMOLLM2, "speculative_config": json.dumps(
            {"method": "dflash", "load_format": "dummy", "num_speculative_tokens": 2,
             "target_layer_ids": [0, 99]})}, env={})
    with pytest.raises(ValueError, match="reads 3 target layers"):
        build_config({"model": SMOLLM2, "speculative_config": json.dumps(
            {"method": "eagle", "load_format": "dummy", "num_speculative_tokens": 2,
             "target_layer_ids": [0, 5]})}, env={})
    with pytest.raises(ValueError, match="deeper than the target's 30 layers"):
        build_config({"model": SMOLLM2, "speculative_config": json.dumps(
            {"method": "draft_model", "load_format": "dummy", "num_speculative_tokens": 2,
             "draft_num_layers": 999})}, env={})


def test_a_drafter_that_fails_to_load_stops_serve_with_exit_2_and_no_restarts(tmp_path):
    """The worker refuses its configuration (CONFIG_REFUSED): the supervisor does not
    restart it, and `kestrel serve` exits 2 with the reason in its log."""
    folder = _tiny_llama_folder(tmp_path / "badweights")
    from safetensors.torch import save_file
    import torch
    save_file({"model.norm.weight": torch.ones(64)}, os.path.join(folder, "model.safetensors"))
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", SMOLLM2, "--device", "cpu",
                        "--kv-cache-gib", "0.05", "--max-model-len", "512", "--no-engine-standby",
                        "--speculative-config", json.dumps({"method": "draft_model", "model": folder,
                                                            "num_speculative_tokens": 2}),
                        "--runtime-dir", str(tmp_path / "rt"), "--watchdog-dump-dir", str(tmp_path / "dumps"),
                        "--instance-id", "spd" + uuid.uuid4().hex[:6]],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    log = r.stdout + r.stderr
    assert r.returncode == 2, log[-4000:]
    assert "the worker refused its configuration" in log, log[-4000:]
    assert "restarting engine" not in log.lower() and log.count("started worker-0") == 1, log[-4000:]
