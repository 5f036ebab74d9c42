"""Incremental detokenization: token ids in, final text out, one request at a time.

Technique (prefix/read offsets, as in Hugging Face text-generation-inference and vLLM):
keep the ids of the text already emitted, decode a short window `ids[prefix:read]` (text
already emitted) and `ids[prefix:]` (the same plus the new tokens) with the `tokenizers`
decoder, and emit the difference once it does not end in U+FFFD. A multi-byte UTF-8
character split across tokens is therefore held back until its last byte arrives, and
decoders whose output depends on the context (SentencePiece's leading-space rule) see the
same context in both decodes. The window starts with the last few prompt tokens for that
context.
"""

from __future__ import annotations

import copy

from services.frontend.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded as context before the first output token


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas that are final.

    prompt_ids: the request's prompt token ids (only the last few are used, as context).
    skip_special_tokens: leave special tokens (EOS, chat markers) out of the text.
    The concatenation of every `add` result and the final `flush` equals the tokenizer's
    one-shot decode of all output ids (for byte-level BPE tokenizers, exactly).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int],
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.num_output_tokens = 0

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy in the same state (the same tokenizer object), to probe
        what more tokens would give without advancing this one."""
        other = copy.copy(self)
        other._ids = list(self._ids)
        return other

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, new_ids: list[int]) -> str:
        """Feed new output tokens; return the text that became final ('' if none did).

        Text that ends in an incomplete UTF-8 sequence is held back, so the result never
        ends in U+FFFD for a character split across tokens.
        """
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        self.num_output_tokens += len(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back, at the end of the request (may contain U+FFFD if the
        model's output really ends with an incomplete character)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Keep the window short: drop ids before the prefix offset.
        if self._prefix_offset > 0:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta
