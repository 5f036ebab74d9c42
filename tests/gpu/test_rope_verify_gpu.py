"""The fused rotary + KV write + multi-query attention kernel of verify steps (`kernels.rope_verify`,
docs/ARCHITECTURE.md §5.5) on CUDA, Qwen3-0.6B's attention shape (16 query heads, 8 KV heads of
128, its q/k norm), block size 16:

- eager, as a verify graph launches it (max_q_len 1 + k, max_seq_len = max_model_len 4096): q_len
  1 .. 5 mixed, contexts off the 64-key tile, new tokens straddling a partition boundary, a
  padding seq (seq_len 0, slots -1: its rows 0); bf16 / fp16 / fp32 q over a cache in q's dtype,
  bf16 q over fp8_e4m3 and int8 caches; the split merge launched and in the kernel: the output
  against the two-launch references (`rotary_and_store_kv_ref`, `paged_attention_ref`) and the
  two-launch Triton path (`rotary_and_store_kv`, `paged_attention`), the written slots against
  the Triton rotary writer's, every other slot untouched;
- in a CUDA graph captured at long contexts and replayed at shorter ones: each replay equal to
  the eager call at the same inputs bit for bit, and to the reference;
- `VerifyAttention` (ROPE_VERIFY on) in the worker seams' dense fp64 check
  (tests/unit/test_worker_seams.run_backend_steps);
- a runner loaded with the switch on (warm-up and verify graphs capture the fused kernel): a
  graph-replayed and an eager verify step against the eager step with the switch off.
Tolerances as tests/gpu/test_mq_fused_gpu.py (fp32 2e-3: tf32 dots; bf16 2e-2; fp16 5e-3; a
quantized cache 2e-2); written rows: relative norm error 1e-2 against the Triton writer (both
round the rotation once in the dtype; a one-ulp difference of the norm can move a quantized
value one step). Skipped without CUDA or triton.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kernels import attention, decode_merge, kv_quant, rope_verify, rotary  # noqa: E402
from kernels import attention_triton as at  # noqa: E402
from tests.launch_count import LaunchCount  # noqa: E402

H, KVH, D, BS = 16, 8, 128, 16
MAX_MODEL_LEN = 4096
TOL = {torch.float32: 2e-3, torch.bfloat16: 2e-2, torch.float16: 5e-3}
QUANT_TOL = 2e-2
EPS = 1e-6


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite output"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _meta(st, ctx_qlens) -> None:
    """Write seq_lens, positions and slots of seqs (context, q_len) into st's tensors (context 0:
    a padding seq, seq_len 0, positions 0, slots -1)."""
    bt = st["bt"].cpu()
    sl, pos, slots = [], [], []
    for s, (c, n) in enumerate(ctx_qlens):
        sl.append(c + n if c else 0)
        for p in range(c, c + n):
            pos.append(p if c else 0)
            slots.append(int(bt[s, p // BS]) * BS + p % BS if c else -1)
    st["sl"].copy_(torch.tensor(sl, dtype=torch.int32))
    st["pos"].copy_(torch.tensor(pos, dtype=torch.long))
    st["slots"].copy_(torch.tensor(slots, dtype=torch.long))


def _step(ctx_qlens, dtype, kv="none", seed=0):
    """A verify step's inputs (dict): qkv [T, (H + 2 KVH) D], q/k norm weights, the angle table,
    cu_seqlens_q, seq_lens, block tables MAX_MODEL_LEN keys wide of distinct valid ids,
    positions, slots, caches (dtype; fp8_e4m3 with layer scales; int8 with per-token scales)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = len(ctx_qlens)
    width = MAX_MODEL_LEN // BS + 1
    nb = b * width + 2
    raw_k = torch.randn(nb, BS, KVH, D, device="cuda", generator=g)
    raw_v = torch.randn(nb, BS, KVH, D, device="cuda", generator=g)
    if kv == "fp8":
        ks, vs = torch.tensor(0.05, device="cuda"), torch.tensor(0.02, device="cuda")
        kc, vc = kv_quant.quantize_fp8(raw_k, ks), kv_quant.quantize_fp8(raw_v, vs)
    elif kv == "int8":
        (kc, ks), (vc, vs) = kv_quant.quantize_int8(raw_k), kv_quant.quantize_int8(raw_v)
        ks, vs = ks.contiguous(), vs.contiguous()
    else:
        ks = vs = None
        kc, vc = raw_k.to(dtype), raw_v.to(dtype)
    bt = torch.randperm(nb, device="cuda", generator=g)[:b * width].view(b, width).to(torch.int32).contiguous()
    q_lens = [n for _, n in ctx_qlens]
    t = sum(q_lens)
    st = {"qkv": torch.randn(t, (H + 2 * KVH) * D, device="cuda", generator=g).to(dtype),
          "qn": (1 + 0.2 * torch.randn(D, device="cuda", generator=g)).to(dtype),
          "kn": (1 + 0.2 * torch.randn(D, device="cuda", generator=g)).to(dtype),
          "table": rotary.rope_cos_sin(rotary.rope_inv_freq(D, 1e6), MAX_MODEL_LEN + 8).cuda(),
          "cu": torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda"),
          "sl": torch.zeros(b, dtype=torch.int32, device="cuda"), "bt": bt,
          "pos": torch.zeros(t, dtype=torch.long, device="cuda"),
          "slots": torch.zeros(t, dtype=torch.long, device="cuda"),
          "kc": kc, "vc": vc, "ks": ks, "vs": vs, "max_q_len": max(q_lens)}
    _meta(st, ctx_qlens)
    return st


