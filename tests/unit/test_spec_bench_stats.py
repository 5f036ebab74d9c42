"""benchmarks/spec_stats.py: the spec_decode counters read from Prometheus text (as
prometheus_client writes it) and from the engine's stats (as `SpecPolicy.stats` names them),
acceptance length, the batch-1 speed summary and the output comparison."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from benchmarks import spec_stats as st
from services.engine.spec_policy import SpecPolicy
from shared.spec_config import SpeculativeConfig


class _Spec:
    """A collector exporting spec_decode counters the way the frontend's collector exports
    engine counters (metrics.py: CounterMetricFamily, model_name label)."""

    def __init__(self, values: dict[str, dict[str, float]], per_pos: dict[str, list[float]]):
        self.values, self.per_pos = values, per_pos

    def collect(self):
        for name, by_model in self.values.items():
            c = CounterMetricFamily("kestrel:" + name, "doc", labels=["model_name"])
            for model, v in by_model.items():
                c.add_metric([model], v)
            yield c
        c = CounterMetricFamily("kestrel:" + st.PER_POS, "doc", labels=["model_name", "position"])
        for model, vs in self.per_pos.items():
            for i, v in enumerate(vs):
                c.add_metric([model, str(i)], v)
        yield c


def test_counters_are_read_from_prometheus_text_and_summed_over_labels():
    reg = CollectorRegistry()
    reg.register(_Spec({"spec_decode_num_drafts": {"a": 10, "b": 5},
                        "spec_decode_num_draft_tokens": {"a": 40, "b": 20},
                        "spec_decode_num_accepted_tokens": {"a": 25, "b": 2}},
                       {"a": [9, 8, 5, 3], "b": [1, 1]}))
    text = generate_latest(reg).decode() + 'kestrel:num_requests_running{model_name="a"} 1.0\n'
    assert "_total" in text  # prometheus_client names counters ..._total
    c = st.parse_spec_metrics(text)
    assert c == {"num_drafts": 15, "num_draft_tokens": 60, "num_accepted_tokens": 27, "per_pos": [10, 9, 5, 3]}


def test_text_without_spec_counters_gives_none():
    assert st.parse_spec_metrics('# HELP x y\nkestrel:engine_up{model_name="m"} 1.0\n') is None
    assert st.parse_spec_metrics("") is None


def test_counters_from_the_engine_stats_use_the_policys_names():
    pol = SpecPolicy(SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}'), True)
    pol.num_drafts, pol.num_draft_tokens, pol.num_accepted_tokens = 7, 19, 11
    pol.accepted_per_pos = [6, 4, 1]
    c = st.spec_counters_from_stats(pol.stats())
    assert c == {"num_drafts": 7, "num_draft_tokens": 19, "num_accepted_tokens": 11, "per_pos": [6, 4, 1]}
    assert st.spec_counters_from_stats({"num_steps": 3}) is None


def test_deltas_sums_and_acceptance_length():
    before = {"num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": 3, "per_pos": [2, 1]}
    after = {"num_drafts": 6, "num_draft_tokens": 24, "num_accepted_tokens": 12, "per_pos": [6, 4, 1, 0]}
    d = st.counters_delta(after, before)
    assert d == {"num_drafts": 4, "num_draft_tokens": 16, "num_accepted_tokens": 9, "per_pos": [4, 3, 1, 0]}
    total = st.counters_sum([d, {"num_drafts": 1, "num_draft_tokens": 4, "num_accepted_tokens": 3, "per_pos": [1, 1]}])
    assert total == {"num_drafts": 5, "num_draft_tokens": 20, "num_accepted_tokens": 12, "per_pos": [5, 4, 1, 0]}
    s = st.acceptance_summary(total)
    assert s["mean_acceptance_length"] == pytest.approx(1 + 12 / 5, abs=1e-3)
    assert s["draft_acceptance_rate"] == pytest.approx(12 / 20, abs=1e-3)
    assert st.acceptance_length(0, 0) is None
    assert st.acceptance_summary(st.counters_sum([]))["mean_acceptance_length"] is None


def test_speed_of_batch_one_requests():
    recs = [st.Timed(sent=0.0, first=0.5, end=2.5, tokens=11), st.Timed(sent=10.0, first=10.2, end=11.2, tokens=6),
            st.Timed(sent=20.0, first=20.1, end=20.1, tokens=1)]
    s = st.speed(recs)
    assert s["tokens"] == 18 and s["seconds"] == pytest.approx(2.5 + 1.2 + 0.1)
    assert s["output_tok_per_s"] == pytest.approx(18 / 3.8, abs=0.01)
    assert s["decode_tok_per_s"] == pytest.approx((10 + 5) / (2.0 + 1.0), abs=0.01)  # the 1-token request left out
    assert s["ttft_ms_mean"] == pytest.approx(1e3 * (0.5 + 0.2 + 0.1) / 3, abs=0.1)
    with pytest.raises(ValueError):
        st.speed([])


def test_pair_ratios_and_ratio():
    off = [st.Timed(0, 0, 4.0, 10), st.Timed(0, 0, 3.0, 10), st.Timed(0, 0, 1.0, 10)]
    on = [st.Timed(0, 0, 2.0, 10), st.Timed(0, 0, 3.0, 10), st.Timed(0, 0, 0.5, 10)]
    assert st.pair_ratios(off, on) == {"median": 2.0, "min": 1.0, "max": 2.0}
    assert st.pair_ratios([], []) == {"median": None, "min": None, "max": None}
    assert st.ratio(3.0, 2.0) == 1.5 and st.ratio(None, 2.0) is None and st.ratio(1.0, 0.0) is None


@pytest.mark.parametrize("a,b,want", [("abc", "abc", None), ("abcd", "abxd", 2), ("abc", "abcdef", 3),
                                      ("", "x", 0), ("xyz", "ayz", 0)])
def test_first_mismatch(a, b, want):
    assert st.first_mismatch(a, b) == want
    assert st.first_mismatch(b, a) == want
