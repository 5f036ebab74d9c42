"""The config object: every setting has a value and a source; profiles; precedence; errors.

Device facts are injected (`probe=`), so these tests do not depend on the host.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing

import pytest

from shared.config import KestrelConfig, add_cli_arguments, build_config
from shared.config_fields import FIELDS, parse_bool, parse_log_level
from shared.config_generation import normalize_override
from shared.device import GIB, DeviceInfo
from shared.model_size import estimate_model_size
from shared.profiles import choose_profile
from shared.spec_config import normalize_setting
from shared.startup_report import format_startup_report

CPU = DeviceInfo("cpu", host_memory_bytes=32 * GIB, host_available_bytes=20 * GIB, cpu_count=8)
H200 = DeviceInfo("cuda", "NVIDIA H200", "9.0", 141 * GIB, 1, 512 * GIB, 400 * GIB, 64)
A100 = DeviceInfo("cuda", "NVIDIA A100-SXM4-80GB", "8.0", 80 * GIB, 1, 512 * GIB, 400 * GIB, 64)

SOURCES = {"default", "env", "config file", "cli", "derived"}


def _llama_config(tmp_path, name, hidden, layers, inter, vocab, heads, kv_heads):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": inter, "vocab_size": vocab, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": 8192,
        "tie_word_embeddings": False}))
    return str(d)


@pytest.fixture
def small_model(tmp_path):
    # SmolLM2-135M's shape (untied here): about 0.16B parameters.
    return _llama_config(tmp_path, "small", 576, 30, 1536, 49152, 9, 3)


@pytest.fixture
def llama8b(tmp_path):
    # Llama-3-8B's shape: about 8.0B parameters.
    return _llama_config(tmp_path, "l8b", 4096, 32, 14336, 128256, 32, 8)


@pytest.fixture
def llama70b(tmp_path):
    return _llama_config(tmp_path, "l70b", 8192, 80, 28672, 128256, 64, 8)


def _cli(argv):
    p = argparse.ArgumentParser()
    add_cli_arguments(p)
    return vars(p.parse_args(argv))


def test_every_setting_has_a_value_and_a_known_source(small_model):
    cfg = build_config(_cli(["--model", small_model]), env={}, probe=CPU)
    assert {f.name for f in FIELDS} == set(cfg.sources)
    for name, source in cfg.sources.items():
        assert source in SOURCES or source.startswith("profile:"), (name, source)
    table = cfg.table()
    for f in FIELDS:
        assert f.name in table


def test_cpu_profile_values_have_the_profile_source(small_model):
    cfg = build_config(_cli(["--model", small_model]), env={}, probe=CPU)
    assert cfg.profile == "cpu" and cfg.source("profile") == "derived"
    assert (cfg.max_num_seqs, cfg.source("max_num_seqs")) == (16, "profile:cpu")
    assert (cfg.max_num_batched_tokens, cfg.source("max_num_batched_tokens")) == (1024, "profile:cpu")
    assert cfg.source("kv_cache_gib") == "profile:cpu"
    # 5% of the 20 GiB available (less the fp32 weights), within [0.5, 4] GiB.
    assert 0.5 <= cfg.kv_cache_gib <= 1.0
    assert "[profile:cpu]" in cfg.table()


def test_cpu_kv_cache_grows_to_hold_max_model_len(llama8b):
    cfg = build_config(_cli(["--model", llama8b, "--device", "cpu"]), env={}, probe=CPU)
    # 8192 tokens x 32 layers x 2 x 8 kv heads x 128 x 4 bytes = 1 GiB; 1.25x margin.
    assert cfg.kv_cache_gib >= 1.25
    assert cfg.max_num_seqs == 8  # a medium model on cpu


def test_sm90_profile_on_an_h200(small_model):
    cfg = build_config(_cli(["--model", small_model, "--device", "cuda"]), env={}, probe=H200)
    assert cfg.profile == "sm90"
    assert (cfg.max_num_seqs, cfg.source("max_num_seqs")) == (256, "profile:sm90")
    assert (cfg.max_num_batched_tokens, cfg.source("max_num_batched_tokens")) == (8192, "profile:sm90")
    assert (cfg.gpu_memory_utilization, cfg.source("gpu_memory_utilization")) == (0.9, "profile:sm90")
    assert cfg.source("kv_cache_gib") == "default"  # the GPU path sizes KV by utilization


def test_model_size_picks_smaller_batches_for_large_models(llama70b, llama8b):
    assert 7.5e9 < estimate_model_size(llama8b).params < 8.5e9
    assert 65e9 < estimate_model_size(llama70b).params < 75e9
    assert choose_profile("auto", "cuda", llama70b, probe=H200).values["max_num_seqs"] == 128
    other = choose_profile("auto", "cuda", llama8b, probe=A100)
    assert other.name == "gpu" and other.values["max_num_seqs"] == 128


def test_device_cpu_setting_picks_the_cpu_profile_on_a_gpu_host(small_model):
    cfg = build_config(_cli(["--model", small_model, "--device", "cpu"]), env={}, probe=H200)
    assert cfg.profile == "cpu" and cfg.source("max_num_seqs") == "profile:cpu"


def test_explicit_cli_value_overrides_the_profile(small_model):
    cfg = build_config(_cli(["--model", small_model, "--max-num-seqs", "3"]), env={}, probe=CPU)
    assert (cfg.max_num_seqs, cfg.source("max_num_seqs")) == (3, "cli")
    assert cfg.source("max_num_batched_tokens") == "profile:cpu"


def test_env_and_config_file_override_the_profile_and_env_beats_the_file(small_model, tmp_path):
    f = tmp_path / "kestrel.json"
    f.write_text(json.dumps({"max_num_seqs": 5, "max_num_batched_tokens": 300}))
    cfg = build_config(_cli(["--model", small_model, "--config-file", str(f)]),
                       env={"KESTREL_MAX_NUM_SEQS": "7"}, probe=CPU)
    assert (cfg.max_num_seqs, cfg.source("max_num_seqs")) == (7, "env")
    assert (cfg.max_num_batched_tokens, cfg.source("max_num_batched_tokens")) == (300, "config file")


def test_cli_beats_env(small_model):
    cfg = build_config(_cli(["--model", small_model, "--port", "9001"]),
                       env={"KESTREL_PORT": "9002"}, probe=CPU)
    assert (cfg.port, cfg.source("port")) == (9001, "cli")


def test_profile_none_keeps_the_defaults(small_model):
    cfg = build_config(_cli(["--model", small_model, "--profile", "none"]), env={}, probe=CPU)
    defaults = {f.name: f.default for f in FIELDS}
    assert (cfg.max_num_seqs, cfg.source("max_num_seqs")) == (defaults["max_num_seqs"], "default")
    assert cfg.profile == "none" and cfg.source("profile") == "cli"


def test_requested_profile_applies_on_any_device(small_model):
    cfg = build_config(_cli(["--model", small_model, "--profile", "sm90"]), env={}, probe=CPU)
    assert cfg.source("max_num_seqs") == "profile:sm90" and cfg.source("profile") == "cli"


@pytest.mark.parametrize("argv, env, setting", [
    (["--max-num-seqs", "0"], {}, "max_num_seqs"),
    ([], {"KESTREL_PORT": "eighty"}, "port"),
    ([], {"KESTREL_ENABLE_PREFIX_CACHING": "maybe"}, "enable_prefix_caching"),
    ([], {"KESTREL_PROFILE": "tpu"}, "profile"),
    ([], {"KESTREL_GPU_MEMORY_UTILIZATION": "1.5"}, "gpu_memory_utilization"),
    ([], {"KESTREL_KV_CACHE_GIB": "-1"}, "kv_cache_gib"),
])
def test_bad_values_raise_value_error_naming_the_setting(small_model, argv, env, setting):
    with pytest.raises(ValueError, match=setting):
        build_config(_cli(["--model", small_model, *argv]), env=env, probe=CPU)


def test_bad_key_in_the_config_file_is_named(small_model, tmp_path):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"max_num_seqz": 4}))
    with pytest.raises(ValueError, match="max_num_seqz"):
        build_config(_cli(["--model", small_model, "--config-file", str(f)]), env={}, probe=CPU)


def test_api_key_is_masked_in_the_table_but_kept_in_the_resolved_config(small_model, tmp_path):
    cfg = build_config(_cli(["--model", small_model]), env={"KESTREL_API_KEY": "s3cr3t-key"},
                       probe=CPU)
    assert cfg.api_key == "s3cr3t-key" and cfg.source("api_key") == "env"
    assert "s3cr3t-key" not in cfg.table()
    path = tmp_path / "resolved.json"
    path.write_text(cfg.to_json())
    again = build_config({"resolved_config": str(path)}, env={})
    assert again.api_key == "s3cr3t-key"
    assert again.source("max_num_seqs") == "profile:cpu"


def test_startup_report_lines_name_every_part(small_model):
    report = {"device": CPU.describe(), "num_blocks": 100, "block_size": 16, "kv_tokens": 1600,
              "max_model_len": 1024, "phases": {"engine ready": 1.5, "ready": 2.0},
              "workers": [{"rank": 0, "device": "cpu", "dtype": "float32", "threads": 2,
                           "attention": "torch reference", "weight_bytes": GIB // 2,
                           "kv_bytes": GIB, "load_seconds": 1.2, "startup_s": 1.3}]}
    text = "\n".join(format_startup_report(report))
    for part in ("device: cpu", "kernels: attention torch reference", "weights 0.50 GiB",
                 "KV cache 1.00 GiB", "100 of 16 tokens = 1600 KV tokens", "graph sizes",
                 "load 1.20 s", "ready 2.00 s"):
        assert part in text
    assert all(line.startswith("startup report: ") for line in text.splitlines())


def test_device_detection_without_a_gpu_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys; from shared.device import detect_device; d = detect_device(); "
            "print(d.kind, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    kind, imported = out.stdout.split()
    assert imported == "False"
    assert kind == ("cuda" if os.path.exists("/dev/nvidiactl") else "cpu")


# ---------------------------------------------------------------- the typed config object

# the JSON settings' parsers return canonical JSON text
_PARSED_TYPE = {str: str, int: int, float: float, parse_bool: bool, normalize_setting: str,
                normalize_override: str, parse_log_level: str}
_PROVENANCE = ("sources", "profile_detail", "threads_detail")  # KestrelConfig's fields that are not settings


def test_fields_table_and_typed_config_name_the_same_settings_in_the_same_order():
    typed = [f.name for f in dataclasses.fields(KestrelConfig)]
    assert typed[-len(_PROVENANCE):] == list(_PROVENANCE)
    assert typed[:-len(_PROVENANCE)] == [f.name for f in FIELDS]


def test_each_typed_field_is_its_parsers_type_and_optional_only_when_it_may_stay_unset(small_model):
    hints = typing.get_type_hints(KestrelConfig)
    cfg = build_config(_cli(["--model", small_model]), env={}, probe=CPU)
    for f in FIELDS:
        hint = hints[f.name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        assert [a for a in args if a is not type(None)] == [_PARSED_TYPE[f.type]], f.name
        optional = type(None) in args
        if f.default is not None:
            assert not optional and isinstance(f.default, hint), f.name
        elif not optional:  # unset by default, never None in the object: build_config derives it
            assert cfg.source(f.name) == "derived" and getattr(cfg, f.name) is not None, f.name
        assert isinstance(getattr(cfg, f.name), hint), (f.name, getattr(cfg, f.name))
        if f.choices:
            assert f.default is None or f.default in f.choices, f.name


def test_the_config_is_frozen_and_a_changed_copy_keeps_the_other_values(small_model):
    cfg = build_config(_cli(["--model", small_model]), env={}, probe=CPU)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_num_seqs = 3  # type: ignore[misc]
    other = dataclasses.replace(cfg, max_num_waiting=2)
    assert (other.max_num_waiting, cfg.max_num_waiting) == (2, 256)
    assert other.runtime_dir == cfg.runtime_dir and other.sources == cfg.sources


def test_resolved_config_file_round_trips_every_value_and_source(small_model, tmp_path):
    cfg = build_config(_cli(["--model", small_model, "--max-num-seqs", "5"]),
                       env={"KESTREL_KEEPALIVE_S": "3"}, probe=CPU)
    path = tmp_path / "resolved.json"
    path.write_text(cfg.to_json())
    data = json.loads(path.read_text())
    assert list(data) == [f.name for f in FIELDS]
    assert data["max_num_seqs"] == [5, "cli"] and data["keepalive_s"] == [3.0, "env"]
    assert data["engine_address"] == [f"ipc://{cfg.runtime_dir}/engine.sock", "derived"]
    again = build_config({"resolved_config": str(path)}, env={"KESTREL_MAX_NUM_SEQS": "9"})
    assert again == cfg
    assert dict(again.sources) == dict(cfg.sources)
    del data["seed"]
    with pytest.raises(ValueError, match="seed"):
        KestrelConfig.from_json(json.dumps(data))


def test_null_in_the_config_file_unsets_only_settings_that_may_be_unset(small_model, tmp_path):
    f = tmp_path / "kestrel.json"
    f.write_text(json.dumps({"max_model_len": None, "runtime_dir": None}))
    cfg = build_config(_cli(["--model", small_model, "--config-file", str(f)]), env={}, probe=CPU)
    assert cfg.max_model_len is None and cfg.source("runtime_dir") == "derived"
    f.write_text(json.dumps({"block_size": None}))
    with pytest.raises(ValueError, match="block_size"):
        build_config(_cli(["--model", small_model, "--config-file", str(f)]), env={}, probe=CPU)
