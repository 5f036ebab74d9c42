"""The multi-query (verify-step) attention kernel with its split merge in the kernel
(`kernels.attention_multi_query`, MQ_DEFAULTS "fused_merge"; docs/ARCHITECTURE.md §6.4) on CUDA,
Qwen3-0.6B's attention shape (16 query heads, 8 KV heads of 128), block size 16:

- eager, as a verify graph launches it (max_q_len 1 + k, max_seq_len = max_model_len 4096):
  q_len 1 .. 5 mixed in a batch, contexts off the 64-key tile, one of one tile (one live
  split, stored directly), a padding seq (seq_len 0: its rows 0); bf16 / fp16 / fp32 q and an
  fp8_e4m3 cache against `paged_attention_ref`, against the merge launch's output, no
  `_merge_kernel` launch, three runs bit-identical (the merge sums the live splits in split
  order whichever program arrives last), the counters back at 0;
- in a CUDA graph captured at long contexts and replayed at shorter ones (the grid and split
  count fixed at capture from max_seq_len; each seq sizes its partitions from its own length):
  every replay equals the eager call at the same inputs bit for bit and the reference, with
  the merge in the kernel and by the launch.
Tolerances as tests/gpu/test_kernels_gpu.py (fp32 2e-3: tf32 dots; bf16 2e-2; fp16 5e-3), the
fp8 cache's as tests/gpu/test_fp8_kv_gpu.py (2e-2 for bf16 q). Skipped without CUDA or triton.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kernels import attention, decode_merge, device_info, kv_quant  # noqa: E402
from kernels import attention_triton as at  # noqa: E402
from tests.launch_count import LaunchCount  # noqa: E402

H, KVH, D, BS = 16, 8, 128, 16
MAX_MODEL_LEN = 4096
TOL = {torch.float32: 2e-3, torch.bfloat16: 2e-2, torch.float16: 5e-3}
FP8_TOL = 2e-2
KS, VS = 0.05, 0.02


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite output"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _counters_zero(fused: bool = True) -> bool:
    """Whether every split-K counter is back at 0 (and, fused, the merge's pool exists)."""
    torch.cuda.synchronize()
    pools = [key[1] for key in device_info.TILE_COUNTERS]
    return (not fused or decode_merge.MERGE_POOL in pools) and \
        all(bool((c == 0).all()) for c in device_info.TILE_COUNTERS.values())


def _step(ctx_qlens, dtype, fp8=False, seed=0):
    """Inputs of a verify step: seqs of (cached context, q_len) (q_len > 0 with context 0 and
    q_len 5: a padding seq, seq_len 0); block tables MAX_MODEL_LEN keys wide of distinct valid
    block ids (a graph's tables); caches in dtype, or fp8_e4m3 with scales. Returns a dict."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = len(ctx_qlens)
    width = MAX_MODEL_LEN // BS + 1
    nb = b * width + 2
    if fp8:
        ks, vs = torch.tensor(KS, device="cuda"), torch.tensor(VS, device="cuda")
        kc = kv_quant.quantize_fp8(torch.randn(nb, BS, KVH, D, device="cuda", generator=g), ks)
        vc = kv_quant.quantize_fp8(torch.randn(nb, BS, KVH, D, device="cuda", generator=g), vs)
    else:
        ks = vs = None
        kc = torch.randn(nb, BS, KVH, D, device="cuda", generator=g).to(dtype)
        vc = torch.randn(nb, BS, KVH, D, device="cuda", generator=g).to(dtype)
    perm = torch.randperm(nb, device="cuda", generator=g)[:b * width]
    bt = perm.view(b, width).to(torch.int32).contiguous()
    q_lens = [n for _, n in ctx_qlens]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    sl = torch.tensor([c + n if c else 0 for c, n in ctx_qlens], dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu[-1]), H, D, device="cuda", generator=g).to(dtype)
    return {"q": q, "kc": kc, "vc": vc, "cu": cu, "sl": sl, "bt": bt, "ks": ks, "vs": vs,
            "max_q_len": max(q_lens)}


def _ref(st) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference over the seqs of seq_len > 0 in fp32, mask of their rows [T])."""
    cu, sl = st["cu"].cpu(), st["sl"].cpu()
    real = torch.zeros(int(cu[-1]), dtype=torch.bool)
    for s in range(len(sl)):
        if sl[s] > 0:
            real[int(cu[s]):int(cu[s + 1])] = True
    keep = sl > 0
    q_lens = (cu[1:] - cu[:-1])[keep]
    cu_r = torch.tensor([0] + q_lens.cumsum(0).tolist(), dtype=torch.int32)
    kc, vc = st["kc"], st["vc"]
    if st["ks"] is None:
        kc, vc = kc.float(), vc.float()
    ref = attention.paged_attention_ref(st["q"][real.cuda()].float(), kc, vc, cu_r, sl[keep], st["bt"][keep.cuda()],
                                        D ** -0.5, None, st["ks"], st["vs"])
    return ref, real.cuda()


def _run(st, fused: bool) -> torch.Tensor:
    return at.paged_attention_triton(st["q"], st["kc"], st["vc"], st["cu"], st["sl"], st["bt"], D ** -0.5,
                                     st["max_q_len"], MAX_MODEL_LEN, {"fused_merge": fused}, st["ks"], st["vs"])


# (context, q_len): mixed q_len 1..5, contexts off the 64-key tile, one within one tile (40 + 3),
# a padding seq (0, 5), a long one
MIXED = [(1000, 5), (700, 1), (40, 3), (0, 5), (2999, 2), (129, 4)]


@pytest.mark.parametrize("dtype,fp8", [(torch.bfloat16, False), (torch.float16, False), (torch.float32, False),
                                       (torch.bfloat16, True)])
@pytest.mark.parametrize("seqs", [MIXED, [(1023, 5)], [(17, 5)]])
def test_fused_merge_matches_reference_and_the_merge_launch(monkeypatch, dtype, fp8, seqs):
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 conversions need compute capability 8.9+")
    st = _step(seqs, dtype, fp8)
    ref, real = _ref(st)
    launch = _run(st, False)
    merges = LaunchCount(decode_merge._merge_kernel)
    monkeypatch.setattr(decode_merge, "_merge_kernel", merges)
    outs = [_run(st, True) for _ in range(3)]
    torch.cuda.synchronize()
    assert merges.n == 0  # merged in the kernel
    tol = FP8_TOL if fp8 else TOL[dtype]
    assert rel(outs[0][real], ref) < tol
    assert rel(outs[0][real], launch[real]) < tol
    assert all(torch.equal(o, outs[0]) for o in outs[1:])  # deterministic
    assert bool((outs[0][~real] == 0).all())  # the padding seq's rows
    assert _counters_zero()


@pytest.mark.parametrize("fused", [True, False])
def test_graph_captured_at_long_contexts_replays_shorter_ones(monkeypatch, fused):
    """Captured with max_seq_len = max_model_len at long contexts (as `services.worker.verify_graphs`
    captures), replayed at shorter ones (one a single tile, a padding seq among them): equal to
    the eager call at the same inputs bit for bit, and to the reference."""
    long = [(3000, 5), (2500, 3), (4000, 5), (1900, 1)]
    shorter = [[(1000, 5), (0, 3), (40, 5), (700, 1)], [(63, 5), (129, 3), (2047, 5), (0, 1)]]
    st = _step(long, torch.bfloat16, seed=1)
    merges = LaunchCount(decode_merge._merge_kernel)
    monkeypatch.setattr(decode_merge, "_merge_kernel", merges)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _run(st, fused)  # warm-up: compiles, allocates the counters outside capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert merges.n == (0 if fused else 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(st, fused)
    assert merges.n == (0 if fused else 2)  # the captured step has no merge launch, or its one
    for case in [long] + shorter:
        # same q_lens as captured (cu_seqlens_q fixed); new contexts, a padding seq where 0
        st["sl"].copy_(torch.tensor([c + n if c else 0 for c, n in case], dtype=torch.int32))
        out.fill_(float("nan"))  # a row the replay leaves unwritten shows
        graph.replay()
        torch.cuda.synchronize()
        eager = _run(st, fused)
        ref, real = _ref(st)
        assert torch.equal(out, eager)
        assert rel(out[real], ref) < TOL[torch.bfloat16]
        assert bool((out[~real] == 0).all())
        assert _counters_zero(fused)
