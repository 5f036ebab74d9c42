// Kestrel's CPU decode ops: the RMS norm (with the residual add fused) and the decode attention
// (rotary on q and k, the KV store, paged attention over each sequence's blocks) as one C++ call
// each, where the torch references take ~9 and ~40 ATen calls. Python side, shapes and the cases
// that take them: kernels/cpu_decode.py; docs/ARCHITECTURE.md §6.4 "CPU decode ops".
//
// Plain C++ written for the compiler's vectoriser (no intrinsics): the same source builds with
// AVX-512, AVX2 or no flags at all (kernels/cpu_decode.py picks them from the CPU). Reductions keep
// kLanes partial sums (lane l sums elements l, l + kLanes, ...) so that -O3 vectorises them without
// -ffast-math; built with -ffp-contract=off, so that the rotary and the norm round each product and
// sum once as torch's ops do (the rotation is then bit-equal to kernels.rotary's reference).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int kLanes = 16;
// multiply-adds a chunk of the attention's at::parallel_for holds at least: below that the threads'
// fork and join cost about what they save (SmolLM2's 9 heads of 64 at batch 1 split in two chunks
// from ~60 keys on, and run on one thread below)
constexpr int64_t kMinWork = 1 << 16;

// sum of a[i] * b[i], i < n, in kLanes partial sums
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// one row: out = (x * rsqrt(sum(x^2) / n + eps)) * w, the order of kernels.norm.rms_norm_ref in fp32
inline void norm_row(const float* __restrict x, const float* __restrict w, float* __restrict out, int64_t n,
                     float eps) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * r) * w[i];
}

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat && t.device().is_cpu() && t.stride(1) == 1,
              what, " must be an fp32 CPU [T, hidden] tensor with unit column stride");
}

// rows a chunk of at::parallel_for: about 16K values a chunk (one row of 576 is not worth a thread)
inline int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

// x [T, n] fp32 (unit column stride), weight [n] fp32 -> [T, n]
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  RECORD_FUNCTION("kestrel::rms_norm", c10::ArrayRef<c10::IValue>{});
  check_rows(x, "rms_norm: x");
  const int64_t t = x.size(0), n = x.size(1), sx = x.stride(0);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == torch::kFloat &&
                  weight.is_contiguous(), "rms_norm: weight must be a contiguous fp32 [hidden] tensor");
  auto out = torch::empty({t, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, t, row_grain(n), [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) norm_row(xp + i * sx, wp, op + i * n, n, e);
  });
  return out;
}

// residual' = x + residual; returns (rms_norm(residual'), residual'), both new [T, n] tensors
std::tuple<torch::Tensor, torch::Tensor> fused_add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                                            const torch::Tensor& weight, double eps) {
  RECORD_FUNCTION("kestrel::fused_add_rms_norm", c10::ArrayRef<c10::IValue>{});
  check_rows(x, "fused_add_rms_norm: x");
  check_rows(residual, "fused_add_rms_norm: residual");
  const int64_t t = x.size(0), n = x.size(1), sx = x.stride(0), sr = residual.stride(0);
  TORCH_CHECK(residual.size(0) == t && residual.size(1) == n, "fused_add_rms_norm: x and residual differ in shape");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == torch::kFloat &&
                  weight.is_contiguous(), "fused_add_rms_norm: weight must be a contiguous fp32 [hidden] tensor");
  auto out = torch::empty({t, n}, x.options());
  auto res = torch::empty({t, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* np = res.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, t, row_grain(n), [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) {
      const float* xr = xp + i * sx;
      const float* rr = rp + i * sr;
      float* nr = np + i * n;
      for (int64_t c = 0; c < n; ++c) nr[c] = xr[c] + rr[c];
      norm_row(nr, wp, op + i * n, n, e);
    }
  });
  return {out, res};
}

// The neox rotation of one head (kernels/rotary.py): for i < half, out[i] = x1 c - x2 s and
// out[half + i] = x2 c + x1 s with x1 = x[i], x2 = x[half + i], c = cs[i], s = cs[half + i]; the dims
// past 2 half pass through (partial rotary). out may not alias x.
inline void rotate(const float* __restrict x, const float* __restrict cs, int64_t half, int64_t d,
                   float* __restrict out) {
  const float* c = cs;
  const float* s = cs + half;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    out[i] = x1 * c[i] - x2 * s[i];
    out[half + i] = x2 * c[i] + x1 * s[i];
  }
  for (int64_t i = 2 * half; i < d; ++i) out[i] = x[i];
}

// q [T, H, D], k and v [T, KVH, D] as pointers and strides (token, head; unit last stride)
struct QKV {
  const float *q, *k, *v;
  int64_t nt, h, kvh, d, sq0, sq1, sk0, sk1, sv0, sv1;
};

// One decode token per sequence t (T of them): rotate q[t] and k[t] by positions[t]'s row of cos_sin,
// store the rotated k[t] and v[t] at slot_mapping[t] (a slot < 0: not stored), and attend q[t]'s heads
// over the seq_lens[t] cached tokens of block_tables[t] (query head h reads KV head h / (H / KVH)),
// softmax(q k^T * scale) v in fp32. Returns [T, H * D] fp32. Shapes and errors: kernels/cpu_decode.py.
torch::Tensor attend(const QKV& x, const torch::Tensor& positions, const torch::Tensor& cos_sin,
                     const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                     const torch::TensorOptions& opts) {
  auto f32 = [](const torch::Tensor& t) { return t.scalar_type() == torch::kFloat && t.device().is_cpu(); };
  const int64_t nt = x.nt, h = x.h, d = x.d, kvh = x.kvh;
  TORCH_CHECK(kvh > 0 && h % kvh == 0, "decode_attention: num_heads ", h, " is not a multiple of num_kv_heads ", kvh);
  TORCH_CHECK(k_cache.dim() == 4 && f32(k_cache) && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  f32(v_cache) && v_cache.is_contiguous() && k_cache.size(2) == kvh && k_cache.size(3) == d,
              "decode_attention: k_cache and v_cache must be contiguous fp32 CPU [blocks, block_size, kv_heads, "
              "head_dim] tensors");
  TORCH_CHECK(cos_sin.dim() == 2 && f32(cos_sin) && cos_sin.is_contiguous() && cos_sin.size(1) <= d,
              "decode_attention: cos_sin must be a contiguous fp32 [positions, rot_dim <= head_dim] table");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == nt && positions.scalar_type() == torch::kLong &&
                  slot_mapping.dim() == 1 && slot_mapping.size(0) == nt &&
                  slot_mapping.scalar_type() == torch::kLong,
              "decode_attention: positions and slot_mapping must be int64 [T]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == nt && block_tables.scalar_type() == torch::kInt &&
                  seq_lens.dim() == 1 && seq_lens.size(0) == nt && seq_lens.scalar_type() == torch::kInt,
              "decode_attention: block_tables must be int32 [T, max_blocks] and seq_lens int32 [T] (one token a "
              "sequence)");
  const auto pos_c = positions.contiguous(), slot_c = slot_mapping.contiguous();
  const auto bt_c = block_tables.contiguous(), sl_c = seq_lens.contiguous();
  const int64_t* pos = pos_c.data_ptr<int64_t>();
  const int64_t* slots = slot_c.data_ptr<int64_t>();
  const int32_t* bt = bt_c.data_ptr<int32_t>();
  const int32_t* sl = sl_c.data_ptr<int32_t>();
  const int64_t nb = k_cache.size(0), bs = k_cache.size(1), width = block_tables.size(1);
  const int64_t npos = cos_sin.size(0), rot = cos_sin.size(1), half = rot / 2;
  int64_t smax = 0;
  for (int64_t t = 0; t < nt; ++t) {  // every index the loops below follow, checked first
    const int64_t s = sl[t];
    TORCH_CHECK(s >= 1 && s <= width * bs, "decode_attention: seq_lens[", t, "] = ", s, " outside 1..",
                width * bs, " (its block table's tokens)");
    TORCH_CHECK(pos[t] >= 0 && pos[t] < npos, "decode_attention: positions[", t, "] = ", pos[t],
                " outside the rotary table's ", npos, " rows");
    TORCH_CHECK(slots[t] < nb * bs, "decode_attention: slot_mapping[", t, "] = ", slots[t], " past the cache");
    for (int64_t j = 0; j < (s + bs - 1) / bs; ++j) {
      const int32_t blk = bt[t * width + j];
      TORCH_CHECK(blk >= 0 && blk < nb, "decode_attention: block_tables[", t, ", ", j, "] = ", blk,
                  " is not a block of the cache (", nb, ")");
    }
    smax = std::max(smax, s);
  }
  auto out = torch::empty({nt, h * d}, opts);
  if (nt == 0) return out;
  const float* csp = cos_sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row = kvh * d;  // a slot's values in the cache

  // 1. the new keys (rotated) and values into their slots; every token's before any attention reads
  for (int64_t t = 0; t < nt; ++t) {
    if (slots[t] < 0) continue;
    const float* cs = csp + pos[t] * rot;
    for (int64_t j = 0; j < kvh; ++j) {
      rotate(x.k + t * x.sk0 + j * x.sk1, cs, half, d, kc + slots[t] * row + j * d);
      const float* vs = x.v + t * x.sv0 + j * x.sv1;
      float* vd = vc + slots[t] * row + j * d;
      for (int64_t i = 0; i < d; ++i) vd[i] = vs[i];
    }
  }

  // 2. a task per (token, query head): two passes over the keys (scores, then softmax-weighted values);
  // the tasks of a chunk of at::parallel_for hold at least ~kMinWork multiply-adds
  const int64_t g = h / kvh;
  const float sc = static_cast<float>(scale);
  const int64_t grain = std::max<int64_t>(1, kMinWork / std::max<int64_t>(smax * d * 2, 1));
  at::parallel_for(0, nt * h, grain, [&](int64_t b, int64_t end) {
    std::vector<float> buf(smax + 2 * d);
    float* scores = buf.data();
    float* qr = scores + smax;
    float* acc = qr + d;
    for (int64_t task = b; task < end; ++task) {
      const int64_t t = task / h, hh = task % h, j = hh / g, s = sl[t];
      rotate(x.q + t * x.sq0 + hh * x.sq1, csp + pos[t] * rot, half, d, qr);
      const int32_t* table = bt + t * width;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < s; ++p) {
        const float* kr = kc + (static_cast<int64_t>(table[p / bs]) * bs + p % bs) * row + j * d;
        const float e = dot(qr, kr, d) * sc;
        scores[p] = e;
        mx = std::max(mx, e);
      }
      float sum = 0.0f;
      for (int64_t p = 0; p < s; ++p) {
        const float e = std::exp(scores[p] - mx);
        scores[p] = e;
        sum += e;
      }
      for (int64_t i = 0; i < d; ++i) acc[i] = 0.0f;
      for (int64_t p = 0; p < s; ++p) {
        const float* vr = vc + (static_cast<int64_t>(table[p / bs]) * bs + p % bs) * row + j * d;
        const float w = scores[p];
        for (int64_t i = 0; i < d; ++i) acc[i] += w * vr[i];
      }
      const float inv = 1.0f / sum;
      float* o = op + t * h * d + hh * d;
      for (int64_t i = 0; i < d; ++i) o[i] = acc[i] * inv;
    }
  });
  return out;
}

