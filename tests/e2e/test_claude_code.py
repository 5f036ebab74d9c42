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

Claude Code sends no temperature, so the server's sampling defaults decide
(`--override-generation-config`, docs/ARCHITECTURE.md §7.5). At temperature 1 SmolLM2's
answer often ran past 64 tokens; an answer cut at max_tokens is continued by Claude Code
("Output token limit hit. Resume directly ...", up to 3 more requests) and when every one
is cut `claude -p` exits 1 ("API Error: Claude's response exceeded the 64 output token
maximum"), which happened now and then. Greedy decoding alone loops ("... how to use the
CLI to automate tasks." again and again: all four answers cut). So the server runs greedy
with repetition_penalty 1.17 (SAMPLING_DEFAULTS). Measured by rendering a captured request
as the Anthropic route does and asking for greedy answers with the parts of the prompt that
change between runs varied (the temporary HOME's path, twice in the system prompt, and the
date): 1.15 and 1.20 ended the answer by itself in 26 and 34 tokens in each of 5-7 variants,
1.16-1.19 in 24-34 tokens, while 1.13 and 1.21 ran to 64 (1.0 and 1.1 loop, 1.25 and 1.3
ramble). 1.17 is the middle of that window; ten runs of this test then each got one
answer ended by the model in 27 or 24 tokens ("This document contains text formatted
according to the format specified above. Please refer to ..."; prompts of 2613-2620 tokens,
the path tokenizing differently). The test checks that Claude Code sent one request, whose
answer the model ended ("stop") below max_tokens, that every request got a 200, and that
Claude Code's usage equals the sum of the prompt and completion tokens the server logged.

The CLI is installed once with npm into ~/.cache/kestrel-tests/npm (pinned to
CLAUDE_CODE_VERSION, the version this was checked with) and reused; the test skips only when
npm is absent or the install fails for a network reason. The watchdog's timeout is raised to
the CPU step timeout: a 2.6k-token prefill on a busy 2-core machine takes over 30 s without
a beat, and its stack dump would be left behind.

On the 2-core dev machine at a load average of about 2-4, `claude -p` took 29-85 s (the
whole test 43-126 s, server startup included). The test records that time
(`claude_code_seconds`) and each answer's finish reason and completion tokens
(`claude_code_answers`) as properties and prints them.
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
# Claude Code sends no temperature: the server's defaults decode greedily, with a penalty
# that makes the tiny model end its answer (module doc)
SAMPLING_DEFAULTS = {"temperature": 0, "repetition_penalty": 1.17}
FINISHED = re.compile(r"(msg_\w+) finished: (\w+).*?, (\d+) prompt \+ (\d+) completion tokens")

pytestmark = pytest.mark.timeout(CLAUDE_TIMEOUT_S + 900)  # + install, startup


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
                        "4096", "--api-key", API_KEY, "--override-generation-config",
                        json.dumps(SAMPLING_DEFAULTS), "--watchdog-timeout-s", "600").start()
    yield srv
    srv.stop()
    os.unlink(srv.log.name)


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


def test_claude_code_gets_a_reply_and_exits_0(claude_bin, server, record_property):
    out, seconds = _run_claude(claude_bin, server.base_url)
    with open(server.log.name) as fh:
        log = fh.read()
    answers = FINISHED.findall(log)  # (id, finish reason, prompt tokens, completion tokens)
    record_property("claude_code_seconds", round(seconds, 1))
    record_property("claude_code_answers", [(r, int(n)) for _, r, _, n in answers])
    print(f"claude -p took {seconds:.1f} s, exit {out.returncode}; answers (finish, prompt, "
          f"completion tokens): {[(r, int(p), int(n)) for _, r, p, n in answers]}; "
          f"{out.stdout[:300]}")
    try:
        result = json.loads(out.stdout)
    except ValueError:
        pytest.fail(f"claude -p printed no JSON result (exit {out.returncode}):\n"
                    f"stdout: {out.stdout}\nstderr: {out.stderr}\nserver:\n{log[-6000:]}")
    assert ("sampling defaults (generation_config auto): temperature 0.0 [override_generation_config], "
            "repetition_penalty 1.17 [override_generation_config]") in log, log[-6000:]
    statuses = re.findall(r'"POST /v1/messages\?beta=true HTTP/1.1" (\d+)', log)
    assert statuses and set(statuses) == {"200"}, log
    # Claude Code's own token count is the sum of what the server said it served
    prompts = [int(n) for n in re.findall(r"msg_\w+ added: (\d+) prompt tokens", log)]
    served = (sum(prompts), sum(int(n) for *_, n in answers))
    got = (result["usage"]["input_tokens"], result["usage"]["output_tokens"])
    assert got == served and served[0] > 0, (result["usage"], log)
    assert out.returncode == 0, f"stdout: {out.stdout}\nstderr: {out.stderr}\nserver:\n{log[-6000:]}"
    assert result["type"] == "result" and result["subtype"] == "success", result
    assert result["is_error"] is False, result
    assert isinstance(result["result"], str) and result["result"], result
    # one request, whose answer the model ended itself within max_tokens (no continuation)
    assert [reason for _, reason, _, _ in answers] == ["stop"], answers
    assert int(answers[0][3]) < MAX_OUTPUT_TOKENS, answers
