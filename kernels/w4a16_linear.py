"""4-bit weights with 16-bit activations (W4A16) on the GPU: AWQ and GPTQ checkpoints
(docs/ARCHITECTURE.md §6.4; the formats: `kernels.w4a16_formats`).

`W4Weight` holds one linear layer in Kestrel's layout (qweight int32 [K / 8, N] packed along
K, zeros uint8 [K / G, N], scales fp16 [K / G, N]; W[n, k] = (q[k, n] - z[k // G, n]) *
s[k // G, n]), read from either format at load. Products (`w4a16_linear`), by the rows M of x:
- CPU tensors: `w4a16_linear_ref` (the truth: W dequantized in fp32, x @ W.T in fp32,
  rounded once to x's dtype). The CPU serves AWQ / GPTQ checkpoints dequantized at load into
  the model dtype instead (the loader), so this path is for tests.
- CUDA, M <= SKINNY_MAX_ROWS (decode): `kernels.w4a16_gemv.w4_gemv_triton` (one row: fp32
  FMAs on the nibbles read in place; 2..16 rows: tl.dot on a 16-row tile), K split over
  programs until the GPU is full, fp32 partials summed in a fixed order. A decode step
  reads the packed weight, a quarter of bf16's bytes.
- CUDA, larger M (prefill): `kernels.w4a16_gemm.w4_gemm_triton`, tiles of 64 rows: each K
  tile of W is dequantized in registers to x's dtype and fed to tl.dot (fp32 accumulation).
The tensor-core kernels (2+ rows) feed the dot exact small integers (q - z, or 128 + q /
1024 + q for bf16 / fp16 with the zero subtracted after) and scale after it, or (the GEMM)
round each dequantized element to x's dtype; the one-row kernel keeps fp32. Activations are
never quantized.

`MODE` (set by the model runner before it builds the model): "off"; "checkpoint" (the Linear
layers whose checkpoint tensors are AWQ / GPTQ keep them packed: services/worker/layers/w4a16.py);
"dummy" (--load-format dummy with --quantization awq / gptq: every quantizable Linear gets
random packed values of its shape, `W4Weight.random`, as vLLM's dummy loader fills quantized
parameters). `GROUP_SIZE` is the group size dummy and re-quantized layers use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import w4a16_formats as fmt
from kernels import w4a16_gemm, w4a16_gemv

MODE = "off"  # "off" | "checkpoint" | "dummy" (module docstring)
MODES = ("off", "checkpoint", "dummy")
GROUP_SIZE = 128  # dummy weights and weights quantized again after loader.dense_weights
SKINNY_MAX_ROWS = 16  # rows of x up to which CUDA products take the GEMV / skinny kernel


@dataclass
class W4Weight:
    """One linear layer's 4-bit weight W [out_features, in_features] (module docstring).

    qweight int32 [K / 8, N]; zeros uint8 [K / G, N]; scales fp16 [K / G, N]; group_size G.
    All on one device. Built by `from_awq` / `from_gptq` (checkpoint tensors), `quantize`
    (a float weight, `kernels.w4a16_formats.quantize_groups`), `random` (dummy weights) or
    `cat` (shards stacked along N)."""

    out_features: int
    in_features: int
    group_size: int
    qweight: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    scheme: str = "w4a16"

    @classmethod
    def _of(cls, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> W4Weight:
        k, n = qweight.shape[0] * fmt.PACK, qweight.shape[1]
        return cls(n, k, k // zeros.shape[0], qweight, zeros, scales)

    @classmethod
    def from_awq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> W4Weight:
        """From AWQ tensors (`kernels.w4a16_formats.from_awq`), on their device."""
        return cls._of(*fmt.from_awq(qweight, qzeros, scales))

    @classmethod
    def from_gptq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  g_idx: torch.Tensor | None = None) -> W4Weight:
        """From GPTQ v1 tensors (`kernels.w4a16_formats.from_gptq`), on their device."""
        return cls._of(*fmt.from_gptq(qweight, qzeros, scales, g_idx))

    @classmethod
    def quantize(cls, w: torch.Tensor, group_size: int = GROUP_SIZE) -> W4Weight:
        """Asymmetric round-to-nearest of a float w [N, K] (`quantize_groups`), on w's device.
        Raises ValueError when group_size does not divide K or K is not a multiple of 8."""
        q, z, s = fmt.quantize_groups(w, group_size)
        return cls._of(fmt.pack_rows(q), z.to(torch.uint8), s)

    @classmethod
    def random(cls, n: int, k: int, group_size: int, device: torch.device,
               generator: torch.Generator | None = None, std: float = 0.02) -> W4Weight:
        """Random packed values of W [n, k] (dummy weights): uniform q and zero 8, scales
        with (q - 8) * s of standard deviation ~std (q - 8 has ~4.6)."""
        kp, g = k // fmt.PACK, k // group_size
        qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (kp, n), dtype=torch.int32, device=device, generator=generator)
        zeros = torch.full((g, n), 8, dtype=torch.uint8, device=device)
        scales = torch.full((g, n), std / 4.6, dtype=torch.float16, device=device)
        return cls(n, k, group_size, qw, zeros, scales)

    @classmethod
    def cat(cls, parts: list[W4Weight]) -> W4Weight:
        """The weight of `parts` stacked along N (a fused qkv / gate_up Linear). Raises
        ValueError for parts of different K or group size."""
        if len({(p.in_features, p.group_size) for p in parts}) != 1:
            raise ValueError("w4a16: shards of one weight must share K and the group size, got "
                             f"{[(p.in_features, p.group_size) for p in parts]}")
        if len(parts) == 1:
            return parts[0]
        return cls._of(torch.cat([p.qweight for p in parts], 1).contiguous(),
                       torch.cat([p.zeros for p in parts], 1).contiguous(),
                       torch.cat([p.scales for p in parts], 1).contiguous())

    def to(self, device: torch.device) -> W4Weight:
        """This weight's tensors on `device`."""
        return W4Weight(self.out_features, self.in_features, self.group_size, self.qweight.to(device),
                        self.zeros.to(device), self.scales.to(device))

    @property
    def nbytes(self) -> int:
        """Bytes held (packed values, zeros, scales)."""
        return self.qweight.numel() * 4 + self.zeros.numel() + self.scales.numel() * 2

    def dequantize(self) -> torch.Tensor:
        """The fp32 [out_features, in_features] weight this one stands for."""
        return fmt.dequantize_groups(fmt.unpack_rows(self.qweight), self.zeros, self.scales)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] -> [M, out_features] in x's dtype (`w4a16_linear`)."""
        return w4a16_linear(x, self)


