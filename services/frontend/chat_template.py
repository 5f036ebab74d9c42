"""Chat templates: a model's Jinja template turned into a prompt string.

Follows the Hugging Face chat template conventions (`apply_chat_template` in transformers):
the template runs in jinja2's `ImmutableSandboxedEnvironment` of the dialect defined in
`shared/chat_template_source.py` (where the config builder checks `--chat-template` with it
too). The render variables are `messages`,
`add_generation_prompt`, `tools`, `documents`, the tokenizer's special tokens (`bos_token`,
`eos_token`, ...) and any extra keyword arguments (e.g. `enable_thinking`).

The variables the renderer sets itself (`RESERVED`: messages, tools, documents,
add_generation_prompt, and Kestrel's tool_call_format) cannot come from a request's
`chat_template_kwargs`: `check_template_kwargs` refuses them with 400 naming the key.
A template that cannot render tools, assistant tool calls or tool results gets them through
the fallback of `tool_prompt.py` (probed once, when the template is loaded), never dropped.
"""

from __future__ import annotations

from typing import Any

import jinja2

from services.frontend.errors import InvalidRequest
from services.frontend.tool_prompt import ToolSupport, probe_tool_support, with_fallback
from shared.chat_template_source import compile_template

# Render variables the renderer sets itself; a request's chat_template_kwargs may not.
RESERVED = ("messages", "tools", "documents", "add_generation_prompt", "tool_call_format",
            "continue_final_message")


def check_template_kwargs(kwargs: Any, param: str = "chat_template_kwargs") -> dict[str, Any]:
    """A request's chat_template_kwargs, validated: an object whose keys are not `RESERVED`.
    Returns it as a dict (None -> {}). Raises InvalidRequest (param `<param>.<key>` for a
    reserved key, naming it and the request field to use instead)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest(param, f"'{param}' must be an object.")
    for key in RESERVED:
        if key in kwargs:
            raise InvalidRequest(f"{param}.{key}", f"'{param}' cannot set {key!r}: the server "
                                 "sets it from the request itself (use the request's own "
                                 "field).")
    return dict(kwargs)


class ChatTemplate:
    """A compiled chat template.

    source: the Jinja text (tokenizer_config.json's chat_template).
    special_tokens: render variables such as {"bos_token": "<s>", "eos_token": "</s>"}.
    support: what it renders of tools, tool calls and system messages (probed here, once).
    Raises ValueError if the template does not compile (a fault of the model folder).
    """

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        self._template = compile_template(source)
        self._special_tokens = dict(special_tokens or {})
        self.support: ToolSupport = probe_tool_support(
            lambda messages, tools: self._render(messages, True, tools, {}))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
               **kwargs: Any) -> str:
        """The prompt text for `messages` (dicts with "role" and "content", content a string).

        add_generation_prompt: end with the header of an assistant turn, so that the model
        answers. continue_final_message: the prompt ends inside the final (assistant)
        message, right after its text, so that the model continues it (Anthropic's prefill,
        vLLM's and transformers' `continue_final_message`): the conversation is rendered
        without a generation prompt and cut after the last occurrence of that message's
        stripped text (transformers' rule); add_generation_prompt is then ignored.
        tools: [{"type": "function", "function": {...}}] or None; a template that
        does not render them (or the messages' tool calls) gets them through the fallback
        of `tool_prompt.py`, in the `tool_call_format` kwarg's format ("json" default).
        kwargs become extra template variables (a request's chat_template_kwargs, checked by
        the caller with `check_template_kwargs`: messages / tools / add_generation_prompt
        among them would be a TypeError of this call; "documents" here is a 400 too).
        Raises InvalidRequest (param "messages") when the template rejects the messages
        (its raise_exception) or fails on them; the message is the template's own; (param
        "tools") when tools are given and the template has no place for them.
        """
        if "documents" in kwargs:  # the other reserved names collide with the parameters
            raise InvalidRequest("chat_template_kwargs.documents",
                                 "'chat_template_kwargs' cannot set 'documents'.")
        messages, tools = with_fallback(self.support, messages, tools,
                                        str(kwargs.get("tool_call_format", "json")))
        if not continue_final_message:
            return self._render(messages, add_generation_prompt, tools, kwargs)
        final = messages[-1] if messages else {}
        text = final.get("content")
        if final.get("role") != "assistant" or not isinstance(text, str) or not text.strip():
            raise InvalidRequest("messages", "Continuing the final message needs a final "
                                 "assistant message with text.")
        prompt = self._render(messages, False, tools, kwargs)
        tail = text.strip()
        at = prompt.rfind(tail)
        if at < 0:
            raise InvalidRequest("messages", "The chat template does not render the final "
                                 "assistant message's text as given, so it cannot be continued.")
        return prompt[:at + len(tail)]

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> str:
        variables = {**self._special_tokens, **kwargs}
        try:
            return self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.TemplateError as e:
            raise InvalidRequest("messages",
                                 f"The chat template rejected the messages: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise InvalidRequest("messages",
                                 f"The chat template failed on the messages: {e}") from None
