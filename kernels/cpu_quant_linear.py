"""Weight-only quantized linear layers on the CPU: y = x @ dequant(Wq).T (+ b), int8 or int4.

Why: CPU decode streams every weight of the model from memory once per step; fp32 weights
are 4 bytes a value, int8 one and int4 half. The products run through PyTorch's own packed
weight-only kernels (ATen ops of the torch CPU build, the ones torchao's CPU weight-only
int8/int4 layouts call):

- int8: `torch.ops.aten._weight_int8pack_mm(x [M, K], w int8 [N, K], scales [N]) -> [M, N]`,
  x, scales and the output in one of fp32/bf16/fp16; symmetric per-output-channel.
- int4: `torch.ops.aten._convert_weight_to_int4pack_for_cpu(w int32 [N, K] of 0..15,
  innerKTiles) -> uint8 [N, K / 2]` once at load, then `torch.ops.aten.
  _weight_int4pack_mm_for_cpu(x [M, K], packed, group_size, scale_and_zeros [K / G, N, 2])
  -> [M, N]`: asymmetric group-wise ("tinygemm" format: w = (q - 8) * scale + zero, q in
  0..15, scale and zero per group of G consecutive input columns of one output row).
  The kernel needs N % 16 == 0 and G in {32, 64, 128, 256} (checked in torch 2.13's CPU
  build); other shapes are padded here (zero rows of W, zero columns of W and x).
  The int8 kernel with bf16 x reads K in steps of 16 and crashes the process otherwise
  (K = 8, 17, 24, 40, 100 segfaulted; 16, 32, 48, 64, 80, 96, 576 ran): K is padded to a
  multiple of INT8_K_ALIGN the same way.

Activations: both kernels are fast only with bf16 x in this build (torch 2.13 CPU, AVX-512
with BF16, 1 thread, SmolLM2-135M's 30 layers of qkv/o/gate_up/down at one row, ms a step:
fp32 dense (MKL) 30-39, oneDNN-packed fp32 36-40; int8 with bf16 x 16-23, with fp32 x 90;
int4 bf16 x 6.2-6.8 for G 32/64/128, fp32 x ~190). So x is cast to bf16 (ACT_DTYPE) for the
product and the result back to x's dtype; the scales are stored in bf16 as the kernels read
them. At 8 rows: fp32 packed 34, int8 36-39, int4 22-26 ms; at 128 rows (prefill chunks)
the quantized products were 1.1-1.6x the packed fp32 one on a loaded machine.

End to end (SmolLM2-135M, one worker thread, the 2-core VM at load ~3, the three models in
one process, interleaved, best of 4): decode 60.1 / 43.0 / 32.5 ms a token for none / int8 /
int4 (1.4x, 1.85x); a 512-token prefill 1.94 / 2.17 / 1.93 s. What int4 leaves is the tied
lm_head, which stays fp32 (49152x576: 5.8 ms a row; an int4 copy would take 1.6 ms) and the
step's other ops. Accuracy: tests/parity/test_cpu_quant_accuracy.py.

The tied LM head's int8 copy (`head_scheme`) takes "w8a8" where the CPU has VNNI: the same
per-channel int8 weight, multiplied by oneDNN's int8 inner product (`onednn::qlinear_prepack`
/ `qlinear_pointwise`, the ops PyTorch's x86 PT2E quantization lowers to) with the activations
quantized per row at run time, less each row's W8A8_OUTLIERS largest |x| columns, which are
multiplied exactly by the fp32 weight's rows beside it (the tied embedding, which the head
keeps anyway; LLM.int8()'s outlier split, by magnitude per row rather than by a threshold):
s_m = max |x[m, inliers]| / 127, u8 codes round(x / s_m) + 128 (zero point 128) with the
outlier columns zeroed, the kernel's int32 dots scaled by the weight's scales, the row by
s_m, plus x[m, outliers] @ W[:, outliers].T in fp32. SmolLM2's final hidden states have a few
channels ~8x the row's rms: quantized per row without the split, the head's mean KL against
fp32 went 0.0017 -> 0.0081 (its 202 prompt positions, head alone); with 8 split columns 0.0007.
SmolLM2's 49152x576 head, one row, one thread, L3 flushed: 2.09 ms (`_weight_int8pack_mm`,
bf16 x) -> 1.08 ms (the product alone). Without VNNI oneDNN's u8 x s8 dots may saturate in
int16, so the head keeps "int8" there (docs/ARCHITECTURE.md §6.4 "CPU weight-only
quantization").

int4 where the CPU has AVX-512 VNNI and the extension builds (`INT4_VNNI`, on): Kestrel's own
kernel instead (kernels/cpu_int4_vnni.py: x quantized to int8 per group of 32 at run time, u8 x s8
integer dots, llama.cpp's Q4_1 x Q8 idea), in its own copy of the weight (5 bits a weight as
tinygemm's; `pack_int4` makes one or the other, both with INT4_KEEP_TINYGEMM). x goes in two
int8 planes (`cpu_int4_vnni.X_PLANES`; one plane's error failed the accuracy bound). One thread,
SmolLM2's layer products (benchmarks/cpu_int4_kernel_micro.py): 2.6x tinygemm's at one row, 1.5x
at 64 rows; a decode step 25.0 -> 16.0 ms (int4), 26.0 -> 16.5 (gguf) on the loaded VM; KL against
fp32 0.0011 -> 0.00064 (docs/ARCHITECTURE.md §6.4 "CPU int4 x int8 kernel").

`quantize_int8` / `quantize_int4` are the pure-torch quantizers (fp32 math),
`dequantize_int8` / `dequantize_int4` their inverses, `quant_linear_ref` the truth of the
product (dequantize, then x @ W.T in fp32). `QuantWeight` holds one layer's packed weight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kernels import cpu_int4_vnni, ref_fast

log = logging.getLogger(__name__)

# the weight-only scheme a CPU worker's Linear layers take after loading (set by the model
# runner before loading, from the `quantization` setting): "none", "int8", "int4" or "gguf"
# (int4 groups taken from a GGUF's blocks, dense weights int8: `dense_scheme`)
QUANTIZATION = "none"
SCHEMES = ("none", "int8", "int4", "gguf")
# int4 group size (input columns per scale and zero); a K it does not divide takes the
# largest of INT4_GROUPS below it that does (SmolLM2's K = 576 is not a multiple of 128)
INT4_GROUP_SIZE = 32
INT4_GROUPS = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu accepts
INT4_N_ALIGN = 16  # rows of W a multiple of this (the pack op's requirement)
INT8_K_ALIGN = 16  # columns of W a multiple of this (the bf16 int8 kernel's; module doc)
ACT_DTYPE = torch.bfloat16  # the activations' dtype inside the products (module doc)
# the tied head's copy in "w8a8" where `w8a8_available` (module doc); off: "int8"
HEAD_W8A8 = True
W8A8_ZERO_POINT = 128  # the u8 activation codes' zero point (codes round(x / s) + 128 in 1..255)
W8A8_OUTLIERS = 8  # columns of x a row multiplies in fp32 instead (module doc)
# int4 products through the AVX-512 VNNI kernel (int8 activations, kernels/cpu_int4_vnni.py) where
# it builds here: `pack_int4` then makes the kernel's copy of the weight instead of tinygemm's (the
# same 5 bits a weight; the kernel takes any number of rows). Off: tinygemm's copy, and its kernel.
INT4_VNNI = True
# keep tinygemm's copy beside the VNNI one (twice the int4 bytes): for an A/B of the two products in
# one process (benchmarks/cpu_decode_profile.py --int4-ab) and tests; INT4_VNNI then picks the product
INT4_KEEP_TINYGEMM = False
XBUF_ROWS = 16  # rows of x whose ACT_DTYPE copy goes through a reused buffer (QuantWeight._xbuf)
_INT4_INNER_K_TILES = 2  # the convert op's argument (the CUDA layout's; the CPU layout is fixed)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of w [N, K] (any float dtype): returns (q int8 [N, K],
    scale fp32 [N]) with scale_n = max_k |w[n, k]| / 127 (1 for an all-zero row) and
    q = clamp(round(w / scale), -127, 127), so |w - q * scale| <= scale / 2 elementwise
    (fp32 rounding aside). The format of `_weight_int8pack_mm`'s weight and scales."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K], scale [N] (any float dtype) -> fp32 [N, K] = q * scale."""
    return q.float() * scale.float()[:, None]


