"""CPU linear layers on oneDNN-packed fp32 weights: y = x @ W.T (+ b) for any number of rows.

Why: on the CPU a decode or speculative verify step multiplies a few rows of x (1 + drafts,
or the batch) by every weight of the model, which streams from memory. MKL's fp32 gemm is
2.5-3.5x slower at 2..16 rows than its gemv at one row (it re-packs W on each call), so a
verify step of 5 tokens cost ~2.7 decode steps. oneDNN's inner product on a weight packed
once at load (`torch.ops.mkldnn._reorder_linear_weight`, its blocked layout) reads W once
for all rows. Measured (benchmarks/cpu_linear_sweep.py, SmolLM2-135M shapes: 30 layers of
qkv/o/gate_up/down + the 49152x576 head, weights far larger than the caches, 2-core AMD
EPYC VM, fp32, medians of a shared machine):

    ms per step   1 thread: M=1   M=2   M=5   M=9   M=16  | 2 threads: M=1  M=5   M=16
    MKL F.linear (W.t() contiguous)  27+5  42+10 81+34 80+35 105+46 |     35+6  74+34 80+37
    oneDNN packed (hint 16)          30+7  35+8  47+12 61+14  90+21 |     29+6  35+7  52+11

(layers + head). One thread at one row pays ~10% for the packed layout (a loaded machine:
30-40%; much of it is oneDNN's per-call cost, ~25-90 us against MKL's ~4 us, over the 120
products of a step); every other case gains 1.2-4x, prefill (M=64..200) is equal or better.
The packed tensor replaces the dense weight: `dense` turns it back for a reference. Only fp32
is packed (bf16 on AVX2 without native bf16 dot products was not measured); other dtypes
keep MKL. PACK_WEIGHTS = False keeps the dense weights (set it before the model loads);
`use_packing` is the rule the model runner applies per worker.

One row on one thread: a worker that packs only because of speculation (one thread) would run
its plain decode steps (batch 1, one row, k = 0 whenever the policy turns speculation off)
~10-40% slower than a worker without speculation, which keeps MKL. With KEEP_DENSE_ONE_ROW
(`keep_dense_one_row`: one thread and speculation) the dense column-major weight is kept
beside the packed one, and every product of a step without drafts takes it (`Linear`, an
untied `LMHead`; `PACKED_STEP`, which the model runner sets per step): the plain steps
(prefill and decode) run exactly the plain worker's path, so the prompt's KV and first token
are the plain worker's bit for bit, and only verify steps take the packed one (an int8 KV
cache had magnified the packed prefill's other rounding into other greedy tokens from the first
one on). Cost: a second copy of the linear weights in memory (SmolLM2-135M: +425 MB); at 2+
threads the packed layout is the faster one at every row count and no copy is kept.
"""

from __future__ import annotations

import torch

PACK_WEIGHTS = True
# with PACK_WEIGHTS: keep the dense column-major weight too, for the plain steps (module doc)
KEEP_DENSE_ONE_ROW = False
# with KEEP_DENSE_ONE_ROW: whether the step now running verifies drafts (its products of 2+ rows
# take the packed weight; every other product the dense copy). Set by the model runner per step.
PACKED_STEP = False


def takes_dense(rows: int) -> bool:
    """Whether a product of `rows` rows takes a layer's dense copy, where one is kept beside a
    packed weight: one row, or any step that verifies no drafts (`PACKED_STEP` False)."""
    return rows == 1 or not PACKED_STEP


# the row count oneDNN is told to expect when it picks the blocked layout; one layout serves
# every row count (measured: hints 5 and 16 within noise of each other at 1..16 rows)
PACK_BATCH_HINT = 16
# Row counts at which a dense fp32 weight stored column-major (a tied LM head, which the
# embedding's lookups keep dense) is faster on oneDNN's inner product than on MKL's gemm.
# 49152x576 head, 1 thread: M=1 6.6 vs 6.8 ms, M=2 10.5 vs 17.2, M=3 16.3 vs 20.5, M=5 36.1
# vs 26.8, M=9 34.7 vs 27.8, M=16 35.9 vs 41.0 (MKL vs oneDNN, caches flushed in between).
DENSE_ONEDNN_ROWS = range(4, 13)


def use_packing(num_threads: int, multi_row_steps: bool) -> bool:
    """Whether a CPU worker packs its fp32 weights (the table above): yes with 2 or more
    threads (faster at every row count) or when its steps run several rows per sequence
    (speculative verify steps of 1 + k tokens); no for plain decoding on one thread, where
    the packed layout costs ~10% at one row."""
    return num_threads >= 2 or multi_row_steps


def keep_dense_one_row(num_threads: int, multi_row_steps: bool) -> bool:
    """Whether a packing CPU worker also keeps its dense weights for one-row products (module
    doc): where it packs only for its multi-row (speculative verify) steps, on one thread,
    where the packed layout costs ~10% or more at one row; its plain decode steps then run
    MKL's path, as a worker without speculation does."""
    return num_threads < 2 and multi_row_steps


def dense_linear_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `packed_linear` beats F.linear for x on a dense fp32 CPU weight (DENSE_ONEDNN_ROWS)."""
    return (x.shape[0] in DENSE_ONEDNN_ROWS and x.dtype == torch.float32 and weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available())


def packable(weight: torch.Tensor) -> bool:
    """Whether `pack` applies: PACK_WEIGHTS on, a dense 2-D fp32 CPU weight [N, K], oneDNN built."""
    return (PACK_WEIGHTS and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.dim() == 2 and not weight.is_mkldnn and weight.numel() > 0
            and torch.backends.mkldnn.is_available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of a dense fp32 CPU weight [N, K] (any strides): an opaque
    tensor (`is_mkldnn`) of the same shape and dtype that only `packed_linear` and `dense`
    read. The caller drops the dense one (it is the only copy kept)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) on oneDNN for x [M, K] fp32 (any M, row-strided views made
    contiguous), weight from `pack` ([N, K]) or a dense fp32 [N, K] (any strides), bias [N] fp32 or None -> [M, N] fp32. Equals F.linear on
    the dense weight up to fp32 summation order."""
    if not x.is_contiguous():
        x = x.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def dense(weight: torch.Tensor) -> torch.Tensor:
    """A weight as a dense tensor: `pack`'s output unpacked (a new [N, K] copy), any other
    tensor itself. For references and tests."""
    return weight.to_dense() if weight.is_mkldnn else weight
