"""Structured output in the engine: grammars compiled by xgrammar, one matcher per request.

Flow (docs/ARCHITECTURE.md §7 "Structured output"):
1. At startup, `StructuredOutputManager(model_path, vocab_size, eos_token_ids)` builds
   `xgrammar.TokenizerInfo` from the model's `tokenizer.json` (no transformers needed): the
   vocabulary in id order and its encoding (GPT-2 byte-level, SentencePiece byte fallback,
   or raw), padded to config.json's `vocab_size` (the lm_head width).
2. At add time, `manager.compile(spec)` compiles the request's `StructuredSpec` (JSON
   schema, any JSON object, regex or EBNF grammar), and a `RequestGrammar`, a fresh
   `GrammarMatcher`, is made over it. Compiled grammars are cached by (kind, spec), so a repeated
   schema costs nothing (`cached_grammar_for`). A new grammar is compiled in a thread off
   the engine loop (`services.engine.grammar_jobs`), and its request joins the scheduler when
   it is ready: a new JSON schema over a 49k vocabulary takes tens of ms, but a deeply
   nested one takes seconds (SmolLM2, an array nested 520 deep: 8.4 s), and xgrammar
   releases the GIL meanwhile (the loop kept its pace: the longest gap between its 1 ms
   sleeps was 3.6 ms). A grammar that fails to compile raises `GrammarError` and fails only
   its own request (error_kind "invalid").
3. Each step, the scheduler asks `RequestGrammar.bitmask()` for every sampled request:
   xgrammar's packed int32 bitmask of ceil(vocab/32) words, as little-endian bytes
   (bit t set = token t allowed), sent in `ScheduledSeq.allowed_token_bitmask`.
4. After the step, `accept(token)` advances the matcher; `is_terminated()` turns True when
   the grammar accepted a stop token (EOS), which ends the request with "stop".
5. Speculative decoding (docs/ARCHITECTURE.md §5.5): a verify seq needs a mask per position.
   `draft_bitmasks(drafts)` advances the matcher tentatively over the drafts (stopping at
   the first one the grammar rejects, or one that would terminate it), takes the mask of
   each position and rolls back (`GrammarMatcher.rollback`), so the matcher is left as it
   was; `accept` then advances it over the tokens the step really emitted.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict

import xgrammar as xgr

from shared.grammar_errors import grammar_error_text
from shared.protocol import StructuredSpec

log = logging.getLogger("kestrel.engine")

CACHE_SIZE = 128  # compiled grammars kept (LRU)
KINDS = ("json_schema", "json_object", "regex", "grammar")


class GrammarError(ValueError):
    """The request's grammar is invalid or failed to compile (the client's fault)."""


def _vocab_type(tokenizer_json: dict) -> xgr.VocabType:
    """GPT-2 style byte-level BPE, SentencePiece with byte fallback, or raw strings."""
    text = json.dumps(tokenizer_json.get("decoder") or {})
    if "ByteLevel" in text:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in text:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def tokenizer_info(model_path: str, vocab_size: int, eos_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a model's tokenizer, read from `<model_path>/tokenizer.json`.

    vocab_size: the logits width (config.json); ids without a token get "" (never allowed).
    Raises FileNotFoundError without tokenizer.json.
    """
    path = os.path.join(model_path, "tokenizer.json")
    with open(path, encoding="utf-8") as fh:
        tj = json.load(fh)
    vocab: dict[str, int] = dict(tj.get("model", {}).get("vocab", {}))
    for t in tj.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    encoded = [""] * max(vocab_size, max(vocab.values(), default=-1) + 1)
    for s, i in vocab.items():
        encoded[i] = s
    vtype = _vocab_type(tj)
    return xgr.TokenizerInfo(encoded, vtype, vocab_size=len(encoded), stop_token_ids=list(eos_token_ids),
                             add_prefix_space=vtype == xgr.VocabType.BYTE_FALLBACK)


class RequestGrammar:
    """One request's grammar state (an xgrammar GrammarMatcher). Not thread-safe."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._buf = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab/32)] int32
        self._draft_buf = self._buf  # [k + 1, ceil(vocab/32)], grown on demand

    def bitmask(self) -> bytes:
        """The allowed next tokens: ceil(vocab/32) little-endian int32 words as bytes."""
        self.matcher.fill_next_token_bitmask(self._buf)
        return self._buf.numpy().astype("<i4", copy=False).tobytes()

    def draft_bitmasks(self, drafts: list[int]) -> tuple[int, bytes]:
        """The masks of a verify seq over `drafts` (module doc, 5). Returns (n, masks): n
        drafts the grammar accepts in a row (it stops before a rejected draft and before one
        that would terminate the grammar: no position follows a terminated grammar), and
        n + 1 masks back to back (position i: after drafts[:i]), each ceil(vocab/32)
        little-endian int32 words. The matcher is left as it was."""
        m = self.matcher
        n = 0
        for tok in drafts:
            if not m.accept_token(tok):
                break
            n += 1
            if m.is_terminated():
                m.rollback(1)
                n -= 1
                break
        if self._draft_buf.shape[0] < n + 1:
            self._draft_buf = xgr.allocate_token_bitmask(max(n + 1, 2 * self._draft_buf.shape[0]),
                                                         self.vocab_size)
        buf = self._draft_buf
        for i in range(n, -1, -1):  # the deepest state first, rolling back one token each
            m.fill_next_token_bitmask(buf, i)
            if i:
                m.rollback(1)
        return n, buf[:n + 1].numpy().astype("<i4", copy=False).tobytes()

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token. False when the grammar rejects it."""
        return bool(self.matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class StructuredOutputManager:
    """Compiles request grammars for one model (see the module docstring)."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: list[int], max_threads: int = 2):
        self.vocab_size = vocab_size
        self.info = tokenizer_info(model_path, vocab_size, eos_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        """Compile (or fetch from the LRU cache) a spec. Raises GrammarError."""
        key = (spec.kind, spec.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        if spec.kind not in KINDS:
            raise GrammarError(f"unknown structured output kind {spec.kind!r} (one of {', '.join(KINDS)})")
        try:
            if spec.kind == "json_schema":
                json.loads(spec.spec)  # a clear message for malformed JSON
                compiled = self.compiler.compile_json_schema(spec.spec, any_whitespace=False)
            elif spec.kind == "json_object":
                compiled = self.compiler.compile_builtin_json_grammar()
            elif spec.kind == "regex":
                compiled = self.compiler.compile_regex(spec.spec)
            else:
                compiled = self.compiler.compile_grammar(spec.spec)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from None
        except Exception as e:  # xgrammar raises RuntimeError/ValueError on bad grammars
            raise GrammarError(f"{spec.kind} failed to compile: {grammar_error_text(e)}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def cached_grammar_for(self, spec: StructuredSpec) -> RequestGrammar | None:
        """A fresh matcher when the spec's grammar is already compiled, else None (the
        caller compiles it off its loop with `compile`)."""
        with self._lock:
            hit = self._cache.get((spec.kind, spec.spec))
            if hit is not None:
                self._cache.move_to_end((spec.kind, spec.spec))
        return None if hit is None else RequestGrammar(hit, self.vocab_size)
