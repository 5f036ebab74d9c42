"""The model runner: loads the model, owns the KV cache, runs one `StepPlan` per call.

A step flattens its sequences' tokens (prefill chunks and decodes together), builds the
attention metadata once, runs the model, computes logits only at the sampled positions and
samples one token per sequence with `sample=True` (`Sampler.sample`: processors, draw and
raw logprobs). A prefill chunk of a request with `prompt_logprobs` also gets the lm_head over
all its positions, to score the prompt tokens (see `_prompt_logprobs`).
"""

from __future__ import annotations

import contextlib
import time

import torch

from kernels import attention as attn_kernels
from kernels.pending_ids import encode_pending
from services.worker.kv_cache import KVCache, num_blocks_for
from services.worker.kv_transfer import KVTransfer
from services.worker.layers.attention import AttentionMetadata
from services.worker.cuda_graphs import DecodeGraphs
from services.worker.gpu_memory import profile_kv_budget
from services.worker.loader import load_dummy_weights, load_weights
from services.worker.models import model_class
from services.worker.sampler import Sampler, make_token_logprobs
from shared.config import KestrelConfig
from shared.kv_layout import KVLayout
from shared.model_spec import model_spec_for, resolved_dtype
from shared.plan_state import PlanState
from shared.protocol import PENDING_TOKEN, SamplingParams, ScheduledSeq, StepPlan, StepResult, TokenLogprob

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_PROMPT_CARRY = 256  # requests whose last prompt-chunk logits wait for their next chunk
GPU_WORKER_THREADS = 4  # torch intra-op threads of a GPU worker unless num_threads is set


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
    num_threads (0 = all cores on the CPU, GPU_WORKER_THREADS with a GPU), max_model_len
    (None = model's, capped at 8192), seed (sampling seed of requests without one).
    Raises FileNotFoundError / ValueError from the loader, ValueError for an unknown
    architecture or a KV budget below one block.
    """

    def __init__(self, cfg: KestrelConfig):
        t0 = time.perf_counter()
        dev = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if cfg.num_threads and cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        elif dev != "cpu":
            # the host side of a GPU step is small tensor work: a full-width OpenMP pool only
            # spins, and competes with the engine and frontends for the cores (H200 host, 16
            # cores, serve_bench at 256 streams: 8,305 -> 9,445 output tok/s with 2 threads)
            torch.set_num_threads(min(GPU_WORKER_THREADS, torch.get_num_threads()))
        self.device = torch.device(dev)
        dt = resolved_dtype(cfg.dtype, self.device.type)
        self.dtype = _DTYPES[dt]
        self.spec = model_spec_for(cfg, dtype=dt)  # the model's facts (shared.model_spec)
        hf_config = dict(self.spec.hf_config)
        self.max_model_len = self.spec.max_model_len
        with torch.device(self.device), _default_dtype(self.dtype):
            self.model = model_class(hf_config)(hf_config, self.max_model_len)
        if cfg.load_format == "dummy":
            self.weight_bytes = load_dummy_weights(self.model, cfg.seed)
        else:
            self.weight_bytes = load_weights(self.model, cfg.model)
        self.model.eval()
        layers = self.model.attention_layers()
        num_layers, kv_heads, head_dim = self.model.kv_shape()
        self.block_size = cfg.block_size
        self.kv_layout = KVLayout.for_model(self.spec, self.block_size)
        if (num_layers, kv_heads, head_dim) != (self.kv_layout.num_layers, self.kv_layout.kv_heads_per_rank,
                                                self.kv_layout.head_dim):
            raise ValueError(f"the model's KV shape {(num_layers, kv_heads, head_dim)} is not its "
                             f"config's {self.kv_layout}")
        per_block = self.kv_layout.block_bytes
        self.use_ref_attention = self.device.type == "cpu" or attn_kernels.paged_attention_triton is None
        self.activation_peak_bytes = 0
        if self.device.type == "cuda":  # KV sized from gpu_memory_utilization (gpu_memory.py)
            self.activation_peak_bytes, kv_budget = profile_kv_budget(self, cfg, layers, kv_heads, head_dim)
            self.num_blocks = kv_budget // per_block
            if self.num_blocks < 1:
                raise ValueError(f"gpu_memory_utilization={cfg.gpu_memory_utilization} leaves "
                                 f"{kv_budget} bytes, less than one KV block of {per_block}")
        else:
            self.num_blocks = num_blocks_for(cfg.kv_cache_gib, per_block)
        self.kv = KVCache(layers, self.num_blocks, self.block_size, kv_heads, head_dim,
                          self.dtype, self.device)
        self.kv_transfer = KVTransfer(self.kv, self.kv_layout)  # kvstore tier copies (kv_transfer.py)
        self.graphs = None
        if self.device.type == "cuda" and not cfg.enforce_eager and not self.use_ref_attention:
            self.graphs = DecodeGraphs(self.model, cfg.max_num_seqs, self.max_model_len,
                                       self.block_size, self.device)
        if self.device.type == "cuda" and not self.use_ref_attention:
            from kernels.sampling_triton import warm_up_sampler  # compile now, not mid-serving
            warm_up_sampler(self.model.args.vocab_size, cfg.max_num_seqs, self.device)
        self.sampler = Sampler(cfg.seed, self.spec.eos_token_ids)
        self.plan_state = PlanState()  # what the engine sends once per request
        # request id -> logits [vocab] of the last position of its previous prompt chunk,
        # which scores the first token of its next chunk (prompt_logprobs across chunks)
        self._prompt_carry: dict[str, torch.Tensor] = {}
        # the last step that sampled: (its token ids on the device [rows] int64, request id ->
        # row); a PENDING_TOKEN of the next plan is read from it (async scheduling)
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self._last_kept: DecodeGraphs | None = None  # the graphs whose `last` holds that draw
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
            "activation_peak_bytes": self.activation_peak_bytes,
            "cuda_graph_sizes": self.graphs.sizes if self.graphs else [],
            "cuda_graph_capture_seconds": round(self.graphs.capture_seconds, 3) if self.graphs else 0.0,
            "kv_block_bytes": self.kv_transfer.slot_bytes,
        }

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[int]:
        """Run one step. Returns one token id per ScheduledSeq with sample=True, plan order.

        Raises ValueError when a sequence's block table does not cover its tokens or its
        length passes max_model_len.
        """
        return self.run_step(plan).sampled_token_ids

    @torch.inference_mode()
    def run_step(self, plan: StepPlan) -> StepResult:
        """Run one step and return its full result: the sampled tokens (plan order), their
        logprobs where asked (`Sampler.sample`), and the prompt logprobs of prefill chunks
        of requests with `prompt_logprobs` set. KV tier copies: plan.kv_loads before the
        forward, plan.kv_stores after it (`kv_transfer.py`). Raises like `execute`."""
        self.plan_state.resolve(plan)  # whole block tables and sampling params (plan_state.py)
        self.kv_transfer.before_step(plan)
        try:
            logits, rows, prompt_logits = self._forward(plan)
        except BaseException:
            self._last_sampled = self._last_kept = None  # a later plan's pending tokens cannot come from here
            raise
        seqs = plan.seqs
        result = StepResult(plan.step_id, [])
        if rows:
            g = self.graphs
            kept = g if g is not None and len(rows) <= g.max_bs else None
            out = self.sampler.sample(logits, [seqs[i] for i in rows], keep=kept.keep if kept else None)
            result.sampled_token_ids = out.token_ids
            result.logprobs = out.logprobs
            self._last_sampled = (out.token_tensor, {seqs[i].request_id: j for j, i in enumerate(rows)})
            self._last_kept = kept
        for i, chunk_logits in prompt_logits.items():
            result.prompt_logprobs[seqs[i].request_id] = self._prompt_logprobs(seqs[i], chunk_logits)
        result.kv_store_error = self.kv_transfer.after_step(plan)
        return result

    def _prompt_logprobs(self, s: ScheduledSeq, logits: torch.Tensor) -> list[TokenLogprob]:
        """Logprobs of the prompt tokens of one chunk (token i given tokens < i).

        logits: [len(s.token_ids), vocab] fp32, one row per chunk position. Row j predicts the
        token at position start_pos + j + 1, so the chunk scores positions start_pos + 1 ..
        min(start_pos + len, num_prompt_tokens) - 1 itself; the token at start_pos is scored
        with the previous chunk's last row, kept in `_prompt_carry`. Token 0 has no logprob.
        Returns them in position order (k = sampling.prompt_logprobs alternatives each).
        """
        n, p, start = len(s.token_ids), s.num_prompt_tokens, s.start_pos
        rows = [logits[j] for j in range(max(0, min(n, p - start) - 1))]
        targets = list(s.token_ids[1:1 + len(rows)])
        carry = self._prompt_carry.pop(s.request_id, None)
        if start > 0 and carry is not None:
            rows.insert(0, carry)
            targets.insert(0, s.token_ids[0])
        if start + n < p:  # the next chunk's first token is scored by this chunk's last row
            while len(self._prompt_carry) >= MAX_PROMPT_CARRY:
                self._prompt_carry.pop(next(iter(self._prompt_carry)))
            self._prompt_carry[s.request_id] = logits[n - 1].clone()
        if not rows:
            return []
        lp = torch.log_softmax(torch.stack(rows).float(), dim=-1)
        ids = torch.tensor(targets, dtype=torch.long, device=lp.device)
        return make_token_logprobs(lp, ids, [s.sampling.prompt_logprobs or 0] * len(rows))

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor:
        """Run one step like `execute` (the KV cache is written the same way) but return the
        logits instead of sampling: [num sample=True seqs, vocab] fp32, plan order."""
        self.plan_state.resolve(plan)
        return self._forward(plan)[0]

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor | None, list[int], dict[int, torch.Tensor]]:
        """Forward the step; logits at the last token of each sample=True sequence, plus
        {seq index: [chunk len, vocab] logits} for prompt chunks that want prompt logprobs."""
        seqs = plan.seqs
        if not seqs:
            return None, [], {}
        hidden = self._decode_graph(seqs) if self.graphs is not None else None
        if hidden is not None:  # decode-only step replayed from a CUDA graph
            rows = [i for i, s in enumerate(seqs) if s.sample]
            return self.model.compute_logits(hidden.index_select(0, torch.tensor(rows, device=hidden.device))
                                             if len(rows) != len(seqs) else hidden), rows, {}
        input_ids, positions, meta = self._prepare(seqs)
        self._fill_pending(input_ids, seqs)
        hidden = self.model(input_ids, positions, meta)
        prompt_logits: dict[int, torch.Tensor] = {}
        for i, s in enumerate(seqs):
            if s.sampling.prompt_logprobs is not None and s.start_pos < s.num_prompt_tokens:
                a, b = int(meta.cu_seqlens_q[i]), int(meta.cu_seqlens_q[i + 1])
                prompt_logits[i] = self.model.compute_logits(hidden[a:b]).float()
        rows = [i for i, s in enumerate(seqs) if s.sample]
        if not rows:
            return None, rows, prompt_logits
        if len(rows) == len(seqs) and hidden.shape[0] == len(seqs):
            picked = hidden  # decode-only step: every row is sampled
        else:
            last = meta.cu_seqlens_q[1:].long() - 1
            picked = hidden.index_select(0, last[rows])
        return self.model.compute_logits(picked), rows, prompt_logits

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
        if not self.use_ref_attention:  # GPU kernels: one host->device copy of all int inputs
            # each part starts on a 16-byte boundary (an even int64 offset): Triton compiles a
            # kernel per pointer alignment, and unaligned views made steps of some shapes
            # compile mid-run (0.8 s each, H200 offline benchmark)
            parts = [torch.tensor(ids, dtype=torch.long), positions, slots, cu.long(),
                     seq_lens_t.long(), block_tables.long().flatten()]
            sizes = [p.numel() for p in parts]
            packed = torch.empty(sum(n + n % 2 for n in sizes), dtype=torch.long,
                                 pin_memory=dev.type == "cuda")
            off = 0
            for p, n in zip(parts, sizes):
                packed[off:off + n] = p
                off += n + n % 2
            d = packed.to(dev, non_blocking=True)
            views, off = [], 0
            for n in sizes:
                views.append(d[off:off + n])
                off += n + n % 2
            ids_d, pos_d, slots_d, cu_d, sl_d, bt_d = views
            meta = AttentionMetadata(cu_d, sl_d, bt_d.view(b, width), slots_d, None,
                                     max_q_len=max(q_lens), max_seq_len=max(seq_lens))
            return ids_d, pos_d, meta
        tables_dev = block_tables.to(dev)
        plan = attn_kernels.build_ref_plan(cu, seq_lens_t, tables_dev, bs) if self.use_ref_attention else None
        meta = AttentionMetadata(cu.to(dev), seq_lens_t.to(dev), tables_dev, slots.to(dev), plan)
        return torch.tensor(ids, dtype=torch.long, device=dev), positions.to(dev), meta


    def _decode_graph(self, seqs: list[ScheduledSeq]) -> torch.Tensor | None:
        """Hidden states [b, hidden] of a decode-only step from its CUDA graph, or None when
        the step is not one (a prefill chunk, too many sequences, prompt logprobs asked).
        Raises ValueError like `_prepare`."""
        if len(seqs) > self.graphs.max_bs or any(len(s.token_ids) != 1 for s in seqs):
            return None
        if any(s.sampling.prompt_logprobs is not None and s.start_pos < s.num_prompt_tokens for s in seqs):
            return None
        bs = self.block_size
        pos = [s.start_pos for s in seqs]
        for s, p in zip(seqs, pos):
            if p + 1 > len(s.block_table) * bs or p + 1 > self.max_model_len:
                raise ValueError(f"request {s.request_id}: 1 token at {p} does not fit its "
                                 f"{len(s.block_table)} blocks of {bs} or max_model_len {self.max_model_len}")
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos)]
        ids = [s.token_ids[0] for s in seqs]
        if PENDING_TOKEN in ids:  # a reference to the last draw's row, resolved in the graph
            index = self._pending_rows([s.request_id for s, t in zip(seqs, ids) if t == PENDING_TOKEN])
            if self._last_kept is not self.graphs:  # that draw is not in the graphs' copy yet
                self.graphs.keep(self._last_sampled[0])
                self._last_kept = self.graphs
            ids = [encode_pending(index[s.request_id]) if t == PENDING_TOKEN else t for s, t in zip(seqs, ids)]
        return self.graphs.run(ids, pos, slots, [p + 1 for p in pos], [s.block_table for s in seqs])

    def _pending_rows(self, request_ids: list[str]) -> dict[str, int]:
        """request id -> its row in the last draw, for requests whose input is pending.
        Raises ValueError when one has no such draw (the engine and the worker disagree, or
        the step that drew it failed)."""
        last = self._last_sampled
        missing = [r for r in request_ids if last is None or r not in last[1]]
        if missing:
            raise ValueError(f"request {missing[0]}: a pending token with no draw of the last step")
        return last[1]

    def _fill_pending(self, ids: torch.Tensor, seqs: list[ScheduledSeq]) -> None:
        """Replace the PENDING_TOKEN entries of the step's flattened input ids [T] int64 (on
        the device) with the tokens the last sampling step drew for those requests, on the
        device (no host sync). Raises ValueError when a pending token has no such draw (the
        engine and the worker disagree, or the step that drew it failed)."""
        dst, rows, off = [], [], 0
        for s in seqs:
            off += len(s.token_ids)
            if s.token_ids[-1] == PENDING_TOKEN:
                dst.append(off - 1)
                rows.append(s.request_id)
        if not dst:
            return
        index = self._pending_rows(rows)
        src = self._last_sampled[0]
        rows = [index[r] for r in rows]
        n = len(dst)
        if dst == list(range(n)) and rows == list(range(n)) and src.numel() == n:
            ids[:n].copy_(src)  # the usual decode step: the same requests in the same order
            return
        idx = torch.tensor(dst + rows, dtype=torch.long, pin_memory=ids.is_cuda).to(ids.device, non_blocking=True)
        ids.index_copy_(0, idx[:n], src.index_select(0, idx[n:]).to(ids.dtype))


def generate(runner: ModelRunner, prompts: list[list[int]], n: int,
             sampling: SamplingParams | None = None, chunk: int | None = None,
             pending: bool = False) -> list[list[int]]:
    """Drive `runner.execute` with hand-made StepPlans, for tests and benchmarks (no engine).

    Each prompt gets its own blocks (0, 1, ... in prompt order). Prefills run in chunks of
    at most `chunk` tokens (None = whole prompt); a sequence decodes as soon as its prefill
    is done, so chunked runs mix prefill chunks and decodes in one step. pending: decodes
    feed PENDING_TOKEN (the runner's own copy of the last draw, as under async scheduling)
    instead of the token that came back.
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
                seqs.append(ScheduledSeq(f"r{i}", [PENDING_TOKEN if pending else o[-1]], len(p) + len(o) - 1,
                                         tables[i], True, sampling, len(o)))
                who.append(i)
        for i, tok in zip(who, runner.execute(StepPlan(step, seqs))):
            outs[i].append(tok)
        step += 1
    return outs


def greedy_generate(runner: ModelRunner, prompt_ids: list[int], n: int, chunk: int | None = None) -> list[int]:
    """n greedy tokens after prompt_ids (see `generate`)."""
    return generate(runner, [prompt_ids], n, chunk=chunk)[0]
