"""The multi-query (verify-step) attention kernel's in-kernel split merge
(`kernels.attention_multi_query`, MQ_DEFAULTS "fused_merge": `kernels.decode_merge._finish_rows`)
under TRITON_INTERPRET=1 on small CPU tensors; prints one line `RESULT <json>`.

Run by `tests/unit/test_mq_fused_interp.py` in a subprocess (the interpreter switch is read
when triton is first imported). Each check is a relative norm error against
`kernels.attention.paged_attention_ref` (fp32 math over the same inputs), or inf where a
structural condition fails:
- "fused_<dtype>" / "launch_<dtype>": a batch of q_len 1 .. 5 mixed (k = 4 drafts and
  fewer), contexts that are not multiples of the 16-key tile, one of one tile (one live
  split: stored directly) and others over many of the 7 splits, plus a CUDA-graph padding
  seq (seq_len 0, its rows must come out 0); launched as a graph launches it (max_q_len 5,
  max_seq_len 512 > every context). MERGE_CHUNK_ELEMS is lowered so the merge loops over
  several chunks of splits. Each config runs twice from the same state (the second run
  passes only if the first left its counters at 0); fused: no `_merge_kernel` launch, the
  two runs bit-identical, the counter pool back at 0.
- "fused_vs_launch_<dtype>": the two paths' outputs against each other.
- "fused_auto_splits_<dtype>": the split count `multi_query_splits` picks (no override).
- "fp8_fused_<dtype>" / "fp8_launch_<dtype>": the same over an fp8_e4m3 cache quantized by
  `kernels.kv_quant.quantize_fp8` (scales != 1), reference with the same scales.
- "own_length_partitions": 0 if every seq's partials (launch path, max_seq_len 512 fixed as
  at capture) hold keys in exactly the splits its own length fills
  (cdiv(tiles, cdiv(tiles, splits)), tiles = cdiv(seq_len, block_n)), else inf: the
  partitions are sized on the device from each seq's length, not from max_seq_len.
fp32 and fp16 q only: the interpreter's tl.dot on bf16 operands gives garbage (bf16 is
checked on the GPU, tests/gpu/test_mq_fused_gpu.py).
"""

from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
import triton  # noqa: E402

from kernels import attention, device_info, kv_quant  # noqa: E402
from kernels import attention_multi_query as mq  # noqa: E402
from kernels import attention_triton as at  # noqa: E402
from kernels import decode_merge as dm  # noqa: E402
from tests.launch_count import LaunchCount  # noqa: E402

H, KVH, D, BS, BLOCK_N, SPLITS = 4, 2, 16, 8, 16, 7
MAX_SEQ_LEN = 512  # a graph's bound (max_model_len): above every context here
# (cached prefix, queries): q_len 5 / 1 / 3 / 2 / 4 mixed; 9 + 3 = 12 keys fit one 16-key tile
SEQS = [(40, 5), (130, 1), (9, 3), (301, 2), (17, 4)]
PAD = 2  # where the padding seq goes


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; inf on NaN or a shape mismatch."""
    if a.shape != b.shape or not torch.isfinite(a.double()).all():
        return float("inf")
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def case(dt: torch.dtype, gen: torch.Generator, fp8: bool):
    """q [T, H, D] in dt for SEQS with a padding seq (seq_len 0, 5 queries, as a graph pads a
    batch) inserted at index PAD; caches [blocks, BS, KVH, D] (dt, or fp8_e4m3 with scales);
    metadata; the reference over the real seqs; the mask of real rows [T]; the scales (None,
    None without fp8)."""
    q_lens = [n for _, n in SEQS]
    lens = [p + n for p, n in SEQS]
    q_lens.insert(PAD, 5)
    lens.insert(PAD, 0)
    total = sum(-(-n // BS) for n in lens) + 3
    ks, vs = (torch.tensor(0.0625), torch.tensor(0.03)) if fp8 else (None, None)
    k_real = torch.randn(total, BS, KVH, D, generator=gen)
    v_real = torch.randn(total, BS, KVH, D, generator=gen)
    kc = kv_quant.quantize_fp8(k_real, ks) if fp8 else k_real.to(dt)
    vc = kv_quant.quantize_fp8(v_real, vs) if fp8 else v_real.to(dt)
    perm = torch.randperm(total, generator=gen).tolist()
    width = max(-(-n // BS) for n in lens) + 1
    tables = []
    for n in lens:
        nb = -(-n // BS)
        tables.append([perm.pop() for _ in range(nb)] + [0] * (width - nb))  # valid ids past the end, as graphs
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], H, D, generator=gen).to(dt)
    bt = torch.tensor(tables, dtype=torch.int32)
    cu_t, sl = torch.tensor(cu, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    real = torch.ones(cu[-1], dtype=torch.bool)
    real[cu[PAD]:cu[PAD + 1]] = False
    keep = sl > 0
    cu_r = torch.tensor([0] + torch.tensor(q_lens)[keep].cumsum(0).tolist(), dtype=torch.int32)
    ref = attention.paged_attention_ref(q[real].float(), kc if fp8 else kc.float(), vc if fp8 else vc.float(),
                                        cu_r, sl[keep], bt[keep], D ** -0.5, None, ks, vs)
    return q, kc, vc, cu_t, sl, bt, ref, real, ks, vs


def counters_zero() -> bool:
    """Whether the merge's counter pool exists and every counter of it is back at 0."""
    buf = device_info.TILE_COUNTERS.get((torch.device("cpu"), dm.MERGE_POOL))
    return buf is not None and bool((buf == 0).all())


