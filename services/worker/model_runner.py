"""The model runner: loads the model, owns the KV cache, runs one `StepPlan` per call.

A step flattens its sequences' tokens (prefill chunks and decodes together), builds the
attention metadata once, runs the model, computes logits only at the sampled positions and
samples one token per sequence with `sample=True`.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import torch

from kernels import attention as attn_kernels
from services.worker.kv_cache import KVCache, block_bytes, num_blocks_for
from services.worker.layers.attention import AttentionMetadata
from services.worker.loader import load_weights
from services.worker.models import model_class
from services.worker.sampler import Sampler
from shared.config import KestrelConfig
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_MODEL_LEN_CAP = 8192  # default cap of max_model_len (config.py: "capped at 8192")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class ModelRunner:
    """One worker's model, KV cache and sampler.

    cfg fields used: model (HF folder), device, dtype, block_size, kv_cache_gib,
    num_threads (0 = torch's default), max_model_len (None = model's, capped at 8192), seed
    (sampling seed of requests without one).
    Raises FileNotFoundError / ValueError from the loader, ValueError for an unknown
    architecture or a KV budget below one block.
    """

    def __init__(self, cfg: KestrelConfig):
        t0 = time.perf_counter()
        if cfg.num_threads and cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        dev = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(dev)
        dt = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = _DTYPES[dt]
        with open(os.path.join(cfg.model, "config.json")) as fh:
            hf_config = json.load(fh)
        max_pos = int(hf_config.get("max_position_embeddings", 2048))
        self.max_model_len = cfg.max_model_len or min(max_pos, MAX_MODEL_LEN_CAP)
        with torch.device(self.device), _default_dtype(self.dtype):
            self.model = model_class(hf_config)(hf_config, self.max_model_len)
        self.weight_bytes = load_weights(self.model, cfg.model)
        self.model.eval()
        layers = self.model.attention_layers()
        num_layers, kv_heads, head_dim = self.model.kv_shape()
        self.block_size = cfg.block_size
        self.num_blocks = num_blocks_for(cfg.kv_cache_gib, block_bytes(
            num_layers, self.block_size, kv_heads, head_dim, self.dtype))
        self.kv = KVCache(layers, self.num_blocks, self.block_size, kv_heads, head_dim,
                          self.dtype, self.device)
        self.sampler = Sampler(cfg.seed)
        self.use_ref_attention = self.device.type == "cpu" or attn_kernels.paged_attention_triton is None
        self.load_seconds = time.perf_counter() - t0

    def report(self) -> dict:
        """Startup facts: device, dtype, weight/KV bytes, KV blocks and tokens, load seconds."""
        return {
            "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "attention": "torch reference" if self.use_ref_attention else "triton",
            "weight_bytes": self.weight_bytes, "kv_bytes": self.kv.bytes,
            "num_blocks": self.num_blocks, "block_size": self.block_size,
            "kv_tokens": self.num_blocks * self.block_size,
            "max_model_len": self.max_model_len, "load_seconds": round(self.load_seconds, 3),
        }

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[int]:
        """Run one step. Returns one token id per ScheduledSeq with sample=True, plan order.

        Raises ValueError when a sequence's block table does not cover its tokens or its
        length passes max_model_len.
        """
        logits, rows = self._forward(plan)
        if not rows:
            return []
        seqs = plan.seqs
        return self.sampler(logits, [seqs[i].sampling for i in rows],
                            [seqs[i].output_index for i in rows])

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor:
        """Run one step like `execute` (the KV cache is written the same way) but return the
        logits instead of sampling: [num sample=True seqs, vocab] fp32, plan order."""
        return self._forward(plan)[0]

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor | None, list[int]]:
        """Forward the step; logits only at the last token of each sample=True sequence."""
        seqs = plan.seqs
        if not seqs:
            return None, []
        input_ids, positions, meta = self._prepare(seqs)
        hidden = self.model(input_ids, positions, meta)
        rows = [i for i, s in enumerate(seqs) if s.sample]
        if not rows:
            return None, rows
        if len(rows) == len(seqs) and hidden.shape[0] == len(seqs):
            picked = hidden  # decode-only step: every row is sampled
        else:
            last = meta.cu_seqlens_q[1:].long() - 1
            picked = hidden.index_select(0, last[rows])
        return self.model.compute_logits(picked), rows

    def _prepare(self, seqs: list[ScheduledSeq]):
        """Flatten the step: input_ids [T], positions [T] int64, and the attention metadata."""
        bs = self.block_size
        ids: list[int] = []
        q_lens, starts, seq_lens = [], [], []
        width = max(len(s.block_table) for s in seqs)
        tables: list[int] = []
        for s in seqs:
            n = len(s.token_ids)
            end = s.start_pos + n
            if end > len(s.block_table) * bs or end > self.max_model_len or n == 0:
                raise ValueError(f"request {s.request_id}: {n} tokens at {s.start_pos} do not fit its "
                                 f"{len(s.block_table)} blocks of {bs} or max_model_len {self.max_model_len}")
            ids.extend(s.token_ids)
            q_lens.append(n)
            starts.append(s.start_pos)
            seq_lens.append(end)
            tables.extend(s.block_table)
            tables.extend([-1] * (width - len(s.block_table)))
        b, t = len(seqs), len(ids)
        block_tables = torch.tensor(tables, dtype=torch.int32).view(b, width)
        starts_t = torch.tensor(starts, dtype=torch.long)
        cu = torch.zeros(b + 1, dtype=torch.int32)
        if t == b:  # decode only
            positions, seq_idx = starts_t, torch.arange(b)
            cu[1:] = torch.arange(1, b + 1, dtype=torch.int32)
        else:
            q_lens_t = torch.tensor(q_lens, dtype=torch.long)
            cu[1:] = q_lens_t.cumsum(0)
            seq_idx = torch.repeat_interleave(torch.arange(b), q_lens_t)
            positions = starts_t[seq_idx] + torch.arange(t) - cu[:-1].long()[seq_idx]
        slots = block_tables[seq_idx, positions // bs].long() * bs + positions % bs
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        dev = self.device
        tables_dev = block_tables.to(dev)
        plan = attn_kernels.build_ref_plan(cu, seq_lens_t, tables_dev, bs) if self.use_ref_attention else None
        meta = AttentionMetadata(cu.to(dev), seq_lens_t.to(dev), tables_dev, slots.to(dev), plan)
        return torch.tensor(ids, dtype=torch.long, device=dev), positions.to(dev), meta


def generate(runner: ModelRunner, prompts: list[list[int]], n: int,
             sampling: SamplingParams | None = None, chunk: int | None = None) -> list[list[int]]:
    """Drive `runner.execute` with hand-made StepPlans, for tests and benchmarks (no engine).

    Each prompt gets its own blocks (0, 1, ... in prompt order). Prefills run in chunks of
    at most `chunk` tokens (None = whole prompt); a sequence decodes as soon as its prefill
    is done, so chunked runs mix prefill chunks and decodes in one step.
    Returns n new token ids per prompt. Raises ValueError when the KV cache is too small.
    """
    sampling = sampling or SamplingParams(temperature=0.0)
    bs = runner.block_size
    tables, nxt = [], 0
    for p in prompts:
        need = -(-(len(p) + n) // bs)
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    if nxt > runner.num_blocks:
        raise ValueError(f"needs {nxt} KV blocks, the runner has {runner.num_blocks}")
    done = [0] * len(prompts)  # prompt tokens already run
    outs: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(o) < n for o in outs):
        seqs, who = [], []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                m = min(chunk or len(p), len(p) - done[i])
                last = done[i] + m == len(p)
                seqs.append(ScheduledSeq(f"r{i}", p[done[i]:done[i] + m], done[i], tables[i], last, sampling, 0))
                done[i] += m
                if last:
                    who.append(i)
            elif len(outs[i]) < n:
                o = outs[i]
                seqs.append(ScheduledSeq(f"r{i}", [o[-1]], len(p) + len(o) - 1, tables[i], True, sampling, len(o)))
                who.append(i)
        for i, tok in zip(who, runner.execute(StepPlan(step, seqs))):
            outs[i].append(tok)
        step += 1
    return outs


def greedy_generate(runner: ModelRunner, prompt_ids: list[int], n: int, chunk: int | None = None) -> list[int]:
    """n greedy tokens after prompt_ids (see `generate`)."""
    return generate(runner, [prompt_ids], n, chunk=chunk)[0]
