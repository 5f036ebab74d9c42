"""Gated DeltaNet's in-place decode kernels (kernels/gdn_decode.py) and the gated RMSNorm kernel
(kernels/norm.py) compiled ahead of time for the H200 (sm90) on a machine without a GPU:
Triton's front end and ptxas (shipped in Triton's wheel) accept them at Qwen3.5-35B-A3B's shapes
with the launch shapes the dispatchers use, and ptxas reports no spill (no stack frame) for the
recurrent kernel's tiles at K = 128: the fixed config (8 value columns, one warp), every
`REC_LAUNCH` entry and the sweep's candidates (`REC_CANDIDATES`, at most 64 state values a
thread; 32 columns in one warp or 64 in two spill, 104 and 88 bytes measured), and that
those tiles move the state in 128-bit loads and stores. The interpreter tests
(test_gdn_decode_interp.py) check what the kernels compute; this checks that the compiled path
exists, which the interpreter does not. Skipped without Triton's CUDA backend or its tools.
"""

from __future__ import annotations

import os
import re
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


def _compile(fn, sig: dict, consts: dict, num_warps: int, aligned: tuple[str, ...] = ()):
    """fn compiled for sm90; `aligned`: arguments specialised as multiples of 16 (bytes for a
    pointer), as a launch specialises them when they are (Triton's default for pointers and
    ints not in do_not_specialize)."""
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    try:
        return triton.compile(ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}},
                                        constexprs=consts, attrs=attrs), target=SM90,
                              options={"num_warps": num_warps})
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
REC_CONFIGS = sorted({(8, 1, "grid3", 1, 1)} | {tuple(e[1:]) for e in gdn_decode.REC_LAUNCH}
                     | {(bv, w, "flat", 1, 1) for bv, w in gdn_decode.REC_CANDIDATES}
                     | {(bv, w, "flat", it, st) for bv, w, it, st in gdn_decode.REC_LOOP_CANDIDATES})


def _compile_rec(block_v: int, warps: int, order: str, items: int, stages: int):
    """The recurrent kernel at Qwen3.5's shape with bf16 inputs, its pointers and q/k/v/a/b
    strides 16-aligned as at a model launch (row strides 8192 and 64, head strides 128); the
    slot and flag pointers and the flags' stride unspecialised, as the kernel declares."""
    sig = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "alog_ptr", "dtb_ptr")}
    sig.update({"s_ptr": "*fp32", "o_ptr": "*bf16", "slot_ptr": "*i64", "init_ptr": "*u8"})
    strides = ("sq_n", "sq_h", "sk_n", "sk_h", "sv_n", "sv_h", "sa_n", "sb_n")
    sig.update({n: "i32" for n in (*strides, "init_stride", "total")})
    sig["scale"] = "fp32"
    aligned = ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "alog_ptr", "dtb_ptr", "s_ptr", "o_ptr", *strides)
    return _compile(gdn_decode._gdr_decode_kernel, sig,
                    {"HV": 32, "GROUP": 2, "K": 128, "V": 128, "BK": 128, "BV": block_v, "NVT": 128 // block_v,
                     "FLAT": order == "flat", "ITEMS": items, "STAGES": stages, "L2NORM": True, "EPS": 1e-6},
                    warps, aligned)


@pytest.mark.parametrize("block_v,warps,order,items,stages", REC_CONFIGS)
def test_recurrent_step_state_moves_in_128_bit_accesses(block_v, warps, order, items, stages):
    """Each thread's share of the [128, block_v] fp32 state slice (128 block_v / (32 warps)
    values) is loaded and stored 4 values an instruction, and no scalar 32-bit store is left
    (the output's is bf16; 32-bit scalar loads are pairs of bf16 q/k values)."""
    ptx = _compile_rec(block_v, warps, order, items, stages).asm["ptx"]
    per_thread = 128 * block_v // (32 * warps)
    assert ptx.count("st.global.v4.b32") == per_thread // 4
    assert "st.global.b32" not in ptx
    if items == 1:
        assert ptx.count("ld.global.v4.b32") == per_thread // 4
    else:  # a loop's state loads are asynchronous 16-byte copies into shared memory
        assert re.search(r"cp\.async\.c[ag]\.shared\.global(\.L2::\w+)? \[[^]]+\], \[[^]]+\], 0?x?10", ptx), \
            "no 16-byte cp.async in the loop"


@pytest.mark.parametrize("block_v,warps,order,items,stages", REC_CONFIGS)
def test_recurrent_step_kernel_compiles_for_sm90_without_spills(block_v, warps, order, items, stages):
    k = _compile_rec(block_v, warps, order, items, stages)
    stack = _stack_bytes(k)
    if stack is None:
        pytest.skip("no cuobjdump to read the resource usage")
    assert stack == 0, f"the [128, {block_v}] state tile in {warps} warp(s) spills: {stack} bytes of stack"


def test_gated_rms_norm_kernel_compiles_for_sm90():
    sig = {"x_ptr": "*bf16", "g_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sx_t": "i32", "sx_h": "i32",
           "sg_t": "i32", "sg_h": "i32", "n_cols": "i32", "eps": "fp32"}
    assert "ptx" in _compile(norm._rms_norm_gated_kernel, sig, {"H": 32, "BLOCK": 128}, 4).asm
