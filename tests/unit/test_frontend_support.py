"""Test doubles for the frontend's unit tests (no tests here).

- `build_model_dir(path)`: a model folder with a small byte-level BPE `tokenizer.json`
  trained on mixed English/CJK/emoji text (so that many characters span several tokens) and
  a `tokenizer_config.json` with a ChatML chat template.
- `Stack`: a model folder, a FakeEngine and a frontend subprocess on a free port;
  `running_stack(*flags)` starts one for a fixture (and the module-scoped fixtures `stack`
  and `tok` are built on it).
- `fake_engine_in_tempdir(prefix)`: a FakeEngine on a model folder in a fresh temporary
  folder, for an in-process app (starlette's TestClient); stopped and removed on exit.
- `FakeEngine`: a thread with a ZMQ ROUTER that speaks `shared.protocol` like the engine:
  answers Hello with EngineInfo and Heartbeat with Heartbeat, and answers each AddRequest
  with a fixed reply (token ids of REPLY_TEXT), shaped by the last user message:
  "please fail" -> finish "error"; "please overload" / "please reject" -> at once, no token,
  finish "error" with error_kind "overloaded" (waiting queue full) / "invalid" (as the
  engine refuses an AddRequest), or with "late" in the message too: a few tokens first, the
  error 0.5 s later (a stream that already started); "please hang" -> no output until aborted;
  "slow" -> the reply after 0.5 s; "keep going" -> the reply without a finish
  (the request runs until aborted); "please drop" -> a few tokens, then finish "abort" with
  an error, unasked (as the engine does when it drops a silent frontend); a message containing a key of SCRIPTED -> that reply
  instead of REPLY_TEXT (reasoning and tool-call outputs for the output parsers). A request
  with `max_tokens: 0` (completions scoring) finishes "length" with no token. A request with
  `prompt_logprobs` gets them on its first output: None for the first prompt token, then
  each prompt token as chosen with logprob FAKE_PROMPT_LOGPROB. It records
  AddRequests, Aborts and Hellos. `forget()` makes it forget every frontend: their next
  Heartbeat is answered with NotAttached (as the engine answers an identity it dropped),
  until they say Hello again.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import pytest
import zmq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.frontend.tokenizer import Tokenizer as FrontendTokenizer
from shared import protocol as p
from tests.runtime_guard import new_instance_id

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = "<|im_end|>"
REPLY_TEXT = "Hello there! 你好，世界。Kestrels hover 🦅🪶 over 龍🐉 then stop here."
# Hand-written model outputs, chosen by a key in the last user message.
SCRIPTED = {
    "please think": "<think>abc</think>hello",
    "please call": ('<think>hm</think><tool_call>{"name": "get_weather", "arguments": '
                    '{"city": "P\\"<b>", "n": 123456789012345678901234567890, "x": [1.5, null]}}'
                    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
    "please force": '[{"name": "get_weather", "arguments": {"city": "Oslo", "n": 3}}]',
}
# Engine refusals, chosen by a key in the last user message: key -> (error_kind, error).
ERROR_KINDS = {
    "please overload": ("overloaded", "waiting queue full (64 requests)"),
    "please reject": ("invalid", "simulated invalid request: the schema cannot be compiled"),
}
MAX_MODEL_LEN = 16384  # room for tools in the prompts (tool_prompt.py), a 400-deep schema too
FAKE_PROMPT_LOGPROB = -1.5  # every prompt token's logprob (requests with prompt_logprobs)
MODEL = "test-model"  # the served model name
HI = [{"role": "user", "content": "Say hello 你好"}]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ChatML, as SmolLM2 and Qwen use it; roles after an optional system message must alternate.
CHATML_TEMPLATE = (
    "{% set offset = 1 if messages[0]['role'] == 'system' else 0 %}"
    "{% for message in messages %}"
    "{% if message['role'] != 'system'"
    " and (message['role'] == 'user') != ((loop.index0 - offset) % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello there, how are you today?",
    "Kestrels hover over fields, then stop and dive. A kestrel is a small falcon.",
    "你好，世界。今天天气很好。我们去公园散步吧。",
    "こんにちは世界。日本語のテキストです。",
    "Emoji: 🦅 🪶 😀 👍🏽 🇫🇷 and more text for merges, system user assistant.",
]


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer with a small vocabulary (CJK and emoji split into bytes)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def build_model_dir(path: str, template: str = CHATML_TEMPLATE) -> str:
    """Write tokenizer.json and tokenizer_config.json into `path`; return path."""
    os.makedirs(path, exist_ok=True)
    build_tokenizer().save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump({"bos_token": None, "eos_token": EOS, "pad_token": "<|endoftext|>",
                   "chat_template": template}, fh)
    return path


class FakeEngine:
    """A thread answering the frontend protocol on a ROUTER bound at `address`."""

    def __init__(self, address: str, model_path: str, engine_id: str = "fake-engine"):
        self.address = address
        self.tokenizer = Tokenizer.from_file(os.path.join(model_path, "tokenizer.json"))
        self.eos_id = self.tokenizer.token_to_id(EOS)
        self.reply_ids = self.tokenizer.encode(REPLY_TEXT).ids
        self.info = p.EngineInfo(engine_id=engine_id, model_name="fake", model_path=model_path,
                                 max_model_len=MAX_MODEL_LEN, block_size=16, num_blocks=64,
                                 eos_token_ids=[self.eos_id])
        self.added: list[p.AddRequest] = []
        self.aborted: list[str] = []
        self.hellos: list[bytes] = []  # identities, one per Hello received
        self._known: set[bytes] = set()
        self._forgotten: set[bytes] = set()
        self._forget = threading.Event()
        self._pending: list[tuple[float, bytes, object]] = []  # (due, identity, message)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "FakeEngine":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def forget(self) -> None:
        """Forget every attached frontend (see the module docstring)."""
        self._forget.set()

    def _last_user_text(self, req: p.AddRequest) -> str:
        text = self.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=False)
        return text.rsplit("<|im_start|>user\n", 1)[-1]

    def _plan(self, ident: bytes, req: p.AddRequest) -> None:
        now, user = time.monotonic(), self._last_user_text(req)
        n_prompt = len(req.prompt_token_ids)
        prompt_lps: list = []  # on the first output only
        if req.sampling.prompt_logprobs is not None:
            prompt_lps = [None] + [p.TokenLogprob(t, FAKE_PROMPT_LOGPROB, 1, [t],
                                                  [FAKE_PROMPT_LOGPROB])
                                   for t in req.prompt_token_ids[1:]]

        def out(ids, finish=None, **kw):
            nonlocal prompt_lps
            lps, prompt_lps = prompt_lps, []
            return p.Outputs([p.RequestOutput(req.request_id, ids, n_prompt, finish,
                                              prompt_logprobs=lps, **kw)])

        if "please hang" in user:
            return
        if "please drop" in user:
            self._pending.append((now, ident, out(self.reply_ids[:2])))
            self._pending.append((now + 0.3, ident, out(
                [], "abort", error="the engine dropped this frontend after 6 s of silence",
                error_kind="internal")))
            return
        if "please fail" in user:
            self._pending.append((now, ident, out(self.reply_ids[:2])))
            self._pending.append((now, ident, out([], "error", error="simulated worker fault")))
            return
        refusal = next((v for key, v in ERROR_KINDS.items() if key in user), None)
        if refusal is not None:
            kind, error = refusal
            if "late" in user:
                self._pending.append((now, ident, out(self.reply_ids[:2])))
                now += 0.5
            self._pending.append((now, ident, out([], "error", error=error, error_kind=kind)))
            return
        if req.sampling.max_tokens == 0:  # scoring: the prompt runs, nothing is sampled
            self._pending.append((now, ident, out([], "length")))
            return
        reply_ids = next((self.tokenizer.encode(text).ids for key, text in SCRIPTED.items()
                          if key in user), self.reply_ids)
        ids = reply_ids[:req.sampling.max_tokens]
        due = now + (0.5 if "slow" in user else 0.0)
        chunks = [ids[i:i + 3] for i in range(0, len(ids), 3)]
        for chunk in chunks[:-1]:
            self._pending.append((due, ident, out(chunk)))
        if "keep going" in user:  # the reply, then the request runs on until aborted
            self._pending.append((due, ident, out(chunks[-1])))
            return
        if len(ids) < len(reply_ids):
            self._pending.append((due, ident, out(chunks[-1], "length")))
        else:
            self._pending.append((due, ident, out(chunks[-1] + [self.eos_id], "stop",
                                                  stop_token_id=self.eos_id)))

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        enc, dec = p.encoder(), p.decoder(p.FrontendToEngine)
        try:
            while not self._stop.is_set():
                if sock.poll(20):
                    ident, payload = sock.recv_multipart()
                    msg = dec.decode(payload)
                    if self._forget.is_set():
                        self._forget.clear()
                        self._forgotten |= self._known
                        self._known.clear()
                    if isinstance(msg, p.Hello):
                        self.hellos.append(ident)
                        self._known.add(ident)
                        self._forgotten.discard(ident)
                        sock.send_multipart([ident, enc.encode(self.info)])
                    elif isinstance(msg, p.Heartbeat) and ident in self._forgotten:
                        sock.send_multipart([ident, enc.encode(p.NotAttached("forgotten"))])
                    elif isinstance(msg, p.Heartbeat):
                        sock.send_multipart([ident, enc.encode(p.Heartbeat(time.time()))])
                    elif isinstance(msg, p.AddRequest):
                        self.added.append(msg)
                        self._plan(ident, msg)
                    elif isinstance(msg, p.Abort):
                        self.aborted.extend(msg.request_ids)
                        self._pending = [e for e in self._pending
                                         if e[2].outputs[0].request_id not in msg.request_ids]
                    elif isinstance(msg, p.UtilityCall):
                        sock.send_multipart([ident, enc.encode(p.UtilityResult(
                            msg.call_id, {"method": msg.method}))])
                now = time.monotonic()
                due = [e for e in self._pending if e[0] <= now]
                self._pending = [e for e in self._pending if e[0] > now]
                for _, ident, msg in due:
                    sock.send_multipart([ident, enc.encode(msg)])
        finally:
            sock.close(0)
            ctx.term()


@contextlib.contextmanager
def fake_engine_in_tempdir(prefix: str):
    """(fake engine, model folder, temporary folder): a started FakeEngine on an ipc socket
    in a fresh folder (mkdtemp with `prefix`) that also holds the model folder; the engine is
    stopped and the folder removed on exit, also when the body raised."""
    d = tempfile.mkdtemp(prefix=prefix)
    model_dir = build_model_dir(os.path.join(d, "model"))
    fake = FakeEngine(f"ipc://{d}/engine.sock", model_dir).start()
    try:
        yield fake, model_dir, d
    finally:
        fake.stop()
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- frontend subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code
    except httpx.TransportError:
        return None


class Stack:
    """A model folder, a fake engine and a frontend subprocess, on a free port."""

    def __init__(self, *extra_args: str):
        self.extra_args = list(extra_args)  # more frontend flags (--tool-call-parser ...)
        self.dir = tempfile.mkdtemp(prefix="kfe-")
        self.model_dir = build_model_dir(os.path.join(self.dir, "model"))
        self.address = f"ipc://{self.dir}/engine.sock"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine: FakeEngine | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self.dir, "frontend.log")

    def start_engine(self) -> FakeEngine:
        self.engine = FakeEngine(self.address, self.model_dir).start()
        return self.engine

    def start_frontend(self, startup_timeout_s: float = 30.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KESTREL_")}
        cmd = [sys.executable, "-m", "services.frontend.server", "--engine-address",
               self.address, "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
               "--dtype", "float32", "--model", self.model_dir, "--served-model-name", MODEL,
               "--keepalive-s", "0.2", "--startup-timeout-s", str(startup_timeout_s),
               "--runtime-dir", os.path.join(self.dir, "run"),  # removed with self.dir
               "--instance-id", new_instance_id("f"), *self.extra_args]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log,
                                         stderr=subprocess.STDOUT)

    def wait_healthy(self) -> None:
        wait_for(lambda: health(self.url) == 200 or self.proc.poll() is not None, 20,
                  "frontend health")
        assert self.proc.poll() is None, self.log()

    def log(self) -> str:
        with open(self.log_path) as fh:
            return fh.read()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.engine is not None:
            self.engine.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def running_stack(*extra_args: str):
    """A Stack with its fake engine and a healthy frontend (extra_args: more frontend
    flags), closed when the generator is closed: `yield from` it in a fixture."""
    s = Stack(*extra_args)
    try:
        s.start_engine()
        s.start_frontend()
        s.wait_healthy()
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def stack():
    yield from running_stack()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tok(stack) -> FrontendTokenizer:
    return FrontendTokenizer(stack.model_dir)
