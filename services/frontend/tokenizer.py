"""The frontend's tokenizer: a Hugging Face fast tokenizer folder read without transformers.

Reads, from a model folder (Hugging Face layout):
- `tokenizer.json`: the `tokenizers` library's serialized tokenizer (vocabulary, merges,
  normalizer, pre-tokenizer, decoder, added tokens);
- `tokenizer_config.json`: `chat_template` (a string, or a list of {"name", "template"} of
  which "default" is used), the special tokens `bos_token`, `eos_token`, `unk_token`,
  `pad_token` (each a string or an AddedToken dict with "content");
- `chat_template.jinja`, when present, overrides the config's template (newer HF layout).
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# From this many characters (encode) or ids (decode) on, go through the `_batch` methods:
# the library releases the GIL in those only (tokenizers 0.23: `encode` holds it for the
# whole call, ~6 s on 7 MB), so a big input run in a thread does not stall the event loop.
RELEASE_GIL_FROM = 4096


def _token_text(v: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or {"content": str, ...}."""
    if v is None:
        return None
    if isinstance(v, dict):
        return v.get("content")
    return str(v)


def _pick_template(v: Any) -> str | None:
    """chat_template as HF stores it: a string, or a list of named templates."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list):
        by_name = {t.get("name"): t.get("template") for t in v if isinstance(t, dict)}
        return by_name.get("default") or next(iter(by_name.values()), None)
    return None


class Tokenizer:
    """Encode and decode token ids with a model folder's tokenizer.

    Attributes: chat_template (str | None), special_tokens ({"bos_token": "<s>", ...} for
    those the config names), vocab_size (ids in the vocabulary, added tokens included).
    Raises FileNotFoundError if the folder has no tokenizer.json, ValueError if a file is
    malformed.
    """

    def __init__(self, model_path: str):
        path = os.path.join(model_path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer.json in {model_path}")
        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception on a bad file
            raise ValueError(f"cannot load {path}: {e}") from None
        config: dict[str, Any] = {}
        cfg_path = os.path.join(model_path, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as fh:
                try:
                    config = json.load(fh)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
        self.special_tokens: dict[str, str] = {}
        for key in SPECIAL_TOKEN_KEYS:
            text = _token_text(config.get(key))
            if text is not None:
                self.special_tokens[key] = text
        self.chat_template = _pick_template(config.get("chat_template"))
        jinja_path = os.path.join(model_path, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as fh:
                self.chat_template = fh.read()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # Byte-level BPE (GPT-2 style): vocabulary strings map bytes to printable chars.
        self.byte_level = type(self._tok.decoder).__name__ == "ByteLevel"
        self.added_tokens = {i: t.content for i, t in
                             self._tok.get_added_tokens_decoder().items()}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (such as `<|im_start|>`
        from a chat template) become their ids. add_special_tokens adds the post-processor's
        tokens (e.g. BOS); chat prompts leave it False because the template writes them.
        CPU time grows with the text (seconds for megabytes): call it off the event loop
        for request-sized input."""
        if len(text) >= RELEASE_GIL_FROM:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`. An incomplete UTF-8 sequence at either end decodes as U+FFFD."""
        if len(ids) >= RELEASE_GIL_FROM:
            return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (byte-level BPE keeps its byte-to-char mapping),
        or None for an id outside the vocabulary."""
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary token, or None."""
        return self._tok.token_to_id(token)
