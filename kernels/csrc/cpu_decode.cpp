// Kestrel's CPU decode ops: the RMS norm (with the residual add fused) and the decode attention
// (rotary on q and k, the KV store, paged attention over each sequence's blocks) as one C++ call
// each, where the torch references take ~9 and ~40 ATen calls. Python side, shapes and the cases
// that take them: kernels/cpu_decode.py; docs/ARCHITECTURE.md §6.4 "CPU decode ops".
//
// Plain C++ written for the compiler's vectoriser: the same source builds with AVX-512, AVX2 or no
// flags at all (kernels/cpu_decode.py picks them from the CPU). Reductions keep kLanes partial sums
// (lane l sums elements l, l + kLanes, ...) so that -O3 vectorises them without -ffast-math; built
// with -ffp-contract=off, so that the rotary and the norm round each product and sum once as torch's
// ops do (the rotation is then bit-equal to kernels.rotary's reference). The attention's inner loops
// (a dot product a key, e^x, the value sums) take AVX-512 intrinsics where the build has __AVX512F__
// (one horizontal sum a key instead of a scalar chain, a polynomial e^x on 16 lanes), else the loops.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int kLanes = 16;
// multiply-adds a chunk of the attention's at::parallel_for holds at least: below that the threads'
// fork and join cost about what they save (SmolLM2's 3 KV heads of 3 x 64 at batch 1: one thread below
// ~57 keys, two chunks to ~85, a chunk a KV head from there)
constexpr int64_t kMinWork = 1 << 16;

// sum of a[i] * b[i], i < n, in kLanes partial sums (summed as a tree: no chain of kLanes adds)
inline float dot_lanes(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  float s = acc[0];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

#ifdef __AVX512F__
// AVX-512 (the "avx512" build): 16 lanes a vector, the tail by a mask; FMAs (one rounding a product-sum)
inline __mmask16 tail(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }

inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 m = tail(n - i);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// e^x for x <= 0 (lanes below -87.3 give ~0): x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor polynomial
// of degree 7 (relative error ~1e-8 at |r| = ln2 / 2 before rounding), times 2^n by vscalefps
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts: hi exact in 9 bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// x[p] = e^(x[p] - m) for p < n; returns their sum
inline float exp_sub_sum(float* x, int64_t n, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + 16 <= n; p += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + p), vm));
    _mm512_storeu_ps(x + p, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (p < n) {
    const __mmask16 k = tail(n - p);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + p), vm));
    _mm512_mask_storeu_ps(x + p, k, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(acc);
}

// y[i] += w * x[i], i < n
inline void axpy(float w, const float* x, float* y, int64_t n) {
  const __m512 vw = _mm512_set1_ps(w);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(vw, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  if (i < n) {
    const __mmask16 m = tail(n - i);
    _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(vw, _mm512_maskz_loadu_ps(m, x + i),
                                                    _mm512_maskz_loadu_ps(m, y + i)));
  }
}

// One query head q (rotated, ND * 16 values) over s keys of one KV head (kj, vj: the head's column in the
// caches; table: the sequence's blocks of bs slots of `row` values): scores, softmax and the weighted sum
// of the values with q and the output sums in registers, keys in order -> out[ND * 16]. scores: s floats.
template <int ND>
void head_avx512(const float* q, const float* kj, const float* vj, const int32_t* table, int64_t s, int64_t bs,
                 int64_t row, float sc, float* scores, float* out) {
  __m512 qv[ND], acc[ND];
  for (int c = 0; c < ND; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t p0 = 0; p0 < s; p0 += bs) {
    const float* kb = kj + static_cast<int64_t>(table[p0 / bs]) * bs * row;
    const int64_t n = std::min(bs, s - p0);
    for (int64_t o = 0; o < n; ++o) {
      const float* kr = kb + o * row;
      __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
      for (int c = 1; c < ND; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), a);
      const float e = _mm512_reduce_add_ps(a) * sc;
      scores[p0 + o] = e;
      mx = std::max(mx, e);
    }
  }
  const float inv = 1.0f / exp_sub_sum(scores, s, mx);
  for (int c = 0; c < ND; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < s; p0 += bs) {
    const float* vb = vj + static_cast<int64_t>(table[p0 / bs]) * bs * row;
    const int64_t n = std::min(bs, s - p0);
    for (int64_t o = 0; o < n; ++o) {
      const float* vr = vb + o * row;
      const __m512 w = _mm512_set1_ps(scores[p0 + o]);
      for (int c = 0; c < ND; ++c) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 16 * c), acc[c]);
    }
  }
  const __m512 vi = _mm512_set1_ps(inv);
  for (int c = 0; c < ND; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[c], vi));
}

using HeadFn = void (*)(const float*, const float*, const float*, const int32_t*, int64_t, int64_t, int64_t, float,
                        float*, float*);