// q [T, H, D], k, v [T, KVH, D] fp32 views (unit last stride) -> attend
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& positions, const torch::Tensor& cos_sin,
                               const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                               const torch::Tensor& seq_lens, double scale) {
  RECORD_FUNCTION("kestrel::decode_attention", c10::ArrayRef<c10::IValue>{});
  auto f32 = [](const torch::Tensor& t) { return t.scalar_type() == torch::kFloat && t.device().is_cpu(); };
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && f32(q) && f32(k) && f32(v) && q.stride(2) == 1 &&
                  k.stride(2) == 1 && v.stride(2) == 1,
              "decode_attention: q, k, v must be fp32 CPU [T, heads, head_dim] tensors with unit last stride");
  const int64_t nt = q.size(0), d = q.size(2), kvh = k.size(1);
  TORCH_CHECK(k.size(0) == nt && v.size(0) == nt && v.size(1) == kvh && k.size(2) == d && v.size(2) == d,
              "decode_attention: k and v must be [T, kv_heads, head_dim] of q's T and head_dim");
  const QKV x{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), nt, q.size(1), kvh, d,
              q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1)};
  return attend(x, positions, cos_sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale, q.options());
}

// the fused projection's output qkv [T, (H + 2 KVH) D] (unit column stride): q, k, v its column ranges
torch::Tensor decode_attention_qkv(const torch::Tensor& qkv, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                   const torch::Tensor& positions, const torch::Tensor& cos_sin,
                                   const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                   const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                                   const torch::Tensor& seq_lens, double scale) {
  RECORD_FUNCTION("kestrel::decode_attention", c10::ArrayRef<c10::IValue>{});
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat && qkv.device().is_cpu() && qkv.stride(1) == 1 &&
                  heads > 0 && kv_heads > 0 && head_dim > 0 && qkv.size(1) == (heads + 2 * kv_heads) * head_dim,
              "decode_attention_qkv: qkv must be an fp32 CPU [T, (heads + 2 kv_heads) head_dim] tensor with unit "
              "column stride");
  const float* p = qkv.data_ptr<float>();
  const int64_t s0 = qkv.stride(0);
  const QKV x{p, p + heads * head_dim, p + (heads + kv_heads) * head_dim, qkv.size(0), heads, kv_heads, head_dim,
              s0, head_dim, s0, head_dim, s0, head_dim};
  return attend(x, positions, cos_sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale,
                qkv.options());
}

