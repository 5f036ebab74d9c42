"""Linear layers whose weight may be stacked from several checkpoint tensors.

Fusing q/k/v (and gate/up) into one matmul saves kernel launches and, on the CPU, the Python
overhead of separate calls. The checkpoint keeps them apart, so a stacked weight records
the row sizes of its shards and the loader copies each checkpoint tensor into its rows.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kernels import cpu_linear, cpu_quant_linear
from kernels.activation import silu_and_mul
from kernels.cpu_quant_linear import QuantWeight
from kernels import fp8_linear, w4a16_linear
from kernels.fp8_linear import Fp8Weight
from kernels.linear import _check_fused, linear
from kernels.norm import rms_norm
from kernels.w4a16_linear import W4Weight
from services.worker.layers.fp8 import Fp8Stash, process_fp8
from services.worker.layers.w4a16 import process_w4
from services.worker.layers.module import Module


class Linear(Module):
    """y = x @ W.T (+ b).

    in_features: columns of W. out_features: rows of W, or a list of shard row counts whose
    sum is the rows (shard i fills rows sum(sizes[:i]) .. sum(sizes[:i+1])-1).
    Parameters are created uninitialised (torch.empty, in the default dtype and device):
    the loader fills them. Stacked parameters carry `shard_sizes` for the loader.
    x: [num_tokens, in_features] -> [num_tokens, sum(out_features)].
    forward's keyword arguments fuse a step before or after the matmul (see
    `kernels.linear.linear`): norm_weight / eps an RMSNorm of x, silu_mul a SiLU-and-mul of
    x [num_tokens, 2 * in_features], residual [num_tokens, out] an add to the output.
    weight_dense: on the CPU, the dense column-major weight kept beside a packed `weight` for
    one-row products and every product of a step without drafts (`kernels.cpu_linear.takes_dense`,
    `KEEP_DENSE_ONE_ROW`), else None.
    qweight: on the CPU with `kernels.cpu_quant_linear.QUANTIZATION` int8/int4/gguf, the weight-only
    quantized W (`QuantWeight`) set after loading (or by the GGUF loader from the file's blocks);
    with FP8 weights (`kernels.fp8_linear.MODE`, `services.worker.layers.fp8`) its `Fp8Weight`;
    with 4-bit weights (`kernels.w4a16_linear.MODE`, `services.worker.layers.w4a16`) its
    `W4Weight`; `weight` is then a meta-device parameter of
    W's shape (no values: the dense weight is dropped, and a product on it fails). Else None.
    quantizable: False keeps the layer in the model dtype under --quantization fp8 (MoE
    routers, as vLLM leaves them); the CPU int8/int4 schemes quantize every Linear.
    fp8_stash / fp8_layer: the loader's fp8 checkpoint rows while loading, and whether the
    layer holds (or held, before `loader.dense_weights`) fp8 weights (`layers.fp8`).
    w4_stash / w4_layer: the same for 4-bit AWQ / GPTQ weights (`layers.w4a16`).
    """

    def __init__(self, in_features: int, out_features: int | list[int], bias: bool = False,
                 quantizable: bool = True):
        super().__init__()
        stacked = isinstance(out_features, (list, tuple))
        sizes: list[int] = list(out_features) if isinstance(out_features, (list, tuple)) else [out_features]
        weight = torch.empty(sum(sizes), in_features)
        if weight.device.type == "cpu":  # born in the CPU gemm layout (to_cpu_gemm_layout):
            # the loader copies into it once, instead of a copy and a re-laid second copy
            weight = torch.empty(in_features, sum(sizes)).t()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(sizes)), requires_grad=False) if bias else None
        self.weight_dense: torch.Tensor | None = None  # set by pack_cpu_weight
        self.qweight: QuantWeight | Fp8Weight | W4Weight | None = None  # quantize_cpu_weight / layers.fp8 / .w4a16
        self.quantizable = quantizable
        self.fp8_stash: Fp8Stash | None = None  # the loader's fp8 checkpoint rows (layers.fp8)
        self.fp8_layer = False
        self.w4_stash: dict[int | None, W4Weight] | None = None  # the loader's 4-bit shards (layers.w4a16)
        self.w4_layer = False
        if stacked:
            for p in (self.weight, self.bias):
                if p is not None:
                    setattr(p, "shard_sizes", sizes)  # noqa: B010 (an attribute torch's stubs do not know)

    def forward(self, x: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                silu_mul: bool = False, residual: torch.Tensor | None = None,
                xn_out: torch.Tensor | None = None) -> torch.Tensor:
        """The projection of x [T, in] -> [T, out] with the fused steps of `kernels.linear.linear`
        (norm_weight / eps, silu_mul, residual; xn_out: with norm_weight, receives the normalised
        x [T, in]). Raises ValueError as `linear` for arguments that do not fit."""
        if self.qweight is not None:
            if xn_out is not None:  # the quantized kernels have no such output: the norm apart
                if norm_weight is None:
                    raise ValueError("Linear: xn_out needs norm_weight")
                xn_out.copy_(rms_norm(x, norm_weight, eps))
                x, norm_weight = xn_out, None
            return quant_forward(self.qweight, x, self.bias, norm_weight=norm_weight, eps=eps,
                                 silu_mul=silu_mul, residual=residual)
        dense = self.weight_dense
        w = dense if dense is not None and cpu_linear.takes_dense(x.shape[0]) else self.weight
        if norm_weight is None and residual is None and not silu_mul:
            return linear(x, w, self.bias)
        return linear(x, w, self.bias, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul, residual=residual,
                      xn_out=xn_out)

    def process_weights_after_loading(self) -> None:
        """On the CPU: an fp32 W is replaced by its oneDNN-packed form (`kernels.cpu_linear`:
        same shape and values, fast at every row count; read it back with
        `cpu_linear.dense`), other dtypes are stored column-major (`to_cpu_gemm_layout`);
        with `cpu_linear.KEEP_DENSE_ONE_ROW` the dense weight stays too (`weight_dense`).
        With `cpu_quant_linear.QUANTIZATION` int8/int4/gguf the weight is quantized instead
        (`quantize_cpu_weight`), and no packed or dense copy is kept; a `qweight` the GGUF
        loader set from the file's int4 blocks (services/worker/gguf_loader.py) is kept.
        FP8 weights first (`layers.fp8.process_fp8`): from the loader's fp8 rows, or
        quantized under `kernels.fp8_linear.MODE` "quantize"; then 4-bit weights
        (`layers.w4a16.process_w4`: AWQ / GPTQ shards from the loader, or dummy ones)."""
        if process_fp8(self) or process_w4(self):
            return
        if self.qweight is None and not quantize_cpu_weight(self, "weight"):
            pack_cpu_weight(self, "weight")


@functools.cache
def _meta_weight(n: int, k: int) -> torch.Tensor:
    """A meta [n, k] tensor: the weight shape `_check_fused` checks against, made once a shape (an
    empty meta tensor a call cost ~5 us of the CPU decode step's down projections)."""
    return torch.empty(n, k, device="meta")


def quant_forward(qw: QuantWeight | Fp8Weight | W4Weight, x: torch.Tensor, bias: torch.Tensor | None = None, *,
                  norm_weight: torch.Tensor | None = None, eps: float = 1e-6, silu_mul: bool = False,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """`kernels.linear.linear` on a quantized weight: one row of an `Fp8Weight` whose kernel
    fuses (`Fp8Weight.fuses_one_row`) takes the fused steps inside it
    (`kernels.fp8_linear.fp8_linear`); otherwise the RMSNorm (norm_weight, eps) or
    SiLU-and-mul prologue runs as its own op, then the quantized product (`QuantWeight.matmul`
    on the CPU, `Fp8Weight.matmul`, `W4Weight.matmul`), then the bias and residual adds.
    Shapes and dtypes as `linear` (x [T, K], or [T, 2K] with silu_mul -> [T, N] in x's
    dtype); raises ValueError as it does."""
    if norm_weight is not None or silu_mul or residual is not None:
        _check_fused(x, _meta_weight(qw.out_features, qw.in_features), norm_weight, silu_mul, residual)
        if isinstance(qw, Fp8Weight) and x.shape[0] == 1 and qw.fuses_one_row(x.device, x.dtype):
            return fp8_linear.fp8_linear(x, qw, bias, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul,
                                         residual=residual)
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    if silu_mul:
        x = silu_and_mul(x)
    y = qw.matmul(x)
    if bias is not None:
        y = y.add_(bias)
    return y if residual is None else y.add_(residual)


def quantize_cpu_weight(module: nn.Module, name: str) -> bool:
    """Quantize `module.<name>` (a loaded dense CPU weight [out, in]) into `module.qweight`
    (`cpu_quant_linear.quantize`, scheme `cpu_quant_linear.dense_scheme()`: int8 under gguf)
    when `cpu_quant_linear.quantizes` it, and replace the parameter by a meta-device one of the
    same shape and dtype (`shard_sizes` kept): its values are dropped. Returns whether it
    did (False: quantization off, or not a dense floating CPU weight, e.g. already done)."""
    w = getattr(module, name)
    if not cpu_quant_linear.quantizes(w):
        return False
    set_quantized_weight(module, name, cpu_quant_linear.quantize(w.data, cpu_quant_linear.dense_scheme()))
    return True


def set_quantized_weight(module: nn.Module, name: str, qw: QuantWeight) -> None:
    """Give `module` the quantized weight qw (`module.qweight`) and replace the parameter
    `module.<name>` by a meta-device one of the same shape and dtype (`shard_sizes` kept),
    dropping its values. Raises ValueError when qw's shape is not the parameter's."""
    w = getattr(module, name)
    if (qw.out_features, qw.in_features) != tuple(w.shape):
        raise ValueError(f"quantized weight {qw.out_features}x{qw.in_features} for a parameter of shape "
                         f"{tuple(w.shape)}")
    setattr(module, "qweight", qw)  # noqa: B010
    setattr(module, name, _like(w, torch.empty(w.shape, dtype=w.dtype, device="meta")))


def dequantize_cpu_weight(module: nn.Module, name: str) -> bool:
    """Undo `quantize_cpu_weight` (or an FP8 weight, `layers.fp8`): `module.<name>` becomes a
    dense parameter on the quantized weight's device (the old dtype; column-major on the CPU
    as a CPU Linear is born) of the dequantized values (`QuantWeight.dequantize`,
    `Fp8Weight.dequantize`), `module.qweight` None. Returns whether there was one."""
    qw = getattr(module, "qweight", None)
    if qw is None:
        return False
    old = getattr(module, name)
    values = qw.dequantize()
    if values.device.type == "cpu":
        dense = torch.empty(qw.in_features, qw.out_features, dtype=old.dtype).t()
    else:
        dense = torch.empty(qw.out_features, qw.in_features, dtype=old.dtype, device=values.device)
    dense.copy_(values)
    setattr(module, name, _like(old, dense))
    setattr(module, "qweight", None)  # noqa: B010
    return True


def _like(old: torch.Tensor, data: torch.Tensor) -> nn.Parameter:
    """A frozen parameter of `data` carrying `old`'s `shard_sizes` (when it has them)."""
    p = nn.Parameter(data, requires_grad=False)
    if hasattr(old, "shard_sizes"):
        setattr(p, "shard_sizes", getattr(old, "shard_sizes"))  # noqa: B009, B010 (as in Linear.__init__)
    return p


def quantized_weight_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s quantized weights (`QuantWeight.nbytes` / `Fp8Weight.nbytes` /
    `W4Weight.nbytes` of each `qweight`); 0 without quantization."""
    return sum(qw.nbytes for m in model.modules() for name in ("qweight", "qweight_tied")
               if isinstance(qw := getattr(m, name, None), (QuantWeight, Fp8Weight, W4Weight)))


def held_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights `model` holds: its parameters (each tensor once; meta-device ones,
    whose values were dropped for a quantized copy, count 0), the quantized weights
    (`quantized_weight_bytes`) and the dense one-row copies (`dense_copy_bytes`)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.device.type != "meta" and id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total + quantized_weight_bytes(model) + dense_copy_bytes(model)


def pack_cpu_weight(module: nn.Module, name: str) -> None:
    """Replace `module.<name>` (a loaded CPU weight [out, in]) by its oneDNN-packed
    parameter when `cpu_linear.packable`, else re-lay it (`to_cpu_gemm_layout`). The dense
    tensor is dropped (one copy of the weights), unless `cpu_linear.KEEP_DENSE_ONE_ROW`:
    then it stays, column-major, as the plain tensor `module.<name>_dense` for one-row
    products. `shard_sizes` is kept. Idempotent."""
    w = getattr(module, name)
    if not cpu_linear.packable(w):
        to_cpu_gemm_layout(w)
        return
    p = nn.Parameter(cpu_linear.pack(w.data), requires_grad=False)
    if hasattr(w, "shard_sizes"):
        setattr(p, "shard_sizes", getattr(w, "shard_sizes"))  # noqa: B009, B010 (as in Linear.__init__)
    if cpu_linear.KEEP_DENSE_ONE_ROW:
        to_cpu_gemm_layout(w)  # (a Linear's weight is born so: no copy)
        setattr(module, f"{name}_dense", w.data)
    setattr(module, name, p)


def dense_copy_bytes(model: nn.Module) -> int:
    """Bytes of the dense weights kept beside packed ones for one-row products
    (`pack_cpu_weight` with `cpu_linear.KEEP_DENSE_ONE_ROW`); 0 when none is kept."""
    return sum(t.numel() * t.element_size() for m in model.modules()
               for k, t in vars(m).items() if k.endswith("_dense") and isinstance(t, torch.Tensor))


def unpack_cpu_weights(model: nn.Module) -> int:
    """Replace every packed weight of `model` (`pack_cpu_weight`) by a dense parameter of the
    same values (`cpu_linear.dense`, `shard_sizes` kept), and every quantized one
    (`quantize_cpu_weight`) by a dense parameter of its dequantized values, for code that
    writes or reads weights in place after loading (tests); `loader.process_weights_after_loading`
    packs them again (or quantizes them again: the values then in place, rounded to the
    format; under gguf that is int8, `cpu_quant_linear.dense_scheme`, not the file's int4
    blocks). Returns how many were unpacked."""
    n = 0
    for m in model.modules():
        if getattr(m, "qweight_tied", None) is not None:  # a tied head's copy: its weight is dense
            setattr(m, "qweight_tied", None)  # noqa: B010
            n += 1
        if dequantize_cpu_weight(m, "weight"):
            n += 1
            continue
        for name, w in list(m.named_parameters(recurse=False)):
            if w.is_mkldnn:
                p = nn.Parameter(cpu_linear.dense(w.data), requires_grad=False)
                if hasattr(w, "shard_sizes"):
                    setattr(p, "shard_sizes", getattr(w, "shard_sizes"))  # noqa: B009, B010 (as in Linear.__init__)
                setattr(m, name, p)
                if getattr(m, f"{name}_dense", None) is not None:  # the copy would go stale: packing remakes it
                    setattr(m, f"{name}_dense", None)
                n += 1
    return n


def to_cpu_gemm_layout(weight: torch.Tensor) -> None:
    """Re-lay a CPU [out, in] weight in place so that W.t() is contiguous.

    F.linear then hands MKL a plain [in, out] operand instead of a transposed one; for the
    few-row matmuls of decode that kernel is faster (SmolLM2-135M fp32 on 2 cores: batch-8
    decode step 62 -> 52 ms, batch 1 unchanged). GPU weights keep the row-major layout.
    """
    if weight.device.type == "cpu" and not weight.is_mkldnn and not weight.t().is_contiguous():
        weight.data = weight.data.t().contiguous().t()


def shard_rows(param: torch.Tensor, shard: int | None) -> torch.Tensor:
    """The view of `param` that checkpoint shard `shard` fills (None = the whole tensor).

    Raises IndexError for a shard the parameter does not have.
    """
    sizes = getattr(param, "shard_sizes", None)
    if shard is None or sizes is None:
        return param.data
    if not 0 <= shard < len(sizes):
        raise IndexError(f"shard {shard} out of {len(sizes)}")
    return param.data.narrow(0, sum(sizes[:shard]), sizes[shard])


def weights_unquantized() -> bool:
    """Whether no weight quantization is in use (`kernels.fp8_linear.MODE` and
    `kernels.w4a16_linear.MODE` both "off"): the condition for stacking projections of
    different checkpoint tensors into one weight, which must be one format."""
    return fp8_linear.MODE == "off" and w4a16_linear.MODE == "off"
