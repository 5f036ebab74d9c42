"""Claude Code (`@anthropic-ai/claude-code` from npm) as a real client of `kestrel serve`.

`claude -p` is run against the server with telemetry, auto-update and non-essential traffic
off, in a temporary HOME and project folder, and must get a reply and exit 0. Its
requests are what the CLI sends to Anthropic's API: `/v1/messages?beta=true`, streamed,
`anthropic-beta` headers, a system prompt of text blocks with `cache_control`, a system
message inside `messages`, `thinking: {"type": "adaptive"}`, `context_management`,
`output_config.effort`, `metadata.user_id`, and the tools. Its tools are cut to `Agent`
(`--tools Agent`), whose agent list is the mid-conversation system message, so that the
prompt (about 2.6k tokens with Kestrel's qwen3 template rendering the tool) fits
SmolLM2's context: the whole built-in set is about 77 kB of JSON, past 8192 tokens.
`CLAUDE_CODE_MAX_OUTPUT_TOKENS=64` keeps the CPU decode short (Claude Code sends it as
max_tokens). The key is checked (`--api-key`; Claude Code sends it as `x-api-key`).

An answer cut at max_tokens is continued by Claude Code ("Output token limit hit. Resume
directly ...", up to 3 more requests); when every one is cut, `claude -p` exits 1 with the
result "API Error: Claude's response exceeded the 64 output token maximum" (`is_error`).
SmolLM2 samples at temperature 1 (Claude Code sends none): to this prompt, 3 of 5 of its
answers ended within 48 tokens (and 2 of 5 to "hi"), so four cut answers in a row happen
now and then (a CI run saw all eight answers of two runs cut, and a run at 256 tokens all
four). Only that outcome, recognized by its exact result, is run again; when the second run
is cut too the test is reported as xfail (the tiny model never stopped: not a protocol
fault), after the same checks of every run's streams; any other error fails at once. The test also checks what Claude Code parsed from the streams: its
usage equals the sum of the prompt and completion tokens the server logged, and every
request got a 200.

The CLI is installed once with npm into ~/.cache/kestrel-tests/npm (pinned to
CLAUDE_CODE_VERSION, the version this was checked with) and reused; the test skips only when
npm is absent or the install fails for a network reason.

Measured on the 2-core dev machine with other work running: 322 s for `claude -p` at a load
average of about 5-6 (three streamed requests of 2735, 2850 and 2965 prompt tokens; the
first two were cut at 64 tokens, the third ended after 55), after about 30 s of
server startup. The test records the time of each run (`claude_code_seconds_run<i>`) and the
number of runs (`claude_code_runs`) as properties and prints them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time

import pytest

from tests.e2e.server import KestrelServer

MODEL = "SmolLM2-135M-Instruct"
CLAUDE_CODE_VERSION = "2.1.197"
NPM_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "kestrel-tests", "npm")
API_KEY = "sk-kestrel-claude-code-test"
NETWORK_ERRORS = ("ENOTFOUND", "EAI_AGAIN", "ETIMEDOUT", "ECONNREFUSED", "ECONNRESET",
                  "ENETUNREACH", "network", "getaddrinfo", "proxy")
CLAUDE_TIMEOUT_S = 2400  # generous: a busy 2-core machine decodes slowly
PROMPT = "Reply with one word: hello."
MAX_OUTPUT_TOKENS = 64
MAX_TOKENS_RESULT = (f"API Error: Claude's response exceeded the {MAX_OUTPUT_TOKENS} output "
                     "token maximum.")
RUNS = 2  # a second run only when every answer of the first was cut at max_tokens

pytestmark = pytest.mark.timeout(RUNS * CLAUDE_TIMEOUT_S + 900)  # + install, startup


def _installed(claude: str) -> bool:
    if not os.path.exists(claude):
        return False
    try:
        out = subprocess.run([claude, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.startswith(CLAUDE_CODE_VERSION)


@pytest.fixture(scope="module")
def claude_bin() -> str:
    """The path of the `claude` CLI, installed with npm into NPM_CACHE unless already there."""
    claude = os.path.join(NPM_CACHE, "node_modules", ".bin", "claude")
    if _installed(claude):
        return claude
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: cannot install @anthropic-ai/claude-code")
    os.makedirs(NPM_CACHE, exist_ok=True)
    try:
        out = subprocess.run([npm, "install", "--prefix", NPM_CACHE, "--no-audit", "--no-fund",
                              f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}"],
                             capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip("npm install of @anthropic-ai/claude-code timed out (network?)")
    if out.returncode != 0:
        text = out.stdout + out.stderr
        if any(e.lower() in text.lower() for e in NETWORK_ERRORS):
            pytest.skip(f"npm could not reach its registry: {text.strip()[-300:]}")
        pytest.fail(f"npm install of @anthropic-ai/claude-code failed:\n{text[-2000:]}")
    assert _installed(claude), f"{claude} does not run after npm install"
    return claude


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = KestrelServer(str(smollm2_dir), "--chat-template", "qwen3", "--max-model-len",
                        "4096", "--api-key", API_KEY).start()
    yield srv
    srv.stop()


def _run_claude(claude_bin: str, base_url: str) -> tuple[subprocess.CompletedProcess, float]:
    """`claude -p` in a fresh temporary HOME and project folder: (the process, seconds)."""
    home = tempfile.mkdtemp(prefix="kestrel-claude-home-")
    project = os.path.join(home, "project")
    os.makedirs(project)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home,
           "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": API_KEY,
           "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
           "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_OUTPUT_TOKENS),
           "API_TIMEOUT_MS": str(CLAUDE_TIMEOUT_S * 1000)}
    t0 = time.monotonic()
    try:
        out = subprocess.run([claude_bin, "-p", PROMPT, "--model", MODEL,
                              "--tools", "Agent", "--output-format", "json"],
                             cwd=project, env=env, capture_output=True, text=True,
                             timeout=CLAUDE_TIMEOUT_S)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return out, time.monotonic() - t0


def _tokens_served(log: str, since: int) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of the /v1/messages requests the server logged
    from character `since` of its log on."""
    log = log[since:]
    prompts = [int(n) for n in re.findall(r"msg_\w+ added: (\d+) prompt tokens", log)]
    completions = [int(n) for n in re.findall(
        r"msg_\w+ finished: \w+, \d+ prompt \+ (\d+) completion tokens", log)]
    return sum(prompts), sum(completions)


