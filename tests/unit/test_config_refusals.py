"""Settings a new user found accepted that cannot work: each is refused by the config builder
(a ValueError naming the setting), so `kestrel serve` exits 2 with the message as its last
line on stderr before any process starts (no runtime folder, no weights loaded)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from shared.config import build_config, check_cpu_kv_cache

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOLLM2 = os.path.join(REPO, "models", "SmolLM2-135M-Instruct")  # max_position_embeddings 8192


def _broken_template(tmp_path) -> str:
    path = tmp_path / "broken.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor")  # no closing %}
    return str(path)


REFUSED = [
    ({"chat_template": "no-such-template"}, "setting chat_template: chat template "
     "'no-such-template' is neither a file nor one of the bundled templates ['qwen3']"),
    ({"chat_template": "BROKEN"}, "setting chat_template: chat template does not compile"),
    ({"kv_offload_cpu_gib": "-1"}, "setting kv_offload_cpu_gib: must be >= 0"),
    ({"kv_offload_cpu_gib": "1", "kv_offload_disk_dir": "/tmp/kv-disk"},
     "setting kv_offload_disk_dir requires --kv-offload-disk-gib"),
    ({"kv_offload_cpu_gib": "1", "kv_offload_disk_gib": "2"},
     "setting kv_offload_disk_gib requires --kv-offload-disk-dir"),
    ({"kv_offload_disk_dir": "/tmp/kv-disk", "kv_offload_disk_gib": "2"},
     "setting kv_offload_disk_dir requires --kv-offload-cpu-gib"),
    # a KV tier without the prefix cache was accepted: the kvstore and its shm pool started,
    # and the engine never connected to them
    ({"kv_offload_cpu_gib": "0.5", "enable_prefix_caching": "false"},
     "setting kv_offload_cpu_gib requires --enable-prefix-caching"),
    # an unknown level was accepted: the frontend crashed in uvicorn and restarted in a loop
    ({"log_level": "bogus"}, "setting log_level: 'bogus' is not one of critical, error, warning, info, debug"),
    # a negative worker timeout was accepted: every step with a wait timed out at once and the
    # engine restarted ("no word from the workers for -1 s in step 1"); 0 became 10 silently
    ({"worker_timeout_s": "-1"}, "setting worker_timeout_s: must be positive, got -1.0"),
    ({"worker_timeout_s": "0"}, "setting worker_timeout_s: must be positive, got 0.0"),
    ({"step_timeout_s": "-1"}, "setting step_timeout_s: must be >= 0 seconds"),
    ({"watchdog_timeout_s": "0"}, "setting watchdog_timeout_s: must be positive, got 0.0"),
    ({"keepalive_s": "0"}, "setting keepalive_s: must be positive"),
    ({"startup_timeout_s": "-5"}, "setting startup_timeout_s: must be positive"),
    ({"restart_window_s": "0"}, "setting restart_window_s: must be positive"),
    # an instance id that cannot name a segment was accepted: "a/b" and one over 32 bytes
    # crashed the engine at its ring in a restart loop (leaving /tmp/kestrel-a behind)
    ({"instance_id": "a/b"}, "setting instance_id: 'a/b' cannot name shared-memory segments"),
    ({"instance_id": "a" * 33}, "setting instance_id: '" + "a" * 33 + "' cannot name"),
    ({"instance_id": ""}, "setting instance_id: '' cannot name"),
    ({"served_model_name": ""}, "setting served_model_name: must not be empty"),
    ({"shutdown_timeout": "-1"}, "setting shutdown_timeout: must be >= 0 seconds"),
    ({"max_model_len": "8193"}, "setting max_model_len: 8193 is longer than the model's "
     "max_position_embeddings (8192 in "),
]


def _cli(tmp_path, settings: dict[str, str]) -> dict[str, str]:
    return {k: _broken_template(tmp_path) if v == "BROKEN" else v for k, v in settings.items()}


@pytest.mark.parametrize("settings,message", REFUSED, ids=[next(iter(s)) + ("+" if len(s) > 1 else "")
                                                            for s, _ in REFUSED])
def test_a_setting_that_cannot_work_is_refused_by_the_config_builder(tmp_path, settings, message):
    with pytest.raises(ValueError) as e:
        build_config({"model": SMOLLM2, "device": "cpu"} | _cli(tmp_path, settings), env={})
    assert message in str(e.value)


def test_what_is_still_accepted_next_to_those_refusals(tmp_path):
    """The limits themselves pass, and KESTREL_ALLOW_LONG_MAX_MODEL_LEN=1 (vLLM's
    VLLM_ALLOW_LONG_MAX_MODEL_LEN) lets a longer max_model_len through."""
    base = {"model": SMOLLM2, "device": "cpu"}
    assert build_config(base | {"max_model_len": "8192"}, env={}).max_model_len == 8192
    cfg = build_config(base | {"max_model_len": "16384"}, env={"KESTREL_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    assert cfg.max_model_len == 16384 and cfg.source("allow_long_max_model_len") == "env"
    assert build_config(base | {"shutdown_timeout": "0", "chat_template": "qwen3"}, env={}).shutdown_timeout == 0
    disk = str(tmp_path / "disk")
    cfg = build_config(base | {"kv_offload_cpu_gib": "0.5", "kv_offload_disk_dir": disk,
                               "kv_offload_disk_gib": "1"}, env={})
    assert (cfg.kv_offload_disk_dir, cfg.kv_offload_disk_gib) == (disk, 1.0)
    assert build_config(base | {"kv_offload_cpu_gib": "0", "enable_prefix_caching": "false"},
                        env={}).enable_prefix_caching is False
    assert build_config(base | {"log_level": "debug"}, env={}).log_level == "DEBUG"
    assert build_config(base | {"step_timeout_s": "0"}, env={}).step_timeout_s == 0  # 0: derived
    assert build_config(base | {"instance_id": "my-server_2.b" + "x" * 19}, env={}).instance_id.startswith("my-")
    assert len(build_config(base, env={}).instance_id) == 8  # derived: 8 hex digits
    # a worker alone (tests, parity runs) may have a KV cache under max_model_len: only serve refuses it
    small = build_config(base | {"kv_cache_gib": "0.01"}, env={})
    with pytest.raises(ValueError, match="0.01 GiB holds 224 tokens"):
        check_cpu_kv_cache(small)
    check_cpu_kv_cache(build_config(base | {"kv_cache_gib": "0.01", "max_model_len": "224"}, env={}))


SERVE_REFUSED = [(["--chat-template", "no-such-template"], "setting chat_template: chat template "
                  "'no-such-template' is neither a file"),
                 (["--chat-template", "BROKEN"], "setting chat_template: chat template does not compile"),
                 (["--max-model-len", "9000"], "setting max_model_len: 9000 is longer than the model's "
                  "max_position_embeddings (8192 in "),
                 (["--kv-offload-cpu-gib", "0.1", "--no-enable-prefix-caching"],
                  "setting kv_offload_cpu_gib requires --enable-prefix-caching"),
                 (["--log-level", "bogus"], "'bogus' is not one of critical, error, warning, info, debug"),
                 (["--worker-timeout-s", "-1"], "setting worker_timeout_s: must be positive, got -1.0"),
                 (["--instance-id", "a/b"], "setting instance_id: 'a/b' cannot name shared-memory segments"),
                 # was refused by the engine only after the worker had loaded the weights
                 (["--kv-cache-gib", "0.03"], "setting kv_cache_gib: 0.03 GiB holds 688 tokens of KV cache "
                  "(43 blocks of 737280 bytes), fewer than max_model_len 8192; raise --kv-cache-gib or lower "
                  "--max-model-len")]


@pytest.mark.parametrize("args,message", SERVE_REFUSED, ids=["unknown template", "template syntax error",
                                                             "max_model_len", "kv offload without prefix cache",
                                                             "log level", "worker timeout", "instance id",
                                                             "kv cache under max_model_len"])
def test_serve_refuses_them_with_exit_2_and_the_message_before_any_process_starts(tmp_path, args, message):
    """A broken --chat-template used to log an ERROR and serve, every chat request a 500."""
    runtime = tmp_path / "rt"
    args = [_broken_template(tmp_path) if a == "BROKEN" else a for a in args]
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", SMOLLM2, "--device", "cpu",
                        "--instance-id", "ref" + uuid.uuid4().hex[:6], *args, "--runtime-dir", str(runtime)],
                       cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if not k.startswith("KESTREL_")})
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr.strip().splitlines()[-1], r.stderr
    assert not runtime.exists(), "a process started: the runtime folder was created"


@pytest.mark.parametrize("reuseport", [False, True], ids=["plain listener", "another Kestrel's frontends"])
def test_serve_refuses_a_port_another_process_listens_on_before_any_process_starts(tmp_path, reuseport):
    """A held port used to load the weights and then restart the frontend until the restart
    policy gave up (exit 1, "frontend-0 failed 6 times"); a port held with SO_REUSEPORT (another
    Kestrel with --frontends > 1) was joined silently by --frontends > 1, the two servers
    splitting its connections."""
    import socket

    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuseport:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    runtime = tmp_path / "rt"
    try:
        r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", SMOLLM2, "--device", "cpu",
                            "--port", str(port), "--frontends", "2" if reuseport else "1",
                            "--runtime-dir", str(runtime), "--instance-id", "ref" + uuid.uuid4().hex[:6]],
                           cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in os.environ.items() if not k.startswith("KESTREL_")})
    finally:
        holder.close()
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"cannot listen on 127.0.0.1:{port} (Address already in use)" in r.stderr.strip().splitlines()[-1]
    assert not runtime.exists(), "a process started: the runtime folder was created"


def test_a_kestrel_variable_that_names_no_setting_is_warned_about_with_the_closest_one(caplog):
    """KESTREL_MAX_NUM_SEQ=4 (for KESTREL_MAX_NUM_SEQS) was ignored without a word, where a
    config file's unknown key is refused; the variables Kestrel itself sets are not flagged."""
    env = {"KESTREL_MAX_NUM_SEQ": "4", "KESTREL_MAX_NUM_SEQS": "3", "KESTREL_SUPERVISOR_PID": "1",
           "KESTREL_BASE_IMAGE": "x", "KESTREL_E2E_PORT": "1"}
    with caplog.at_level("WARNING", logger="kestrel.config"):
        cfg = build_config({"model": SMOLLM2, "device": "cpu"}, env=env)
    assert cfg.max_num_seqs == 3
    warned = [r.getMessage() for r in caplog.records if r.name == "kestrel.config"]
    assert warned == ["environment variable KESTREL_MAX_NUM_SEQ is not a Kestrel setting and is "
                      "ignored (did you mean KESTREL_MAX_NUM_SEQS?)"]