def w4a16_linear_ref(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The truth: x [M, K] @ w.dequantize().T (+ bias [N]) in fp32, rounded to x's dtype."""
    y = x.float() @ w.dequantize().to(x.device).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def w4a16_linear(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T (+ bias) for a `W4Weight`: x [M, in_features] (bf16 / fp16 on CUDA; any
    float dtype on the CPU: the reference), bias [out_features] or None -> [M, out_features]
    in x's dtype; the kernel by M as the module docstring says. Raises ValueError when x's
    width is not in_features."""
    n, k = w.out_features, w.in_features
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"w4a16 linear: x {tuple(x.shape)} does not fit weight ({n}, {k})")
    if not x.is_cuda or w4a16_gemv.w4_gemv_triton is None or w4a16_gemm.w4_gemm_triton is None:
        return w4a16_linear_ref(x, w, bias)
    if x.shape[0] == 0:
        return x.new_empty((0, n))
    xc = x if x.stride(1) == 1 else x.contiguous()
    if x.shape[0] <= SKINNY_MAX_ROWS:
        return w4a16_gemv.w4_gemv_triton(xc, w.qweight, w.zeros, w.scales, w.group_size, bias)
    return w4a16_gemm.w4_gemm_triton(xc, w.qweight, w.zeros, w.scales, w.group_size, bias)
