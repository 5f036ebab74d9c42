"""Our converted tokenizer.json and chat template vs transformers' GGUF tokenizer loader.

One known difference, decided in favour of llama.cpp: the GGUF says pre="smollm", which
llama.cpp pre-tokenizes by first isolating every `\\p{N}` character and then applying the GPT-2
regex (the original SmolLM2 tokenizer.json does the same with Digits(individual_digits)).
transformers' GGUF converter (5.24) drops the digit step, so for "a  1" it gives
[a, Ġ, Ġ1→Ġ, 1] where llama.cpp gives [a, ĠĠ, 1]. The reference below therefore splits the text
with llama.cpp's `\\p{N}` rule and lets transformers encode each piece.
"""

from __future__ import annotations

import json

import jinja2.sandbox
import pytest
import regex

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "日本語のテキストと中文文本",
    "한국어 문장입니다",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "tabs\tand\t\ttabs   and   spaces    end   ",
    "\n\n\nnewlines\r\n\r\nmixed\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>kestrel<file_sep>main.py",
    "Numbers: 3.14159, 1,000,000 and 2024-11-29",
    "a  1   22    333",
    "price $1234.56 (-7%)",
    "½ ² ③ ٣ ७",
    "Mixed: English, Русский, العربية, ελληνικά, עברית",
    "Ünïcödé àccents café naïve",
    "URL: https://example.com/path?q=1&r=two#frag",
    "   leading and trailing   ",
    "don't won't they're I've we'll she'd",
]


@pytest.fixture(scope="module")
def hf_tokenizer(hf_smollm2):
    """transformers' tokenizer built from the GGUF (independent of our converter)."""
    return hf_smollm2[0]


@pytest.fixture(scope="module")
def our_tokenizer(smollm2_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


def reference_ids(hf_tokenizer, text: str) -> list[int]:
    """llama.cpp's smollm pre-split (each \\p{N} char isolated), transformers' BPE per piece."""
    pieces = [p for p in regex.split(r"(\p{N})", text) if p]
    ids: list[int] = []
    for piece in pieces:
        ids += hf_tokenizer.encode(piece, add_special_tokens=False)
    return ids


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_encode_matches_reference_and_decode_round_trips(text, hf_tokenizer, our_tokenizer):
    ours = our_tokenizer.encode(text, add_special_tokens=True).ids
    assert ours == reference_ids(hf_tokenizer, text)
    if not regex.search(r"\p{N}", text):  # no digit: transformers' loader agrees directly
        assert ours == hf_tokenizer.encode(text, add_special_tokens=True)
    assert our_tokenizer.decode(ours, skip_special_tokens=False) == text
    assert hf_tokenizer.decode(ours, skip_special_tokens=False) == text


def test_special_tokens_in_config_are_single_ids(smollm2_dir, our_tokenizer, hf_tokenizer):
    cfg = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert our_tokenizer.token_to_id(cfg[key]) == hf_tokenizer.convert_tokens_to_ids(
            getattr(hf_tokenizer, key))
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [hf_tokenizer.eos_token_id]
    assert cfg["add_bos_token"] is False and our_tokenizer.encode("hi").ids == [6004]


def test_chat_template_rendered_with_jinja2_matches_apply_chat_template(
        smollm2_dir, our_tokenizer, hf_tokenizer):
    cfg = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris. Anything else?"},
        {"role": "user", "content": "Name 3 rivers there, please."},
    ]
    # Same jinja2 settings transformers documents for chat templates.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(cfg["chat_template"]).render(
        messages=messages, add_generation_prompt=True, bos_token=cfg["bos_token"],
        eos_token=cfg["eos_token"])
    ours = our_tokenizer.encode(text, add_special_tokens=False).ids
    theirs = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(theirs, list):  # transformers 5 returns a BatchEncoding
        theirs = theirs["input_ids"]
    assert ours == list(theirs)
    assert text.endswith("<|im_start|>assistant\n") and text.count("<|im_start|>") == 5
