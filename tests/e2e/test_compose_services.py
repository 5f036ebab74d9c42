"""compose.yaml cannot rot: a real Compose parser accepts it (where one is installed), and
each service's own command and environment, run as local processes, serve a chat request."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

import httpx
import openai
import pytest
import yaml

from tests.e2e.server import KESTREL, free_port, segments
from tests.runtime_guard import new_instance_id

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPOSE = os.path.join(ROOT, "compose.yaml")


def load():
    with open(COMPOSE) as fh:
        return yaml.safe_load(fh)


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` / `${VAR}` substitution, from this process's environment."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}",
                  lambda m: os.environ.get(m.group(1)) or (m.group(2) or ""), value)


def _seconds(text: str) -> float:
    """A Compose duration ("35s", "1m30s", "500ms") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(text))
    assert parts and "".join(a + b for a, b in parts) == str(text), text
    return sum(float(a) * units[b] for a, b in parts)


def test_compose_file_shape():
    doc = load()
    svcs = doc["services"]
    assert {"engine", "worker", "frontend", "kvstore"} <= set(svcs)
    assert svcs["engine"]["ipc"] == "shareable"
    for name in ("worker", "frontend", "kvstore"):
        assert svcs[name]["ipc"] == "service:engine"
    for name, svc in svcs.items():
        assert svc["command"][0] == "kestrel" and svc["command"][1] == name
        assert any(v.endswith(":/models:ro") for v in svc["volumes"])
        assert svc["restart"] in ("always", "unless-stopped", "on-failure"), name
        assert svc["healthcheck"]["test"], name


def test_compose_stop_grace_outlasts_the_shutdown_timeout():
    doc = load()
    for name, svc in doc["services"].items():
        timeout = float(svc["environment"]["KESTREL_SHUTDOWN_TIMEOUT"])
        assert _seconds(svc["stop_grace_period"]) > timeout + 5, name


def test_compose_frontend_and_kvstore_restart_independently_of_the_engine():
    """`restart frontend` and an engine restart touch only that service: nothing else is
    pinned to the engine's pid namespace (whose end would kill its members) or network."""
    svcs = load()["services"]
    for name in ("frontend", "kvstore", "worker"):
        assert "pid" not in svcs[name] and "network_mode" not in svcs[name], name
    assert svcs["frontend"]["ports"], "the frontend publishes the API port"
    hc = " ".join(svcs["frontend"]["healthcheck"]["test"])
    assert "/health" in hc and "urllib" in hc


def compose_command() -> tuple[list[str] | None, str]:
    """The first working Compose implementation: (its argv prefix, "") for `docker compose`
    (the v2 plugin) or `docker-compose` whose `version` exits 0; (None, why not) when there
    is none. A docker without the compose plugin takes `docker compose -f` as its own flag
    and fails ("unknown shorthand flag: 'f'"), so a working one is probed, not assumed."""
    tried = []
    for argv in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(argv[0]) is None:
            tried.append(f"{argv[0]} is not installed")
            continue
        try:
            r = subprocess.run(argv + ["version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            tried.append(f"`{' '.join(argv)} version` failed: {e}")
            continue
        if r.returncode == 0:
            return argv, ""
        err = (r.stderr or r.stdout).strip().splitlines()
        tried.append(f"`{' '.join(argv)} version` exited {r.returncode}"
                     + (f" ({err[0]})" if err else ""))
    return None, "no working Compose parser: " + "; ".join(tried)


def test_compose_config_parses_with_real_parser():
    cmd, why = compose_command()
    if cmd is None:
        pytest.skip(why)
    r = subprocess.run(cmd + ["-f", COMPOSE, "config"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_each_compose_service_command_serves(smollm2_dir, tmp_path):
    doc = load()
    iid = new_instance_id("c")
    port = free_port()
    runtime = tempfile.mkdtemp(prefix="krun-")  # short: unix socket paths are limited to ~100 bytes
    procs = []
    try:
        for name in ("engine", "kvstore", "worker", "frontend"):
            svc = doc["services"][name]
            env = dict(os.environ)
            env.update({k: interpolate(str(v)) for k, v in svc["environment"].items()})
            # the container paths become local ones; the instance id is made unique
            env["KESTREL_MODEL"] = str(smollm2_dir)
            env["KESTREL_RUNTIME_DIR"] = runtime
            env["KESTREL_INSTANCE_ID"] = iid
            argv = [KESTREL] + [str(a) for a in svc["command"][1:]]
            if name == "frontend":
                argv = [a if a != "8000" else str(port) for a in argv]
                argv = [a if a != "0.0.0.0" else "127.0.0.1" for a in argv]
            log = open(tmp_path / f"{name}.log", "w")
            procs.append((name, subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)))
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            for name, p in procs:
                assert p.poll() is None, f"{name} exited: {(tmp_path / f'{name}.log').read_text()[-3000:]}"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "compose services never became healthy"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=8, temperature=0)
        assert r.choices[0].message.content
    finally:
        for _, p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(runtime, ignore_errors=True)
    assert segments(iid) == []
