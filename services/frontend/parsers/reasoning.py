"""Reasoning parsers: split a model's raw text into reasoning and content, streaming.

`qwen3`: reasoning is written inside `<think>...</think>` at the start of the answer (Qwen3's
format). The reasoning ends at `</think>`, or at a `<tool_call>` when the model never closed
it (that tag and what follows are content, for the tool parser). Whitespace right after
`</think>` is dropped. When the prompt already ends with `<think>` (templates that open the
block for the model), the answer starts inside the reasoning. With thinking disabled
(`enabled=False`) everything is content.

`feed(text) -> (reasoning, content)` and `finish() -> (reasoning, content)`; any split of the
text gives the same concatenations as one feed.
"""

from __future__ import annotations

from services.frontend.parsers.tool_parsers import TOOL_CALL_OPEN, partial_prefix_len

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class Qwen3ReasoningParser:
    """enabled: thinking is on for this request. starts_inside: the prompt ended with
    `<think>` so the output begins inside the reasoning block."""

    def __init__(self, enabled: bool = True, starts_inside: bool = False):
        self._state = ("reasoning" if starts_inside else "start") if enabled else "content"
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = "", ""
        self._buf += text
        while self._buf:
            if self._state == "content":
                content += self._buf
                self._buf = ""
            elif self._state == "lstrip":  # right after </think>
                s = self._buf.lstrip()
                self._buf = s
                if s:
                    self._state = "content"
            elif self._state == "start":
                s = self._buf.lstrip()
                if s.startswith(THINK_OPEN):
                    self._buf, self._state = s[len(THINK_OPEN):], "reasoning"
                elif not s or THINK_OPEN.startswith(s):
                    break
                else:
                    self._state = "content"  # the model answered without thinking
            else:  # reasoning
                ends = [(i, tag) for tag in (THINK_CLOSE, TOOL_CALL_OPEN)
                        if (i := self._buf.find(tag)) >= 0]
                if ends:
                    i, tag = min(ends)
                    reasoning += self._buf[:i]
                    if tag == THINK_CLOSE:
                        self._buf, self._state = self._buf[i + len(tag):], "lstrip"
                    else:
                        self._buf, self._state = self._buf[i:], "content"
                    continue
                keep = max(partial_prefix_len(self._buf, THINK_CLOSE),
                           partial_prefix_len(self._buf, TOOL_CALL_OPEN))
                reasoning += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._state == "reasoning":
            return buf, ""
        if self._state == "start":  # a bare prefix of "<think>" and nothing else
            return "", buf
        return "", buf if self._state == "content" else ""


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}
