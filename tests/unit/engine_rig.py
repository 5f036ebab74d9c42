"""Engine cores built for tests: a config, model facts, and a driver loop.

`core_config` builds a KestrelConfig for a toy model; `toy_info` its ModelSpec; `drive`
runs an EngineCore's step pipeline until nothing is left, as the engine process's loop
does between frontend messages, and collects every output sent per request id.
"""

from __future__ import annotations

import time

from services.engine.core import EngineCore
from services.engine.executor import Executor
from services.engine.outputs import Emitted
from services.engine.pipeline import StepPipeline
from shared import protocol as P
from shared.config import KestrelConfig, build_config
from shared.model_spec import ModelSpec, default_max_model_len


def core_config(**settings) -> KestrelConfig:
    """A config for cores on the CPU: the test model's folder, then `settings`."""
    cli = {"model": "models/SmolLM2-135M-Instruct", "device": "cpu"}
    cli.update(settings)
    return build_config(cli=cli, env={})


def toy_info(vocab_size: int, eos: int, max_model_len: int | None = None,
             max_position_embeddings: int = 4096) -> ModelSpec:
    """Model facts of a toy model (no folder). max_model_len: the setting (None: the default
    for max_position_embeddings), as `shared.model_spec.load_model_spec` resolves it."""
    return ModelSpec(path="/nonexistent/toy", architecture="Toy", model_type="toy", num_layers=1,
                     hidden_size=8, intermediate_size=16, num_heads=1, num_kv_heads=1, head_dim=8,
                     vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                     tie_word_embeddings=False, num_experts=1, moe_intermediate_size=16,
                     eos_token_ids=(eos,), bos_token_id=None, dtype="float32", kv_dtype="float32",
                     max_model_len=max_model_len or default_max_model_len(max_position_embeddings),
                     hf_config={})


class Outbox:
    """Every output a core emitted, per request id, in order."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[P.RequestOutput]] = {}

    def take(self, em: Emitted | None) -> None:
        if em is None:
            return
        for _, o in em.outputs():
            self.outputs.setdefault(o.request_id, []).append(o)

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]

    def final(self, rid: str) -> P.RequestOutput:
        return self.outputs[rid][-1]


def drive(core: EngineCore, executor: Executor, async_scheduling: bool, outbox: Outbox,
          timeout_s: float = 30.0) -> StepPipeline:
    """Run `core` on `executor` until no work is left (the engine loop's order: admit
    compiled grammars, read the executor, advance, apply aborts). Raises AssertionError on
    a stall."""
    pipeline = StepPipeline(core, executor, async_scheduling)
    deadline = time.monotonic() + timeout_s
    while pipeline.busy() or core.num_compiling:
        assert time.monotonic() < deadline, "engine loop stalled"
        if core.num_compiling:
            outbox.take(core.admit_compiled({b"fe"}))
        executor.drain()
        if pipeline.busy():
            outbox.take(pipeline.advance())
        else:
            time.sleep(0.005)  # only compiles are left
        outbox.take(core.apply_aborts())
    return pipeline
