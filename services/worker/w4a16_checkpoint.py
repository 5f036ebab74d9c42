"""The 4-bit tensors of a checkpoint whose config.json has an AWQ or GPTQ `quantization_config`
(`shared.weight_quant.CheckpointQuant`, method "awq" / "gptq"; docs/ARCHITECTURE.md §6.3), for
the loader.

Tensor names, as AutoAWQ and AutoGPTQ / GPTQModel write them (layouts: kernels/w4a16_formats.py):
a quantized Linear `<module>` has `<module>.qweight`, `<module>.qzeros`, `<module>.scales`
(and, GPTQ, an optional `<module>.g_idx`) instead of `<module>.weight`; its `<module>.bias`,
if any, is a plain tensor. Layers a checkpoint keeps unquantized (`modules_to_not_convert`,
lm_head, embeddings, norms) are plain tensors and load as before.

`W4Checkpoint.open` reads every qzeros / scales / g_idx up front (small; a shard file may
hold a qweight whose scales sit in another); the loader skips them (`is_aux`), and at each
`<module>.qweight` takes `weight` (a `kernels.w4a16_linear.W4Weight`, for a Linear that keeps
packed weights: services/worker/layers/w4a16.py) or its `dequantize()` (fp32 [N, K], for every
other parameter, and for every one on the CPU or without W4A16 in use).
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from kernels.w4a16_linear import W4Weight
from shared.weight_quant import CheckpointQuant

AUX = ("qzeros", "scales", "g_idx")  # a qweight's companion tensors
QWEIGHT = ".qweight"


class W4Checkpoint:
    """The companion tensors of one AWQ / GPTQ checkpoint and the conversion of its qweights.

    quant: the checkpoint's format (method, group size). aux: tensor name -> tensor, as read.
    Built by `open`."""

    def __init__(self, quant: CheckpointQuant, aux: dict[str, torch.Tensor]):
        self.quant = quant
        self.aux = aux

    @classmethod
    def open(cls, files: list[str], quant: CheckpointQuant) -> W4Checkpoint:
        """Read the qzeros, scales and g_idx tensors of every file of the checkpoint."""
        aux: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name.rpartition(".")[2] in AUX:
                        aux[name] = f.get_tensor(name)
        return cls(quant, aux)

    @staticmethod
    def is_aux(name: str) -> bool:
        """Whether a checkpoint tensor is a qweight's companion (read here, not a parameter)."""
        return name.rpartition(".")[2] in AUX

    @staticmethod
    def weight_name(name: str) -> str | None:
        """`<module>.weight`, the parameter a `<module>.qweight` fills; None for other names."""
        return name[:-len(QWEIGHT)] + ".weight" if name.endswith(QWEIGHT) else None

    def weight(self, name: str, qweight: torch.Tensor, device: torch.device) -> W4Weight:
        """The `W4Weight` of `<module>.qweight` (int32) with its qzeros / scales (/ g_idx), on
        `device`. Raises ValueError naming the tensor for a missing companion, a dtype or shape
        that does not fit the format, or a group size other than the config's."""
        base = name[:-len(QWEIGHT)]
        got = {a: self.aux.get(f"{base}.{a}") for a in AUX}
        missing = [a for a in ("qzeros", "scales") if got[a] is None]
        if missing or qweight.dtype != torch.int32:
            raise ValueError(f"tensor {name}: {self.quant.method} qweight ({qweight.dtype}) needs int32 and "
                             f"{base}.qzeros / .scales; missing {missing}")
        qz, sc = got["qzeros"], got["scales"]
        assert qz is not None and sc is not None
        try:
            if self.quant.method == "awq":
                w = W4Weight.from_awq(qweight.to(device), qz.to(device), sc.to(device))
            else:
                gi = got["g_idx"]
                w = W4Weight.from_gptq(qweight.to(device), qz.to(device), sc.to(device),
                                       None if gi is None else gi.to(device))
        except ValueError as e:
            raise ValueError(f"tensor {name}: {e}") from None
        want = self.quant.group_size
        if want not in (None, -1) and w.group_size != want:
            raise ValueError(f"tensor {name}: group size {w.group_size} from its scales, the config says {want}")
        return w
