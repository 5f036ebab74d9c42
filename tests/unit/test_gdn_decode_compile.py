"""Gated DeltaNet's in-place decode kernels (kernels/gdn_decode.py) and the gated RMSNorm kernel
(kernels/norm.py) compiled ahead of time for the H200 (sm90) on a machine without a GPU:
Triton's front end and ptxas (shipped in Triton's wheel) accept them at Qwen3.5-35B-A3B's shapes
with the launch shapes the dispatchers use, and ptxas reports no spill (no stack frame) for the
recurrent kernel's tiles at K = 128: the fixed config (8 value columns, one warp), every
`REC_LAUNCH` entry and the sweep's candidates (`REC_CANDIDATES`, at most 64 state values a
thread; 32 columns in one warp or 64 in two spill, 104 and 88 bytes measured). The interpreter tests
(test_gdn_decode_interp.py) check what the kernels compute; this checks that the compiled path
exists, which the interpreter does not. Skipped without Triton's CUDA backend or its tools.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")

from kernels import gdn_decode, norm  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # an older Triton's layout
    pytest.skip("triton.compiler.ASTSource / GPUTarget not available", allow_module_level=True)

SM90 = GPUTarget("cuda", 90, 32)


def _compile(fn, sig: dict, consts: dict, num_warps: int):
    try:
        return triton.compile(ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}},
                                        constexprs=consts), target=SM90, options={"num_warps": num_warps})
    except (RuntimeError, FileNotFoundError) as e:  # no ptxas in this Triton install
        if "ptxas" in str(e).lower():
            pytest.skip(f"no ptxas: {e}")
        raise


def _stack_bytes(kernel) -> int | None:
    """The compiled kernel's stack frame from cuobjdump --dump-resource-usage (None without it)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    tool = tool if os.path.exists(tool) else shutil.which("cuobjdump")
    if not tool:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    for part in out.split():
        if part.startswith("STACK:"):
            return int(part.split(":")[1])
    return None


@pytest.mark.parametrize("w", [2, 3, 4])
def test_conv_update_kernel_compiles_for_sm90(w):
    sig = {"x_ptr": "*bf16", "s_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16",
           "slot_ptr": "*i64", "init_ptr": "*u8", "sx_n": "i32", "init_stride": "i32", "C": "i32"}
    k = _compile(gdn_decode._conv_update_kernel, sig,
                 {"W": w, "HAS_BIAS": False, "SILU": True, "BLOCK_C": gdn_decode.TUNING["block_c"]},
                 gdn_decode.TUNING["conv_warps"])
    assert "ptx" in k.asm


# the fixed config, every REC_LAUNCH entry, and benchmarks/gdn_decode_sweep.py's candidates
REC_CONFIGS = sorted({(gdn_decode.TUNING["block_v"], gdn_decode.TUNING["rec_warps"], gdn_decode.TUNING["rec_order"])}
                     | {(e[1], e[2], e[3]) for e in gdn_decode.REC_LAUNCH}
                     | {(bv, w, "flat") for bv, w in gdn_decode.REC_CANDIDATES})


@pytest.mark.parametrize("block_v,warps,order", REC_CONFIGS)
def test_recurrent_step_kernel_compiles_for_sm90_without_spills(block_v, warps, order):
    sig = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "alog_ptr", "dtb_ptr")}
    sig.update({"s_ptr": "*fp32", "o_ptr": "*bf16", "slot_ptr": "*i64", "init_ptr": "*u8"})
    sig.update({n: "i32" for n in ("sq_n", "sq_h", "sk_n", "sk_h", "sv_n", "sv_h", "sa_n", "sb_n", "init_stride")})
    sig["scale"] = "fp32"
    k = _compile(gdn_decode._gdr_decode_kernel, sig,
                 {"HV": 32, "GROUP": 2, "K": 128, "V": 128, "BK": 128, "BV": block_v, "NVT": 128 // block_v,
                  "FLAT": order == "flat", "L2NORM": True, "EPS": 1e-6},
                 warps)
    stack = _stack_bytes(k)
    if stack is None:
        pytest.skip("no cuobjdump to read the resource usage")
    assert stack == 0, f"the [128, {block_v}] state tile in {warps} warp(s) spills: {stack} bytes of stack"


def test_gated_rms_norm_kernel_compiles_for_sm90():
    sig = {"x_ptr": "*bf16", "g_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sx_t": "i32", "sx_h": "i32",
           "sg_t": "i32", "sg_h": "i32", "n_cols": "i32", "eps": "fp32"}
    assert "ptx" in _compile(norm._rms_norm_gated_kernel, sig, {"H": 32, "BLOCK": 128}, 4).asm
