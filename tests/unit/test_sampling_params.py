"""The sampler's logits processors and logprobs, each against a direct formula.

References are written independently of `kernels.sampling`: per-row Python/numpy loops of
the documented formulas (OpenAI's presence/frequency penalty, CTRL's repetition penalty,
xgrammar's bitmask layout) on random logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.sampling import apply_penalties_ref, token_logprobs_ref, unpack_bitmask
from services.worker.sampler import Sampler
from shared.protocol import SamplingParams, ScheduledSeq

VOCAB = 50
EOS = [7, 11]


def _seq(sp: SamplingParams, out_index: int = 0, penalty_ids=(), n_prompt=0, mask=None) -> ScheduledSeq:
    return ScheduledSeq("r", [1], 0, [0], True, sp, out_index, list(penalty_ids), n_prompt, mask)


def _np_penalties(logits, prompt, output, presence, frequency, repetition):
    out = logits.copy()
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        c = output.count(t)
        out[t] -= frequency * c + presence
    return out


def test_penalties_match_openai_and_ctrl_formulas():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (3, VOCAB)).astype(np.float32)
    cases = [([1, 2, 3, 3], [3, 4, 4, 4, 9], 0.5, 0.3, 1.3),
             ([5], [], 1.0, 1.0, 2.0),
             ([0, 0, 49], [49, 0, 17, 17], -0.7, 0.2, 0.8)]
    width = max(len(p) + len(o) for p, o, *_ in cases)
    ids = np.full((3, width), VOCAB, dtype=np.int64)
    is_out = np.zeros((3, width), dtype=bool)
    for i, (p, o, *_) in enumerate(cases):
        ids[i, :len(p) + len(o)] = p + o
        is_out[i, len(p):len(p) + len(o)] = True
    got = apply_penalties_ref(torch.from_numpy(logits), torch.from_numpy(ids), torch.from_numpy(is_out),
                              torch.tensor([c[2] for c in cases]), torch.tensor([c[3] for c in cases]),
                              torch.tensor([c[4] for c in cases]))
    for i, (p, o, pr, fr, rep) in enumerate(cases):
        np.testing.assert_allclose(got[i].numpy(), _np_penalties(logits[i], p, o, pr, fr, rep), rtol=1e-6, atol=1e-6)


def test_sampler_applies_penalties_only_to_rows_that_ask():
    torch.manual_seed(1)
    logits = torch.randn(2, VOCAB) * 3
    prompt, out = [2, 3], [3, 5, 5]
    sp = SamplingParams(temperature=0.0, presence_penalty=0.4, frequency_penalty=0.25, repetition_penalty=1.5)
    seqs = [_seq(sp, 3, prompt + out, 2), _seq(SamplingParams(temperature=0.0))]
    got = Sampler(0, EOS).process(logits, seqs)
    want = _np_penalties(logits[0].numpy(), prompt, out, 0.4, 0.25, 1.5)
    np.testing.assert_allclose(got[0].numpy(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1], logits[1])


def test_logit_bias_adds_and_plus_100_forces_the_token():
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB)
    bias = {3: 1.5, 40: -2.0}
    got = Sampler(0, EOS).process(logits, [_seq(SamplingParams(logit_bias=bias))] * 4)
    want = logits.clone()
    want[:, 3] += 1.5
    want[:, 40] -= 2.0
    assert torch.allclose(got, want)
    sp = SamplingParams(temperature=1.0, seed=5, logit_bias={13: 100.0})
    toks = Sampler(0, EOS).sample(torch.randn(8, VOCAB) * 2, [_seq(sp, i) for i in range(8)]).token_ids
    assert toks == [13] * 8


def test_min_tokens_never_emits_eos_or_stop_ids_early():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS[0]] = 50.0  # EOS would win every draw
    logits[0, 20] = 49.0  # then the stop token id
    sp = SamplingParams(temperature=1.0, seed=3, min_tokens=5, stop_token_ids=[20])
    s = Sampler(0, EOS)
    for i in range(5):
        tok = s.sample(logits, [_seq(sp, i)]).token_ids[0]
        assert tok not in EOS and tok != 20
    assert s.sample(logits, [_seq(sp, 5)]).token_ids[0] == EOS[0]
    greedy = SamplingParams(temperature=0.0, min_tokens=2)
    assert s.sample(logits, [_seq(greedy, 0)]).token_ids[0] == 20
    # ignore_eos: EOS is not a stop, so min_tokens leaves it alone
    free = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert s.sample(logits, [_seq(free, 0)]).token_ids[0] == EOS[0]


def _pack(allowed: np.ndarray) -> bytes:
    """Pack a bool [vocab] array the way xgrammar does: bit t%32 of int32 word t//32."""
    words = np.zeros((len(allowed) + 31) // 32, dtype=np.uint32)
    for t in np.flatnonzero(allowed):
        words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return words.astype("<u4").tobytes()


def test_bitmask_allows_exactly_the_set_bits():
    rng = np.random.default_rng(4)
    allowed = rng.random(VOCAB) < 0.3
    allowed[33] = allowed[31] = True  # bit 31 is the int32 sign bit
    words = torch.from_numpy(np.frombuffer(_pack(allowed), dtype="<i4").copy())[None]
    assert np.array_equal(unpack_bitmask(words, VOCAB)[0].numpy(), allowed)
    sp = SamplingParams(temperature=1.0, seed=9)
    s = Sampler(0, EOS)
    logits = torch.randn(1, VOCAB) * 3
    out = s.process(logits, [_seq(sp, mask=_pack(allowed))])
    assert torch.isneginf(out[0, ~torch.from_numpy(allowed)]).all()
    assert torch.equal(out[0, torch.from_numpy(allowed)], logits[0, torch.from_numpy(allowed)])
    for i in range(30):
        assert allowed[s.sample(logits, [_seq(sp, i, mask=_pack(allowed))]).token_ids[0]]


def test_logprobs_are_raw_log_softmax_with_rank_and_top_k():
    torch.manual_seed(5)
    logits = torch.randn(3, VOCAB) * 2
    sp = SamplingParams(temperature=0.8, seed=1, logprobs=4, presence_penalty=1.0, logit_bias={0: 5.0})
    seqs = [_seq(sp, 0, [1, 2], 1), _seq(SamplingParams(temperature=0.0)), _seq(sp, 1, [3], 1)]
    out = Sampler(0, EOS).sample(logits, seqs)
    assert out.logprobs[1] is None
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i in (0, 2):
        lp = out.logprobs[i]
        tok = out.token_ids[i]
        assert lp.token_id == tok
        assert abs(lp.logprob - ref[i, tok].item()) < 1e-5
        assert lp.rank == int((ref[i] > ref[i, tok]).sum()) + 1
        order = torch.argsort(ref[i], descending=True)[:4].tolist()
        assert lp.top_ids == order
        assert np.allclose(lp.top_logprobs, ref[i, order].numpy(), atol=1e-5)
    chosen, rank, vals, ids = token_logprobs_ref(ref.float(), ref.argmax(-1), 0)
    assert rank.tolist() == [1, 1, 1] and vals.shape == (3, 0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_seeded_sampling_with_penalties_is_reproducible(temperature):
    sp = SamplingParams(temperature=temperature, seed=1234, top_p=0.9, frequency_penalty=0.5,
                        repetition_penalty=1.2, logit_bias={4: 2.0})

    def run():
        torch.manual_seed(7)  # same logits each run; the draws must not depend on global RNG
        base = torch.randn(VOCAB) * 2
        toks = []
        s = Sampler(0, EOS)
        for i in range(20):
            torch.manual_seed(1000 + i)  # perturb global RNG state: must not matter
            t = s.sample(base[None].clone(), [_seq(sp, i, [1, 2] + toks, 2)]).token_ids[0]
            toks.append(t)
        return toks

    a, b = run(), run()
    assert a == b
    assert len(set(a)) > 1  # the penalties push away from repeats
