"""The switch of the CPU decode path's op cuts (docs/ARCHITECTURE.md §6.4 "CPU decode ops").

FEWER_OPS on (the default): the torch references take forms with fewer ATen calls and the
same values, bit for bit, on CPU tensors (CUDA tensors keep the forms before):
- `kernels.norm.rms_norm_ref` in fp32: pow, sum, div_, add_, rsqrt_, mul, mul_ with n and
  eps as cached 0-d tensors (~9 ATen calls) instead of `F.rms_norm` (25: the same composite
  with its casts and the scalars wrapped on every call);
- `kernels.activation.silu_and_mul_ref`: gate and up by slicing instead of chunk;
- `kernels.rotary.rope_factors` once a step and `rotate_with_factors_` per layer instead of
  the rotary table's gather and ~13 ops per layer (`ReferenceAttention`);
- `kernels.attention.paged_attention_ref` at one decode: K and V as one as_strided view of
  the cache each when its blocks are consecutive (no gather copy), its mask made additive
  once a step;
- `kernels.cpu_quant_linear.QuantWeight.matmul`: the bf16 cast of x through a reused buffer,
  the cast back as empty + copy_.
Off: the forms before (benchmarks/cpu_decode_profile.py --ab times both in one process).

CPU_CXX_OPS on (the default): Kestrel's C++ CPU ops (`kernels.cpu_decode`, where its extension
builds) take the fp32 RMS norms (`kernels.norm.rms_norm` / `fused_add_rms_norm`), the
SiLU-and-mul (`kernels.activation.silu_and_mul`) and the decode-only steps' attention (`services.worker.layers.attention.ReferenceAttention`: rotary, KV
store and paged attention in one call) on CPU tensors; off, or where the extension cannot be had,
the torch references above (benchmarks/cpu_decode_profile.py --cxx-ab times both in one process).
"""

FEWER_OPS = True
CPU_CXX_OPS = True
