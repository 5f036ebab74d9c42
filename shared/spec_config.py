"""`--speculative-config`: what speculative decoding runs with (docs/ARCHITECTURE.md §5.5).

The setting is a JSON object, spelled as vLLM's `--speculative-config`:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "models/SmolLM2-135M-Instruct", "num_speculative_tokens": 4}
    {"method": "eagle", "model": "<EAGLE-3 head folder>", "num_speculative_tokens": 3}
    {"method": "dflash", "model": "<DFlash drafter folder>", "num_speculative_tokens": 8,
     "target_layer_ids": [1, 9, 17, 25], "draft_sampling": "probabilistic"}

Fields:
- method: "ngram" (prompt lookup: the n-gram that ends the context is searched earlier in
  it and what followed is proposed; no weights), "draft_model" (a smaller model folder with
  the target's tokenizer, run in the same worker with its own KV cache group), "eagle" (an
  EAGLE-style head: one decoder layer over the target's hidden states and the next token's
  embedding, arXiv 2401.15077 / 2503.01840), "dflash" (a block drafter that proposes
  `num_speculative_tokens` tokens in one forward, conditioned on hidden states of
  `target_layer_ids`, arXiv 2602.06036).
- num_speculative_tokens: k, the most drafts verified per step (1..16). The policy
  (services/engine/spec_policy.py) chooses 0..k per request and step.
- prompt_lookup_min / prompt_lookup_max: n-gram sizes tried, longest first (ngram only).
- model: the drafter's folder (draft_model, eagle, dflash). With `load_format` dummy it may
  be omitted for eagle/dflash (a head of the target's shape, random weights).
- draft_sampling: "greedy" (drafts are the drafter's argmax: verified as point masses) or
  "probabilistic" (drafts are sampled from the drafter's distribution q, verified by
  rejection sampling against q). ngram is always a point mass.
- target_layer_ids: target layers whose outputs the drafter reads (eagle: 3 layers,
  EAGLE-3's low/mid/high features; dflash: its conditioning layers). Empty: the method's
  default (eagle: 3 layers spread over the depth; dflash: 4).
- policy: "adaptive" (default: k per request and step from its running acceptance rate and
  the batch size, down to 0 where verifying costs more than it gains) or "fixed" (always k:
  for tests and benchmarks).
- load_format: "auto" (the drafter's weights from `model`) or "dummy" (seeded random drafter
  weights without a folder, for tests and timing; also implied by the target's
  `--load-format dummy` when `model` is absent).
- draft_num_layers: dummy drafter depth (draft_model with load_format dummy: a model of the
  target's shape with this many layers; 0 = the target's own depth; dflash with load_format
  dummy and no model: the drafter's layers, 0 = one per target layer it reads).

Errors: `SpeculativeConfig.parse` raises ValueError naming the field for an unknown field, a
wrong type or value, or a field that the method does not take.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from shared.model_spec import load_model_spec

METHODS = ("ngram", "draft_model", "eagle", "dflash")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """The parsed `--speculative-config` (module doc for each field)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    draft_sampling: str = "greedy"
    target_layer_ids: tuple[int, ...] = field(default_factory=tuple)
    policy: str = "adaptive"
    draft_num_layers: int = 0
    load_format: str = "auto"

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """The config from the setting's JSON text (or an already-decoded object, from a
        config file); None for None or "". Raises ValueError naming the field."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                data = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not JSON ({e.msg}, character {e.pos})") from None
        else:
            data = value
        if not isinstance(data, dict):
            raise ValueError("speculative_config: expected a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field {unknown[0]!r} (known: {sorted(known)})")
        method = data.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method: {method!r} is not one of {METHODS}")
        k = data.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens: expected an integer in "
                             f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        ints = ("prompt_lookup_min", "prompt_lookup_max", "draft_num_layers")
        for name in ints:
            v = data.get(name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"speculative_config.{name}: expected a non-negative integer, got {v!r}")
        if method != "ngram":
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if name in data:
                    raise ValueError(f"speculative_config.{name}: only for method 'ngram'")
        if method == "ngram":
            for name in ("model", "draft_sampling", "target_layer_ids", "draft_num_layers"):
                if name in data:
                    raise ValueError(f"speculative_config.{name}: not for method 'ngram'")
        if method not in ("eagle", "dflash") and "target_layer_ids" in data:
            raise ValueError("speculative_config.target_layer_ids: only for methods 'eagle' and 'dflash'")
        lo, hi = data.get("prompt_lookup_min", 2), data.get("prompt_lookup_max", 4)
        if "prompt_lookup_max" in data and "prompt_lookup_min" not in data:
            lo = min(lo, hi)  # vLLM: one given alone bounds the other
        if "prompt_lookup_min" in data and "prompt_lookup_max" not in data:
            hi = max(lo, hi)
        if method == "ngram" and not 1 <= lo <= hi:
            raise ValueError(f"speculative_config: prompt_lookup_min {lo} and prompt_lookup_max {hi} "
                             "must satisfy 1 <= min <= max")
        model = data.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"speculative_config.model: expected a folder path, got {model!r}")
        sampling = data.get("draft_sampling", "greedy")
        if sampling not in ("greedy", "probabilistic"):
            raise ValueError(f"speculative_config.draft_sampling: {sampling!r} is not 'greedy' or 'probabilistic'")
        layers = data.get("target_layer_ids", [])
        if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                   for i in layers):
            raise ValueError(f"speculative_config.target_layer_ids: expected a list of layer indexes, got {layers!r}")
        load_format = data.get("load_format", "auto")
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"speculative_config.load_format: {load_format!r} is not 'auto' or 'dummy'")
        if method == "ngram" and "load_format" in data:
            raise ValueError("speculative_config.load_format: not for method 'ngram'")
        if load_format == "dummy" and model is not None:
            raise ValueError("speculative_config.load_format: 'dummy' makes random weights; it takes no model folder")
        policy = data.get("policy", "adaptive")
        if policy not in ("adaptive", "fixed"):
            raise ValueError(f"speculative_config.policy: {policy!r} is not 'adaptive' or 'fixed'")
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi,
                   model=model, draft_sampling=sampling, target_layer_ids=tuple(layers), policy=policy,
                   draft_num_layers=data.get("draft_num_layers", 0), load_format=load_format)

    def dummy_weights(self, target_load_format: str) -> bool:
        """Whether the drafter gets seeded random weights: no folder, and this config's
        `load_format` or the target's (`--load-format`) is "dummy"."""
        return self.model is None and "dummy" in (self.load_format, target_load_format)

    @property
    def uses_draft_probs(self) -> bool:
        """Whether drafts come with the drafter's distribution (rejection sampling against
        q); False: point-mass drafts (verified by drawing the target and comparing)."""
        return self.method != "ngram" and self.draft_sampling == "probabilistic"

    def to_json(self) -> str:
        """Canonical JSON (what `parse` reads back): method, k and the fields that differ
        from their defaults, sorted."""
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        keep = ("method", "num_speculative_tokens")
        default = asdict(SpeculativeConfig(self.method, self.num_speculative_tokens))
        default["target_layer_ids"] = []
        return json.dumps({k: v for k, v in d.items() if k in keep or v != default[k]}, sort_keys=True)


