"""A fake drafter for the runner's proposer plumbing tests (test_spec_runner.py and
tests/gpu/test_spec_runner_gpu.py): registered in place of a real method
(`services.worker.spec.PROPOSERS`), it has a KV group of its own, records what the runner
hands it and proposes a given continuation."""

from __future__ import annotations

import torch

from services.worker.kv_cache import PagedKVSpec
from services.worker.spec.base import Proposal, Proposer, ProposerInfo, ProposeRequest, StepView


class FakeDrafter(Proposer):
    """A drafter with its own KV group (2 layers of 1 head x 8) that reads target layer 1,
    writes each token id (mod 256: exact in bf16) into its K cache at the step's slots, and
    proposes the tokens of a plain run (`oracle`), with one-hot draft distributions when
    `with_probs`. `seen`: per observed step, host copies of what its view held (a CUDA
    graph's view is its persistent buffers, overwritten by the next replay)."""

    target_layer_ids = (1,)
    last: FakeDrafter | None = None

    def __init__(self, cfg, spec, runner):
        self.spec, self.vocab = spec, runner.spec.vocab_size
        self.layers: list = []
        self.seen: list[dict] = []
        self.requests: list[list[ProposeRequest]] = []
        self.oracle: dict[str, list[int]] = {}
        self.with_probs = False
        self.forgotten: list[str] = []
        FakeDrafter.last = self

    def kv_specs(self):
        return [PagedKVSpec(1, 8)] * 2

    def bind_kv(self, layers):
        self.layers = layers

    def observe(self, view: StepView):
        slots = view.meta.slot_mapping
        k = self.layers[0].k
        k.view(-1, 8)[slots, 0] = (view.input_ids % 256).to(k.dtype)
        self.seen.append({
            "seqs": list(view.seqs), "ids": view.input_ids.tolist(), "positions": view.positions.tolist(),
            "slots": slots.tolist(), "hidden": tuple(view.hidden.shape),
            "aux": None if view.aux_hidden is None else tuple(view.aux_hidden.shape),
            "kv": k.view(-1, 8)[slots, 0].long().tolist()})

    def propose(self, requests, view):
        self.requests.append(requests)
        toks = [self.oracle.get(r.request_id, [])[r.output_index:r.output_index + r.num_propose]
                for r in requests]
        probs = None
        if self.with_probs:
            probs = [torch.nn.functional.one_hot(torch.tensor(t, dtype=torch.long), self.vocab).float()
                     for t in toks]
        return Proposal(toks, probs)

    def forget(self, request_ids):
        self.forgotten.extend(request_ids)

    def info(self):
        return ProposerInfo("fake", detail={"fake": True})
