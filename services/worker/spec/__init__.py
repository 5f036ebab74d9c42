"""Speculative decoding in the worker (docs/ARCHITECTURE.md §5.5): proposers (`base.Proposer`
and one module per model-based method), verification (`verify`) and the runner's verify and
propose halves of a step (`step`). n-gram drafts are the engine's (services/engine/
ngram_drafts.py): the worker only verifies them, with no proposer.

`build_proposer(cfg, runner)` is the registry: `cfg.speculative.method` -> the proposer
class, imported on first use (a method's module may pull in weights loaders or kernels the
others never need).
"""

from __future__ import annotations

import importlib
from typing import Any

from services.worker.spec.base import Proposer

ENGINE_METHODS = ("ngram",)  # drafts found by the engine at plan time: no worker proposer
# method -> (module, class); every class is built as cls(cfg, spec, runner)
PROPOSERS: dict[str, tuple[str, str]] = {
    "draft_model": ("services.worker.spec.draft_model", "DraftModelProposer"),
    "eagle": ("services.worker.spec.eagle", "EagleProposer"),
    "dflash": ("services.worker.spec.dflash", "DFlashProposer"),
}


def build_proposer(cfg: Any, runner: Any) -> Proposer | None:
    """The proposer of `cfg.speculative` (a `KestrelConfig`; None when speculative decoding
    is off or its drafts are the engine's, `ENGINE_METHODS`), built as `cls(cfg, spec, runner)`.

    runner: the `ModelRunner` being built; at this point it has device, dtype, spec (the
    target's `ModelSpec`), max_model_len, block_size, model (weights loaded), fusion,
    use_ref_attention and sampler, but no KV cache yet (the proposer's `kv_specs` size it,
    and `bind_kv` hands over its group) and no CUDA graphs.
    Raises ValueError for an unknown method or one whose module is not built yet, and
    whatever the proposer's constructor raises (a missing drafter folder, ...).
    """
    spec = cfg.speculative
    if spec is None or spec.method in ENGINE_METHODS:
        return None
    entry = PROPOSERS.get(spec.method)
    if entry is None:
        raise ValueError(f"speculative_config.method: unknown method {spec.method!r} (known: {sorted(PROPOSERS)})")
    module_name, class_name = entry
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise ValueError(f"speculative_config.method {spec.method!r}: not built ({module_name} is missing)") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"speculative_config.method {spec.method!r}: not built ({module_name} has no {class_name})")
    proposer = cls(cfg, spec, runner)
    if not isinstance(proposer, Proposer):
        raise TypeError(f"{module_name}.{class_name} is not a services.worker.spec.base.Proposer")
    return proposer


def proposer_report(proposer: Proposer | None, k: int, kv: Any, kv_bytes_per_block: int,
                    method: str | None = None) -> dict | None:
    """The proposer's startup facts for the worker's report (None with speculation off):
    method, k (num_speculative_tokens), its weight bytes, its KV group's bytes (`kv`: the
    group's `KVCache`, or None) and bytes per block, the target layers it reads, and its own
    `ProposerInfo.detail`. method: the configured method; one of `ENGINE_METHODS` (no
    proposer) reports no weights, no KV and `"drafts": "engine"`."""
    if proposer is None:
        if method not in ENGINE_METHODS:
            return None
        return {"method": method, "num_speculative_tokens": k, "weight_bytes": 0, "kv_bytes": 0,
                "kv_bytes_per_block": 0, "target_layer_ids": [], "drafts": "engine"}
    info = proposer.info()
    return {"method": info.method, "num_speculative_tokens": k, "weight_bytes": info.weight_bytes,
            "kv_bytes": kv.bytes if kv is not None else 0, "kv_bytes_per_block": kv_bytes_per_block,
            "target_layer_ids": list(proposer.target_layer_ids), **info.detail}
