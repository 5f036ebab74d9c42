"""Helpers of the GPU benchmarks: a model folder from a config in benchmarks/configs, and
the runner's settings."""

from __future__ import annotations

import json
import os
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_dir(config_name: str) -> str:
    """A temporary model folder holding only benchmarks/configs/<config_name>.json as its
    config.json (for `--load-format dummy`; no tokenizer: the benchmarks feed token ids)."""
    src = os.path.join(ROOT, "benchmarks", "configs", config_name + ".json")
    with open(src) as fh:
        cfg = json.load(fh)
    d = tempfile.mkdtemp(prefix=f"kestrel-{config_name}-")
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return d


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