// head_avx512 for head_dim d (a multiple of 16 up to 128), else nullptr (the general loop)
inline HeadFn head_kernel(int64_t d) {
  if (d % 16) return nullptr;
  switch (d / 16) {
    case 1: return head_avx512<1>;
    case 2: return head_avx512<2>;
    case 3: return head_avx512<3>;
    case 4: return head_avx512<4>;
    case 5: return head_avx512<5>;
    case 6: return head_avx512<6>;
    case 7: return head_avx512<7>;
    case 8: return head_avx512<8>;
    default: return nullptr;
  }
}
#else
// the portable build: loops for the vectoriser, std::exp
inline float dot(const float* a, const float* b, int64_t n) { return dot_lanes(a, b, n); }

inline float exp_sub_sum(float* x, int64_t n, float m) {
  float s = 0.0f;
  for (int64_t p = 0; p < n; ++p) {
    x[p] = std::exp(x[p] - m);
    s += x[p];
  }
  return s;
}

inline void axpy(float w, const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

using HeadFn = void (*)(const float*, const float*, const float*, const int32_t*, int64_t, int64_t, int64_t, float,
                        float*, float*);
inline HeadFn head_kernel(int64_t) { return nullptr; }
#endif

// one row: out = (x * rsqrt(sum(x^2) / n + eps)) * w, the order of kernels.norm.rms_norm_ref in fp32
inline void norm_row(const float* __restrict x, const float* __restrict w, float* __restrict out, int64_t n,
                     float eps) {
  const float r = 1.0f / std::sqrt(dot_lanes(x, x, n) / static_cast<float>(n) + eps);
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

  // 2. a task per (token, KV head): its g query heads over the sequence's keys, in two passes (scores,
  // then softmax-weighted values); a chunk of at::parallel_for holds at least ~kMinWork multiply-adds
  const int64_t g = h / kvh;
  const float sc = static_cast<float>(scale);
  const int64_t grain = std::max<int64_t>(1, kMinWork / std::max<int64_t>(smax * d * 2 * g, 1));
  const HeadFn head = head_kernel(d);
  at::parallel_for(0, nt * kvh, grain, [&](int64_t b, int64_t end) {
    std::vector<float> buf(g * (smax + 2 * d) + 2 * g);
    float* scores = buf.data();      // [g, smax]
    float* qr = scores + g * smax;   // [g, d]: the rotated q heads
    float* acc = qr + g * d;         // [g, d]
    float* mx = acc + g * d;         // [g]
    float* sum = mx + g;             // [g]
    for (int64_t task = b; task < end; ++task) {
      const int64_t t = task / kvh, j = task % kvh, s = sl[t];
      for (int64_t i = 0; i < g; ++i)
        rotate(x.q + t * x.sq0 + (j * g + i) * x.sq1, csp + pos[t] * rot, half, d, qr + i * d);
      const int32_t* table = bt + t * width;
      const float* kj = kc + j * d;
      const float* vj = vc + j * d;
      if (head != nullptr) {  // AVX-512, head_dim a multiple of 16 up to 128: a head at a time in registers
        for (int64_t i = 0; i < g; ++i)
          head(qr + i * d, kj, vj, table, s, bs, row, sc, scores, op + t * h * d + (j * g + i) * d);
        continue;
      }
      for (int64_t i = 0; i < g; ++i) mx[i] = -std::numeric_limits<float>::infinity();
      for (int64_t p0 = 0; p0 < s; p0 += bs) {  // block by block: no division a key
        const float* kb = kj + static_cast<int64_t>(table[p0 / bs]) * bs * row;
        const int64_t n = std::min(bs, s - p0);
        for (int64_t o = 0; o < n; ++o) {
          const float* kr = kb + o * row;
          for (int64_t i = 0; i < g; ++i) {
            const float e = dot(qr + i * d, kr, d) * sc;
            scores[i * smax + p0 + o] = e;
            mx[i] = std::max(mx[i], e);
          }
        }
      }
      for (int64_t i = 0; i < g; ++i) sum[i] = exp_sub_sum(scores + i * smax, s, mx[i]);
      for (int64_t i = 0; i < g * d; ++i) acc[i] = 0.0f;
      for (int64_t p0 = 0; p0 < s; p0 += bs) {
        const float* vb = vj + static_cast<int64_t>(table[p0 / bs]) * bs * row;
        const int64_t n = std::min(bs, s - p0);
        for (int64_t o = 0; o < n; ++o)
          for (int64_t i = 0; i < g; ++i) axpy(scores[i * smax + p0 + o], vb + o * row, acc + i * d, d);
      }
      for (int64_t i = 0; i < g; ++i) {
        const float inv = 1.0f / sum[i];
        float* o = op + t * h * d + (j * g + i) * d;
        for (int64_t c = 0; c < d; ++c) o[c] = acc[i * d + c] * inv;
      }
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
