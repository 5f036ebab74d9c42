"""The server's sampling defaults on every API: what the engine receives.

A frontend runs in this process (starlette's TestClient runs its lifespan, which resolves the
defaults into the serving context) against the FakeEngine of test_frontend_support, whose
model folder holds a generation_config.json written here; each test reads the SamplingParams
of the AddRequests the fake engine recorded. The truth: the file's values where a request
leaves a field out, the request's own values where it sets them, the override's over the
file's, and the override's max_new_tokens as a ceiling (shared/config_generation.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
from starlette.testclient import TestClient

from services.frontend import server
from shared.config import build_config
from shared.protocol import SamplingParams
from tests.unit.test_frontend_support import HI, MAX_MODEL_LEN, MODEL, FakeEngine, build_model_dir

FILE = {"eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
        "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 12}
FROM_FILE = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
             "repetition_penalty": 1.1}
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
# what a request sets itself (inside every API's range: Anthropic's temperature is [0, 1])
OWN = {"temperature": 0.3, "top_p": 0.5, "top_k": 3, "min_p": 0.2, "repetition_penalty": 1.3}
OWN_MAX = 30  # above the file's max_new_tokens: that is only a default


def _body(api: str, own: dict, max_tokens: int | None) -> dict:
    """A request to `api` setting the sampling fields `own` (the API's spelling) and
    max_tokens (None: left out)."""
    if api == "chat":
        body = {"model": MODEL, "messages": HI, **own}
        key = "max_tokens"
    elif api == "completions":
        body = {"model": MODEL, "prompt": "Hello", **own}
        key = "max_tokens"
    elif api == "responses":
        body = {"model": MODEL, "input": "Say hello", **own}
        key = "max_output_tokens"
    else:  # Anthropic Messages: no min_p / repetition_penalty fields; max_tokens required
        body = {"model": MODEL, "messages": HI,
                **{k: v for k, v in own.items() if k in ("temperature", "top_p", "top_k")}}
        key = "max_tokens"
    if max_tokens is not None:
        body[key] = max_tokens
    return body


ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
          "responses": "/v1/responses", "messages": "/v1/messages"}
APIS = list(ROUTES)


@pytest.fixture()
def stack():
    """start(*flags) -> (TestClient, FakeEngine) of a frontend over a model folder whose
    generation_config.json is FILE; the folder is also at `stack.dir`."""
    d = tempfile.mkdtemp(prefix="kfg-")
    model_dir = build_model_dir(os.path.join(d, "model"))
    with open(os.path.join(model_dir, "generation_config.json"), "w") as fh:
        json.dump(FILE, fh)
    fake = FakeEngine(f"ipc://{d}/engine.sock", model_dir).start()
    clients: list[TestClient] = []

    def start(**settings) -> tuple[TestClient, FakeEngine]:
        cfg = build_config({"engine_address": fake.address, "served_model_name": MODEL,
                            "model": model_dir, "startup_timeout_s": 20,
                            "runtime_dir": os.path.join(d, "run"), **settings}, env={})
        client = TestClient(server.create_app(cfg))
        client.__enter__()
        clients.append(client)
        return client, fake

    start.dir = d  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        for c in clients:
            c.__exit__(None, None, None)
        fake.stop()
        shutil.rmtree(d, ignore_errors=True)


def _sent(client: TestClient, fake: FakeEngine, api: str, body: dict) -> SamplingParams:
    """POST body to the api's route; the SamplingParams of the one request the engine got."""
    before = len(fake.added)
    r = client.post(ROUTES[api], json=body)
    assert r.status_code == 200, r.text
    assert len(fake.added) == before + 1
    return fake.added[-1].sampling


def _fields(sp: SamplingParams) -> dict:
    return {k: getattr(sp, k) for k in NEUTRAL}


@pytest.mark.parametrize("api", APIS)
def test_the_model_files_defaults_apply_only_to_fields_the_request_leaves_out(stack, api):
    client, fake = stack()  # generation_config auto (the default)
    absent = _sent(client, fake, api, _body(api, {}, None if api != "messages" else OWN_MAX))
    assert _fields(absent) == FROM_FILE
    if api != "messages":  # its max_tokens is required
        assert absent.max_tokens == FILE["max_new_tokens"]  # not the API's own default
    own = _sent(client, fake, api, _body(api, OWN, OWN_MAX))
    want = dict(OWN) if api != "messages" else {  # no Anthropic field: the file's
        **OWN, "min_p": FROM_FILE["min_p"], "repetition_penalty": FROM_FILE["repetition_penalty"]}
    assert _fields(own) == want
    assert own.max_tokens == OWN_MAX  # the model author's max_new_tokens is no ceiling


@pytest.mark.parametrize("api", APIS)
def test_null_fields_are_left_out_too(stack, api):
    client, fake = stack()
    body = _body(api, dict.fromkeys(OWN), OWN_MAX)
    if api != "messages":
        body.pop("max_output_tokens" if api == "responses" else "max_tokens")
    assert _fields(_sent(client, fake, api, body)) == FROM_FILE


@pytest.mark.parametrize("api", APIS)
def test_the_override_wins_over_the_file_and_its_max_new_tokens_is_a_ceiling(stack, api):
    client, fake = stack(override_generation_config=json.dumps(
        {"temperature": 0, "top_k": None, "repetition_penalty": 1.05, "max_new_tokens": 8}))
    absent = _sent(client, fake, api, _body(api, {}, None if api != "messages" else OWN_MAX))
    # temperature and repetition_penalty from the override, top_k's default removed (null),
    # top_p and min_p still the file's
    assert _fields(absent) == {**FROM_FILE, "temperature": 0.0, "top_k": 0,
                               "repetition_penalty": 1.05}
    assert absent.max_tokens == 8
    assert _sent(client, fake, api, _body(api, OWN, OWN_MAX)).max_tokens == 8  # capped
    assert _sent(client, fake, api, _body(api, OWN, 5)).max_tokens == 5
    assert _fields(_sent(client, fake, api, _body(api, OWN, 5))).items() >= {
        "temperature": OWN["temperature"], "top_k": OWN["top_k"]}.items()


@pytest.mark.parametrize("api", APIS)
def test_vllm_mode_sends_the_neutral_defaults_and_the_apis_own_max_tokens(stack, api):
    client, fake = stack(generation_config="vllm")
    sp = _sent(client, fake, api, _body(api, {}, None if api != "messages" else OWN_MAX))
    assert _fields(sp) == NEUTRAL
    n_prompt = len(fake.added[-1].prompt_token_ids)
    assert sp.max_tokens == {"chat": MAX_MODEL_LEN - n_prompt, "completions": 16,
                             "responses": MAX_MODEL_LEN - n_prompt, "messages": OWN_MAX}[api]


def test_a_default_max_tokens_past_the_room_is_the_room_not_an_error(stack):
    big = MAX_MODEL_LEN + 100
    client, fake = stack(override_generation_config=json.dumps({"max_new_tokens": big}))
    sp = _sent(client, fake, "chat", _body("chat", {}, None))
    assert sp.max_tokens == MAX_MODEL_LEN - len(fake.added[-1].prompt_token_ids)
    # a request's own max_tokens past the room is still its error
    r = client.post(ROUTES["chat"], json=_body("chat", {}, big))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_a_named_folder_replaces_the_models_file(stack):
    other = os.path.join(stack.dir, "other")
    os.makedirs(other)
    with open(os.path.join(other, "generation_config.json"), "w") as fh:
        json.dump({"temperature": 0.25}, fh)
    client, fake = stack(generation_config=other)
    sp = _sent(client, fake, "chat", _body("chat", {}, None))
    assert _fields(sp) == {**NEUTRAL, "temperature": 0.25}
    assert sp.max_tokens == MAX_MODEL_LEN - len(fake.added[-1].prompt_token_ids)


def test_the_responses_object_echoes_the_temperature_and_top_p_used(stack):
    client, _ = stack()
    r = client.post(ROUTES["responses"], json=_body("responses", {}, None))
    assert (r.json()["temperature"], r.json()["top_p"]) == (0.6, 0.9)
