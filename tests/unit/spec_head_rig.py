"""A speculative-decoding loop over hand-made plans for the EAGLE and DFlash proposer tests
(tests/unit/test_spec_eagle.py, test_spec_dflash.py): a `ModelRunner` runs the target, the
proposer observes every step and proposes after it, and the rig plays the engine's part
(block tables, verify seqs [last, d1..dk], acceptance, rollback, preemption, forget).

Two kinds of verification:
- honest greedy: the target's argmax at every verify position, drafts accepted while they
  equal it (the output must equal decoding without speculation);
- forced: the rig accepts a chosen number of drafts and picks the bonus token itself, so
  every acceptance length occurs; what the proposer then drafts must equal the dense
  reference over the context it was given (its state followed the rollbacks).
The dense references of both drafters are in tests/unit/spec_head_dense.py.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.worker.kv_cache import KVCache
from services.worker.loader import dense_weights
from services.worker.model_runner import ModelRunner
from services.worker.spec.base import Proposer, ProposeRequest, StepView
from shared.config import build_config
from shared.protocol import SamplingParams, ScheduledSeq

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 32, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}


def tiny_runner(folder, spec_json: str | None = None, device: str = "cpu", **conf) -> tuple[ModelRunner, object]:
    """(runner, cfg) of a tiny random Llama (TINY with `conf` over it) written to `folder`,
    fp32 on `device`, dummy weights scaled up (std 0.2) so that its features and logits are
    far from uniform."""
    (folder / "config.json").write_text(json.dumps({**TINY, **conf}))
    cli = {"model": str(folder), "load_format": "dummy", "device": device, "dtype": "float32",
           "kv_cache_gib": 0.02, "max_model_len": 1024, "block_size": 16}
    if device == "cuda":
        cli.update(gpu_memory_utilization=0.05, max_num_seqs=16)
    if spec_json:
        cli["speculative_config"] = spec_json
    cfg = build_config(cli=cli, env={})
    runner = ModelRunner(cfg)
    with torch.no_grad(), dense_weights(runner.model):
        for p in runner.model.parameters():
            if p.dim() > 1:
                p.mul_(10.0)
    return runner, cfg


def sharpen(module: torch.nn.Module, seed: int, scale: float = 15.0) -> None:
    """Scale a drafter's matrices (std 0.02 * scale) and give its norms weights around 1, so
    that its distributions are peaked and every weight matters to them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad(), dense_weights(module):
        for name, p in module.named_parameters():
            if p.dim() > 1:
                p.mul_(scale)
            elif "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))


def attach(runner: ModelRunner, proposer: Proposer) -> KVCache:
    """What the runner's plumbing does at load: the proposer's KV group (the target's block
    count and size), bound; the target's aux layers set to the proposer's."""
    specs = proposer.kv_specs()
    cache = KVCache(specs, runner.num_blocks, runner.block_size, runner.dtype, runner.device)
    proposer.bind_kv(cache.layers)
    runner.model.aux_hidden_layers = proposer.target_layer_ids
    return cache


@dataclass
class Req:
    rid: str
    tokens: list[int]  # prompt + outputs
    n_prompt: int
    table: list[int]
    computed: int = 0
    drafts: list[int] = field(default_factory=list)
    joined: bool = False

    @property
    def out(self) -> list[int]:
        return self.tokens[self.n_prompt:]


@dataclass
class Logged:
    """One proposal: the request's tokens up to emitted[-1] (at next_pos), what was asked,
    the drafts and their q (probabilistic)."""

    rid: str
    context: list[int]
    request: ProposeRequest
    drafts: list[int]
    probs: torch.Tensor | None


