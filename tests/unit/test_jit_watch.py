"""The JIT-compile watch (services/worker/jit_watch.py), the engine's accounting of the
compiles a worker reports, and the attention warm-up's coverage of every launch variant
(kernels/attention_warmup.py); docs/ARCHITECTURE.md §6.5, §8.5."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from services.worker import jit_watch
from shared import protocol as P
from tests.unit.test_spec_policy import cpu_like
from tests.unit.test_spec_scheduler import pair, run, spec_json

triton = pytest.importorskip("triton")
ROOT = pathlib.Path(__file__).resolve().parents[2]


class FakeFn:
    """What Triton's hooks pass as `fn` (a JitFunctionInfo: module, name)."""

    module, name = "kernels.fake", "_fake_kernel"


def fire(hook_pre, hook_post, key):
    """Call the hooks as `JITFunction._do_compile` does around one compile."""
    kw = {"key": key, "repr": f"_fake_kernel[num_warps=4](n: i32, BLOCK: constexpr) {key}", "fn": FakeFn(),
          "compile": {"key": key, "constants": {("BLOCK",): 64}}, "is_manual_warmup": False,
          "already_compiled": False}
    assert not hook_pre(**kw)  # falsy: the compile goes on
    hook_post(**kw)


def test_compiles_before_ready_are_startup_and_after_are_counted_and_logged(monkeypatch, caplog):
    w = jit_watch.JitWatch()
    monkeypatch.setattr(jit_watch, "WATCH", w)
    pre, post = jit_watch.cache_hook(), jit_watch.post_compile_hook()
    fire(pre, post, "k1")
    w.note_capture("decode graph batch 8")  # at startup: not counted
    assert (w.startup_compiles, w.compiles, w.captures, w.take()) == (1, 0, 0, 0)
    w.arm()
    with caplog.at_level("WARNING", logger="kestrel.worker.jit"):
        for i in range(jit_watch.LOG_FIRST + 3):
            fire(pre, post, f"serve{i}")
    assert w.compiles == jit_watch.LOG_FIRST + 3
    logged = [r for r in caplog.records if "compiled" in r.getMessage()]
    assert len(logged) == jit_watch.LOG_FIRST  # the first ones only
    assert "kernels.fake._fake_kernel" in logged[0].getMessage() and "BLOCK" in logged[0].getMessage()
    w.note_capture("verify graph batch 64 k 4")
    assert w.captures == 1
    assert w.take() == jit_watch.LOG_FIRST + 4 and w.take() == 0  # since the last take
    assert w.stats()["startup_compiles"] == 1


def test_hooks_chain_to_hooks_already_set(monkeypatch):
    w = jit_watch.JitWatch()
    monkeypatch.setattr(jit_watch, "WATCH", w)
    seen = []

    def prev_pre(**kw):
        seen.append(("pre", kw["key"]))
        return False

    def prev_post(**kw):
        seen.append(("post", kw["key"]))

    fire(jit_watch.cache_hook(prev_pre), jit_watch.post_compile_hook(prev_post), "k")
    assert seen == [("pre", "k"), ("post", "k")] and w.startup_compiles == 1


def test_install_sets_this_tritons_hooks_around_the_ones_there(monkeypatch):
    rt = getattr(getattr(triton, "knobs", None), "runtime", None)
    if rt is None or not hasattr(rt, "jit_post_compile_hook"):
        pytest.skip("this Triton has no triton.knobs.runtime hooks")
    w = jit_watch.JitWatch()
    monkeypatch.setattr(jit_watch, "WATCH", w)
    monkeypatch.setattr(jit_watch, "_installed", None)
    seen = []
    monkeypatch.setattr(rt, "jit_post_compile_hook", lambda **kw: seen.append(kw["key"]))
    monkeypatch.setattr(rt, "jit_cache_hook", None)
    assert jit_watch.install() == "knobs"
    assert jit_watch.install() == "knobs"  # once per process
    w.arm()
    fire(rt.jit_cache_hook, rt.jit_post_compile_hook, "k")
    assert w.compiles == 1 and seen == ["k"]


def test_the_engine_counts_reported_compiles_and_keeps_those_steps_out_of_the_cost_curves():
    reqs = [P.AddRequest(f"r{i}", [3 + i, 5, 7], P.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         float(i)) for i in range(3)]
    core, worker = pair(spec_json(4, "adaptive"), 0.0, 1, step_cost=cpu_like, max_model_len=200, max_num_seqs=2)
    plain = worker.execute

    def compiling(plan):
        res = plain(plan)
        res.jit_compiles = 2
        return res

    worker.execute = compiling
    run(core, worker, reqs, False)
    s = core.stats()
    assert s["worker_jit_compiles"] == 2 * s["num_steps"] > 0
    assert s["spec_policy_inputs"]["cost_plain"] == [] and s["spec_policy_inputs"]["cost_spec"] == []
    core2, worker2 = pair(spec_json(4, "adaptive"), 0.0, 1, step_cost=cpu_like, max_model_len=200, max_num_seqs=2)
    run(core2, worker2, reqs, False)  # the same requests without compiles: their steps are timed
    assert core2.stats()["worker_jit_compiles"] == 0 and core2.stats()["spec_policy_inputs"]["cost_plain"]