def int4_group_size(k: int, preferred: int | None = None) -> int:
    """The group size used for K input columns: the largest of INT4_GROUPS that is at most
    `preferred` (default INT4_GROUP_SIZE) and divides K, else `preferred` (K is then padded
    to a multiple of it)."""
    pref = preferred or INT4_GROUP_SIZE
    for g in INT4_GROUPS:
        if g <= pref and k % g == 0:
            return g
    return pref


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise 4-bit quantization of w [N, K] (K % group_size == 0, any float
    dtype) in the tinygemm format of `_weight_int4pack_mm_for_cpu`: for each row n and group
    g of `group_size` consecutive columns, lo/hi = min/max of the group,
    scale = max(hi - lo, 1e-6) / 15, q = clamp(round((w - lo) / scale), 0, 15),
    zero = lo + 8 * scale, so that w ~ (q - 8) * scale + zero and |w - that| <= scale / 2.
    Returns (q int32 [N, K] in 0..15, scale fp32 [N, K / G], zero fp32 [N, K / G]).
    Raises ValueError when group_size does not divide K."""
    n, k = w.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"quantize_int4: group size {group_size} does not divide K={k}")
    wg = w.float().reshape(n, k // group_size, group_size)
    lo, hi = wg.amin(dim=2), wg.amax(dim=2)
    scale = (hi - lo).clamp(min=1e-6) / 15.0
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32)
    return q.reshape(n, k), scale, lo + 8.0 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """q [N, K] of 0..15, scale and zero [N, K / G] (any float dtype) -> fp32 [N, K] =
    (q - 8) * scale + zero, group by group."""
    n, k = q.shape
    g = k // scale.shape[1]
    qg = q.float().reshape(n, k // g, g)
    return ((qg - 8.0) * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)


def quant_linear_ref(x: torch.Tensor, w_dequant: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The truth of a quantized product: x [M, K] @ w_dequant [N, K].T (+ bias [N]) in fp32,
    rounded to x's dtype -> [M, N]."""
    y = x.float() @ w_dequant.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def w8a8_available() -> bool:
    """Whether this CPU and torch build run the "w8a8" scheme: oneDNN's quantized linear ops
    are registered and the CPU has VNNI (u8 x s8 dots into int32 without an int16 step)."""
    try:
        torch.ops.onednn.qlinear_pointwise  # noqa: B018 (an attribute lookup that may raise)
        torch.ops.onednn.qlinear_prepack  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.cpu._is_vnni_supported())