def test_claude_code_gets_a_reply_and_exits_0(claude_bin, server, record_property):
    since = 0
    for attempt in range(1, RUNS + 1):
        out, seconds = _run_claude(claude_bin, server.base_url)
        with open(server.log.name) as fh:
            log = fh.read()
        record_property(f"claude_code_seconds_run{attempt}", round(seconds, 1))
        print(f"claude -p run {attempt} took {seconds:.1f} s, exit {out.returncode}: "
              f"{out.stdout[:300]}")
        try:
            result = json.loads(out.stdout)
        except ValueError:
            pytest.fail(f"claude -p printed no JSON result (exit {out.returncode}):\n"
                        f"stdout: {out.stdout}\nstderr: {out.stderr}\nserver:\n{log[-6000:]}")
        statuses = re.findall(r'"POST /v1/messages\?beta=true HTTP/1.1" (\d+)', log[since:])
        assert statuses and set(statuses) == {"200"}, log[since:]
        # Claude Code's own token count is the sum of what the server said it served
        served = _tokens_served(log, since)
        got = (result["usage"]["input_tokens"], result["usage"]["output_tokens"])
        assert got == served and served[0] > 0, (result["usage"], log[since:])
        since = len(log)
        cut = result.get("is_error") and str(result.get("result")).startswith(MAX_TOKENS_RESULT)
        if not cut:
            break
    record_property("claude_code_runs", attempt)
    if cut:
        pytest.xfail(f"every answer of {RUNS} runs was cut at {MAX_OUTPUT_TOKENS} tokens (the "
                     "tiny model sampled at temperature 1 never stopped); the streams parsed")
    assert out.returncode == 0, f"stdout: {out.stdout}\nstderr: {out.stderr}"
    assert result["type"] == "result" and result["subtype"] == "success", result
    assert result["is_error"] is False, result
    assert isinstance(result["result"], str) and result["result"], result