def _qkv(st, buf=None):
    buf = st["qkv"].clone() if buf is None else buf
    return [x.view(buf.shape[0], -1, D) for x in buf.split([H * D, KVH * D, KVH * D], -1)]


def _caches(st):
    return [None if x is None else x.clone() for x in (st["kc"], st["vc"], st["ks"], st["vs"])]


def _fused(st, caches, cfg=None, buf=None):
    q, k, v = _qkv(st, buf)
    kc, vc, ks, vs = caches
    return rope_verify.rope_verify_triton(q, k, v, st["pos"], st["table"], kc, vc, st["slots"], st["cu"], st["sl"],
                                          st["bt"], D ** -0.5, st["max_q_len"], MAX_MODEL_LEN, st["qn"], st["kn"],
                                          EPS, cfg, ks, vs)


def _two_launch(st, caches):
    q, k, v = _qkv(st)
    kc, vc, ks, vs = caches
    rotary.rotary_and_store_kv(q, k, v, st["pos"], st["table"], kc, vc, st["slots"], st["qn"], st["kn"], EPS, ks, vs)
    return at.paged_attention_triton(q, kc, vc, st["cu"], st["sl"], st["bt"], D ** -0.5, st["max_q_len"],
                                     MAX_MODEL_LEN, None, ks, vs)


def _ref(st):
    """(reference output of the real rows in fp32, mask of those rows [T]): the rotary reference
    on the real rows (slots >= 0) into copies of the caches, then `paged_attention_ref`."""
    real = st["slots"] >= 0
    keep = (st["sl"] > 0).cpu()
    q, k, v = (x[real] for x in _qkv(st))
    kc, vc, ks, vs = _caches(st)
    rotary.rotary_and_store_kv_ref(q, k, v, st["pos"][real], st["table"], kc, vc, st["slots"][real], st["qn"],
                                   st["kn"], EPS, ks, vs)
    cu, sl = st["cu"].cpu(), st["sl"].cpu()
    q_lens = (cu[1:] - cu[:-1])[keep]
    cu_r = torch.tensor([0] + q_lens.cumsum(0).tolist(), dtype=torch.int32)
    quant = ks is not None
    ref = attention.paged_attention_ref(q.float(), kc if quant else kc.float(), vc if quant else vc.float(), cu_r,
                                        sl[keep], st["bt"][keep.cuda()], D ** -0.5, None, ks, vs)
    return ref, real


