"""Incremental detokenizer and stop-string matcher, checked against one-shot decodes."""

from __future__ import annotations

import os
import random

import pytest

from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.generation import StopStringMatcher
from services.frontend.tokenizer import Tokenizer
from tests.unit.test_frontend_support import REPLY_TEXT, build_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOLLM2 = os.path.join(REPO, "models", "SmolLM2-135M-Instruct")

TEXTS = [
    REPLY_TEXT,
    "龍🐉 ümlaut ñ Ελληνικά русский текст 한국어 텍스트 🇯🇵👨‍👩‍👧‍👦 end",
    "日本語のテキストです。絵文字も：😀😃😄😁。繁體中文：龍鳳呈祥。",
    "🦅" * 7 + " mixed 中文 and emoji 👍🏽👍🏿 " + "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕸𝖆𝖙𝖍",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer(build_model_dir(str(tmp_path_factory.mktemp("model"))))


def _stream(tok: Tokenizer, prompt_ids, ids, sizes, skip=True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    pieces, i = [], 0
    for n in sizes:
        pieces.append(detok.add(ids[i:i + n]))
        i += n
    pieces.append(detok.flush())
    return pieces


def _assert_streams_like_one_shot(tok: Tokenizer, text: str, rng: random.Random) -> None:
    prompt_ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text)
    expected = tok.decode(ids)
    # The test only means something if some characters span several tokens.
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    for sizes in ([1] * len(ids), [rng.randint(1, 4) for _ in range(len(ids))]):
        pieces = _stream(tok, prompt_ids, ids, sizes)
        assert "".join(pieces) == expected
        assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_concatenate_to_one_shot_decode_without_replacement_chars(
        tokenizer, text):
    _assert_streams_like_one_shot(tokenizer, text, random.Random(0))


def test_split_character_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("龍")
    assert len(ids) > 1  # a byte-level split character
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "龍"


def test_special_tokens_skipped_or_kept_like_one_shot_decode(tokenizer):
    ids = tokenizer.encode("Hello 世界<|im_end|> then 龍<|endoftext|>")
    for skip in (True, False):
        pieces = _stream(tokenizer, [], ids, [1] * len(ids), skip=skip)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" not in "".join(_stream(tokenizer, [], ids, [1] * len(ids)))


def test_flush_emits_an_incomplete_trailing_character(tokenizer):
    ids = tokenizer.encode("ok 龍")[:-1]  # cut inside the last character
    pieces = _stream(tokenizer, [], ids, [1] * len(ids))
    assert "".join(pieces) == tokenizer.decode(ids)
    assert "\ufffd" not in "".join(pieces[:-1])


@pytest.mark.skipif(not os.path.isfile(os.path.join(SMOLLM2, "tokenizer.json")),
                    reason="SmolLM2 not fetched (kestrel fetch-model)")
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_tokenizer_streams_like_one_shot_decode(text):
    _assert_streams_like_one_shot(Tokenizer(SMOLLM2), text, random.Random(1))


# ---------------------------------------------------------------- stop strings


def _feed_all(stops, pieces):
    m = StopStringMatcher(stops)
    out = []
    for piece in pieces:
        text, matched = m.feed(piece)
        out.append(text)
        if matched:
            return out, True
    out.append(m.flush())
    return out, False


def test_stop_string_spanning_pieces_never_streams_a_prefix():
    text = "The answer is 42. END of story"
    pieces = [text[i:i + 2] for i in range(0, len(text), 2)]
    out, matched = _feed_all(["END"], pieces)
    assert matched
    assert "".join(out) == text.split("END")[0]
    assert not any("E" in piece for piece in out)


def test_earliest_of_several_stop_strings_wins():
    out, matched = _feed_all(["story", "42"], ["The answer is 4", "2. story"])
    assert matched and "".join(out) == "The answer is "


def test_text_without_stop_string_is_emitted_whole():
    text = "no stop here, only ST and E and EN"
    out, matched = _feed_all(["STOP", "END!"], list(text))
    assert not matched and "".join(out) == text
