"""Model registry: Hugging Face architecture name (config.json `architectures[0]`) -> class.

Each architecture lives in its own file; each class is a `torch.nn.Module` that implements
`base.CausalLM` (built as cls(spec, max_positions), spec a `shared.model_spec.ModelSpec`).
"""

from __future__ import annotations

from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.qwen3 import Qwen3ForCausalLM
from services.worker.models.qwen3_moe import Qwen3MoeForCausalLM
from services.worker.models.qwen3_next import (Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration,
                                               Qwen3NextForCausalLM)
from shared.model_spec import ModelSpec

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
}

# model_type -> architecture, for config files whose `architectures` is missing or null
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                  "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def model_class(spec: ModelSpec) -> type:
    """The class for a model: its architecture, or its model_type's when config.json names
    none.

    Raises ValueError naming the architecture and the supported ones when it is unknown.
    """
    arch = spec.architecture or _BY_MODEL_TYPE.get(spec.model_type, "")
    if arch in MODEL_REGISTRY:
        return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported architecture {arch!r} (model_type {spec.model_type!r}); "
                     f"supported: {sorted(MODEL_REGISTRY)}")
