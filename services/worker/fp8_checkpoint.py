"""The FP8 tensors of a checkpoint whose config.json has an FP8 `quantization_config`
(`shared.weight_quant.CheckpointQuant`; docs/ARCHITECTURE.md §6.3), for the loader.

Tensor names, as both published layouts write them: an fp8 weight `<module>.weight`
(float8_e4m3fn [N, K]) with its scale `<module>.weight_scale` (compressed-tensors; quant_method
"fp8" per tensor) or `<module>.weight_scale_inv` (quant_method "fp8" with blocks), fp32 or
bf16, of shape [N, 1] / [N] (per channel), one element (per tensor) or [ceil(N / bn),
ceil(K / bk)] (per block); `<module>.input_scale` (static activations) is read by nobody:
activations are quantized per token. Layers a checkpoint keeps unquantized (its `ignore` /
`modules_to_not_convert`) are plain tensors without a scale and load as before.

`Fp8Checkpoint.open` reads every scale up front (they are small, and a shard file may hold
a weight whose scale sits in another); the loader asks `is_scale` to skip them, `quantized`
whether a tensor is an fp8 weight, then takes either `rows` (per-row e4m3 values and fp32
scales, for a Linear that keeps fp8 weights: `services.worker.layers.fp8`) or `dequantized`
(fp32 values, for every other parameter, and for every one on the CPU or without FP8
weights in use).
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

from kernels.fp8_linear import FP8_DTYPE, checkpoint_rows, dequantize_checkpoint
from shared.weight_quant import CheckpointQuant

WEIGHT_SCALES = ("weight_scale", "weight_scale_inv")  # a weight's scale tensor, per layout
SCALE_SUFFIXES = tuple("." + s for s in WEIGHT_SCALES) + (".input_scale",)


class Fp8Checkpoint:
    """The scales of one FP8 checkpoint and the conversions of its fp8 weights.

    quant: the checkpoint's format (its block size is the block scales'). scales: tensor
    name -> its weight scale, as read. Built by `open`."""

    def __init__(self, quant: CheckpointQuant, scales: dict[str, torch.Tensor]):
        self.quant = quant
        self.scales = scales

    @classmethod
    def open(cls, files: list[str], quant: CheckpointQuant) -> Fp8Checkpoint:
        """Read the weight scales of every file of the checkpoint."""
        scales: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name.rpartition(".")[2] in WEIGHT_SCALES:
                        scales[name] = f.get_tensor(name)
        return cls(quant, scales)

    @staticmethod
    def is_scale(name: str) -> bool:
        """Whether a checkpoint tensor is a scale (read here, not a parameter)."""
        return name.endswith(SCALE_SUFFIXES)

    def scale_of(self, name: str) -> torch.Tensor | None:
        """The scale tensor of weight `name` (`<module>.weight`), None when it has none."""
        base = name.rpartition(".")[0]
        for s in WEIGHT_SCALES:
            t = self.scales.get(f"{base}.{s}")
            if t is not None:
                return t
        return None

    def quantized(self, name: str, tensor: torch.Tensor, file: str) -> bool:
        """Whether tensor `name` is an fp8 weight (float8_e4m3fn with a scale). Raises
        ValueError for an fp8 tensor without a scale, or a scale whose weight is not fp8."""
        scale = self.scale_of(name) if name.endswith(".weight") else None
        fp8 = tensor.dtype == FP8_DTYPE
        if fp8 and scale is None:
            raise ValueError(f"tensor {name} in {os.path.basename(file)}: float8_e4m3fn without a "
                             f"weight_scale or weight_scale_inv tensor")
        if scale is not None and not fp8:
            raise ValueError(f"tensor {name} in {os.path.basename(file)}: {tensor.dtype} but the checkpoint "
                             "has a scale for it (fp8 weights are float8_e4m3fn)")
        return fp8

    def rows(self, name: str, q: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row (q float8_e4m3fn [N, K], scale fp32 [N]) of fp8 weight `name` on `device`
        (`kernels.fp8_linear.checkpoint_rows`; a block-scaled weight is converted there).
        Raises ValueError naming the tensor for a scale of the wrong shape."""
        scale = self.scale_of(name)
        assert scale is not None  # `quantized` said so
        try:
            return checkpoint_rows(q.to(device), scale.to(device), self.quant.block)
        except ValueError as e:
            raise ValueError(f"tensor {name}: {e}") from None

    def dequantized(self, name: str, q: torch.Tensor, device: torch.device) -> torch.Tensor:
        """fp32 [N, K] values of fp8 weight `name`, computed on `device`
        (`kernels.fp8_linear.dequantize_checkpoint`). Raises ValueError as `rows`."""
        scale = self.scale_of(name)
        assert scale is not None
        try:
            return dequantize_checkpoint(q.to(device), scale.to(device), self.quant.block)
        except ValueError as e:
            raise ValueError(f"tensor {name}: {e}") from None
