"""benchmarks/spec_serve.py's pure parts (benchmarks/spec_stats.py `side_summary`,
`serve_row`, `verdict`, `stats_delta`, `stats_sum`; benchmarks/spec_prompts.py
`hashed_token_ids`): the plain/spec rows against values worked out by hand from the
inputs, and hashed prompts against the worker's own n-gram lookup."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import spec_stats as st
from benchmarks.spec_prompts import SETS, hashed_token_ids
from shared.ngram import ngram_lookup


def _run(tok_s, ttft=10.0, tpot=2.0, errors=0):
    """A serve_stats.summarize-shaped result of one run."""
    return {"requests": 8, "errors": errors, "error_examples": ["boom"] if errors else [],
            "output_tok_per_s": tok_s, "ttft_ms": {"p50": ttft, "p99": None, "mean": None},
            "tpot_ms": {"p50": tpot, "p99": None, "mean": None}, "itl_ms": {}}


def test_row_ratio_is_the_median_of_back_to_back_pairs():
    plain = [_run(100.0, ttft=10), _run(90.0, ttft=30), _run(110.0, ttft=20)]
    spec = [_run(99.0, tpot=1.0), _run(80.0, tpot=3.0), _run(120.0, tpot=2.5)]
    row = st.serve_row(plain, spec, [], 0.97)
    # pairs 0.99, 0.889, 1.091 -> median 0.99; medians of the sides 100 and 99
    assert row["pair_ratios"] == [0.99, 0.889, 1.091]
    assert row["ratio"] == 0.99 and row["meets_0.97"] is True
    assert row["ratio_of_medians"] == 0.99
    assert row["plain"]["output_tok_per_s"] == 100.0 and row["plain"]["ttft_p50_ms"] == 20
    assert row["spec"]["tpot_p50_ms"] == 2.5 and row["spec"]["requests"] == 24
    assert row["acceptance"] is None


def test_row_below_the_threshold_or_without_a_ratio_does_not_meet_it():
    row = st.serve_row([_run(100.0), _run(100.0)], [_run(96.0), _run(95.0, errors=2)], [], 0.97)
    assert row["ratio"] == pytest.approx(0.955) and row["meets_0.97"] is False
    assert row["spec"]["errors"] == 2 and row["spec"]["error_examples"] == ["boom"]
    none = st.serve_row([_run(None)], [_run(50.0)], [], 0.97)
    assert none["ratio"] is None and none["meets_0.97"] is False


def test_row_acceptance_sums_the_spec_runs_counters():
    c = [{"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 15, "per_pos": [8, 5, 2, 0]},
         {"num_drafts": 10, "num_draft_tokens": 20, "num_accepted_tokens": 5, "per_pos": [5]}]
    acc = st.serve_row([_run(1.0)], [_run(1.0)], c, 0.97)["acceptance"]
    assert acc["mean_acceptance_length"] == pytest.approx(1 + 20 / 20)
    assert acc["draft_acceptance_rate"] == pytest.approx(20 / 60, abs=1e-3)
    assert acc["per_pos"] == [13, 5, 2, 0]


def test_verdict_covers_only_the_checked_levels_that_ran():
    ok = {"meets_0.97": True}
    bad = {"meets_0.97": False}
    rows = {1: {"copy": bad, "nocopy": bad}, 32: {"copy": ok, "nocopy": bad}, 256: {"copy": ok, "nocopy": ok}}
    v = st.verdict(rows, [32, 256], 0.97)
    assert v["levels"] == [32, 256] and v["meets"] is False and v["failing"] == ["32/nocopy"]
    assert st.verdict({256: rows[256]}, [32, 256], 0.97)["meets"] is True
    assert st.verdict({1: rows[1]}, [32, 256], 0.97)["meets"] is None


def test_engine_stats_deltas_and_sums():
    before = {"num_steps": 10, "num_generated_tokens": 100, "spec_decode_k_hist": [5, 1]}
    after = {"num_steps": 30, "num_generated_tokens": 180, "spec_decode_k_hist": [9, 1, 2], "other": 7}
    d = st.stats_delta(after, before, ("num_steps", "num_generated_tokens", "spec_decode_k_hist", "absent"))
    assert d == {"num_steps": 20, "num_generated_tokens": 80, "spec_decode_k_hist": [4, 0, 2]}
    s = st.stats_sum([d, {"num_steps": 20, "num_generated_tokens": 40, "spec_decode_k_hist": [1]}])
    assert s == {"num_steps": 40, "num_generated_tokens": 120, "spec_decode_k_hist": [5, 0, 2], "tokens_per_step": 3.0}


def test_hashed_ids_keep_a_texts_repeats_for_the_ngram_lookup():
    text = SETS["copy"][0]
    ids = hashed_token_ids(text, 151936)
    assert all(100 <= i < 30000 for i in ids)
    assert hashed_token_ids(text, 151936) == ids  # no per-process hash seed
    small = hashed_token_ids(text, 1000)
    assert all(100 <= i < 1000 for i in small)
    # a model that copies the code block up to a 4-gram found once in the prompt: the
    # worker's n-gram lookup drafts what follows it there
    start = ids.index(hashed_token_ids("def", 151936)[0])
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    end = next(m for m in range(start + 8, len(ids) - 4) if grams.count(tuple(ids[m - 4:m])) == 1)
    context = np.array(ids + ids[start:end], dtype=np.int64)
    assert ngram_lookup(context, 2, 4, 4) == ids[end:end + 4]
    with pytest.raises(ValueError):
        hashed_token_ids("x", 100)
