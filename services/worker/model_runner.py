"""The model runner: loads the model, owns the KV cache, runs one `StepPlan` per call of
`execute` (its one entry point, docs/ARCHITECTURE.md §6).

A step flattens its sequences' tokens (prefill chunks and decodes together), builds the
attention metadata once and from it the step's attention backend
(`services.worker.layers.attention.select_backend`), picks the layer path
(`services.worker.fusion.FusionPlan`), runs the model, computes logits only at the sampled
positions and samples one token per sequence with `sample=True` (`Sampler.sample`:
processors, draw and raw logprobs). A prefill chunk of a request with `prompt_logprobs`
also gets the lm_head over all its positions, to score the prompt tokens (see
`prompt_logprobs.PromptScorer`). Drivers for tests and benchmarks (hand-made plans, no
engine) are in `tests/runner_driver.py`.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field

import torch

from kernels import attention as attn_kernels
from kernels import cpu_decode, cpu_linear, cpu_quant_linear, fp8_linear, ref_fast, w4a16_linear
from kernels.pending_ids import encode_pending
from services.worker import jit_watch
from services.worker.cuda_graphs import DecodeGraphs
from services.worker.fusion import FusionPlan
from services.worker.gpu_memory import profile_kv_budget
from services.worker.kv_cache import KVCache
from services.worker.kv_transfer import KVTransfer
from services.worker.layers.attention import AttentionLayer, AttentionMetadata, bind_layers, select_backend
from services.worker.state_cache import StateCache, StepState
from services.worker.layers.linear import dense_copy_bytes, held_weight_bytes
from services.worker.gguf_loader import load_gguf_weights
from services.worker.loader import load_dummy_weights, load_weights, read_kv_scales
from services.worker.models import model_class
from services.worker.models.base import CausalLM
from services.worker.prompt_logprobs import PromptScorer
from services.worker.sampler import Sampler
from services.worker.spec import build_proposer, proposer_report
from services.worker.spec.base import StepView
from services.worker.spec.step import (DraftProbs, check_drafts, graph_view, logit_rows, propose,
                                       propose_requests, verify_drafts)
from services.worker.step_inputs import prepare_step
from services.worker.verify_graphs import VerifyGraphs, replay_verify
from shared.config import KestrelConfig, state_checkpoint_slots
from shared.gguf_source import require_gguf
from shared.kv_layout import KVLayout, num_blocks_for
from shared.model_spec import model_spec_for, resolved_dtype
from shared.plan_state import PlanState
from shared.state_layout import StateLayout
from shared.protocol import PENDING_TOKEN, ScheduledSeq, StepPlan, StepResult
from shared.weight_quant import check_fp8_setting, check_w4a16_setting, fp8_in_use, w4a16_in_use

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_QUANT_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}  # kernels/kv_quant.py


@dataclass
class StepLogits:
    """What one step's forward produced, before sampling.

    logits: [len(rows), vocab] fp32 at the last token of each sample=True sequence (with
    drafts: its last num_draft + 1 tokens, `spec.step.logit_rows`), or None when no sequence
    samples. rows: the plan indexes of those sequences, in order.
    prompt_logits: plan index -> [chunk len, vocab] fp32, for prompt chunks that want
    prompt logprobs. view: the forward as the proposer sees it (None without a proposer).
    offsets: [num_seqs + 1] host ints, each seq's first flat token index (with a proposer or
    drafts; else empty).
    """

    logits: torch.Tensor | None
    rows: list[int]
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    view: StepView | None = None
    offsets: list[int] = field(default_factory=list)


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
    num_threads (torch threads, resolved by the config builder: shared.cpu_budget), max_model_len
    (None: the model's default, `shared.model_spec.default_max_model_len`), seed (sampling seed of requests without one).
    speculative_config (None: off; `spec.build_proposer`).
    Attributes a driver may replace between steps: graphs (None: eager decode), verify_graphs
    (`VerifyGraphs` for verify steps, seqs of mixed k padded to the largest, captured with
    graphs on and speculation configured; None: eager verify) and fusion (the `FusionPlan`; captured graphs keep the
    plan of their capture).
    The proposer's KV group (`proposer.kv_specs()`) has the target's num_blocks and
    block_size, and the KV budget is split by the bytes of one block of both groups.
    Raises FileNotFoundError / ValueError from the loader, ValueError for device cuda without CUDA, fp8 weights
    where they cannot run (`shared.weight_quant.check_fp8_setting`, with the GPU's capability), an unknown
    architecture or a KV budget below one block.
    """

    def __init__(self, cfg: KestrelConfig):
        t0 = time.perf_counter()
        self.jit_hooks = jit_watch.install()  # Triton compile counts (jit_watch.py), armed when ready
        dev = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if cfg.num_threads > 0:  # resolved by the config builder (shared.cpu_budget)
            torch.set_num_threads(cfg.num_threads)
        self.device = torch.device(dev)
        if self.device.type == "cuda" and not torch.cuda.is_available():  # refused, not restarted (worker.py)
            raise ValueError("setting device: 'cuda', but torch sees no CUDA device on this host (no GPU, or a "
                             "CPU build of torch); use --device cpu (or auto)")
        dt = resolved_dtype(cfg.dtype, self.device.type)
        self.dtype = _DTYPES[dt]
        self.spec = model_spec_for(cfg, dtype=dt)  # the model's facts (shared.model_spec)
        self.max_model_len = self.spec.max_model_len
        if self.device.type == "cpu":  # oneDNN-packed fp32 weights (kernels/cpu_linear.py), set before loading
            threads, multi_row = torch.get_num_threads(), cfg.speculative is not None
            cpu_linear.PACK_WEIGHTS = cpu_linear.use_packing(threads, multi_row)
            cpu_linear.KEEP_DENSE_ONE_ROW = cpu_linear.keep_dense_one_row(threads, multi_row)
        # weight-only int8/int4 CPU linear layers (kernels/cpu_quant_linear.py; the config
        # refuses them on other devices), applied by each Linear after loading; gguf takes
        # them from the recorded GGUF's int4 blocks (gguf_loader.py, §6.4)
        self.quantization = cfg.quantization if self.device.type == "cpu" else "none"
        cpu_quant_linear.QUANTIZATION = self.quantization if self.quantization in cpu_quant_linear.SCHEMES else "none"
        # FP8 / 4-bit weights (kernels/fp8_linear.py, kernels/w4a16_linear.py), set before building
        self.weight_format = self._fp8_mode(cfg, dt)
        with torch.device(self.device), _default_dtype(self.dtype):
            module = model_class(self.spec)(self.spec, self.max_model_len)
        self.gguf_tensors: dict[str, int] | None = None  # what each GGUF tensor became (gguf only)
        self.gguf_file: str | None = None  # the GGUF loaded from (gguf only)
        if cfg.load_format == "dummy":
            self.weight_bytes = load_dummy_weights(module, cfg.seed)
        elif self.quantization == "gguf":
            loaded = load_gguf_weights(module, require_gguf(cfg.model))
            self.weight_bytes, self.gguf_tensors = loaded.weight_bytes, loaded.tensors
            self.gguf_file = loaded.file
        else:
            self.weight_bytes = load_weights(module, cfg.model, self.checkpoint_quant)
        module.eval()
        self.one_row_weight_bytes = dense_copy_bytes(module)  # the target's (kernels/cpu_linear.py)
        self.held_weight_bytes = held_weight_bytes(module)  # after packing / quantization
        assert isinstance(module, CausalLM)
        self.model = module
        kv_specs = module.kv_specs()
        num_layers, kv_heads, head_dim = len(kv_specs), kv_specs[0].num_kv_heads, kv_specs[0].head_dim
        self.block_size = cfg.block_size
        self.kv_layout = KVLayout.for_model(self.spec, self.block_size)
        if (num_layers, kv_heads, head_dim) != (self.kv_layout.num_layers, self.kv_layout.kv_heads_per_rank,
                                                self.kv_layout.head_dim):
            raise ValueError(f"the model's KV shape {(num_layers, kv_heads, head_dim)} is not its "
                             f"config's {self.kv_layout}")
        self.use_ref_attention = self.device.type == "cpu" or attn_kernels.paged_attention_triton is None
        self.kv_dtype = _QUANT_KV_DTYPES.get(self.spec.kv_dtype, self.dtype)
        fp8_scales, self.kv_scales = self._kv_scales(cfg)
        self.fusion = FusionPlan.choose(module.fusable_projections(), self.device, self.dtype)
        self.sampler = Sampler(cfg.seed, self.spec.eos_token_ids)
        self.proposer = build_proposer(cfg, self)  # drafter weights load here (before the KV sizing)
        spec_cfg = cfg.speculative
        self.num_speculative_tokens = spec_cfg.num_speculative_tokens if spec_cfg is not None else 0
        self.spec_method = spec_cfg.method if spec_cfg is not None else None
        # n-gram's n range, for drivers that play the engine's drafter (tests/runner_driver.py)
        self.prompt_lookup = (spec_cfg.prompt_lookup_min, spec_cfg.prompt_lookup_max) if spec_cfg is not None else None
        draft_specs = self.proposer.kv_specs() if self.proposer is not None else []
        if self.proposer is not None and self.proposer.target_layer_ids:
            # the CausalLM contract's aux_hidden_layers (models/base.py), set once before any forward
            setattr(module, "aux_hidden_layers", tuple(self.proposer.target_layer_ids))  # noqa: B010
        # bytes of one block of the proposer's group, as KVCache lays it out (a meta-device block)
        self.draft_block_bytes = KVCache(draft_specs, 1, self.block_size, self.dtype, "meta").bytes if draft_specs else 0
        per_block = self.kv_layout.block_bytes + self.draft_block_bytes  # both groups index one block id
        # a hybrid model's recurrent-state group (state_cache.py): one slot per running request,
        # allocated before the KV sizing (which then counts it as used memory)
        state_specs = module.state_specs()
        state_layout = StateLayout.for_model(self.spec, self.kv_layout)
        want = state_layout.state_bytes if state_layout is not None else 0
        if sum(sp.slot_bytes for sp in state_specs) != want:  # the kvstore's state slots are sized from it
            raise ValueError(f"the model's recurrent state takes {sum(sp.slot_bytes for sp in state_specs)} "
                             f"bytes a request, its state layout {want}")
        self.state_cache = StateCache(state_specs, cfg.max_num_seqs + state_checkpoint_slots(cfg),
                                      self.device) if state_specs else None
        self._step_state: StepState | None = None  # the current step's view (run_model gives it on)
        self.activation_peak_bytes = 0
        if self.device.type == "cuda":  # KV sized from gpu_memory_utilization (gpu_memory.py)
            self.activation_peak_bytes, kv_budget = profile_kv_budget(self, cfg, kv_specs)
            self.num_blocks = kv_budget // per_block
            if self.num_blocks < 1:
                raise ValueError(f"gpu_memory_utilization={cfg.gpu_memory_utilization} leaves "
                                 f"{kv_budget} bytes, less than one KV block of {per_block}")
        else:
            self.num_blocks = num_blocks_for(cfg.kv_cache_gib, per_block)
        self.kv = KVCache(kv_specs, self.num_blocks, self.block_size, self.kv_dtype, self.device, fp8_scales)
        self.draft_kv: KVCache | None = None
        if draft_specs:
            assert self.proposer is not None
            self.draft_kv = KVCache(draft_specs, self.num_blocks, self.block_size, self.dtype, self.device)
            self.proposer.bind_kv(self.draft_kv.layers)
        self.attn_layers = bind_layers(module.attention_specs(), self.kv.layers)
        # kvstore tier copies, blocks and a hybrid's state checkpoints (kv_transfer.py)
        self.kv_transfer = KVTransfer(self.kv, self.kv_layout, self.state_cache)
        self._graph_aux: dict[int, torch.Tensor] = {}  # batch size -> a graph's aux hidden output
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not cfg.enforce_eager and not self.use_ref_attention:
            # a hybrid's graphs read the state slots from their staged header (cuda_graphs.py)
            self.graphs = DecodeGraphs(self._graph_forward, cfg.max_num_seqs, self.max_model_len,
                                       self.block_size, self.device, self.state_cache)
        self.verify_graphs: VerifyGraphs | None = None  # verify steps (verify_graphs.py)
        # a hybrid's verify steps run eagerly: its recurrent layers run each verify seq token
        # by token and keep the state after each (StepState.track, docs/ARCHITECTURE.md §4.7)
        if self.graphs is not None and self.num_speculative_tokens > 0 and self.state_cache is None:
            self.verify_graphs = VerifyGraphs(self._verify_graph_forward, cfg.max_num_seqs,
                                              self.num_speculative_tokens, self.max_model_len,
                                              self.block_size, self.device)
        if self.device.type == "cuda" and not self.use_ref_attention:
            from kernels.sampling_triton import warm_up_sampler  # compile now, not mid-serving
            warm_up_sampler(self.spec.vocab_size, cfg.max_num_seqs, self.device)
            # every launch variant eager steps can meet (verify steps past the verify graphs,
            # prefill chunks with decodes): kernels/attention_warmup.py
            from kernels.attention_warmup import warm_up_attention
            a0 = module.attention_specs()[0] if self.kv.k else None
            if a0 is not None:
                warm_up_attention(self.kv.k[0], self.kv.v[0], a0.num_heads, self.dtype, self.max_model_len,
                                  cfg.max_num_batched_tokens, self.kv.k_scale[0], self.kv.v_scale[0])
        self.plan_state = PlanState()  # what the engine sends once per request
        self.prompt_scorer = PromptScorer()  # prompt logprobs across a prompt's chunks
        self.draft_probs = DraftProbs()  # q of the last proposal per request (probabilistic drafting)
        # the last step that sampled: (the device ids of each sampled seq's last emitted token
        # [rows] int64, after a verify step host ints until `_pending_rows` needs them; request
        # id -> row); a PENDING_TOKEN of the next plan is read from it (async scheduling)
        self._last_sampled: tuple[torch.Tensor | list[int], dict[str, int]] | None = None
        self._last_kept: DecodeGraphs | None = None  # the graphs whose `last` holds that draw
        self.load_seconds = time.perf_counter() - t0
        jit_watch.WATCH.arm()  # ready: from here a compile or capture is a serving stall

    def _fp8_mode(self, cfg: KestrelConfig, dtype: str) -> str:
        """Decide FP8 weights (docs/ARCHITECTURE.md §6.3): set `kernels.fp8_linear.MODE`
        ("quantize": --quantization fp8 on a bf16 or dummy checkpoint; "checkpoint": an FP8
        checkpoint run as FP8; "off"), `checkpoint_quant` (the checkpoint's FP8 format, None
        with dummy weights) and `quantization` ("fp8" when on). Returns the weight format for
        the startup report ("" for a plain checkpoint without FP8). Raises ValueError for
        fp8 where it cannot run (`check_fp8_setting`, with this GPU's capability)."""
        cap = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        check_fp8_setting(cfg.quantization, self.device.type, dtype, cap)
        ckpt = self.checkpoint_quant = self.spec.checkpoint_quant if cfg.load_format != "dummy" else None
        w4a16_linear.MODE = "off"
        if (ckpt is not None and ckpt.is_w4) or cfg.quantization in ("awq", "gptq"):
            fp8_linear.MODE = "off"
            return self._w4_mode(cfg, dtype)
        on = fp8_in_use(cfg.quantization, ckpt, self.device.type, dtype, cap)
        fp8_linear.MODE = ("checkpoint" if ckpt is not None else "quantize") if on else "off"
        if on:
            self.quantization = "fp8"
            return (f"fp8 from the checkpoint ({ckpt.describe()})" if ckpt is not None else
                    "fp8 e4m3, per-channel scales, quantized at load")
        if ckpt is not None:
            return (f"{ckpt.describe()} checkpoint dequantized to {dtype} at load (fp8 weights need CUDA with "
                    f"compute capability 8.9+ and bfloat16)")
        return ""

    def _w4_mode(self, cfg: KestrelConfig, dtype: str) -> str:
        """Decide 4-bit weights (docs/ARCHITECTURE.md §6.3): set `kernels.w4a16_linear.MODE`
        ("checkpoint": an AWQ / GPTQ checkpoint on CUDA in bf16 / fp16; "dummy": dummy weights
        with --quantization awq / gptq; "off": the checkpoint dequantized at load) and
        `quantization` (the method when packed). Returns the startup report's weight format.
        Raises ValueError as `check_w4a16_setting`."""
        ckpt, dummy = self.checkpoint_quant, cfg.load_format == "dummy"
        check_w4a16_setting(cfg.quantization, self.device.type, dtype, ckpt, dummy)
        if w4a16_in_use(cfg.quantization, ckpt, self.device.type, dtype, dummy):
            w4a16_linear.MODE = "dummy" if dummy else "checkpoint"
            self.quantization = cfg.quantization if dummy else ckpt.method if ckpt else cfg.quantization
            if dummy:
                return f"{cfg.quantization} 4-bit (W4A16), random packed weights, group {w4a16_linear.GROUP_SIZE}"
            assert ckpt is not None
            return f"{ckpt.describe()} from the checkpoint (W4A16)"
        assert ckpt is not None  # awq / gptq without a 4-bit checkpoint were refused
        return f"{ckpt.describe()} checkpoint dequantized to {dtype} at load (W4A16 needs CUDA and bf16 / fp16)"

    def _kv_scales(self, cfg: KestrelConfig) -> tuple[list[tuple[float, float]] | None, str]:
        """The fp8_e4m3 cache's per-layer (k, v) scales (None for another KV dtype) and
        where the scales come from, for the startup report: fp8 takes the checkpoint's
        (`loader.read_kv_scales`), 1.0 where a layer has none; int8 computes a scale per
        token and head at each write."""
        kind = self.spec.kv_dtype
        if kind == "int8":
            return None, "per token and head (computed at write)"
        if kind != "fp8_e4m3":
            return None, ""
        found = read_kv_scales(cfg.model) if cfg.load_format != "dummy" else {}
        ids = self.spec.attention_layer_ids
        pairs = [(found.get(i, {}).get("k", 1.0), found.get(i, {}).get("v", 1.0)) for i in ids]
        n = sum(1 for i in ids if i in found)
        if not n:
            return pairs, "1.0 per layer (none in the checkpoint)"
        return pairs, f"per layer from the checkpoint ({n} of {len(ids)} layers, others 1.0)"

    def report(self) -> dict:
        """Startup facts: device, dtype, weight/KV bytes (and `cpu_one_row_weight_bytes`, the
        dense copies kept beside packed CPU weights, kernels/cpu_linear.py), the weight
        quantization (`quantization`) and the weight bytes held after it (`weight_bytes_held`;
        `weight_bytes` is the checkpoint's in the model dtype; under gguf, `gguf_file` (the path)
        and `gguf_tensors` (the GGUF tensors per form and type, `gguf_loader.GGUFLoad`)), KV blocks and tokens, load seconds,
        the proposer (`speculative`, None when off), the verify graphs (`verify_graphs`,
        only when captured)."""
        return {
            "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "attention": self._attention_report(),
            "weight_bytes": self.weight_bytes, "kv_bytes": self.kv.bytes,
            # the KV dtype in use and its scales' source (docs/ARCHITECTURE.md §4.6)
            "kv_cache_dtype": self.spec.kv_dtype, "kv_scales": self.kv_scales,
            "quantization": self.quantization, "weight_bytes_held": self.held_weight_bytes,
            **({"weight_format": self.weight_format} if self.weight_format else {}),
            **({"gguf_file": self.gguf_file, "gguf_tensors": self.gguf_tensors}
               if self.gguf_tensors is not None else {}),
            # the dense weights a one-thread speculative CPU worker keeps beside the packed ones
            "cpu_one_row_weight_bytes": self.one_row_weight_bytes,
            "num_blocks": self.num_blocks, "block_size": self.block_size,
            "kv_tokens": self.num_blocks * self.block_size,
            "max_model_len": self.max_model_len, "load_seconds": round(self.load_seconds, 3),
            "activation_peak_bytes": self.activation_peak_bytes,
            "cuda_graph_sizes": self.graphs.sizes if self.graphs else [],
            "cuda_graph_capture_seconds": round(self.graphs.capture_seconds, 3) if self.graphs else 0.0,
            "kv_block_bytes": self.kv_transfer.slot_bytes,
            # the recurrent-state group of a hybrid model (state_cache.py): 0 / 0 without one
            "state_bytes": self.state_cache.bytes if self.state_cache else 0,
            "state_slots": self.state_cache.num_slots if self.state_cache else 0,
            # one checkpoint in a kvstore state slot (shared/state_layout.py; the engine checks it)
            "state_checkpoint_bytes": self.kv_transfer.state_bytes,
            "speculative": proposer_report(self.proposer, self.num_speculative_tokens, self.draft_kv,
                                           self.draft_block_bytes, self.spec_method),
            # Triton compiles before ready and where the compile hooks sit (jit_watch.py)
            "jit_startup_compiles": jit_watch.WATCH.startup_compiles, "jit_hooks": self.jit_hooks,
            # verify steps' CUDA graphs (verify_graphs.py), only when captured
            **({"verify_graphs": self.verify_graphs.report()} if self.verify_graphs else {}),
        }

    def recapture_graphs(self) -> float:
        """Capture the decode graphs again, for the benchmarks' A/B rounds: kernel switches
        (`kernels.moe.DECODE_FUSED`, the decode kernels' launch defaults) are read while a
        graph is captured, so a graph keeps the path of its capture; the `FusionPlan` is
        chosen again first (its module flags, e.g. fusion.FUSE_QUANTIZED_ONE_ROW, and the
        quantized kernels' switches read now). The old graphs (and their memory pool) are
        dropped first; sizes and buffers as at start-up. Returns the capture seconds; 0.0
        (nothing done, the plan kept) without decode graphs."""
        if self.graphs is None:
            return 0.0
        self.fusion = FusionPlan.choose(self.model.fusable_projections(), self.device, self.dtype)
        max_bs = self.graphs.max_bs
        self.graphs, self._last_kept = None, None
        self._graph_aux.clear()
        torch.cuda.empty_cache()
        self.graphs = DecodeGraphs(self._graph_forward, max_bs, self.max_model_len, self.block_size,
                                   self.device, self.state_cache)
        return self.graphs.capture_seconds

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step and return its full result: the tokens of each ScheduledSeq with
        sample=True (plan order; one each, or with drafts in the plan 1..num_draft+1 each,
        flat, counted in `num_sampled`), their logprobs where asked (`Sampler.sample`), the
        prompt logprobs of prefill chunks of requests with `prompt_logprobs` set, and the
        proposer's drafts for seqs with num_propose > 0 (`draft_token_ids`). KV tier copies:
        plan.kv_loads before the forward, plan.kv_stores after it (`kv_transfer.py`).
        Raises ValueError when a sequence's block table does not cover its tokens or its
        length passes max_model_len, a pending token has no draw of the last step, or a
        seq's num_draft does not fit it."""
        if plan.forget:
            self._forget(plan.forget)
        self.plan_state.resolve(plan)  # whole block tables and sampling params (plan_state.py)
        load_error = self.kv_transfer.before_step(plan)
        if load_error:  # the inputs are garbage: no forward; the engine recomputes (§4.5)
            result = StepResult(plan.step_id, [], kv_load_error=load_error)
            self._dummy_draw(plan)
            result.kv_store_error = self.kv_transfer.after_step(plan)
            result.jit_compiles = jit_watch.WATCH.take()
            return result
        try:
            result = self._step(plan)
        except BaseException:
            self._last_sampled = self._last_kept = None  # a later plan's pending tokens cannot come from here
            raise
        result.kv_store_error = self.kv_transfer.after_step(plan)
        result.jit_compiles = jit_watch.WATCH.take()
        return result

    def _dummy_draw(self, plan: StepPlan) -> None:
        """After a step whose tier loads failed: a draw of token 0 for each of its sampled
        seqs, so that a plan made on top of it (async scheduling) still runs; the engine
        discards what such a plan computes for these requests (they recompute)."""
        sampled = [s.request_id for s in plan.seqs if s.sample]
        ids = torch.zeros(len(sampled), dtype=torch.long, device=self.device)
        self._last_sampled = (ids, {rid: j for j, rid in enumerate(sampled)})
        self._last_kept = None

    def _forget(self, request_ids: list[str]) -> None:
        """Drop what the runner and its proposer keep for requests that ended."""
        self.draft_probs.drop(request_ids)
        if self.proposer is not None:
            self.proposer.forget(request_ids)

    def _step(self, plan: StepPlan) -> StepResult:
        """Forward, observe, sample or verify, propose (`execute`)."""
        fwd = self._forward(plan)
        if self.proposer is not None and fwd.view is not None:
            self.proposer.observe(fwd.view)
        seqs, rows, logits = plan.seqs, fwd.rows, fwd.logits
        result = StepResult(plan.step_id, [])
        if rows and logits is not None:
            sampled = [seqs[i] for i in rows]
            emitted: list[list[int]] | None = None
            if logits.shape[0] != len(rows):  # some seq verifies drafts (§5.5)
                emitted = self._verify(result, logits, sampled)
                st = self._step_state
                if st is not None and st.track:  # recurrent layers roll back to the accepted drafts (§4.7)
                    st.commit({i: len(toks) for i, toks in zip(rows, emitted)})
            else:
                g = self.graphs
                kept = g if g is not None and len(rows) <= g.max_bs else None
                out = self.sampler.sample(logits, sampled, keep=kept.keep if kept else None)
                result.sampled_token_ids = out.token_ids
                result.logprobs = out.logprobs
                assert out.token_tensor is not None  # Sampler.sample always returns the device ids
                self._last_sampled = (out.token_tensor, {s.request_id: j for j, s in enumerate(sampled)})
                self._last_kept = kept
            if self.proposer is not None:
                if emitted is None:
                    emitted = [[t] for t in result.sampled_token_ids]
                self._propose(result, fwd, emitted)
        for i, chunk_logits in fwd.prompt_logits.items():
            result.prompt_logprobs[seqs[i].request_id] = self.prompt_scorer.score(seqs[i], chunk_logits)
        if self.state_cache is not None:  # prefix-cache checkpoints of the recurrent state (§4.7)
            self.state_cache.save_checkpoints(seqs)
        return result

    def _verify(self, result: StepResult, logits: torch.Tensor, sampled: list[ScheduledSeq]) -> list[list[int]]:
        """Verify a step with drafts (`spec.step.verify_drafts`) into `result` and keep each
        seq's last emitted token for the pending inputs of the next plan. Returns the
        emitted tokens per sampled seq."""
        v = verify_drafts(self.sampler, logits, sampled, self.draft_probs)
        v.fill(result)
        # host ints: `_pending_rows` moves them to the device only for a plan that reads one (a
        # verify step is synchronous, §5.5, so the next plan usually holds the tokens themselves)
        self._last_sampled = ([toks[-1] for toks in v.tokens], {s.request_id: j for j, s in enumerate(sampled)})
        self._last_kept = None  # a decode graph copies it into its own buffer when it needs it
        return v.tokens

    def _propose(self, result: StepResult, fwd: StepLogits, emitted: list[list[int]]) -> None:
        """The proposer's drafts for the seqs with num_propose > 0 (`spec.step.propose`)."""
        assert self.proposer is not None and fwd.view is not None
        reqs = propose_requests(fwd.view.seqs, fwd.rows, emitted, fwd.offsets)
        if reqs:
            result.draft_token_ids = propose(self.proposer, reqs, fwd.view, self.spec.vocab_size,
                                             self.max_model_len, self.draft_probs)

    def _attention_report(self) -> str:
        """The startup report's attention path: "triton", or "torch reference", plus Kestrel's C++ CPU
        decode attention where its layers take it (`kernels.cpu_decode`, §6.4)."""
        if not self.use_ref_attention:
            return "triton"
        if ref_fast.CPU_CXX_OPS and any(a.cxx for a in self.attn_layers) and cpu_decode.available():
            return f"torch reference; decode steps C++ ({cpu_decode.flavour()})"
        return "torch reference"

    def _forward(self, plan: StepPlan) -> StepLogits:
        """Forward a resolved plan (the KV cache written, nothing sampled); see `StepLogits`.
        Raises like `execute`."""
        seqs = plan.seqs
        if not seqs:
            return StepLogits(None, [])
        check_drafts(seqs)
        rows = [i for i, s in enumerate(seqs) if s.sample]
        graphs = self.graphs
        hidden = self._decode_graph(seqs) if graphs is not None else None
        if graphs is not None and hidden is not None:  # decode-only step replayed from a CUDA graph
            self._step_state = None  # its state view is the graph's own (no verify seq to commit)
            logits = self.model.compute_logits(
                hidden.index_select(0, torch.tensor(rows, device=hidden.device))
                if len(rows) != len(seqs) else hidden)
            if self.proposer is None:
                return StepLogits(logits, rows)
            aux = self._graph_aux.get(graphs.padded_size(len(seqs)) or 0)  # the replayed graph's
            return StepLogits(logits, rows, view=graph_view(graphs, seqs, hidden, self.max_model_len, aux),
                              offsets=list(range(len(seqs) + 1)))
        verified = self._verify_graph(seqs) if self.verify_graphs is not None else None
        if verified is not None:
            return verified
        input_ids, positions, meta = self._prepare(seqs)
        self._fill_pending(input_ids, seqs)
        if self.state_cache is not None:
            self._step_state = StepState.for_seqs(self.state_cache, seqs, self.device)
        # a one-thread CPU worker with dense copies runs its plain steps on them, as a worker
        # without speculation does, and only steps that verify drafts on the packed weights
        cpu_linear.PACKED_STEP = any(s.num_draft for s in seqs)
        hidden = self.run_model(input_ids, positions, meta)
        drafts = any(seqs[i].num_draft for i in rows)
        offsets: list[int] = []
        view: StepView | None = None
        if drafts or self.proposer is not None:
            offsets = [0, *itertools.accumulate(len(s.token_ids) for s in seqs)]
        if self.proposer is not None:
            aux = getattr(self.model, "aux_hidden", None) if self.proposer.target_layer_ids else None
            view = StepView(seqs, input_ids, positions, meta, hidden, aux)
        prompt_logits: dict[int, torch.Tensor] = {}
        for i, s in enumerate(seqs):
            if s.sampling is not None and s.sampling.prompt_logprobs is not None and s.start_pos < s.num_prompt_tokens:
                a, b = int(meta.cu_seqlens_q[i]), int(meta.cu_seqlens_q[i + 1])
                prompt_logits[i] = self.model.compute_logits(hidden[a:b]).float()
        if not rows:
            return StepLogits(None, rows, prompt_logits, view, offsets)
        if drafts:
            keep = logit_rows(seqs, rows, offsets)  # increasing: all of hidden when it ends at its last row
            if len(keep) == hidden.shape[0] and keep[-1] == len(keep) - 1:
                picked = hidden  # every seq samples and is [last token, drafts]: no gather (§5.5)
            else:
                idx = torch.tensor(keep, dtype=torch.long)
                picked = hidden.index_select(0, idx.to(hidden.device, non_blocking=True))
        elif len(rows) == len(seqs) and hidden.shape[0] == len(seqs):
            picked = hidden  # decode-only step: every row is sampled
        else:
            last = meta.cu_seqlens_q[1:].long() - 1
            picked = hidden.index_select(0, last[rows])
        return StepLogits(self.model.compute_logits(picked), rows, prompt_logits, view, offsets)

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  layers: list[AttentionLayer] | None = None, state: StepState | None = None) -> torch.Tensor:
        """The model over one step's flattened inputs (input_ids, positions [T] int64 on the
        device) with the step's attention backend and fusion choice -> hidden [T, hidden].
        layers: the attention layers to run on (default the runner's own; the KV sizing
        runs on a temporary cache). state: the recurrent layers' view of the step (hybrid
        models; default `_step_state`, which the eager caller sets; a decode graph passes
        its own)."""
        attn = select_backend(self.attn_layers if layers is None else layers, meta, self.use_ref_attention)
        attn.state = self._step_state if state is None else state
        return self.model(input_ids, positions, attn, self.fusion.fused(input_ids.shape[0]))

    def _prepare(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's flattened inputs on the device (`step_inputs.prepare_step`)."""
        return prepare_step(seqs, self.block_size, self.max_model_len, self.device, not self.use_ref_attention)

    def _graph_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       state: StepState | None = None) -> torch.Tensor:
        """What a decode graph captures (`DecodeGraphs`): `run_model` on the graph's buffers
        (state: its recurrent-state view, `DecodeGraphs.state_view`; the path an eager
        decode step takes, on static buffers). The model's aux hidden output of each capture
        is kept by batch size (a proposer that reads target layers finds a replay's there)."""
        hidden = self.run_model(input_ids, positions, meta, state=state)
        aux = getattr(self.model, "aux_hidden", None)
        if aux is not None and self.proposer is not None and self.proposer.target_layer_ids:
            self._graph_aux[input_ids.shape[0]] = aux
        return hidden

    def _verify_graph_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                              meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a verify graph captures (`VerifyGraphs`): `run_model` on the graph's buffers,
        and the model's aux hidden output when the proposer reads target layers."""
        hidden = self.run_model(input_ids, positions, meta)
        want_aux = self.proposer is not None and bool(self.proposer.target_layer_ids)
        return hidden, getattr(self.model, "aux_hidden", None) if want_aux else None

    def _verify_graph(self, seqs: list[ScheduledSeq]) -> StepLogits | None:
        """A verify step replayed from a CUDA graph (`replay_verify`; seqs of mixed k, decodes
        among them, padded to the largest): the logits of its real rows, as the eager step
        keeps them (every seq's 1 + num_draft rows, `logit_rows`), the proposer's view in
        the eager step's layout; or None when the step does not take a graph."""
        vg = self.verify_graphs
        assert vg is not None
        out = replay_verify(vg, seqs, self.block_size)
        if out is None:
            return None
        hidden, aux, lay = out
        view = None
        if self.proposer is not None:  # over the graph's buffers, overwritten by the next replay
            ids, pos, meta = vg.real_inputs(lay)
            view = StepView(seqs, ids, pos, meta, hidden, aux)
        return StepLogits(self.model.compute_logits(hidden), list(range(len(seqs))), view=view,
                          offsets=lay.offsets)

    def _decode_graph(self, seqs: list[ScheduledSeq]) -> torch.Tensor | None:
        """Hidden states [b, hidden] of a decode-only step from its CUDA graph, or None when
        the step is not one (a prefill chunk, too many sequences, prompt logprobs asked).
        Raises ValueError like `_prepare` (and `StepState.for_seqs`: a seq without a state
        slot)."""
        graphs = self.graphs
        assert graphs is not None
        if len(seqs) > graphs.max_bs or any(len(s.token_ids) != 1 for s in seqs):
            return None
        if any(s.sampling is not None and s.sampling.prompt_logprobs is not None
               and s.start_pos < s.num_prompt_tokens for s in seqs):
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
            src, index = self._pending_rows([s.request_id for s, t in zip(seqs, ids) if t == PENDING_TOKEN])
            if self._last_kept is not graphs:  # that draw is not in the graphs' copy yet
                graphs.keep(src)
                self._last_kept = graphs
            ids = [encode_pending(index[s.request_id]) if t == PENDING_TOKEN else t for s, t in zip(seqs, ids)]
        if self.state_cache is None:
            return graphs.run(ids, pos, slots, [p + 1 for p in pos], [s.block_table for s in seqs])
        # a hybrid's recurrent layers: each seq's slot, and whether it continues from it (a
        # one-token prompt starts from zeros); a prefix hit's checkpoint is copied in first
        self.state_cache.check_slots(seqs)
        self.state_cache.restore_checkpoints(seqs)
        return graphs.run(ids, pos, slots, [p + 1 for p in pos], [s.block_table for s in seqs],
                          [s.state_slot for s in seqs], [s.start_pos > 0 for s in seqs])

    def _pending_rows(self, request_ids: list[str]) -> tuple[torch.Tensor, dict[str, int]]:
        """The last draw (its token ids on the device [rows] int64, request id -> row), for
        requests whose input is pending. Raises ValueError when one has no such draw (the
        engine and the worker disagree, or the step that drew it failed)."""
        last = self._last_sampled
        missing = [r for r in request_ids if last is None or r not in last[1]]
        if last is None or missing:
            raise ValueError(f"request {missing[0]}: a pending token with no draw of the last step")
        ids, index = last
        if not isinstance(ids, torch.Tensor):  # a verify step's last emitted tokens, kept as host ints
            ids = torch.tensor(ids, dtype=torch.long, pin_memory=self.device.type == "cuda")
            ids = ids.to(self.device, non_blocking=True)
            self._last_sampled = (ids, index)
        return ids, index

    def _fill_pending(self, ids: torch.Tensor, seqs: list[ScheduledSeq]) -> None:
        """Replace the PENDING_TOKEN entries of the step's flattened input ids [T] int64 (on
        the device) with the tokens the last sampling step drew for those requests, on the
        device (no host sync). Raises ValueError when a pending token has no such draw (the
        engine and the worker disagree, or the step that drew it failed)."""
        dst: list[int] = []
        pending: list[str] = []
        off = 0
        for s in seqs:  # only a seq's first token may be pending (a decode, or a verify's last token)
            if s.token_ids[0] == PENDING_TOKEN:
                dst.append(off)
                pending.append(s.request_id)
            off += len(s.token_ids)
        if not dst:
            return
        src, index = self._pending_rows(pending)
        rows = [index[r] for r in pending]
        n = len(dst)
        if dst == list(range(n)) and rows == list(range(n)) and src.numel() == n:
            ids[:n].copy_(src)  # the usual decode step: the same requests in the same order
            return
        idx = torch.tensor(dst + rows, dtype=torch.long, pin_memory=ids.is_cuda).to(ids.device, non_blocking=True)
        ids.index_copy_(0, idx[:n], src.index_select(0, idx[n:]).to(ids.dtype))

