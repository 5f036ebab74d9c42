"""benchmarks/serve_stats.py (the serving benchmark's statistics) against numbers worked out
by hand, and the synthetic tokenizer of config-only benchmark folders against the frontend's
own tokenizer loader."""

from __future__ import annotations

import pytest

from benchmarks.serve_stats import RequestRecord, itl, percentile, summarize, tpot, ttft


def test_percentile_interpolates_between_closest_ranks():
    # rank = q/100 * (n-1): [1,2,3,4] p50 -> rank 1.5 -> 2.5; p99 -> rank 2.97 -> 3.97
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([4, 1, 3, 2], 99) == pytest.approx(3.97)
    assert percentile([10, 20], 25) == pytest.approx(12.5)
    assert percentile([7.0], 99) == 7.0
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3


def test_percentile_rejects_no_values_and_bad_q():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_tpot_counts_tokens_from_usage_not_chunks():
    # 4 chunks, 5 tokens (one chunk carried 2): TPOT = (1.1 - 0.5) / (5 - 1) = 0.15 s
    rec = RequestRecord(sent=0.0, end=1.2, chunks=[0.5, 0.6, 0.8, 1.1], output_tokens=5)
    assert ttft(rec) == pytest.approx(0.5)
    assert tpot(rec) == pytest.approx(0.15)
    assert itl(rec) == pytest.approx([0.1, 0.2, 0.3])


def test_tpot_is_undefined_for_one_output_token():
    rec = RequestRecord(sent=1.0, end=2.0, chunks=[1.25], output_tokens=1)
    assert ttft(rec) == pytest.approx(0.25)
    assert tpot(rec) is None and itl(rec) == []


def test_summary_of_a_level_skips_failed_requests_but_counts_their_time():
    a = RequestRecord(sent=10.0, end=11.0, chunks=[10.2, 10.4, 10.8], output_tokens=3)
    b = RequestRecord(sent=10.5, end=12.0, chunks=[10.6, 11.0, 11.9], output_tokens=4)
    bad = RequestRecord(sent=9.0, end=9.5, error="HTTP 503: busy")
    s = summarize([a, b, bad])
    assert (s["requests"], s["errors"], s["error_examples"]) == (3, 1, ["HTTP 503: busy"])
    # wall: first sent 9.0 (the failed one) -> last end 12.0 = 3 s; 3 + 4 tokens
    assert s["output_tokens"] == 7 and s["seconds"] == pytest.approx(3.0)
    assert s["output_tok_per_s"] == pytest.approx(7 / 3, abs=0.05)
    # TTFT 200 ms and 100 ms; TPOT (0.6/2 =) 300 ms and (1.3/3 =) 433.33 ms
    assert s["ttft_ms"]["p50"] == pytest.approx(150.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(100 + 0.99 * 100)
    assert s["tpot_ms"]["mean"] == pytest.approx((300 + 1300 / 3) / 2, abs=1e-3)
    # ITL pooled: 200, 400, 400, 900 ms -> p50 = 400, p99 = rank 2.97 -> 400 + 0.97 * 500
    assert s["itl_ms"]["p50"] == pytest.approx(400.0)
    assert s["itl_ms"]["p99"] == pytest.approx(885.0)
    assert s["itl_ms"]["mean"] == pytest.approx(475.0)


def test_summary_of_only_failures_has_no_latencies():
    s = summarize([RequestRecord(sent=0.0, end=1.0, error="x")])
    assert s["output_tokens"] == 0 and s["ttft_ms"] == {"p50": None, "p99": None, "mean": None}


def test_synthetic_tokenizer_decodes_every_id_to_text(tmp_path):
    from benchmarks.common import write_synthetic_tokenizer
    from services.frontend.detokenizer import IncrementalDetokenizer
    from services.frontend.tokenizer import Tokenizer

    write_synthetic_tokenizer(str(tmp_path), 1000)
    tok = Tokenizer(str(tmp_path))
    assert tok.vocab_size == 1000
    assert tok.decode([0, 999, 5]) == "t0 t999 t5"
    detok = IncrementalDetokenizer(tok, [1, 2, 3])
    assert [detok.add([i]) for i in (7, 8, 9)] == [" t7", " t8", " t9"]