@pytest.mark.parametrize("heads,kv_heads,head_dim,max_model_len,sms",
                         [(16, 8, 128, 2048, 132), (32, 8, 128, 4096, 132), (4, 2, 16, 512, 4), (8, 8, 256, 1000, 78)])
def test_the_warm_up_covers_every_variant_a_step_can_meet(heads, kv_heads, head_dim, max_model_len, sms):
    """Every (batch, q_len, max_seq_len) a step can have maps to a compiled variant (kernel,
    BLOCK_R, ONE_SPLIT, BLOCK_S) that one of the warm-up's launches has, by the dispatch's
    own functions (`fits_multi_query`, `multi_query_splits`)."""
    from kernels.attention_multi_query import fits_multi_query, multi_query_splits
    from kernels.attention_warmup import variants

    g = heads // kv_heads
    block_n = 64 if triton.next_power_of_2(head_dim) <= 128 else 32

    def key(q: int, splits: int) -> tuple:
        if q > 1 and not fits_multi_query(q, heads, kv_heads):
            return ("prefill",)
        kind = ("decode", 0) if q == 1 else ("mq", max(16, triton.next_power_of_2(q * g)))
        return (*kind, splits == 1, triton.next_power_of_2(splits))

    warmed = {key(q, s) for q, s in variants(heads, kv_heads, head_dim, max_model_len, 2048, sms)}
    need = set()
    for b in range(1, 257):
        for q in list(range(1, MAXQ + 1)) + [200]:
            for seq_len in range(1, max_model_len + 1, block_n // 2):
                need.add(key(q, multi_query_splits(b, kv_heads, seq_len, sms, block_n)))
    assert need <= warmed, sorted(need - warmed)


MAXQ = 70


def test_the_warm_up_runs_under_the_interpreter():
    """warm_up_attention launches each variant once on a small CPU cache (TRITON_INTERPRET=1,
    in a subprocess: this process may hold triton in compiled mode)."""
    code = ("import torch; from kernels.attention_warmup import variants, warm_up_attention\n"
            "k = torch.randn(16, 4, 2, 16); v = torch.randn(16, 4, 2, 16)\n"
            "n = warm_up_attention(k, v, 4, torch.float32, 256, 40)\n"
            "assert n == len(variants(4, 2, 16, 256, 40, 4)) > 5, n\nprint('OK', n)\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_a_real_compile_is_described_and_a_new_alignment_is_named(monkeypatch):
    """The watch describes a compile from Triton's own hook arguments (this machine's Triton,
    compiling for real is not possible without a GPU, so the hook is called with the
    `compile` dict `JITFunction._call_hook` builds: signature, constants and the attrs of
    `backend.parse_attr`), and a second compile that differs only in one pointer's
    alignment names that argument."""
    from triton.backends.compiler import BaseBackend
    w = jit_watch.JitWatch()
    monkeypatch.setattr(jit_watch, "WATCH", w)
    pre, post = jit_watch.cache_hook(), jit_watch.post_compile_hook()
    sig = {"x_ptr": "*bf16", "cu_ptr": "*i64", "n": "i32", "BLOCK": "constexpr"}

    def comp(cu_aligned: bool) -> dict:
        attrs = {(0,): BaseBackend.parse_attr("D"), (2,): BaseBackend.parse_attr("D")}
        if cu_aligned:
            attrs[(1,)] = BaseBackend.parse_attr("D")
        return {"key": str(cu_aligned), "signature": sig, "constants": {(3,): 64}, "configs": [attrs],
                "num_warps": 4, "num_stages": 2}

    for aligned, key in ((True, "a"), (False, "b")):
        kw = {"key": key, "repr": "x", "fn": FakeFn(), "compile": comp(aligned)}
        pre(**kw)
        post(**kw)
        w.arm()
    assert w.compiles == 1
    line = w.stats()["serving"][0]
    assert "cu_ptr: *i64 div16 -> *i64" in line, line
    assert "x_ptr" not in line and "BLOCK" not in line  # what did not change is not named


def test_the_warm_up_passes_metadata_of_the_eager_steps_dtype():
    """Triton keys a compile on each pointer's element type: the warm-up's cu_seqlens_q,
    seq_lens and block tables have the dtype `prepare_step` gives the GPU kernels (warmed
    with int32, every eager verify step compiled again while serving on the H200)."""
    import torch

    from kernels.attention_warmup import META_DTYPE
    from services.worker.step_inputs import prepare_step

    seqs = [P.ScheduledSeq("a", [1, 2, 3], 0, [0], True, P.SamplingParams()),
            P.ScheduledSeq("b", [4], 5, [1, 2], True, P.SamplingParams())]
    _, _, meta = prepare_step(seqs, 4, 64, torch.device("cpu"), kernels=True)
    assert meta.cu_seqlens_q.dtype == meta.seq_lens.dtype == meta.block_tables.dtype == META_DTYPE