def normalize_setting(value: str | dict[str, Any]) -> str:
    """The setting's parser (`shared.config_fields`): JSON text or a decoded object -> the
    canonical JSON text, "" unset. Raises ValueError like `SpeculativeConfig.parse`."""
    cfg = SpeculativeConfig.parse(value)
    return "" if cfg is None else cfg.to_json()


# Methods whose drafter keeps a KV cache group of its own, indexed by the target's block ids
# (services/worker/spec/base.py, `Proposer.kv_specs`).
OWN_KV_METHODS = ("draft_model", "eagle", "dflash")


def check_speculative(cfg: Any) -> None:
    """Refuse, at configuration time (before any process starts or weights load),
    speculative settings that cannot work with the rest of `cfg` (a `KestrelConfig`):
    a drafter folder that is missing or whose vocabulary is not the target's, a method
    without the weights it needs, draft_num_layers with a draft folder (it sizes a dummy
    draft), and a drafter with its own KV group (`OWN_KV_METHODS`) together with the
    kvstore tiers (on with kv_offload_cpu_gib > 0 and the prefix cache: a tier stores and
    loads the target's KV only, so a block loaded from it would have no draft KV). Raises
    ValueError naming the setting (`shared.model_spec.ModelFolderError` for a malformed
    draft folder)."""
    spec = SpeculativeConfig.parse(cfg.speculative_config)
    if spec is None:
        return
    import os

    if spec.method in ("draft_model", "eagle", "dflash") and spec.model is None:
        if not spec.dummy_weights(cfg.load_format):
            raise ValueError(f"speculative_config.model: method {spec.method!r} needs the drafter's folder "
                             "(or \"load_format\": \"dummy\" for seeded random drafter weights)")
    if spec.method in OWN_KV_METHODS and (cfg.kv_offload_cpu_gib or 0) > 0 and cfg.enable_prefix_caching:
        raise ValueError(f"speculative_config.method: {spec.method!r} keeps a KV cache of its own, which the "
                         "kvstore tiers do not store (a block loaded from a tier would lack the drafter's KV); "
                         "turn the tiers off (--kv-offload-cpu-gib 0) or use method 'ngram'")
    if spec.method == "draft_model" and spec.model is not None and spec.draft_num_layers:
        raise ValueError("speculative_config.draft_num_layers: sizes a dummy draft (load_format dummy, no "
                         "model); a draft folder has its own depth")
    if spec.model is not None and spec.method in ("draft_model", "eagle", "dflash"):
        conf = os.path.join(spec.model, "config.json")
        if not os.path.isfile(conf):
            raise ValueError(f"speculative_config.model: {spec.model!r} has no config.json")
        if spec.method == "draft_model" and os.path.isfile(os.path.join(cfg.model, "config.json")):
            dv = load_model_spec(spec.model).vocab_size
            tv = load_model_spec(cfg.model).vocab_size
            if dv != tv:
                raise ValueError(f"speculative_config.model: the draft's vocab_size {dv} is not the "
                                 f"target's {tv} (a draft model must share the target's tokenizer)")
    if spec.model is not None and not any(os.path.isfile(os.path.join(spec.model, f))
                                          for f in ("model.safetensors", "model.safetensors.index.json")):
        raise ValueError(f"speculative_config.model: {spec.model!r} has no model.safetensors or "
                         "model.safetensors.index.json (the drafter's weights)")
    target_layers = _target_layers(cfg.model)
    if target_layers is not None:
        bad = [i for i in spec.target_layer_ids if i >= target_layers]
        if bad:
            raise ValueError(f"speculative_config.target_layer_ids: {bad} past the target's {target_layers} layers")
        if spec.draft_num_layers > target_layers:
            raise ValueError(f"speculative_config.draft_num_layers: {spec.draft_num_layers} is deeper than the "
                             f"target's {target_layers} layers")
    if spec.method == "eagle" and spec.target_layer_ids and len(spec.target_layer_ids) != EAGLE_NUM_FEATURE_LAYERS:
        raise ValueError(f"speculative_config.target_layer_ids: an EAGLE-3 head reads {EAGLE_NUM_FEATURE_LAYERS} "
                         f"target layers (its fc fuses their features), got {list(spec.target_layer_ids)}")


EAGLE_NUM_FEATURE_LAYERS = 3  # EAGLE-3 (arXiv 2503.01840): low, middle and high features


def _target_layers(model: str) -> int | None:
    """The target's decoder layers from its folder's config.json (None when it cannot tell)."""
    import os

    if not os.path.isfile(os.path.join(model, "config.json")):
        return None
    try:
        return load_model_spec(model).num_layers
    except ValueError:
        return None