class SpecRig:
    """The loop (module doc). k: drafts asked per step. verify: None (honest greedy) or
    `forced(rng)`'s function (seq drafts -> accepted count); bonus tokens of forced
    verification come from `rng`."""

    def __init__(self, runner: ModelRunner, proposer: Proposer, k: int, sampling: SamplingParams | None = None):
        self.runner, self.proposer, self.k = runner, proposer, k
        self.sampling = sampling or SamplingParams(temperature=0.0, seed=11)
        self.next_block = 0
        self.log: list[Logged] = []
        self.accepted = 0
        self.steps = 0

    def blocks(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // self.runner.block_size)
        if self.next_block + n > self.runner.num_blocks:
            raise ValueError("the rig ran out of KV blocks")
        self.next_block += n
        return list(range(self.next_block - n, self.next_block))

    def run(self, prompts: list[list[int]], n: int, chunk: int | None = None, join: list[int] | None = None,
            preempt: dict[int, int] | None = None, verify: Callable[[list[int]], int] | None = None,
            rng: random.Random | None = None) -> list[list[int]]:
        """n output tokens per prompt. join[i]: the step request i arrives at; preempt:
        step -> request index restarted from position 0 there (new blocks, its tokens so
        far recomputed as a prompt)."""
        join = join or [0] * len(prompts)
        preempt = preempt or {}
        margin = n + 2 * self.k + 4
        reqs = [Req(f"q{i}", list(p), len(p), self.blocks(len(p) + margin)) for i, p in enumerate(prompts)]
        step = 0
        while any(len(r.out) < n for r in reqs):
            if step in preempt:
                r = reqs[preempt[step]]
                r.computed, r.drafts, r.table = 0, [], self.blocks(len(r.tokens) + margin)
            seqs, who = [], []
            for i, r in enumerate(reqs):
                if step < join[i] or len(r.out) >= n:
                    continue
                todo = len(r.tokens) - r.computed
                if todo > 1 or not r.drafts:
                    m = min(todo, chunk or todo)
                    ids, nd = r.tokens[r.computed:r.computed + m], 0
                else:
                    ids, nd = [r.tokens[-1]] + r.drafts, len(r.drafts)
                sample = r.computed + len(ids) - nd == len(r.tokens)
                seqs.append(ScheduledSeq(r.rid, ids, r.computed, r.table, sample, self.sampling, len(r.out),
                                         num_draft=nd, num_propose=self.k if sample else 0))
                who.append(r)
            self._step(seqs, who, verify, rng or random.Random(0), n)
            for r in reqs:
                if len(r.out) >= n and not r.joined:
                    r.joined = True  # done: the engine's forget
                    self.proposer.forget([r.rid])
            step += 1
        self.steps = step
        return [r.out[:n] for r in reqs]

    def _step(self, seqs: list[ScheduledSeq], who: list[Req], verify, rng: random.Random, n: int) -> None:
        runner = self.runner
        with torch.inference_mode():
            ids, pos, meta = runner._prepare(seqs)
            hidden = runner.run_model(ids, pos, meta)
            view = StepView(seqs, ids, pos, meta, hidden, runner.model.aux_hidden)
            self.proposer.observe(view)
            rows, off = [], 0
            for s in seqs:
                off += len(s.token_ids)
                if s.sample:
                    rows.extend(range(off - s.num_draft - 1, off))
            logits = runner.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long)]) if rows else None
            argmax = logits.argmax(-1).tolist() if logits is not None else []
            asks: list[ProposeRequest] = []
            ctx: list[list[int]] = []
            j = off = 0
            for si, (s, r) in enumerate(zip(seqs, who)):
                first_row = off + len(s.token_ids) - s.num_draft - 1
                off += len(s.token_ids)
                if not s.sample:
                    r.computed += len(s.token_ids)
                    continue
                draws = argmax[j:j + s.num_draft + 1]
                j += s.num_draft + 1
                drafts = s.token_ids[len(s.token_ids) - s.num_draft:] if s.num_draft else []
                if verify is None:
                    a = 0
                    while a < len(drafts) and drafts[a] == draws[a]:
                        a += 1
                    emitted = drafts[:a] + [draws[a]]
                else:
                    a = min(verify(drafts), len(drafts))
                    emitted = drafts[:a] + [rng.randrange(runner.spec.vocab_size)]
                self.accepted += a
                r.computed = s.start_pos + len(s.token_ids) - s.num_draft + a
                r.tokens.extend(emitted)
                r.drafts = []
                if len(r.out) < n:
                    asks.append(ProposeRequest(r.rid, si, emitted, len(r.tokens) - 1, first_row + a, self.k,
                                               r.table, s.sampling, len(r.out)))
                    ctx.append(list(r.tokens))
            if asks:
                prop = self.proposer.propose(asks, view)
                for a_req, c, d, i in zip(asks, ctx, prop.token_ids, range(len(asks))):
                    r = next(x for x in who if x.rid == a_req.request_id)
                    r.drafts = list(d)
                    q = None if prop.probs is None else prop.probs[i].clone()
                    self.log.append(Logged(a_req.request_id, c, a_req, list(d), q))


def target_features(runner: ModelRunner, tokens: list[int], table: list[int]) -> torch.Tensor:
    """The target's aux features [len(tokens), width] over `tokens` run as one prefill on
    `table` (the truth the dense references read)."""
    seq = ScheduledSeq("ref", tokens, 0, table, False, SamplingParams(temperature=0.0))
    with torch.inference_mode():
        ids, pos, meta = runner._prepare([seq])
        runner.run_model(ids, pos, meta)
        return runner.model.aux_hidden.clone()