def head_scheme() -> str:
    """The scheme of a tied LM head's quantized copy (`LMHead.qweight_tied`): "w8a8" when
    HEAD_W8A8 is on and `w8a8_available`, else "int8" (module doc)."""
    return "w8a8" if HEAD_W8A8 and w8a8_available() else "int8"


def quantize_act_u8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic quantization of activations x [M, K] (float): returns (codes uint8
    [M, K] = round(x / s) + W8A8_ZERO_POINT, s fp32 [M, 1] = max_k |x[m, k]| / 127, or 1 for
    an all-zero row), so that x ~ (codes - 128) * s with |error| <= s / 2."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.div(xf, s).round_().add_(W8A8_ZERO_POINT).to(torch.uint8)
    return q, s


def split_outliers(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (inliers fp32 [M, K]: x with each row's n largest |x| columns set to
    0, idx int64 [M, n]: those columns, vals fp32 [M, n]: their values), so that
    x = inliers + scatter(idx, vals) row by row (n = 0: no columns)."""
    xf = x.float()
    idx = xf.abs().topk(n, dim=1, sorted=False).indices
    return xf.scatter(1, idx, 0.0), idx, xf.gather(1, idx)


_ZERO_I32 = torch.zeros((), dtype=torch.int32)  # the int8 weight's zero point (symmetric)


@dataclass
class QuantWeight:
    """One CPU linear layer's weight-only quantized W [out_features, in_features].

    scheme "int8": packed int8 [N, K'] (K rounded up to INT8_K_ALIGN, zero columns), scales
    ACT_DTYPE [N] (`quantize_int8`).
    scheme "int4": packed uint8 [N', K' / 2] (`_convert_weight_to_int4pack_for_cpu`; N' is N
    rounded up to INT4_N_ALIGN, K' is K rounded up to group_size, both zero-padded),
    scales ACT_DTYPE [K' / G, N', 2] of (scale, zero) pairs (`quantize_int4`); with INT4_VNNI
    where the kernel builds, `vnni`: uint8 [N' / 16, K' / 32, 320] (`cpu_int4_vnni.pack`) and
    `packed` / `scales` empty, unless INT4_KEEP_TINYGEMM keeps them too.
    scheme "w8a8": `onednn::qlinear_prepack`'s opaque (mkldnn) copy of the int8 [N, K] codes
    of `quantize_int8`, scales fp32 [N], and `dense_t`: the fp32 W.T [K, N] (a view of the
    weight it was made from, not a copy) whose rows multiply each x row's W8A8_OUTLIERS
    largest columns; the rest quantized per row (`split_outliers`, `quantize_act_u8`).
    Built by `quantize`; `matmul` is the product, `dequantize` the weight it stands for.
    """

    scheme: str
    out_features: int
    in_features: int
    packed: torch.Tensor
    scales: torch.Tensor
    group_size: int = 0
    dense_t: torch.Tensor | None = None  # "w8a8": the float W.T [K, N] the outlier columns read
    vnni: torch.Tensor | None = None  # "int4": the VNNI kernel's copy (`cpu_int4_vnni.pack`), or None
    # ref_fast.FEWER_OPS: the ACT_DTYPE copy of x for M <= XBUF_ROWS rows, reused (one copy_
    # instead of x.to's four ATen calls; the product reads it before the next call)
    _xbuf: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Bytes held (packed weight and scales, and the int4 VNNI copy where there is one)."""
        held = [self.packed, self.scales] + ([self.vnni] if self.vnni is not None else [])
        return sum(t.numel() * t.element_size() for t in held)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] (fp32/bf16/fp16; row-strided views are made contiguous) ->
        [M, out_features] in x's dtype: x cast to ACT_DTYPE, the packed kernel, cast back.
        Equals `quant_linear_ref(x.to(ACT_DTYPE), self.dequantize())` up to the kernel's
        summation order and the ACT_DTYPE rounding of the output.
        int4 with a `vnni` copy (and INT4_VNNI on, where tinygemm's copy is kept too): the VNNI
        kernel instead, `cpu_int4_vnni.mm` (x quantized to int8 per group of 32; its weight's
        (s, m) in fp16 from the unrounded scales, `dequantize`): equals
        `cpu_int4_vnni.mm_ref(x, self.vnni, N)` up to fp32 accumulation."""
        if self.scheme == "w8a8":
            return self._matmul_w8a8(x)
        if self.vnni is not None and (INT4_VNNI or not self.packed.numel()):
            return cpu_int4_vnni.mm(x, self.vnni, self.out_features)
        int8 = self.scheme == "int8"
        kp = self.packed.shape[1] * (1 if int8 else 2)
        m = x.shape[0]
        if ref_fast.FEWER_OPS and kp == self.in_features and m <= XBUF_ROWS and x.dim() == 2:
            xa = self._xbuf.get(m)
            if xa is None:
                xa = self._xbuf[m] = torch.empty(m, kp, dtype=ACT_DTYPE)
            xa.copy_(x)  # the same rounding as x.to(ACT_DTYPE)
        else:
            xa = x.to(ACT_DTYPE)
            if not xa.is_contiguous():
                xa = xa.contiguous()
        if kp != self.in_features:
            xa = torch.nn.functional.pad(xa, (0, kp - self.in_features))
        if int8:
            y = torch.ops.aten._weight_int8pack_mm(xa, self.packed, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xa, self.packed, self.group_size, self.scales)
            if y.shape[1] != self.out_features:
                y = y[:, :self.out_features].contiguous()
        if ref_fast.FEWER_OPS and y.dtype != x.dtype:  # y.to(x.dtype) in two ATen calls, not four
            return torch.empty(y.shape, dtype=x.dtype).copy_(y)
        return y.to(x.dtype)

    def _matmul_w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """The "w8a8" product (module doc): x [M, K] -> [M, N] in x's dtype. Each row's
        W8A8_OUTLIERS largest |x| columns times `dense_t`'s rows in fp32; the rest quantized
        per row (`quantize_act_u8`) into oneDNN's u8 x s8 inner product (exact int32 dots,
        times the weight's scales, in fp32), times the row's s. Equals
        `quant_linear_ref((codes - 128) * s, self.dequantize())` + outliers @ W[:, idx].T up
        to fp32 rounding."""
        assert self.dense_t is not None  # set by quantize
        k = min(W8A8_OUTLIERS, self.in_features)
        xi, idx, vals = split_outliers(x, k)
        q, s = quantize_act_u8(xi)
        y = torch.ops.onednn.qlinear_pointwise(q, 1.0, W8A8_ZERO_POINT, self.packed, self.scales, _ZERO_I32,
                                               None, 1.0, 0, torch.float32, "none", [], "")
        y = y.mul_(s)
        if k:  # sum_j vals[m, j] * dense_t[idx[m, j]] without gathering the rows first
            w = self.dense_t
            y.add_(torch.nn.functional.embedding_bag(idx, w, per_sample_weights=vals.to(w.dtype), mode="sum"))
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The fp32 [out_features, in_features] weight this one stands for (its stored
        scales, ACT_DTYPE-rounded, included): the reference's W. An int4 weight with only the
        VNNI copy: `cpu_int4_vnni.dequantize` (q * s + m, s and m in fp16)."""
        n, k = self.out_features, self.in_features
        if self.scheme == "w8a8":
            return dequantize_int8(self.packed.to_dense().t(), self.scales)
        if self.scheme == "int8":
            return dequantize_int8(self.packed[:, :k], self.scales)
        if self.vnni is not None and not self.packed.numel():  # the VNNI copy alone
            return cpu_int4_vnni.dequantize(self.vnni, n, k)
        kp, g = self.packed.shape[1] * 2, self.group_size
        # the codes through the kernel itself (its packed layout is its own): with scale 1 and
        # zero 8 every group reads (q - 8) * 1 + 8 = q, exact in ACT_DTYPE, and identity rows
        # pick column j of W; then the stored scales and zeros in fp32
        ones = torch.empty(self.scales.shape, dtype=ACT_DTYPE)
        ones[..., 0], ones[..., 1] = 1.0, 8.0
        eye = torch.eye(kp, dtype=ACT_DTYPE)
        q = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, g, ones).t()  # [N', K'] of 0..15
        sz = self.scales.float().transpose(0, 1)  # [N', K'/G, 2]
        return dequantize_int4(q, sz[..., 0], sz[..., 1])[:n, :k].contiguous()


def quantize(w: torch.Tensor, scheme: str, group_size: int | None = None) -> QuantWeight:
    """The `QuantWeight` of a CPU weight w [N, K] (fp32/bf16/fp16, any strides): scheme
    "int8", "int4" (group size: `int4_group_size(K, group_size)`) or "w8a8" (where
    `w8a8_available`; it keeps w.T, a view of a column-major w, which must then stay
    unchanged, else a contiguous copy). Raises
    ValueError for another scheme or an empty weight."""
    n, k = w.shape
    if n == 0 or k == 0:
        raise ValueError(f"quantize: empty weight {tuple(w.shape)}")
    if scheme == "w8a8":
        q, s = quantize_int8(w)
        packed = torch.ops.onednn.qlinear_prepack(q.contiguous(), [1, k])
        wt = w.t()  # the outlier rows: a view of a column-major w (the tied head's layout), else a copy
        return QuantWeight("w8a8", n, k, packed, s.float().contiguous(), dense_t=wt if wt.is_contiguous() else wt.contiguous())
    if scheme == "int8":
        q, s = quantize_int8(w)
        kp = -(-k // INT8_K_ALIGN) * INT8_K_ALIGN
        if kp != k:
            q = torch.nn.functional.pad(q, (0, kp - k))
        return QuantWeight("int8", n, k, q.contiguous(), s.to(ACT_DTYPE))
    if scheme != "int4":
        raise ValueError(f"quantize: unknown scheme {scheme!r} (int8, int4, w8a8)")
    g = int4_group_size(k, group_size)
    kpad = -(-k // g) * g
    wf = w.float()
    if kpad != k:
        wf = torch.nn.functional.pad(wf, (0, kpad - k))
    q, scale, zero = quantize_int4(wf, g)
    return pack_int4(q, scale, zero, k)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, in_features: int | None = None) -> QuantWeight:
    """The int4 `QuantWeight` of given groups in the tinygemm format (w = (q - 8) * scale +
    zero): q [N, K'] of 0..15 (any integer dtype), scale and zero [N, K' / G] (any float
    dtype; stored in ACT_DTYPE, the one rounding this adds), G = K' / scale.shape[1] in
    INT4_GROUPS. in_features: the real K when K' carries zero padding (default K'). Rows are
    padded to INT4_N_ALIGN with zero weights (scale and zero 0). With INT4_VNNI on where
    `cpu_int4_vnni.available()` (the first call may build the extension): the VNNI kernel's
    copy from the unrounded scale and zero (`QuantWeight.vnni`) instead of tinygemm's (`packed`
    and `scales` then empty), beside it with INT4_KEEP_TINYGEMM. Used by `quantize` and by
    the GGUF loader, whose Q4_0 / Q4_1 / Q4_K blocks are such groups (kernels/gguf_quant.py).
    Raises ValueError for a group size the kernel does not take."""
    n, kp = q.shape
    g = kp // scale.shape[1] if scale.shape[1] else 0
    if g not in INT4_GROUPS or g * scale.shape[1] != kp or scale.shape != zero.shape or scale.shape[0] != n:
        raise ValueError(f"pack_int4: codes {tuple(q.shape)}, scales {tuple(scale.shape)}, zeros "
                         f"{tuple(zero.shape)}: group size must be one of {INT4_GROUPS}")
    in_features = kp if in_features is None else in_features
    vnni = None
    if INT4_VNNI and cpu_int4_vnni.available():
        try:
            vnni = cpu_int4_vnni.pack(q, scale, zero)
        except ValueError as e:  # an (s, m) past fp16's range: this layer stays on tinygemm
            log.warning("pack_int4: no VNNI copy of a [%d, %d] weight: %s", n, kp, e)
    if vnni is not None and not INT4_KEEP_TINYGEMM:
        empty = torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=ACT_DTYPE)
        return QuantWeight("int4", n, in_features, *empty, g, vnni=vnni)
    npad = -(-n // INT4_N_ALIGN) * INT4_N_ALIGN
    q32, s32, z32 = q.to(torch.int32), scale.float(), zero.float()
    if npad != n:
        q32 = torch.nn.functional.pad(q32, (0, 0, 0, npad - n), value=8)
        s32, z32 = (torch.nn.functional.pad(t, (0, 0, 0, npad - n)) for t in (s32, z32))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q32.contiguous(), _INT4_INNER_K_TILES)
    sz = torch.stack([s32, z32], dim=2).transpose(0, 1).contiguous().to(ACT_DTYPE)  # [K'/G, N', 2]
    return QuantWeight("int4", n, in_features, packed, sz, g, vnni=vnni)


def dense_scheme() -> str:
    """The scheme a dense weight takes under QUANTIZATION: int8 / int4 as set; with "gguf"
    (the linear weights come from a GGUF's int4 blocks, services/worker/gguf_loader.py) the
    weights that arrive dense (GGUF types with no exact int4 form, e.g. Q8_0; a draft model's)
    take int8. Raises ValueError when QUANTIZATION is none."""
    if QUANTIZATION not in SCHEMES[1:]:
        raise ValueError(f"dense_scheme: quantization is {QUANTIZATION!r}")
    return "int8" if QUANTIZATION == "gguf" else QUANTIZATION


def quantizes(weight: torch.Tensor) -> bool:
    """Whether a Linear's loaded weight is quantized after loading: QUANTIZATION is int8,
    int4 or gguf and the weight is a dense 2-D floating CPU tensor."""
    return (QUANTIZATION in SCHEMES[1:] and weight.device.type == "cpu" and weight.dim() == 2
            and weight.is_floating_point() and not weight.is_mkldnn and weight.numel() > 0)
