"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_linear
from kernels.cpu_linear import dense_linear_onednn, packed_linear
from kernels import cpu_quant_linear
from kernels.cpu_quant_linear import QuantWeight
from services.worker.layers.linear import pack_cpu_weight, quantize_cpu_weight, to_cpu_gemm_layout
from services.worker.layers.module import Module


class VocabEmbedding(Module):
    """weight [vocab, hidden]; input_ids [num_tokens] int64 -> [num_tokens, hidden]."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(Module):
    """Logits of the given hidden states: [n, hidden] -> [n, vocab] fp32.

    tie_to: an embedding whose weight this head shares (tied embeddings), or None for a
    weight of its own. Call it only on the positions to be sampled. On the CPU the weight
    is re-laid column-major after loading (see `to_cpu_gemm_layout`); a tied embedding then
    looks rows up with a strided gather, which costs little next to the matmuls. An untied
    fp32 weight is packed like `Linear`'s, with its dense copy `weight_dense` for one-row
    products and steps without drafts (`kernels.cpu_linear.takes_dense`) where
    `kernels.cpu_linear.KEEP_DENSE_ONE_ROW` keeps one (else None); with CPU
    weight quantization (`kernels.cpu_quant_linear.QUANTIZATION`) an untied weight is
    quantized instead (`qweight`, as `Linear`'s); a tied one stays the embedding's (whose rows
    the lookups read in fp32) and the head's products take an int8 copy of it (`qweight_tied`,
    whichever scheme: an int4 head measured far lossier; +28 MB for SmolLM2's 49152 x 576;
    under gguf that is an int8 copy of the dequantized GGUF embedding, e.g. SmolLM2's Q8_0; its
    product in "w8a8" where the CPU has VNNI, `cpu_quant_linear.head_scheme`).
    An untied head's weight in a GGUF's int4 blocks becomes `qweight` at load (gguf_loader.py).
    """

    def __init__(self, vocab_size: int, hidden: int, tie_to: VocabEmbedding | None = None):
        super().__init__()
        self.tied = tie_to is not None
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden), requires_grad=False)
        self.weight_dense: torch.Tensor | None = None  # one-row copy beside a packed weight (`Linear`'s)
        self.qweight: QuantWeight | None = None  # an untied CPU weight quantized (`Linear`'s)
        self.qweight_tied: QuantWeight | None = None  # a quantized copy of a tied weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q = self.qweight if self.qweight is not None else self.qweight_tied
        if q is not None:
            return q.matmul(hidden).float()
        if self.weight_dense is not None and cpu_linear.takes_dense(hidden.shape[0]):
            return F.linear(hidden, self.weight_dense).float()
        if self.weight.is_mkldnn or (not hidden.is_cuda and dense_linear_onednn(hidden, self.weight)):
            return packed_linear(hidden, self.weight)
        return F.linear(hidden, self.weight).float()

    def process_weights_after_loading(self) -> None:
        if self.tied:
            to_cpu_gemm_layout(self.weight)
            # int8 whatever the scheme: an int4 copy of SmolLM2's head raised the mean KL
            # against fp32 from 0.0006 to 0.058 (tests/parity/test_cpu_quant_accuracy.py);
            # "w8a8" (its int8 weight, activations int8 per row) where the CPU has VNNI
            self.qweight_tied = cpu_quant_linear.quantize(self.weight.data, cpu_quant_linear.head_scheme()) \
                if cpu_quant_linear.quantizes(self.weight) else None
        elif self.qweight is None and not quantize_cpu_weight(self, "weight"):  # (kept: the GGUF loader's)
            pack_cpu_weight(self, "weight")
