"""Chat template rendering, checked against the ChatML byte format and transformers."""

from __future__ import annotations

import pytest

from services.frontend.chat_template import ChatTemplate
from services.frontend.errors import InvalidRequest
from services.frontend.tokenizer import Tokenizer
from tests.unit.test_frontend_support import CHATML_TEMPLATE, build_model_dir

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France? 日本語"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan?"},
]

# Uses the HF template features: tojson, strftime_now, loop controls, generation blocks,
# special-token variables and extra kwargs.
FEATURE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{% generation %}A: {{ m['content'] }}{% endgeneration %}"
    "{% else %}U: {{ m['content'] | tojson }}{% endif %}\n"
    "{% endfor %}{% if enable_thinking is defined %}think={{ enable_thinking }}\n{% endif %}"
    "year={{ strftime_now('%Y')[:2] }}{% if add_generation_prompt %}\nA:{% endif %}"
)


def test_chatml_render_matches_the_chatml_format():
    prompt = ChatTemplate(CHATML_TEMPLATE).render(MESSAGES, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nCapital of France? 日本語<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
        "<|im_start|>user\nAnd of Japan?<|im_end|>\n"
        "<|im_start|>assistant\n")
    without = ChatTemplate(CHATML_TEMPLATE).render(MESSAGES, add_generation_prompt=False)
    assert without + "<|im_start|>assistant\n" == prompt


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, FEATURE_TEMPLATE])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_render_matches_transformers_apply_chat_template(tmp_path, template, kwargs):
    transformers = pytest.importorskip("transformers")
    path = build_model_dir(str(tmp_path), template)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{path}/tokenizer.json",
                                              bos_token="<|endoftext|>", eos_token="<|im_end|>")
    expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                      chat_template=template, **kwargs)
    tok = Tokenizer(path)
    ours = ChatTemplate(template, {**tok.special_tokens, "bos_token": "<|endoftext|>"})
    assert ours.render(MESSAGES, add_generation_prompt=True, **kwargs) == expected


def test_tojson_keeps_non_ascii_characters():
    t = ChatTemplate("{{ messages[0]['content'] | tojson }}")
    assert t.render([{"role": "user", "content": "日本 \"q\""}]) == '"日本 \\"q\\""'


def test_raise_exception_in_template_is_an_invalid_request_naming_messages():
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidRequest) as e:
        ChatTemplate(CHATML_TEMPLATE).render(bad)
    assert e.value.param == "messages" and e.value.status == 400
    assert "Conversation roles must alternate" in e.value.message


def test_sandbox_refuses_to_mutate_messages():
    messages = [{"role": "user", "content": "a"}]
    with pytest.raises(InvalidRequest):
        ChatTemplate("{{ messages.append(1) }}").render(messages)
    assert messages == [{"role": "user", "content": "a"}]


def test_template_that_does_not_compile_is_a_value_error():
    with pytest.raises(ValueError):
        ChatTemplate("{% for m in messages %}")


PREFILL = [{"role": "user", "content": "Capital of France?"},
           {"role": "assistant", "content": "The capital of France is"}]


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, FEATURE_TEMPLATE])
def test_continue_final_message_matches_transformers(tmp_path, template):
    """The prompt ends right after the final assistant text (Anthropic's prefill, vLLM's
    continue_final_message): transformers' apply_chat_template is the truth."""
    transformers = pytest.importorskip("transformers")
    path = build_model_dir(str(tmp_path), template)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{path}/tokenizer.json",
                                              bos_token="<|endoftext|>", eos_token="<|im_end|>")
    expected = hf.apply_chat_template(PREFILL, tokenize=False, add_generation_prompt=False,
                                      continue_final_message=True, chat_template=template)
    tok = Tokenizer(path)
    ours = ChatTemplate(template, {**tok.special_tokens, "bos_token": "<|endoftext|>"})
    got = ours.render(PREFILL, add_generation_prompt=False, continue_final_message=True)
    assert got == expected and got.endswith("The capital of France is")


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Capital of France?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "  "}]])
def test_continue_final_message_needs_a_final_assistant_text(messages):
    with pytest.raises(InvalidRequest) as e:
        ChatTemplate(CHATML_TEMPLATE).render(messages, continue_final_message=True)
    assert e.value.param == "messages" and e.value.status == 400