def run_path(inputs, fused: bool, splits: int | None) -> tuple[float, torch.Tensor]:
    """(error, output) of two runs of one path from the same state: inf if a padding row is
    not 0, the merge launch count is wrong (fused: none; launch: one a run with > 1 split),
    or (fused) the runs differ in a bit or a counter stayed set."""
    q, kc, vc, cu, sl, bt, ref, real, ks, vs = inputs
    cfg = {"block_n": BLOCK_N, "splits": splits, "fused_merge": fused}
    merges = LaunchCount(dm._merge_kernel)
    dm._merge_kernel = merges
    try:
        outs = [at.paged_attention_triton(q, kc, vc, cu, sl, bt, D ** -0.5, 5, MAX_SEQ_LEN, cfg, ks, vs)
                for _ in range(2)]
    finally:
        dm._merge_kernel = merges.kernel
    err = max(rel(o[real], ref) for o in outs)
    if any(not bool((o[~real] == 0).all()) for o in outs):
        return float("inf"), outs[0]
    if fused and (merges.n != 0 or not torch.equal(outs[0], outs[1]) or not counters_zero()):
        return float("inf"), outs[0]
    if not fused and merges.n != 2 * (splits != 1):
        return float("inf"), outs[0]
    return err, outs[0]


def own_length_partitions(gen: torch.Generator) -> float:
    """0 if each seq's partials, with the split count fixed by MAX_SEQ_LEN, hold keys in the
    splits its own length fills (module doc); inf otherwise."""
    q, kc, vc, cu, sl, bt, _, _, _, _ = case(torch.float32, gen, False)
    seen = {}
    merge = mq.merge_splits

    def record(m, l_, acc, out, splits, pdl, counters=None):
        seen["m"] = m.clone()
        return merge(m, l_, acc, out, splits, pdl, counters)

    mq.merge_splits = record
    try:
        at.paged_attention_triton(q, kc, vc, cu, sl, bt, D ** -0.5, 5, MAX_SEQ_LEN,
                                  {"block_n": BLOCK_N, "splits": SPLITS, "fused_merge": False})
    finally:
        mq.merge_splits = merge
    m = seen["m"]  # [T, H, SPLITS]
    for s in range(len(sl)):
        n = int(sl[s])
        if n == 0:
            continue
        tiles = triton.cdiv(n, BLOCK_N)
        live = triton.cdiv(tiles, triton.cdiv(tiles, SPLITS))
        last = int(cu[s + 1]) - 1  # the seq's last query row sees every key
        want = torch.arange(SPLITS) < live
        if not torch.equal(torch.isfinite(m[last]), want[None, :].expand(H, SPLITS)):
            return float("inf")
    return 0.0


def main() -> None:
    gen = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    out: dict[str, float] = {}
    saved = dm.MERGE_CHUNK_ELEMS
    dm.MERGE_CHUNK_ELEMS = 2 * 16 * D  # 2 splits a chunk at the 16 merge rows (next_pow2(5 x G))
    try:
        for dt in (torch.float32, torch.float16):
            name = str(dt).removeprefix("torch.")
            for fp8 in (False, True):
                pre = "fp8_" if fp8 else ""
                inputs = case(dt, gen, fp8)
                out[f"{pre}fused_{name}"], fo = run_path(inputs, True, SPLITS)
                out[f"{pre}launch_{name}"], lo = run_path(inputs, False, SPLITS)
                out[f"{pre}fused_vs_launch_{name}"] = rel(fo, lo)
                if not fp8:
                    out[f"fused_auto_splits_{name}"], _ = run_path(inputs, True, None)
    finally:
        dm.MERGE_CHUNK_ELEMS = saved
    out["own_length_partitions"] = own_length_partitions(gen)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
