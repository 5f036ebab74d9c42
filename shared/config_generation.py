"""Server-side sampling defaults: `--generation-config` and `--override-generation-config`
(docs/ARCHITECTURE.md §7.5), spelled and resolved as vLLM's settings of the same names.

- `generation_config`: where the defaults come from. "auto" (the default): the model
  folder's `generation_config.json` (none when the folder has no such file); "vllm": no
  file, the neutral defaults (temperature 1, top_p 1, top_k off, min_p 0,
  repetition_penalty 1, max_tokens from the API); any other value: a folder that must hold
  a `generation_config.json`.
- `override_generation_config`: a JSON object of the same keys, merged over the file's
  values (with "vllm": the only defaults). A null value removes that key's default.

Keys read (`KEYS`): temperature [0, 2], top_p (0, 1], top_k (-1 or 0: off, else
1..2**31-1), min_p [0, 1], repetition_penalty (0, 2] (the request fields' ranges,
services/frontend/openai_sampling.py), max_new_tokens >= 1 (transformers' name for
max_tokens). The file's other keys (eos ids, do_sample, ...) are not read; a file value
equal to transformers' own default (`TRANSFORMERS_DEFAULTS`: temperature 1.0, top_p 1.0,
top_k 50, repetition_penalty 1.0) is not a default, as vLLM reads the file (the values
transformers reports as differing from its defaults). A default applies only to a request
that does not set the field itself. `max_new_tokens` is the default max_tokens; from the
override it is also a ceiling on a request's own max_tokens (vLLM's rule: the model
author's value is a fallback, the operator's a server-wide limit).

Errors: `normalize_override` and `resolve` raise ValueError naming the setting, the file and
the key: not JSON, not an object, an unknown key (override only), a wrong type or range, a
folder without `generation_config.json`, an unreadable file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
MODES = ("auto", "vllm")
FILE_NAME = "generation_config.json"
TRANSFORMERS_DEFAULTS: dict[str, float] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50,
                                           "repetition_penalty": 1.0}
INT32_MAX = 2**31 - 1  # the largest top_k (the worker's sampler holds it in a tensor)
OVERRIDE = "override_generation_config"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(key: str, v: Any, where: str) -> float | int:
    """One key's value, checked: a float for the number keys, an int for top_k and
    max_new_tokens. Raises ValueError naming `where` and the key."""
    ranges = {"temperature": (0.0, 2.0, False), "top_p": (0.0, 1.0, True),
              "min_p": (0.0, 1.0, False), "repetition_penalty": (0.0, 2.0, True)}
    if key in ranges:
        lo, hi, lo_open = ranges[key]
        if not _is_number(v) or not (lo < v if lo_open else lo <= v) or not v <= hi:
            interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise ValueError(f"{where}: {key} must be a number in {interval}, got {v!r}")
        return float(v)
    if key == "top_k":
        if not _is_int(v) or not -1 <= v <= INT32_MAX:
            raise ValueError(f"{where}: top_k must be an integer, -1 or 0 (off) or 1..{INT32_MAX}, "
                             f"got {v!r}")
        return v
    if not _is_int(v) or v < 1:  # max_new_tokens
        raise ValueError(f"{where}: max_new_tokens must be an integer >= 1, got {v!r}")
    return v


def _override_dict(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """The override as a checked dict (null values kept: they remove a default). Raises
    ValueError naming the setting."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            data = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{OVERRIDE}: not JSON ({e.msg} at {e.pos})") from None
    else:
        data = value
    if not isinstance(data, dict):
        raise ValueError(f"{OVERRIDE}: expected a JSON object of {', '.join(KEYS)}")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ValueError(f"{OVERRIDE}: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})")
    return {k: None if v is None else _check(k, v, OVERRIDE) for k, v in data.items()}


def normalize_override(value: str | dict[str, Any]) -> str:
    """The setting's parser (shared.config_fields): JSON text or a decoded object (config
    file) -> canonical JSON text (keys sorted; "" for unset). Raises ValueError as the
    module docstring says."""
    data = _override_dict(value)
    return json.dumps(data, sort_keys=True) if data else ""


def read_file_defaults(folder: str, required: bool) -> tuple[dict[str, Any], str | None]:
    """(the sampling keys of `folder`/generation_config.json, the file's path). Values that
    are null or equal to transformers' defaults are left out. A missing file: ({}, None),
    or ValueError when `required` (a folder named by --generation-config). Raises
    ValueError naming the file for unreadable JSON or a bad value."""
    path = os.path.join(folder, FILE_NAME)
    if not os.path.isfile(path):
        if required:
            raise ValueError(f"generation_config: {folder!r} has no {FILE_NAME}")
        return {}, None
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"generation_config: {path} is not a JSON object")
    out: dict[str, Any] = {}
    for key in KEYS:
        v = data.get(key)
        if v is None or (key in TRANSFORMERS_DEFAULTS and v == TRANSFORMERS_DEFAULTS[key]
                         and not isinstance(v, bool)):
            continue
        out[key] = _check(key, v, path)
    return out, path


@dataclass(frozen=True)
class GenerationDefaults:
    """The resolved sampling defaults (None: no default; the API's own applies).

    temperature, top_p, top_k (0 off), min_p, repetition_penalty: used by a request that
    does not set the field. max_tokens: the default max_tokens (max_new_tokens; a request's
    room in the context still bounds it). max_tokens_cap: the override's max_new_tokens, a
    ceiling on a request's own max_tokens too. sources: key -> where its value came from
    (the file's path or the setting's name)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    max_tokens_cap: int | None = None
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def describe(self) -> str:
        """One line for the startup table and log: each default and its source."""
        if not self.sources:
            return "none (neutral: temperature 1, top_p 1, top_k off, min_p 0, " \
                   "repetition_penalty 1, max_tokens from the API)"
        parts = []
        for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if key in self.sources:
                parts.append(f"{key} {getattr(self, key)!r} [{self.sources[key]}]")
        if "max_tokens" in self.sources:
            cap = ", also a ceiling" if self.max_tokens_cap is not None else ""
            parts.append(f"max_tokens {self.max_tokens!r} [{self.sources['max_tokens']}{cap}]")
        return ", ".join(parts)


NO_DEFAULTS = GenerationDefaults()


def resolve(generation_config: str, model_path: str,
            override: str | dict[str, Any] | None) -> GenerationDefaults:
    """The defaults of the settings (see the module docstring): generation_config "auto",
    "vllm" or a folder; model_path: the served model's folder (read with "auto");
    override: the override setting's JSON text (or object). Raises ValueError."""
    values: dict[str, Any]
    path: str | None
    if generation_config == "vllm":
        values, path = {}, None
    elif generation_config == "auto":
        values, path = read_file_defaults(model_path, required=False)
    else:
        values, path = read_file_defaults(generation_config, required=True)
    sources = dict.fromkeys(values, path or "")
    for key, v in _override_dict(override).items():
        if v is None:
            values.pop(key, None)
            sources.pop(key, None)
        else:
            values[key], sources[key] = v, OVERRIDE
    if "max_new_tokens" in values:
        values["max_tokens"] = values.pop("max_new_tokens")
        sources["max_tokens"] = sources.pop("max_new_tokens")
    top_k = values.get("top_k")
    if top_k == -1:
        values["top_k"] = 0  # -1 and 0 both mean off; the engine's off is 0
    cap = values["max_tokens"] if sources.get("max_tokens") == OVERRIDE else None
    return GenerationDefaults(**values, max_tokens_cap=cap, sources=sources)
