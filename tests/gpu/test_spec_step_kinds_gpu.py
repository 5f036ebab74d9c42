"""The e2e benchmark's step kinds and settled replay reference on CUDA
(benchmarks/spec_step_kinds.py, benchmarks/spec_replay.py, docs/ARCHITECTURE.md §5.5):
dummy weights of Qwen3-0.6B's shape (4 layers), bf16, the replay drafter at k = 3 through the
engine core (fixed policy). A plain run is one prefill and decode-graph steps; a speculative
run's verify steps replay verify graphs, one a verified proposal; the reference settled on
the speculative run's own output is reproduced by a timed run with no off-track proposal.
Skipped without CUDA; the CPU twins are in tests/unit/test_spec_bench_replay.py."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from benchmarks.common import load_runner, new_core, run_core  # noqa: E402
from benchmarks.spec_replay import ReplayProposer, registered, settle_reference, without_proposer  # noqa: E402
from benchmarks.spec_stats import spec_counters_from_stats  # noqa: E402
from benchmarks.spec_step_kinds import StepKindTimer  # noqa: E402
from shared.protocol import SamplingParams  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
N = 48
SPEC = json.dumps({"method": "draft_model", "num_speculative_tokens": 3, "policy": "fixed"})


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    cfg = json.loads((ROOT / "benchmarks/configs/qwen3-0.6b.json").read_text())
    cfg["num_hidden_layers"] = 4
    d = tmp_path_factory.mktemp("qwen3kinds")
    (d / "config.json").write_text(json.dumps(cfg))
    with registered():
        r, _ = load_runner({"model": str(d), "load_format": "dummy", "device": "cuda", "dtype": "bfloat16",
                            "max_num_seqs": 8, "max_model_len": 1024, "gpu_memory_utilization": 0.3,
                            "enable_prefix_caching": False, "speculative_config": SPEC})
    assert isinstance(r.proposer, ReplayProposer) and r.verify_graphs is not None
    yield r
    del r
    torch.cuda.empty_cache()


def _run(r, prompt, prefix, spec=None, timer=None):
    core = new_core(r, 4, 1024, 1, {"speculative_config": spec, "load_format": "dummy"} if spec else None)
    toks: dict[str, list[int]] = {}
    sp = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    _, steps, _, _ = run_core(core, timer or r, [(prompt, sp)], prefix, toks)
    return toks[prefix + "0"], steps, core.stats()


def test_kinds_and_a_settled_reference(runner):
    r = runner
    proposer = r.proposer
    prompt = torch.randint(3, 10000, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    with without_proposer(r):
        ref, _, _ = _run(r, prompt, "pw_")
        timer = StepKindTimer(r)
        with timer:
            _run(r, prompt, "pk_", timer=timer)
    plain = timer.summary()
    assert plain["prefill"]["steps"] == 1 and plain["decode_graph"]["steps"] == N - 1
    row = plain["decode_graph"]
    assert 0 < row["device_ms_median"] <= row["wall_ms_median"]

    def spec_tokens(tokens, prefix):
        proposer.refs, proposer.accept, proposer.seed = {prefix + "0": tokens}, 0.7, 1
        return _run(r, prompt, prefix, SPEC)[0]

    rounds = iter(range(100))
    settled, used, ok = settle_reference(ref, lambda t: spec_tokens(t, f"sr{next(rounds)}_"), 8)
    assert ok, f"the reference did not settle in {used} runs"
    proposer.refs, proposer.off_track = {"sk_0": settled}, 0
    timer = StepKindTimer(r)
    replays = r.verify_graphs.replays
    with timer:
        toks, steps, stats = _run(r, prompt, "sk_", SPEC, timer)
    assert toks == settled and proposer.off_track == 0
    kinds = timer.summary()
    c = spec_counters_from_stats(stats)
    assert c is not None and kinds["verify_graph"]["steps"] == c["num_drafts"] == r.verify_graphs.replays - replays
    assert kinds["total"]["steps"] == steps
    v = kinds["verify_graph"]
    assert 0 < v["device_ms_median"] <= v["wall_ms_median"]
    assert v["before_forward_ms_median"] + v["after_last_read_ms_median"] < v["wall_ms_median"]
