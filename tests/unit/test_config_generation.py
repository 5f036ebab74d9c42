"""`--generation-config` / `--override-generation-config` at configuration time: the model
folder's generation_config.json read with "auto", none with "vllm", a named folder, the
override merged over it (a null removing a default), and every bad value refused before
any process starts (ValueError naming the setting and key; `kestrel serve` exits 2).

The truth is the files written here and vLLM's documented rules (shared/config_generation.py).
"""

from __future__ import annotations

import argparse
import json

import pytest

from services import cli
from shared.config import add_cli_arguments, build_config
from shared.config_generation import OVERRIDE, GenerationDefaults, resolve
from shared.device import GIB, DeviceInfo

CPU = DeviceInfo("cpu", host_memory_bytes=32 * GIB, host_available_bytes=20 * GIB, cpu_count=8)
# A model author's file: sampling keys, keys that are not sampling defaults, and top_k 50
# (transformers' own default, which vLLM does not count as the model's).
MODEL_FILE = {"bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": True,
              "temperature": 0.6, "top_p": 0.9, "top_k": 50, "min_p": 0.05,
              "repetition_penalty": 1.1, "max_new_tokens": 300, "transformers_version": "4.45"}


def _folder(tmp_path, name: str, gen: dict | None) -> str:
    d = tmp_path / name
    d.mkdir()
    if gen is not None:
        (d / "generation_config.json").write_text(json.dumps(gen))
    return str(d)


