"""Log-probabilities in OpenAI's two response formats, from the engine's TokenLogprob.

- Chat Completions (`choices[i].logprobs`): {"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}, one entry per generated
  token, `bytes` the token's UTF-8 bytes as a list of ints (a token may hold part of a
  character; `token` is then its bytes decoded with U+FFFD replacement).
- Completions (`choices[i].logprobs`): {"tokens": [str], "token_logprobs": [float|None],
  "top_logprobs": [{token: logprob}|None], "text_offset": [int]}; text_offset is the
  character offset of each token in the choice's text (echoed prompt included). Each
  top_logprobs dict holds the `logprobs` most likely tokens and the chosen one (so
  `logprobs: 0` gives {chosen: logprob}, as vLLM).

Logprobs are natural logs (the engine's TokenLogprob.logprob); -inf/NaN are not valid JSON,
so they are clamped to -9999.0 as OpenAI does.
"""

from __future__ import annotations

import math
import re
from typing import Any

from services.frontend.tokenizer import Tokenizer
from shared.protocol import TokenLogprob

_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
MIN_LOGPROB = -9999.0


def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode table, inverted: printable char -> byte (Radford et al.
    2019, as used by every byte-level BPE tokenizer)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_decoder()


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The bytes one token contributes to the text. Special (added) tokens give their
    content; byte-level BPE maps each char back to its byte; SentencePiece pieces turn
    `<0xNN>` into the byte and `▁` into a space."""
    if token_id in tokenizer.added_tokens:
        return tokenizer.added_tokens[token_id].encode()
    piece = tokenizer.id_to_token(token_id)
    if piece is None:
        return b""
    if tokenizer.byte_level:
        try:
            return bytes(_BYTE_DECODER[c] for c in piece)
        except KeyError:
            return piece.encode()
    m = _HEX_BYTE.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode()


def _lp(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


class LogprobFormatter:
    """Formats TokenLogprobs for one tokenizer (token strings cached by id)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """(token string, its UTF-8 bytes as ints)."""
        hit = self._cache.get(token_id)
        if hit is None:
            raw = token_bytes(self.tokenizer, token_id)
            hit = (raw.decode("utf-8", errors="replace"), list(raw))
            self._cache[token_id] = hit
        return hit

    def chat_content(self, lps: list[TokenLogprob], top_n: int) -> list[dict[str, Any]]:
        """Chat `logprobs.content` entries, one per TokenLogprob, with top_n alternatives."""
        out = []
        for lp in lps:
            text, raw = self.token(lp.token_id)
            tops = []
            for tid, tlp in list(zip(lp.top_ids, lp.top_logprobs))[:top_n]:
                ttext, traw = self.token(tid)
                tops.append({"token": ttext, "logprob": _lp(tlp), "bytes": traw})
            out.append({"token": text, "logprob": _lp(lp.logprob), "bytes": raw,
                        "top_logprobs": tops})
        return out

    def completion(self, lps: list[TokenLogprob | None], token_ids: list[int], top_n: int,
                   offset: int) -> tuple[dict[str, list], int]:
        """Completions-format lists for `token_ids` (aligned with `lps`; None = no logprob,
        as for the first prompt token). offset: text_offset of the first token. Returns
        (the four lists, the offset after the last token)."""
        res: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for tid, lp in zip(token_ids, lps):
            text, _ = self.token(tid)
            res["tokens"].append(text)
            res["text_offset"].append(offset)
            offset += len(text)
            if lp is None:
                res["token_logprobs"].append(None)
                res["top_logprobs"].append(None)
                continue
            res["token_logprobs"].append(_lp(lp.logprob))
            tops: dict[str, float] = {}
            for t, tlp in list(zip(lp.top_ids, lp.top_logprobs))[:top_n]:
                tops.setdefault(self.token(t)[0], _lp(tlp))
            tops.setdefault(text, _lp(lp.logprob))  # the chosen token too, also at logprobs 0 (as vLLM)
            res["top_logprobs"].append(tops)
        return res, offset


def merge_completion(a: dict[str, list] | None, b: dict[str, list]) -> dict[str, list]:
    """Concatenate two completions-format logprob objects."""
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}