def _rows(st, c, s=None):
    """The written rows of cache c (dequantized with scales s where given), fp32 [n, KVH, D]."""
    sl = st["slots"][st["slots"] >= 0]
    if c.dtype == torch.int8:
        return kv_quant.dequantize_int8(c.view(-1, KVH, D)[sl], s.view(-1, KVH)[sl])
    if c.dtype == torch.float8_e4m3fn:
        return c.view(-1, KVH, D)[sl].float() * s
    return c.view(-1, KVH, D)[sl].float()


def _untouched(st, got, before) -> bool:
    rest = torch.ones(got[0].shape[0] * BS, dtype=torch.bool, device="cuda")
    rest[st["slots"][st["slots"] >= 0]] = False
    def flat(x):  # bytes of an fp8 cache (its dtype has no comparison kernels everywhere)
        return (x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x).reshape(rest.shape[0], -1)[rest]

    return all(torch.equal(flat(a), flat(b)) for a, b in zip(got, before) if a is not None and a.dim() >= 3)  # caches, int8 scales


# (context, q_len): q_len 1..5 mixed, contexts off the 64-key tile, one within one tile (40 + 3),
# a padding seq (0, 5), one whose new tokens straddle a 64-key partition boundary (126 + 5), a long one
MIXED = [(1000, 5), (700, 1), (40, 3), (0, 5), (2999, 2), (126, 5)]
# (q dtype, cache, merge in the kernel): each dtype and cache once, the fused merge on bf16 and fp8
CASES = [(torch.bfloat16, "none", False), (torch.bfloat16, "none", True), (torch.float16, "none", False),
         (torch.float32, "none", False), (torch.bfloat16, "fp8", False), (torch.bfloat16, "fp8", True),
         (torch.bfloat16, "int8", False)]


@pytest.mark.parametrize("dtype,kv,fused_merge", CASES)
@pytest.mark.parametrize("seqs", [MIXED, [(1023, 5)], [(17, 4)]])
def test_fused_verify_matches_the_two_launch_path_and_reference(monkeypatch, dtype, kv, seqs, fused_merge):
    if kv == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 conversions need compute capability 8.9+")
    st = _step(seqs, dtype, kv)
    ref, real = _ref(st)
    two = _caches(st)
    want = _two_launch(st, two)
    got = _caches(st)
    merges = LaunchCount(decode_merge._merge_kernel)
    monkeypatch.setattr(decode_merge, "_merge_kernel", merges)
    out = _fused(st, got, {"fused_merge": fused_merge, "splits": 3 if len(seqs) > 1 else None})
    torch.cuda.synchronize()
    tol = QUANT_TOL if kv != "none" else TOL[dtype]
    assert rel(out[real], ref) < tol
    assert rel(out[real], want[real]) < tol
    assert bool((out[~real] == 0).all())  # the padding seq's rows
    if fused_merge:
        assert merges.n == 0
    for i in (0, 1):  # K and V rows written, as the Triton rotary writer's
        assert rel(_rows(st, got[i], got[2 + i]), _rows(st, two[i], two[2 + i])) < 1e-2
    assert _untouched(st, got, _caches(st))


