"""The fused rotary verify kernel (`kernels.rope_verify._rope_verify_kernel`) compiled ahead of time
for the H100 / H200 (sm90) on a machine without a GPU: Triton's front end and ptxas (shipped in
Triton's wheel) accept it at Qwen3-0.6B's verify shapes (16 query heads, 8 KV heads of 128, G = 2)
with the constexprs and launch options its launcher passes at ROPE_VERIFY_DEFAULTS (8 warps, two
stages): bf16 q over a bf16, fp8_e4m3 (as its uint8 view) or int8 cache; q/k norm on; PDL with the
first-tile prefetch and without; the merge launched and in the kernel; k = 1, 4 (BLOCK_R 16) and
k = 8 (BLOCK_R 32); the graphs' int32 and the eager steps' int64 metadata. Its stack frame (register
spills) stays within 256 bytes a thread (measured 0-232; at 4 warps it was 248-1,168, the reason
for the 8-warp default). The interpreter tests (test_rope_verify_interp.py) check what the kernel
computes; this checks that the compiled path exists, which the interpreter does not. Skipped
without Triton's CUDA backend or its tools.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from kernels import rope_verify  # noqa: E402
from kernels.decode_merge import fused_merge_constants  # noqa: E402
from tests.unit.test_gdn_decode_compile import _stack_bytes  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # an older Triton's layout
    pytest.skip("triton.compiler.ASTSource / GPUTarget not available", allow_module_level=True)

H, KVH, D, BLOCK_N = 16, 8, 128, 64
KV = {"none": ("*bf16", "*bf16", 0), "fp8": ("*u8", "*fp32", 1), "int8": ("*i8", "*fp32", 2)}
ALIGNED = ("q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "out_ptr", "acc_ptr")


def _sig(kv: str, meta: str, fused: bool) -> dict:
    cache, scales, _ = KV[kv]
    sig = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "qn_ptr", "kn_ptr", "out_ptr")}
    sig.update({"pos_ptr": "*i64", "cs_ptr": "*fp32", "slot_ptr": "*i64", "kc_ptr": cache, "vc_ptr": cache,
                "bt_ptr": meta, "cu_ptr": meta, "seqlen_ptr": meta, "m_ptr": "*fp32", "l_ptr": "*fp32",
                "acc_ptr": "*fp32", "cnt_ptr": "*i32" if fused else "*bf16", "ks_ptr": scales, "vs_ptr": scales})
    sig.update({n: "i32" for n in ("sq_t", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h", "cs_stride", "sc_b", "sc_s",
                                   "sc_h", "s_bt", "so_t", "so_h", "block_size", "n_splits", "n_heads", "head_dim")})
    sig.update({"qk_scale": "fp32", "eps": "fp32"})
    return sig


def _compile(kv: str, q_len: int, prefetch: bool, fused: bool, meta: str):
    g, splits = H // KVH, 33
    cfg = rope_verify.ROPE_VERIFY_DEFAULTS
    consts = {"G": g, "BLOCK_R": max(16, triton.next_power_of_2(q_len * g)),
              "BLOCK_Q": max(16, triton.next_power_of_2(q_len)), "BLOCK_N": BLOCK_N, "BLOCK_D": D, "NORM": True,
              "ONE_SPLIT": False, "USE_PDL": True, "PREFETCH": prefetch, "FUSED_MERGE": fused, "KV_QUANT": KV[kv][2],
              **fused_merge_constants(H, KVH, D, splits, fused, q_len), "EARLY_ANGLES": bool(cfg["early_angles"])}
    fn = rope_verify._rope_verify_kernel
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ALIGNED}
    src = ASTSource(fn=fn, signature={**_sig(kv, meta, fused), **{k: "constexpr" for k in consts}},
                    constexprs=consts, attrs=attrs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    except (RuntimeError, FileNotFoundError) as e:  # no ptxas in this Triton install
        if "ptxas" in str(e).lower():
            pytest.skip(f"no ptxas: {e}")
        raise


CASES = [(kv, q_len, prefetch, fused, meta) for kv in KV for q_len, prefetch, fused, meta in
         ((5, True, False, "*i32"), (9, True, False, "*i64"), (2, False, True, "*i32"))]


@pytest.mark.parametrize("kv,q_len,prefetch,fused,meta", CASES)
def test_rope_verify_kernel_compiles_for_sm90_within_a_small_stack(kv, q_len, prefetch, fused, meta):
    k = _compile(kv, q_len, prefetch, fused, meta)
    assert "griddepcontrol.wait" in k.asm["ptx"]  # the PDL wait is there
    stack = _stack_bytes(k)
    if stack is None:
        pytest.skip("no cuobjdump to read the resource usage")
    assert stack <= 256, f"{kv} q_len {q_len}: {stack} bytes of stack a thread (register spills)"
