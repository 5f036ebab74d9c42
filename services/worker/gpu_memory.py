"""KV cache sizing on a GPU from `--gpu-memory-utilization` (docs/ARCHITECTURE.md §4, §6).

The KV cache gets what is left of `utilization * total GPU memory` after the memory already
in use (CUDA context, weights, other processes) and the activation peak of the largest
step: a prefill of `max_num_batched_tokens` tokens (in sequences of at most max_model_len)
plus the logits and softmax of `max_num_seqs` rows. That peak is measured by running the
step once on a temporary KV cache (which also compiles the Triton kernels). A margin of
256 MiB stays free for CUDA graphs' pools and allocator fragmentation; a hybrid model's decode
graphs hold copies of their seqs' recurrent states (a few MiB a seq and layer), so for it the
transient bytes of an eager decode step of max_num_seqs seqs are kept free too.
"""

from __future__ import annotations

import logging

import torch

from services.worker.kv_cache import KVCache, PagedKVSpec
from services.worker.layers.attention import bind_layers
from services.worker.state_cache import StepState
from shared.protocol import SamplingParams, ScheduledSeq

log = logging.getLogger("kestrel.worker")
MARGIN_BYTES = 256 << 20


@torch.inference_mode()
def profile_kv_budget(runner, cfg, kv_specs: list[PagedKVSpec]) -> tuple[int, int]:
    """(activation peak bytes, KV cache budget bytes) for `runner` on its CUDA device.

    runner: a ModelRunner with model, device, dtype, block_size, max_model_len,
    use_ref_attention and fusion set. kv_specs: what each layer caches.
    cfg: gpu_memory_utilization, max_num_batched_tokens, max_num_seqs, enforce_eager (a
    hybrid model with CUDA graphs also keeps the decode graphs' pool: `_decode_peak`).
    The budget may be <= 0 when the weights leave no room (the caller raises).
    """
    dev, bs = runner.device, runner.block_size
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    used_before = total - free
    lens, left = [], max(1, cfg.max_num_batched_tokens)
    while left > 0:
        lens.append(min(left, runner.max_model_len))
        left -= lens[-1]
    blocks = [-(-n // bs) for n in lens]
    # in the KV dtype in use (an fp8_e4m3 cache with scales 1.0): the profile runs its kernels
    tmp = KVCache(kv_specs, sum(blocks), bs, getattr(runner, "kv_dtype", runner.dtype), dev)
    layers = bind_layers(runner.model.attention_specs(), tmp.layers)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    seqs, nxt = [], 0
    greedy = SamplingParams(temperature=0.0)
    for i, (n, nb) in enumerate(zip(lens, blocks)):
        seqs.append(ScheduledSeq(f"profile{i}", [1] * n, 0, list(range(nxt, nxt + nb)), True, greedy))
        nxt += nb
    state = getattr(runner, "state_cache", None)  # a hybrid model's recurrent layers run too
    if state is not None:
        for i, s in enumerate(seqs):
            s.state_slot = i % state.num_slots
        runner._step_state = StepState.for_seqs(state, seqs, dev)
    ids, pos, meta = runner._prepare(seqs)
    hidden = runner.run_model(ids, pos, meta, layers)
    rows = hidden[:1].expand(cfg.max_num_seqs, -1).contiguous()
    logits = runner.model.compute_logits(rows)
    torch.softmax(logits, dim=-1).argmax(-1)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del hidden, rows, logits
    graph_pool = 0
    if state is not None and not cfg.enforce_eager:
        graph_pool = _decode_peak(runner, cfg.max_num_seqs, state, layers)
    del tmp, layers
    if state is not None:
        runner._step_state = None
        for t in (t for layer in state.layers for t in layer):
            t.zero_()  # the profile's states are no request's
    torch.cuda.empty_cache()
    budget = int(total * cfg.gpu_memory_utilization) - used_before - peak - graph_pool - MARGIN_BYTES
    log.info("gpu memory: total %.2f GiB, in use before KV %.2f GiB, activation peak %.2f GiB, "
             "decode graph pool %.2f GiB, KV budget %.2f GiB", total / 2**30, used_before / 2**30, peak / 2**30,
             graph_pool / 2**30, budget / 2**30)
    return peak, budget


def _decode_peak(runner, max_num_seqs: int, state, layers) -> int:
    """Bytes a decode step of max_num_seqs one-token seqs allocates on top of what is live
    (a hybrid model's recurrent layers update their slots in place, kernels/gdn_decode.py:
    only activations; with `gated_deltanet.IN_PLACE_DECODE` off, each layer's gathered
    states [max_num_seqs, *shape] per tensor and their updates), run once eagerly: what the
    largest decode graph's private pool keeps (services/worker/cuda_graphs.py), beside the
    eager steps' activations.
    layers: the temporary KV cache's attention layers (every seq writes slot 0 there)."""
    dev = runner.device
    greedy = SamplingParams(temperature=0.0)
    seqs = [ScheduledSeq(f"profile-decode{i}", [1], 0, [0], True, greedy, state_slot=i % state.num_slots)
            for i in range(max_num_seqs)]
    runner._step_state = StepState.for_seqs(state, seqs, dev)
    ids, pos, meta = runner._prepare(seqs)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    runner.run_model(ids, pos, meta, layers)
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) - base
