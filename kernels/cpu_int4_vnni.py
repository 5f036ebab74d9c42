"""Kestrel's CPU int4 x int8 product (any rows of x; made for decode's few): AVX-512 VNNI, a C++ extension.

Why: `_weight_int4pack_mm_for_cpu` widens the int4 weights to bf16 and multiplies in floating
point; at one row it is compute-bound (~8 GB/s of int4 weight bytes on the 2-core EPYC VM).
Here the activations are quantized to int8 per group of 32 at run time and the products are
integer dots (`vpdpbusd`: 4 u8 x s8 products into each int32 lane): the idea of llama.cpp's
Q4_1 x Q8 dot product, written for this layout (kernels/csrc/int4_vnni.cpp, no code taken).

Format (`pack`): uint8 [T, NG, 320] for N = 16 T output rows (zero-padded) and K = 32 NG input
columns; tile t, group g is 256 bytes of codes (byte 4r + i of 64-byte vector j: row 16t + r's
code of column 32g + 4j + i in the low nibble, of column 32g + 16 + 4j + i in the high nibble),
then fp16 s[16], fp16 m[16] (one per row), with w = q * s + m, q in 0..15. From the tinygemm
format of kernels/cpu_quant_linear.py (w = (q - 8) * scale + zero): s = scale,
m = zero - 8 * scale (computed in fp32, rounded once to fp16). A group size G > 32 repeats its
(s, m) for each of its G / 32 sub-groups. 5 bits a weight, as the tinygemm copy with bf16 pairs.

Product (`mm`): per row of x and group g, d = max |x| / 127, q1 = round(x / d) (int8: one
plane, llama.cpp's Q8_0), sx = the sum of the dequantized x; y[n] = sum_g (s[n, g] d[g]
dot(q[n, g], q1[g]) + m[n, g] sx[g]), which is (q s + m) @ x_hat exactly up to fp32 rounding,
x_hat = q1 d (`quantize_x` gives the kernel's codes, `dequantize_x` x_hat). One plane's error,
|x - x_hat| <= d / 2 = max |x| / 254 a group, raised SmolLM2's KL against fp32 from tinygemm's
0.0011 to 0.0038 (its outlier channels take the group's scale), past the accuracy test's bound.
So by default (X_PLANES = 2) a second int8 plane holds the first's rounding error,
q2 = round((x / d - q1) * 254), x_hat = (254 q1 + q2) d / 254, |x - x_hat| <= max |x| / 64516:
twice the integer dots, summed exactly in int32 as 254 dot1 + dot2; KL 0.00064. Alone, a layer's
one-row products take ~1.8x one plane's time (48 -> 88 us, tinygemm 232); in the model step by
step the two were within noise (12.6 / 12.8 ms, 16.0 / 16.2: the weights come from memory).
Rows of x go 4 at a time over a tile of 16 weight rows (more rows: the tile again, from L1);
`at::parallel_for` over tiles.

The extension is built on first use with `torch.utils.cpp_extension.load` (ninja and a C++
compiler; cached in torch's extensions folder, `TORCH_EXTENSIONS_DIR`, under a lock that makes
concurrent first builds safe; ~30 s on the 2-core VM, 0.25 s to load once built), only where the
CPU has AVX-512 F/BW/VL, VNNI and F16C. Where any of that
is missing or the build fails, `available()` is False (one warning logged) and callers keep
`_weight_int4pack_mm_for_cpu`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from kernels import cpu_ext

log = logging.getLogger(__name__)

TILE_N = 16  # output rows a tile
GROUP = 32  # input columns a group (one dx, one s and m)
GROUP_BYTES = 320  # bytes a tile's group: 256 of codes, 16 fp16 s, 16 fp16 m
# int8 planes of x a group (1 or 2): 1, Q8 as llama.cpp's Q8_0 (|error| <= max |x| / 254 a group);
# 2, a second plane of the first's rounding error (<= max |x| / 64516), twice the integer dots (module doc)
X_PLANES = 2
_REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c")
_SOURCE = os.path.join(cpu_ext.CSRC, "int4_vnni.cpp")
# -ffp-contract=off: x * (127 / amax) - q1 must round as torch's two ops do (quantize_x_ref), not as one FMA
# (cpu_ext.build adds -fopenmp: at::parallel_for's OpenMP body)
_FLAGS = ["-O3", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c"]



def cpu_supported() -> bool:
    """Whether this CPU has the ISA the kernel is compiled for (/proc/cpuinfo's flags: AVX-512
    F/BW/VL, AVX512_VNNI, F16C). False where /proc/cpuinfo is not readable."""
    flags = cpu_ext.cpu_flags()
    return all(fl in flags for fl in _REQUIRED_FLAGS)


def _build() -> Any:
    """Load (building if needed) the extension; None with one warning where it cannot be."""
    fallback = "int4 stays on _weight_int4pack_mm_for_cpu"
    if not cpu_supported():
        log.warning("int4 VNNI kernel off: the CPU lacks one of %s; %s", ", ".join(_REQUIRED_FLAGS), fallback)
        return None
    return cpu_ext.build("kestrel_int4_vnni", _SOURCE, _FLAGS, "int4 VNNI kernel", fallback, logger=log)


_loader = cpu_ext.Loader(_build)  # state "ext": the loaded module, or None once a build or check failed


def extension() -> Any:
    """The loaded extension module (built once a process, on first call), or None."""
    return _loader.get()


def available() -> bool:
    """Whether `mm` runs here: the CPU has the ISA and the extension built and loaded."""
    return extension() is not None


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The kernel's weight from tinygemm-format groups (w = (q - 8) * scale + zero): q [N, K] of
    0..15 (any integer dtype), scale and zero [N, K / G] (any float dtype), G a multiple of 32;
    N is padded to a multiple of 16 with zero rows. Returns uint8 [ceil(N / 16), K / 32, 320]
    (module doc). Raises ValueError for other shapes, or where s or m do not fit fp16 (|v| >
    65504 or not finite)."""
    n, k = q.shape
    if k % GROUP or scale.shape != zero.shape or scale.shape[0] != n or scale.shape[1] == 0 \
            or k % scale.shape[1] or (k // scale.shape[1]) % GROUP:
        raise ValueError(f"int4_vnni.pack: codes {tuple(q.shape)}, scales {tuple(scale.shape)}, zeros "
                         f"{tuple(zero.shape)}: K and the group size must be multiples of {GROUP}")
    rep = k // scale.shape[1] // GROUP
    s = scale.float()
    mo = zero.float() - 8.0 * s
    s16, m16 = s.to(torch.float16), mo.to(torch.float16)
    if not (torch.isfinite(s16).all() and torch.isfinite(m16).all()):
        raise ValueError("int4_vnni.pack: a scale or offset does not fit fp16")
    if rep > 1:
        s16, m16 = s16.repeat_interleave(rep, dim=1), m16.repeat_interleave(rep, dim=1)
    npad, ng = -(-n // TILE_N) * TILE_N, k // GROUP
    qu = q.to(torch.uint8)
    if npad != n:
        qu = torch.nn.functional.pad(qu, (0, 0, 0, npad - n))
        s16, m16 = (torch.nn.functional.pad(t, (0, 0, 0, npad - n)) for t in (s16, m16))
    t = npad // TILE_N
    # (tile, row, group, half, j, i) with column 32 g + 16 half + 4 j + i -> (tile, group, half, j, row, i)
    qg = qu.reshape(t, TILE_N, ng, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
    codes = (qg[:, :, 0] | (qg[:, :, 1] << 4)).reshape(t, ng, 256)
    sb = s16.reshape(t, TILE_N, ng).transpose(1, 2).contiguous().view(torch.uint8)  # [T, NG, 32]
    mb = m16.reshape(t, TILE_N, ng).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat([codes, sb, mb], dim=2).contiguous()


def dequantize(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The fp32 [n, k] weight a `pack`ed one stands for: q * s + m (the test's truth; pure torch,
    independent of the extension)."""
    t, ng, _ = packed.shape
    codes = packed[:, :, :256].reshape(t, ng, 4, TILE_N, 4)  # (tile, group, j, row, i)
    lo, hi = codes & 15, codes >> 4
    q = torch.stack([lo, hi], dim=2)  # (tile, group, half, j, row, i)
    q = q.permute(0, 4, 1, 2, 3, 5).reshape(t * TILE_N, ng * GROUP).float()
    s = packed[:, :, 256:288].contiguous().view(torch.float16).float().transpose(1, 2).reshape(t * TILE_N, ng)
    mo = packed[:, :, 288:].contiguous().view(torch.float16).float().transpose(1, 2).reshape(t * TILE_N, ng)
    w = q.reshape(t * TILE_N, ng, GROUP) * s[..., None] + mo[..., None]
    return w.reshape(t * TILE_N, ng * GROUP)[:n, :k]


def mm(x: torch.Tensor, packed: torch.Tensor, n_out: int, planes: int | None = None) -> torch.Tensor:
    """x [M, K] (fp32/bf16/fp16, K <= 32 NG; past K the weight's columns meet zeros) @ the
    `pack`ed weight's first n_out rows .T -> [M, n_out] in x's dtype, the activations quantized
    per group of 32 to `planes` (default X_PLANES) int8 planes (module doc). Raises RuntimeError
    (from the extension) for shapes that do not fit or planes not 1 or 2, AttributeError where
    `available()` is False."""
    ext = extension()
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    y = ext.int4_vnni_mm(xf, packed, n_out, planes or X_PLANES)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def quantize_x(x: torch.Tensor, ng: int, planes: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's quantization of x [M, K] (any float dtype, K <= 32 ng), through the
    extension: (qx int8 [M, ng * planes * 32]: per group `planes` planes of 32 codes, zero past
    K; dx fp32 [M, ng]: the last plane's scale; sx fp32 [M, ng]: the sum of the group's
    dequantized x). `quantize_x_ref` is its pure-torch twin. For tests."""
    qx, dx, sx = extension().quantize_x(x.float().contiguous(), ng, planes)
    return qx, dx, sx


def quantize_x_ref(x: torch.Tensor, ng: int, planes: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch quantization of x [M, K] per group of 32 as the kernel does it, in fp32:
    v = x * (127 / max |x|), q1 = round_half_even(v), d = max |x| / 127 (an all-zero group: 0);
    planes 2: also q2 = round_half_even((v - q1) * 254) and d / 254. Returns the same (qx, dx,
    sx) as `quantize_x`; `dequantize_x` gives the x they stand for. Raises ValueError when
    K > 32 ng or planes is not 1 or 2."""
    m, k = x.shape
    if k > ng * GROUP or planes not in (1, 2):
        raise ValueError(f"quantize_x_ref: K={k} > 32 * {ng} or planes={planes}")
    xg = torch.nn.functional.pad(x.float(), (0, ng * GROUP - k)).reshape(m, ng, GROUP)
    amax = xg.abs().amax(dim=2)
    # a tensor / tensor division (IEEE, as the kernel's); `127.0 / amax` is reciprocal() * 127
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    v = xg * inv[..., None]
    q1 = v.round().clamp_(-127, 127)
    d = amax / 127.0
    if planes == 1:
        return q1.to(torch.int8).reshape(m, -1), d, d * q1.sum(dim=2)
    q2 = ((v - q1) * 254.0).round_().clamp_(-127, 127)
    d2 = d / 254.0
    qx = torch.stack([q1, q2], dim=2).to(torch.int8).reshape(m, -1)
    return qx, d2, d2 * (254 * q1.sum(dim=2) + q2.sum(dim=2))


def dequantize_x(qx: torch.Tensor, dx: torch.Tensor, k: int) -> torch.Tensor:
    """The float64 x [M, k] that (qx, dx) of `quantize_x` stand for: q1 dx (one plane) or
    (254 q1 + q2) dx (two)."""
    m, ng = dx.shape
    planes = qx.shape[1] // (ng * GROUP)
    q = qx.double().reshape(m, ng, planes, GROUP)
    codes = q[:, :, 0] if planes == 1 else 254.0 * q[:, :, 0] + q[:, :, 1]
    return (codes * dx.double()[..., None]).reshape(m, ng * GROUP)[:, :k]


def mm_ref(x: torch.Tensor, packed: torch.Tensor, n_out: int, planes: int | None = None) -> torch.Tensor:
    """The truth of `mm` in pure torch: `dequantize_x(quantize_x_ref(x))` @ `dequantize(packed)`.T
    in float64 -> fp32 [M, n_out]. `mm` equals it up to its fp32 accumulation."""
    m, k = x.shape
    qx, dx, _ = quantize_x_ref(x, packed.shape[1], planes or X_PLANES)
    return (dequantize_x(qx, dx, k) @ dequantize(packed, n_out, k).double().t()).float()