// silu(x[:, :n]) * x[:, n:] for x [T, 2n] fp32 (unit column stride) -> [T, n]; silu(a) = a / (1 + exp(-a))
torch::Tensor silu_and_mul(const torch::Tensor& x) {
  RECORD_FUNCTION("kestrel::silu_and_mul", c10::ArrayRef<c10::IValue>{});
  check_rows(x, "silu_and_mul: x");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: x must have an even number of columns");
  const int64_t t = x.size(0), n = x.size(1) / 2, sx = x.stride(0);
  auto out = torch::empty({t, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, row_grain(n), [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) {
      const float* g = xp + i * sx;
      const float* u = g + n;
      float* o = op + i * n;
      for (int64_t c = 0; c < n; ++c) o[c] = g[c] / (1.0f + std::exp(-g[c])) * u[c];
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  // the GIL is released while an op runs, as torch's own ops do
  mod.def("rms_norm", &rms_norm, "RMS norm of fp32 rows", py::call_guard<py::gil_scoped_release>());
  mod.def("fused_add_rms_norm", &fused_add_rms_norm, "residual add, then RMS norm, of fp32 rows",
          py::call_guard<py::gil_scoped_release>());
  mod.def("decode_attention", &decode_attention,
          "rotary + KV store + paged attention of one decode token a sequence, fp32",
          py::call_guard<py::gil_scoped_release>());
  mod.def("decode_attention_qkv", &decode_attention_qkv, "decode_attention on the fused qkv output",
          py::call_guard<py::gil_scoped_release>());
  mod.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of fp32 rows [T, 2n] -> [T, n]",
          py::call_guard<py::gil_scoped_release>());
}
