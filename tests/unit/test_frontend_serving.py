"""The frontend's serving context: one context and one serving object per API, built at
startup and shared by every request; request metrics recorded into the context's own
registry; a frontend module graph without circles.

The app runs in this process (starlette's TestClient runs its lifespan) against the
FakeEngine of test_frontend_support; answers are checked against the fake engine's reply
and the `tokenizers` library's own encoding.
"""

from __future__ import annotations

import ast
import os

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient
from tokenizers import Tokenizer

from services.frontend import (anthropic_api, chat_api, completions_api, info_api, server,
                               tokenize_api)
from services.frontend.metrics import METRICS, RequestMetrics, RequestTimer
from shared.config import build_config
from tests.unit.test_frontend_support import HI, MODEL, REPLY_TEXT, REPO, fake_engine_in_tempdir

SERVING_CLASSES = [(chat_api, "ChatServing"), (completions_api, "CompletionsServing"),
                   (tokenize_api, "TokenizeServing"), (anthropic_api, "AnthropicServing"),
                   (info_api, "InfoServing")]


@pytest.fixture()
def engine():
    with fake_engine_in_tempdir("kfs-") as (fake, model_dir, _):
        yield fake, model_dir


def _counting(monkeypatch) -> dict[str, int]:
    """Count the constructions of every API's serving class (the classes stay as they are:
    only __init__ is wrapped)."""
    built = {name: 0 for _, name in SERVING_CLASSES}
    for module, name in SERVING_CLASSES:
        cls = getattr(module, name)
        original = cls.__init__

        def init(self, *args, _original=original, _name=name, **kwargs):
            built[_name] += 1
            _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", init)
    return built


def test_each_api_serving_object_is_built_once_at_startup_and_shared_by_every_request(
        engine, monkeypatch, tmp_path):
    fake, model_dir = engine
    built = _counting(monkeypatch)
    cfg = build_config({"engine_address": fake.address, "served_model_name": MODEL,
                        "startup_timeout_s": 20, "runtime_dir": str(tmp_path / "run")}, env={})
    app = server.create_app(cfg)
    assert built == {name: 0 for name in built}  # the route table needs no serving object
    with TestClient(app) as client:
        assert built == {name: 1 for name in built}  # the startup built each one, once
        servings = app.state.servings
        ctx = servings.context
        # every serving object reads the one context
        assert all(getattr(servings, f).ctx is ctx
                   for f in ("info", "chat", "completions", "tokenize", "anthropic"))
        ref = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        for _ in range(3):
            chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": HI})
            assert chat.status_code == 200
            assert chat.json()["choices"][0]["message"]["content"] == REPLY_TEXT
            cmpl = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello",
                                                        "max_tokens": 200})
            assert cmpl.json()["choices"][0]["text"] == REPLY_TEXT
            tok = client.post("/tokenize", json={"prompt": "Kestrels hover 你好"})
            assert tok.json()["tokens"] == ref.encode("Kestrels hover 你好").ids
            detok = client.post("/detokenize", json={"tokens": ref.encode("then stop").ids})
            assert detok.json() == {"prompt": "then stop"}
            msg = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 200,
                                                    "messages": HI})
            assert msg.json()["content"] == [{"type": "text", "text": REPLY_TEXT}]
            count = client.post("/v1/messages/count_tokens", json={"model": MODEL,
                                                                   "messages": HI})
            assert count.json()["input_tokens"] == msg.json()["usage"]["input_tokens"]
            models = client.get("/v1/models").json()
            assert [m["id"] for m in models["data"]] == [MODEL]
            assert models["data"][0]["max_model_len"] == fake.info.max_model_len
            assert client.get("/health").status_code == 200
        assert app.state.servings is servings
    assert built == {name: 1 for name in built}  # and no request built one


def _samples(registry) -> dict[tuple[str, tuple], float]:
    """Every sample of `registry`, parsed back from its Prometheus text."""
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_request_timer_records_into_its_own_metrics_only():
    before = _samples(METRICS.registry)
    m = RequestMetrics()
    m.set_model("m1")
    zeros = _samples(m.registry)  # set_model shows the series at 0 before any request
    assert zeros[("kestrel:prompt_tokens_total", (("model_name", "m1"),))] == 0
    assert zeros[("kestrel:time_to_first_token_seconds_count", (("model_name", "m1"),))] == 0
    timer = RequestTimer(m)
    for n in (1, 2, 0, 3):  # an output with no token is no observation
        timer.tokens(n)
    timer.finish("stop", 7, 6)
    timer.finish("stop", 7, 6)  # once only
    got = _samples(m.registry)
    name = (("model_name", "m1"),)
    assert got[("kestrel:time_to_first_token_seconds_count", name)] == 1
    assert got[("kestrel:inter_token_latency_seconds_count", name)] == 2
    assert got[("kestrel:time_per_output_token_seconds_count", name)] == 1
    assert got[("kestrel:e2e_request_latency_seconds_count", name)] == 1
    assert got[("kestrel:prompt_tokens_total", name)] == 7
    assert got[("kestrel:generation_tokens_total", name)] == 6
    assert got[("kestrel:request_success_total",
                (("finished_reason", "stop"), ("model_name", "m1")))] == 1
    assert _samples(METRICS.registry) == before  # the process's metrics saw nothing


def _frontend_imports() -> tuple[dict[str, set[str]], list[str]]:
    """(module -> frontend modules it imports, imports found inside functions)."""
    root = os.path.join(REPO, "services", "frontend")
    mods: dict[str, str] = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), REPO)[:-3].replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = os.path.join(d, f)
    graph: dict[str, set[str]] = {}
    inner: list[str] = []
    for mod, path in mods.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            deps |= {n for n in names if n in mods and n != mod}
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner += [f"{mod}: {ast.unparse(n)}" for n in ast.walk(fn)
                          if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(
                              "services.")]
        graph[mod] = deps
    return graph, inner


def test_frontend_modules_import_each_other_without_a_circle_or_a_function_level_import():
    graph, inner = _frontend_imports()
    assert "services.frontend.server" in graph and graph["services.frontend.server"]
    assert inner == []
    # Kahn's algorithm: every module can be ordered after the ones it imports
    left = {m: set(d) for m, d in graph.items()}
    while True:
        ready = [m for m, d in left.items() if not d]
        if not ready:
            break
        for m in ready:
            del left[m]
        for d in left.values():
            d.difference_update(ready)
    assert left == {}, f"import circle among {sorted(left)}"
