"""Model registry: Hugging Face architecture name (config.json `architectures[0]`) -> class.

Each architecture lives in its own file; each class is a `torch.nn.Module` that implements
`base.CausalLM` (built as cls(hf_config, max_positions)).
"""

from __future__ import annotations

from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

# model_type -> architecture, for config files whose `architectures` is missing or null
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def model_class(hf_config: dict) -> type:
    """The class for a config.json dict.

    Raises ValueError naming the architecture and the supported ones when it is unknown.
    """
    archs = hf_config.get("architectures") or [_BY_MODEL_TYPE.get(hf_config.get("model_type", ""), "")]
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported architecture {archs} (model_type {hf_config.get('model_type')!r}); "
                     f"supported: {sorted(MODEL_REGISTRY)}")