def test_fused_verify_graph_captured_at_long_contexts_replays_shorter_ones():
    """Captured with max_seq_len = max_model_len at long contexts (as `services.worker.verify_graphs`
    captures), replayed at shorter ones with new positions and slots (a padding seq among them):
    equal to the eager call at the same inputs bit for bit, and to the reference."""
    long = [(3000, 5), (2500, 3), (4000, 5), (1900, 1)]
    shorter = [[(1000, 5), (0, 3), (40, 5), (700, 1)], [(63, 5), (129, 3), (2047, 5), (0, 1)]]
    st = _step(long, torch.bfloat16, seed=1)
    caches = _caches(st)
    buf = st["qkv"].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _fused(st, caches, buf=buf)  # warm-up: compiles
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _fused(st, caches, buf=buf)
    for case in [long] + shorter:
        _meta(st, case)
        st["kc"], st["vc"] = caches[0], caches[1]  # the reference reads the cache as the graph left it
        out.fill_(float("nan"))  # a row the replay leaves unwritten shows
        buf.copy_(st["qkv"])
        graph.replay()
        torch.cuda.synchronize()
        eager = _fused(st, caches)
        ref, real = _ref(st)
        assert torch.equal(out, eager)
        assert rel(out[real], ref) < TOL[torch.bfloat16]
        assert bool((out[~real] == 0).all())


@pytest.mark.parametrize("qk_norm", [False, True])
def test_verify_backend_equals_dense_attention_with_rope(monkeypatch, qk_norm):
    from services.worker.layers.attention import VerifyAttention
    from tests.unit.test_worker_seams import run_backend_steps

    monkeypatch.setattr(rope_verify, "ROPE_VERIFY", True)
    run_backend_steps(VerifyAttention, True, qk_norm, device="cuda", tol=5e-3)


def test_runner_verify_steps_with_the_switch_on_match_the_switch_off_through_graphs_and_eager(tmp_path, monkeypatch):
    """A 4-layer Qwen3-0.6B-shaped runner (dummy fp32 weights, k = 3, verify graphs captured at load)
    loaded with ROPE_VERIFY on: its warm-up and graph captures take the fused kernel; a verify step
    replayed from a graph and the same step run eagerly (every layer through `rope_verify_triton`)
    give the logits of the eager step with the switch off (the rotary kernel, then the multi-query
    kernel), to fp32 rounding (tf32 dots in both)."""
    import gc
    import json

    from tests.gpu.test_verify_graphs_gpu import K, ROOT, _prompts, _runner, _tables, _verify_plan
    from tests.runner_driver import step_logits

    cfg = json.loads((ROOT / "benchmarks/configs/qwen3-0.6b.json").read_text())
    cfg["num_hidden_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    calls = {"n": 0}
    real = rope_verify.rope_verify_triton

    def counting(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(rope_verify, "ROPE_VERIFY", True)  # before the load: warm-up and captures take it
    monkeypatch.setattr(rope_verify, "rope_verify_triton", counting)
    r = _runner(tmp_path, "float32", 0.25)
    try:
        assert calls["n"] > 0 and r.verify_graphs is not None and r.verify_graphs.failed == []
        prompts, tables = _prompts((5, 100, 17)), _tables(3, 400)
        from shared.protocol import SamplingParams, ScheduledSeq, StepPlan
        greedy = SamplingParams(temperature=0.0)
        last = r.execute(StepPlan(0, [ScheduledSeq(f"s{i}", p, 0, t, True, greedy, 0)
                                      for i, (p, t) in enumerate(zip(prompts, tables))])).sampled_token_ids
        vg = r.verify_graphs
        before = vg.replays
        graph = step_logits(r, _verify_plan(1, prompts, tables, last, K, "s")).clone()
        assert vg.replays == before + 1, "the verify step did not replay a graph"
        r.verify_graphs = None
        try:
            calls["n"] = 0
            eager_on = step_logits(r, _verify_plan(2, prompts, tables, last, K, "s")).clone()
            assert calls["n"] >= 4, "not every layer took the fused kernel"
            n_on = calls["n"]
            monkeypatch.setattr(rope_verify, "ROPE_VERIFY", False)
            eager_off = step_logits(r, _verify_plan(3, prompts, tables, last, K, "s")).clone()
            assert calls["n"] == n_on  # off: no fused launch
        finally:
            r.verify_graphs = vg
        torch.testing.assert_close(eager_on, eager_off, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(graph, eager_off, atol=2e-3, rtol=2e-3)
    finally:
        del r
        gc.collect()
        torch.cuda.empty_cache()
