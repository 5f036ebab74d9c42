"""Sampling and stopping fields shared by /v1/chat/completions and /v1/completions.

Fields (OpenAI's, plus vLLM's extensions), with the ranges enforced here (400 naming the
field in `param` otherwise):
- n: integer in [1, 16]; seed: 64-bit integer (choice i of n samples with seed + i);
- temperature [0, 2], top_p (0, 1], top_k -1/0 = off or in [1, 2**31 - 1], min_p [0, 1];
  as vLLM does, a temperature below SAMPLING_EPS (1e-5) is sent to the engine as 0.0
  (greedy: a tiny one would underflow to 0 in float32), and a top_p below MIN_TOP_P (1e-6)
  as MIN_TOP_P (same result, only the most likely token is kept, without underflow)
  (`engine_temperature`, `engine_top_p`);
- presence_penalty, frequency_penalty [-2, 2]; repetition_penalty (0, 2];
- logit_bias: {"<token id>": bias in [-100, 100]}, ids inside the vocabulary, at most 300;
- max_tokens / max_completion_tokens >= 0 (0 only for completions scoring with echo),
  min_tokens >= 0 and <= max_tokens;
- stop: a string or a list of at most MAX_STOP_STRINGS non-empty strings of at most
  MAX_STOP_CHARS characters each; stop_token_ids: ids inside the vocabulary;
- ignore_eos, skip_special_tokens: booleans;
- structured output: response_format, or vLLM's guided_json / guided_regex /
  guided_choice / guided_grammar, or its structured_outputs, at most one
  (services/frontend/structured_fields.py: a constraint xgrammar cannot compile, or a schema
  nested more than 64 levels, is a 400 naming its field);
- stream, and stream_options (an object, only with stream: true) with the booleans
  include_usage (a final usage chunk) and vLLM's continuous_usage_stats (with include_usage,
  usage on every chunk too).

Server-side defaults (`--generation-config`, `--override-generation-config`:
shared/config_generation.py, docs/ARCHITECTURE.md §7.5): temperature, top_p, top_k, min_p
and repetition_penalty take the server's default where the request does not set them (absent
or null), and max_tokens its default max_tokens; the override's max_new_tokens also caps a
request's own max_tokens (`SamplingRequest.max_tokens_for`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from services.frontend.errors import InvalidRequest
from services.frontend.structured_fields import request_constraint
from shared.config_generation import NO_DEFAULTS, GenerationDefaults
from shared.protocol import SamplingParams, StructuredSpec


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1  # the largest top_k (the worker's sampler holds it in a tensor)
SAMPLING_EPS = 1e-5  # temperatures below it are greedy (vLLM's _SAMPLING_EPS)
MIN_TOP_P = 1e-6  # smaller top_p values are sent as this (float32 would underflow)
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 300
MAX_TOP_LOGPROBS = 20


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(float(v)))


def get_int(body: dict, name: str, lo: int, hi: int = INT64_MAX,
            param: str | None = None) -> int | None:
    """body[name] as an int in [lo, hi], None when absent or null; raises InvalidRequest."""
    v = body.get(name)
    if v is None:
        return None
    if not is_int(v) or not lo <= v <= hi:
        bound = ("in the 64-bit range" if lo == INT64_MIN else
                 f"at least {lo}" if hi == INT64_MAX else f"between {lo} and {hi}")
        raise InvalidRequest(param or name, f"'{name}' must be an integer {bound}.")
    return v


def get_number(body: dict, name: str, default: float, lo: float, hi: float,
               lo_open: bool = False) -> float:
    """body[name] as a finite float in [lo, hi] (or (lo, hi]); default when absent."""
    v = body.get(name)
    if v is None:
        return default
    if not is_number(v) or not (lo < v if lo_open else lo <= v) or not v <= hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise InvalidRequest(name, f"'{name}' must be a number in {interval}.")
    return float(v)


def engine_temperature(temperature: float) -> float:
    """The temperature sent to the engine: below SAMPLING_EPS (1e-5) it is 0.0, greedy (as
    vLLM does): a tiny positive one would become 0 in the worker's float32 and divide the
    logits into garbage."""
    return 0.0 if temperature < SAMPLING_EPS else temperature


def engine_top_p(top_p: float) -> float:
    """The top_p sent to the engine: at least MIN_TOP_P (1e-6). Any top_p that small keeps
    only the most likely token (its probability is at least 1/vocab); a smaller one could
    underflow to 0 in float32, and top_p 0 drops every token."""
    return max(top_p, MIN_TOP_P)


def get_bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidRequest(param or name, f"'{name}' must be a boolean.")
    return v


@dataclass
class SamplingRequest:
    """The validated sampling fields of one request, the server's defaults filled in where
    the request set none. max_tokens: the request's own, None when not given (then
    `max_tokens_for` picks the server's default max_tokens, else the API's: the rest of the
    context for chat, OpenAI's 16 for completions). default_max_tokens, max_tokens_cap: the
    server's default max_tokens and its ceiling (None: none). include_usage:
    stream_options.include_usage. continuous_usage: stream_options.continuous_usage_stats
    and include_usage both true (vLLM's rule): every streamed chunk carries its usage."""

    n: int = 1
    seed: int | None = None
    max_tokens: int | None = None
    default_max_tokens: int | None = None
    max_tokens_cap: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    structured: StructuredSpec | None = None
    structured_param: str | None = None  # the request field of `structured` (for errors)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False

    def max_tokens_for(self, room: int, fallback: int | None = None) -> int:
        """The max_tokens to send for a prompt that leaves `room` tokens of the context:
        the request's own max_tokens (the caller has checked it against the room), else the
        server's default or `fallback` (the API's default; None: the whole room), at most
        the room; then at most max_tokens_cap."""
        if self.max_tokens is not None:
            want = self.max_tokens
        else:
            default = self.default_max_tokens if self.default_max_tokens is not None else fallback
            want = room if default is None else min(default, room)
        return want if self.max_tokens_cap is None else min(want, self.max_tokens_cap)

    def to_params(self, max_tokens: int, index: int, logprobs: int | None = None,
                  prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's SamplingParams for choice `index` (seed + index when seeded). A
        temperature below 1e-5 is sent as 0.0 (greedy) and a top_p below 1e-6 as 1e-6
        (`engine_temperature`, `engine_top_p`)."""
        return SamplingParams(
            temperature=engine_temperature(self.temperature),
            top_p=engine_top_p(self.top_p), top_k=self.top_k,
            min_p=self.min_p,
            seed=None if self.seed is None else (self.seed + index) % (2**63),
            max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens),
            stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=dict(self.logit_bias),
            structured=self.structured)


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if (not isinstance(value, list) or len(value) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in value)):
        raise InvalidRequest("stop", "'stop' must be a non-empty string or a list of at most "
                             f"{MAX_STOP_STRINGS} non-empty strings of at most "
                             f"{MAX_STOP_CHARS} characters.")
    return list(dict.fromkeys(value))


def _token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise InvalidRequest(name, f"'{name}' must be a list of token ids.")
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(name, f"Token id {bad[0]} is outside the vocabulary "
                             f"({vocab_size} tokens).")
    return list(value)


def _logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequest("logit_bias", "'logit_bias' must be an object of at most "
                             f"{MAX_LOGIT_BIAS} token ids (as strings) to biases.")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            tid = int(key)
        except ValueError:
            tid = -1
        if not 0 <= tid < vocab_size or str(tid) != key.strip():
            raise InvalidRequest("logit_bias", f"logit_bias key {key!r} is not a token id "
                                 f"of the vocabulary ({vocab_size} tokens).")
        if not is_number(bias) or not -100 <= bias <= 100:
            raise InvalidRequest("logit_bias", "logit_bias values must be numbers in "
                                 "[-100, 100].")
        out[tid] = float(bias)
    return out


def _default(value: float | int | None, neutral: float | int) -> float:
    return float(neutral if value is None else value)


def parse_sampling(body: dict, vocab_size: int, min_max_tokens: int = 1,
                   defaults: GenerationDefaults = NO_DEFAULTS) -> SamplingRequest:
    """The shared sampling fields of a request body (see the module docstring).

    min_max_tokens: the smallest max_tokens allowed (0 for completions, for scoring).
    defaults: the server's sampling defaults (the serving context's), used for the fields
    the body does not set. Raises InvalidRequest naming the first bad field."""
    n = get_int(body, "n", 1, MAX_N)
    max_tokens = get_int(body, "max_tokens", min_max_tokens)
    max_completion = get_int(body, "max_completion_tokens", min_max_tokens)
    if max_completion is not None:
        max_tokens = max_completion
    top_k = get_int(body, "top_k", -1, INT32_MAX)
    min_tokens = get_int(body, "min_tokens", 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequest("min_tokens", "'min_tokens' must not exceed 'max_tokens'.")
    stream = get_bool(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = continuous_usage = False
    if stream_options is not None:
        if not stream:
            raise InvalidRequest("stream_options",
                                 "'stream_options' is only allowed when 'stream' is true.")
        if not isinstance(stream_options, dict):
            raise InvalidRequest("stream_options", "'stream_options' must be an object.")
        include_usage = get_bool(stream_options, "include_usage", False,
                                 "stream_options.include_usage")
        continuous_usage = get_bool(stream_options, "continuous_usage_stats", False,
                                    "stream_options.continuous_usage_stats") and include_usage
    if top_k is None:
        top_k = defaults.top_k
    structured, structured_param = request_constraint(body)  # compiles: off the event loop
    d = defaults
    return SamplingRequest(
        n=n or 1,
        seed=get_int(body, "seed", INT64_MIN),
        max_tokens=max_tokens,
        default_max_tokens=d.max_tokens,
        max_tokens_cap=d.max_tokens_cap,
        temperature=get_number(body, "temperature", _default(d.temperature, 1.0), 0.0, 2.0),
        top_p=get_number(body, "top_p", _default(d.top_p, 1.0), 0.0, 1.0, lo_open=True),
        top_k=0 if top_k is None or top_k == -1 else top_k,
        min_p=get_number(body, "min_p", _default(d.min_p, 0.0), 0.0, 1.0),
        min_tokens=min_tokens,
        presence_penalty=get_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=get_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=get_number(body, "repetition_penalty",
                                      _default(d.repetition_penalty, 1.0), 0.0, 2.0,
                                      lo_open=True),
        logit_bias=_logit_bias(body.get("logit_bias"), vocab_size),
        stop=_stop(body.get("stop")),
        stop_token_ids=_token_ids(body.get("stop_token_ids"), "stop_token_ids", vocab_size),
        ignore_eos=get_bool(body, "ignore_eos", False),
        skip_special_tokens=get_bool(body, "skip_special_tokens", True),
        structured=structured,
        structured_param=structured_param,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
    )
