"""Kestrel's CPU int4 x int8 product for a few rows of x: AVX-512 VNNI, a C++ extension.

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

Product (`mm`): per row of x and group g, dx = max |x| / 127, qx = round(x / dx) (int8),
sx = dx * sum(qx); y[n] = sum_g (s[n, g] dx[g] dot(q[n, g], qx[g]) + m[n, g] sx[g]), which is
(q s + m) @ (qx dx) exactly up to fp32 rounding (`quantize_x` gives the kernel's qx, dx, sx).
The error against the unquantized x is that of Q8 per group: |x - qx dx| <= dx / 2.

The extension is built on first use with `torch.utils.cpp_extension.load` (ninja and a C++
compiler; cached in torch's extensions folder, `TORCH_EXTENSIONS_DIR`, under a lock that makes
concurrent first builds safe), only where the CPU has AVX-512 F/BW/VL and VNNI. Where any of that
is missing or the build fails, `available()` is False (one warning logged) and callers keep
`_weight_int4pack_mm_for_cpu`.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch

log = logging.getLogger(__name__)

TILE_N = 16  # output rows a tile
GROUP = 32  # input columns a group (one dx, one s and m)
GROUP_BYTES = 320  # bytes a tile's group: 256 of codes, 16 fp16 s, 16 fp16 m
_REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c")
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "int4_vnni.cpp")
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c", "-fopenmp"]

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "ext": the loaded module, or None once a build or check failed


def cpu_supported() -> bool:
    """Whether this CPU has the ISA the kernel is compiled for (/proc/cpuinfo's flags: AVX-512
    F/BW/VL, AVX512_VNNI, F16C). False where /proc/cpuinfo is not readable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return all(fl in flags for fl in _REQUIRED_FLAGS)
    except OSError:
        pass
    return False


def _build() -> Any:
    """Load (building if needed) the extension; None with one warning where it cannot be."""
    if not cpu_supported():
        log.warning("int4 VNNI kernel off: the CPU lacks one of %s; int4 stays on "
                    "_weight_int4pack_mm_for_cpu", ", ".join(_REQUIRED_FLAGS))
        return None
    try:
        from torch.utils import cpp_extension

        return cpp_extension.load(name="kestrel_int4_vnni", sources=[_SOURCE], extra_cflags=_FLAGS,
                                  extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # a missing compiler or ninja, a failed build: serve without it
        log.warning("int4 VNNI kernel off: building %s failed (%s: %s); int4 stays on "
                    "_weight_int4pack_mm_for_cpu", _SOURCE, type(e).__name__, str(e).strip()[-300:])
        return None


def extension() -> Any:
    """The loaded extension module (built once a process, on first call), or None."""
    if "ext" not in _state:
        with _lock:
            if "ext" not in _state:
                _state["ext"] = _build()
    return _state["ext"]


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


def mm(x: torch.Tensor, packed: torch.Tensor, n_out: int) -> torch.Tensor:
    """x [M, K] (fp32/bf16/fp16, K <= 32 NG; past K the weight's columns meet zeros) @ the
    `pack`ed weight's first n_out rows .T -> [M, n_out] in x's dtype, the activations quantized
    to int8 per group of 32 (module doc). Raises RuntimeError (from the extension) for shapes
    that do not fit, AttributeError where `available()` is False."""
    ext = _state["ext"] if "ext" in _state else extension()
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    y = ext.int4_vnni_mm(xf, packed, n_out)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def quantize_x(x: torch.Tensor, ng: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's quantization of x [M, K] (any float dtype, K <= 32 ng), through the
    extension: (qx int8 [M, 32 ng], zero past K; dx fp32 [M, ng]; sx fp32 [M, ng] = dx * sum
    of the group's qx). `quantize_x_ref` is its pure-torch twin. For tests."""
    qx, dx, sx = extension().quantize_x(x.float().contiguous(), ng)
    return qx, dx, sx


def quantize_x_ref(x: torch.Tensor, ng: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch Q8 of x [M, K] per group of 32 as the kernel does it (fp32: id = 127 / max |x|,
    qx = round_half_even(x * id), dx = max |x| / 127; an all-zero group: 0, 0): the same
    (qx int8 [M, 32 ng], dx fp32 [M, ng], sx fp32 [M, ng]) as `quantize_x`. Raises ValueError
    when K > 32 ng."""
    m, k = x.shape
    if k > ng * GROUP:
        raise ValueError(f"quantize_x_ref: K={k} > 32 * {ng}")
    xg = torch.nn.functional.pad(x.float(), (0, ng * GROUP - k)).reshape(m, ng, GROUP)
    amax = xg.abs().amax(dim=2)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = (xg * inv[..., None]).round_().clamp_(-127, 127)
    dx = amax / 127.0
    return q.to(torch.int8).reshape(m, ng * GROUP), dx, dx * q.sum(dim=2)


def mm_ref(x: torch.Tensor, packed: torch.Tensor, n_out: int) -> torch.Tensor:
    """The truth of `mm` in pure torch: (qx dx) [M, K] @ `dequantize(packed)`.T in float64
    (`quantize_x_ref`), fp32 [M, n_out]. `mm` equals it up to its fp32 accumulation."""
    m, k = x.shape
    qx, dx, _ = quantize_x_ref(x, packed.shape[1])
    xd = (qx.double().reshape(m, -1, GROUP) * dx.double()[..., None]).reshape(m, -1)[:, :k]
    return (xd @ dequantize(packed, n_out, k).double().t()).float()