def _cli(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    add_cli_arguments(p)
    return vars(p.parse_args(argv))


def _build(model: str, *argv: str, env: dict | None = None):
    return build_config(_cli(["--model", model, *argv]), env=env or {}, probe=CPU)


def test_auto_reads_the_model_folders_sampling_keys_and_nothing_else(tmp_path):
    model = _folder(tmp_path, "model", MODEL_FILE)
    cfg = _build(model)
    assert (cfg.generation_config, cfg.source("generation_config")) == ("auto", "default")
    d = cfg.generation_defaults
    assert (d.temperature, d.top_p, d.min_p, d.repetition_penalty) == (0.6, 0.9, 0.05, 1.1)
    assert d.top_k is None  # 50 is transformers' default: not the model's (as vLLM reads it)
    assert (d.max_tokens, d.max_tokens_cap) == (300, None)  # the model's: a default only
    path = f"{model}/generation_config.json"
    assert d.sources == {"temperature": path, "top_p": path, "min_p": path,
                         "repetition_penalty": path, "max_tokens": path}
    table = cfg.table()
    assert "(sampling defaults)" in table and f"temperature 0.6 [{path}]" in table


def test_a_folder_without_the_file_has_no_defaults_and_vllm_ignores_the_file(tmp_path):
    assert _build(_folder(tmp_path, "bare", None)).generation_defaults == GenerationDefaults()
    model = _folder(tmp_path, "model", MODEL_FILE)
    assert _build(model, "--generation-config", "vllm").generation_defaults == GenerationDefaults()
    assert "none (neutral" in _build(model, "--generation-config", "vllm").table()


def test_a_named_folder_is_read_instead_of_the_models(tmp_path):
    model = _folder(tmp_path, "model", MODEL_FILE)
    other = _folder(tmp_path, "other", {"temperature": 0.3, "top_k": 20})
    d = _build(model, "--generation-config", other).generation_defaults
    assert (d.temperature, d.top_k, d.top_p, d.max_tokens) == (0.3, 20, None, None)


def test_the_override_wins_over_the_file_and_a_null_removes_a_default(tmp_path):
    model = _folder(tmp_path, "model", MODEL_FILE)
    cfg = _build(model, "--override-generation-config",
                 '{"temperature": 0, "top_p": null, "max_new_tokens": 64, "top_k": -1}')
    assert cfg.override_generation_config == (
        '{"max_new_tokens": 64, "temperature": 0.0, "top_k": -1, "top_p": null}')
    d = cfg.generation_defaults
    assert (d.temperature, d.top_p, d.top_k, d.min_p) == (0.0, None, 0, 0.05)
    assert (d.max_tokens, d.max_tokens_cap) == (64, 64)  # the operator's: also a ceiling
    assert d.sources["temperature"] == OVERRIDE and "top_p" not in d.sources
    # with "vllm" the override is the only source
    d = _build(model, "--generation-config", "vllm", "--override-generation-config",
               '{"repetition_penalty": 1.2}').generation_defaults
    assert d == GenerationDefaults(repetition_penalty=1.2)


def test_the_override_from_a_config_file_object_and_from_the_environment(tmp_path):
    model = _folder(tmp_path, "model", None)
    f = tmp_path / "kestrel.json"
    f.write_text(json.dumps({"override_generation_config": {"top_k": 5}}))
    cfg = build_config(_cli(["--model", model, "--config-file", str(f)]), env={}, probe=CPU)
    assert (cfg.generation_defaults.top_k, cfg.source("override_generation_config")) == (5, "config file")
    cfg = _build(model, env={"KESTREL_OVERRIDE_GENERATION_CONFIG": '{"min_p": 0.1}'})
    assert (cfg.generation_defaults.min_p, cfg.source("override_generation_config")) == (0.1, "env")
    # the resolved config the supervisor hands its children keeps it
    again = type(cfg).from_json(cfg.to_json())
    assert again.generation_defaults == cfg.generation_defaults


@pytest.mark.parametrize("override, words", [
    ("{bad", ["override_generation_config", "not JSON"]),
    ('[1, 2]', ["override_generation_config", "JSON object"]),
    ('{"temprature": 0}', ["override_generation_config", "unknown key 'temprature'"]),
    ('{"do_sample": false}', ["unknown key 'do_sample'"]),
    ('{"temperature": "0"}', ["temperature must be a number"]),
    ('{"temperature": 2.5}', ["temperature must be a number in [0, 2]"]),
    ('{"top_p": 0}', ["top_p must be a number in (0, 1]"]),
    ('{"top_k": 1.5}', ["top_k must be an integer"]),
    ('{"repetition_penalty": true}', ["repetition_penalty must be a number"]),
    ('{"max_new_tokens": 0}', ["max_new_tokens must be an integer >= 1"]),
])
def test_a_bad_override_is_refused_at_configuration_time(tmp_path, override, words):
    model = _folder(tmp_path, "model", None)
    with pytest.raises(ValueError) as err:
        build_config({"model": model, "override_generation_config": override}, env={}, probe=CPU)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("content, words", [
    ('{"temperature": -1}', ["generation_config.json", "temperature must be a number"]),
    ('{"max_new_tokens": "many"}', ["generation_config.json", "max_new_tokens"]),
    ("{not json", ["generation_config", "cannot read"]),
    ("[]", ["is not a JSON object"]),
])
def test_a_bad_model_file_is_refused_at_configuration_time(tmp_path, content, words):
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(content)
    with pytest.raises(ValueError) as err:
        _build(str(model))
    assert all(w in str(err.value) for w in words), str(err.value)
    # the file is not read at all with "vllm"
    assert _build(str(model), "--generation-config", "vllm").generation_defaults == GenerationDefaults()


def test_a_named_folder_must_hold_the_file(tmp_path):
    model = _folder(tmp_path, "model", None)
    with pytest.raises(ValueError, match="has no generation_config.json"):
        _build(model, "--generation-config", model)
    with pytest.raises(ValueError, match="is not 'auto', 'vllm' or a folder"):
        _build(model, "--generation-config", str(tmp_path / "missing"))


@pytest.mark.parametrize("argv, message", [
    (["--override-generation-config", '{"temprature": 0}'], "unknown key 'temprature'"),
    (["--override-generation-config", "{bad"], "override_generation_config: not JSON"),
    (["--generation-config", "."], "has no generation_config.json"),
])
def test_kestrel_serve_exits_2_with_the_reason(tmp_path, capsys, monkeypatch, argv, message):
    from services.supervisor import launcher

    monkeypatch.setattr(launcher, "serve", lambda cfg, check: 99)  # were it accepted: no server
    model = _folder(tmp_path, "model", None)
    assert cli.main(["serve", "--model", model, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "invalid normalize_override value" not in err  # the parser's reason, not argparse's


def test_resolve_reads_the_folder_it_is_given(tmp_path):
    """The frontend resolves with the folder the engine names (services/frontend/context.py)."""
    a = _folder(tmp_path, "a", {"temperature": 0.2})
    assert resolve("auto", a, None).temperature == 0.2
    assert resolve("auto", a, '{"temperature": 0.7}').temperature == 0.7
    assert resolve("vllm", a, "").temperature is None
