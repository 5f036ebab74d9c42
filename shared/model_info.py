"""Facts about a Hugging Face model folder that every service needs (no torch import).

Reads `config.json` and, when present, `generation_config.json` (HF formats).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    """What the engine and frontend need to know about a model folder.

    max_position_embeddings: tokens. eos_token_ids: every id that ends generation
    (config.json and generation_config.json merged).
    """

    path: str
    architecture: str
    model_type: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


def _ids(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v]


def load_model_info(path: str) -> ModelInfo:
    """Read a model folder's facts.

    Raises FileNotFoundError if `path` has no config.json, ValueError if it is malformed.
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} is not a Hugging Face model folder (no config.json); "
                                "run `kestrel fetch-model` for the default model")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    gen: dict = {}
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as fh:
            gen = json.load(fh)
    eos = _ids(cfg.get("eos_token_id")) + _ids(gen.get("eos_token_id"))
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    try:
        return ModelInfo(
            path=os.path.abspath(path),
            architecture=archs[0],
            model_type=cfg.get("model_type", "llama"),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            bos_token_id=cfg.get("bos_token_id", gen.get("bos_token_id")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed config.json in {path!r}: {e}") from None
