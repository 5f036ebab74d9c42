// Kestrel's CPU int4 x int8 GEMV/GEMM for a few rows of x (AVX-512 VNNI). Python side and the
// format's description: kernels/cpu_int4_vnni.py. Written for Kestrel; the idea (4-bit weights with a
// per-block scale and offset against activations quantized to int8 per block of 32, integer dots
// scaled in fp32) is llama.cpp's Q4_1 x Q8 dot product; the instruction is Intel's vpdpbusd
// (AVX512_VNNI: 4 u8 x s8 products summed into each int32 lane).
//
// Packed weight: uint8 [T, NG, 320] for N = 16 T output rows and K = 32 NG input columns. Tile t,
// group g (columns 32g .. 32g+31) is 320 bytes:
//   bytes 0..255: four 64-byte vectors j = 0..3; byte 4r + i of vector j holds row 16t + r's code of
//                 column 32g + 4j + i in its low nibble and of column 32g + 16 + 4j + i in its high
//                 nibble (codes q in 0..15);
//   bytes 256..287: fp16 s[16] (one per row of the tile), bytes 288..319: fp16 m[16];
// so that w[n, k] = q * s + m. A 64-byte load gives, with one AND and one shift + AND, two vectors of
// 16 rows x 4 columns of u8 codes: the lanes vpdpbusd sums per row against 4 int8 x values broadcast.
//
// x row m: per group g, d = max |x| / 127, q1 = round(x / d) (int8, round half to even), with two planes
// also q2 = round((x / d - q1) * 254) (quantize_row), and sx = the sum of the dequantized x. Then
// y[m, n] = sum_g (s[n, g] * dx[g] * dot[n, g] + m[n, g] * sx[g]) with dot = dot(q, q1) and dx = d (one
// plane) or dot = 254 dot(q, q1) + dot(q, q2) and dx = d / 254 (two): exactly (q * s + m) @ x_hat up to
// fp32 rounding, the int32 dots being exact (|dot| <= 255 * 32 * 15 * 127 < 2^24).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kTileN = 16;
constexpr int64_t kGroup = 32;
constexpr int64_t kGroupBytes = 320;
constexpr int kRowsMax = 4;  // rows of x one pass over a tile keeps in registers

inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n > 0 ? static_cast<__mmask16>((1u << n) - 1) : 0;
}

// One row x[0..k) -> qx[NG * P * 32] int8 (per group: P planes of 32 codes; zero past k), dx[NG] (the
// scale of the last plane's codes: amax / 127, / 254 with two planes), sx[NG] (the group's sum of the
// dequantized x). One plane: q1 = round(x * 127 / amax). Two: also q2 = round((x * 127 / amax - q1) * 254),
// so that x ~ (254 q1 + q2) * amax / (127 * 254), the error amax / 64516 instead of amax / 254.
template <int P>
void quantize_row(const float* x, int64_t k, int64_t ng, int8_t* qx, float* dx, float* sx) {
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t k0 = g * kGroup;
    int8_t* q = qx + g * kGroup * P;
    const __m512 a = _mm512_maskz_loadu_ps(lanes(k - k0), x + k0);
    const __m512 b = _mm512_maskz_loadu_ps(lanes(k - k0 - 16), x + k0 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 vid = _mm512_set1_ps(id);
    const __m512 va = _mm512_mul_ps(a, vid), vb = _mm512_mul_ps(b, vid);
    const __m512i qa = _mm512_cvtps_epi32(va);  // MXCSR: round half to even
    const __m512i qb = _mm512_cvtps_epi32(vb);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
    const float d = amax / 127.0f;
    int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    if constexpr (P == 1) {
      dx[g] = d;
      sx[g] = d * static_cast<float>(sum);
    } else {
      const __m512 k254 = _mm512_set1_ps(254.0f);
      const __m512i ra = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(va, _mm512_cvtepi32_ps(qa)), k254));
      const __m512i rb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(vb, _mm512_cvtepi32_ps(qb)), k254));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32), _mm512_cvtsepi32_epi8(ra));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 48), _mm512_cvtsepi32_epi8(rb));
      const float d2 = d / 254.0f;
      dx[g] = d2;
      sx[g] = d2 * static_cast<float>(254 * sum + _mm512_reduce_add_epi32(_mm512_add_epi32(ra, rb)));
    }
  }
}

inline __m512i bcast4(const int8_t* p) {  // 4 int8 values broadcast to every int32 lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// MB rows of x against one tile (16 output rows): out[m][0..16) masked by nmask. P planes of x codes
// (quantize_row); the int32 dots of a group: one plane's, or 254 * the first's + the second's (exact:
// |254 * 32 * 15 * 127| < 2^24, so the conversion to fp32 is exact too).
template <int MB, int P>
inline void tile_rows(const uint8_t* tp, int64_t ng, const int8_t* const* qx, const float* const* dx,
                      const float* const* sx, float* const* out, __mmask16 nmask) {
  constexpr int C = P == 1 ? 4 : 2;  // independent chains a plane and row (vpdpbusd's latency)
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 facc[MB];
  for (int m = 0; m < MB; ++m) facc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* gp = tp + g * kGroupBytes;
    __m512i acc[MB][P][C];
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(gp + 64 * j);
      const __m512i wl = _mm512_and_si512(v, low4);
      const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      for (int m = 0; m < MB; ++m) {
        for (int p = 0; p < P; ++p) {
          const int8_t* xq = qx[m] + (g * P + p) * kGroup;
          __m512i& a = acc[m][p][j % C];
          a = _mm512_dpbusd_epi32(j < C ? _mm512_setzero_si512() : a, wl, bcast4(xq + 4 * j));
          a = _mm512_dpbusd_epi32(a, wh, bcast4(xq + 16 + 4 * j));
        }
      }
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + 256)));
    const __m512 mo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + 288)));
    for (int m = 0; m < MB; ++m) {
      __m512i t[P];
      for (int p = 0; p < P; ++p) {
        t[p] = acc[m][p][0];
        for (int c = 1; c < C; ++c) t[p] = _mm512_add_epi32(t[p], acc[m][p][c]);
      }
      __m512i tt = t[0];
      if constexpr (P == 2)  // 254 t0 + t1 = (t0 << 8) - (t0 << 1) + t1
        tt = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(t[0], 8), _mm512_slli_epi32(t[0], 1)), t[1]);
      facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tt), _mm512_mul_ps(s, _mm512_set1_ps(dx[m][g])), facc[m]);
      facc[m] = _mm512_fmadd_ps(mo, _mm512_set1_ps(sx[m][g]), facc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(out[m], nmask, facc[m]);
}

template <int P>
void run(const float* xp, int64_t m_rows, int64_t k, const uint8_t* wp, int64_t tiles, int64_t ng, int64_t n_out,
         float* yp) {
  std::vector<int8_t> qx(static_cast<size_t>(m_rows * ng * kGroup * P));
  std::vector<float> dx(static_cast<size_t>(m_rows * ng)), sx(static_cast<size_t>(m_rows * ng));
  for (int64_t m = 0; m < m_rows; ++m)
    quantize_row<P>(xp + m * k, k, ng, qx.data() + m * ng * kGroup * P, dx.data() + m * ng, sx.data() + m * ng);
  const int64_t tile_bytes = ng * kGroupBytes;
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
    const int8_t* q[kRowsMax];
    const float* d[kRowsMax];
    const float* s[kRowsMax];
    float* o[kRowsMax];
    for (int64_t t = t0; t < t1; ++t) {
      const __mmask16 nmask = lanes(n_out - t * kTileN);
      for (int64_t m0 = 0; m0 < m_rows; m0 += kRowsMax) {
        const int mb = static_cast<int>(std::min<int64_t>(kRowsMax, m_rows - m0));
        for (int i = 0; i < mb; ++i) {
          q[i] = qx.data() + (m0 + i) * ng * kGroup * P;
          d[i] = dx.data() + (m0 + i) * ng;
          s[i] = sx.data() + (m0 + i) * ng;
          o[i] = yp + (m0 + i) * n_out + t * kTileN;
        }
        const uint8_t* tp = wp + t * tile_bytes;
        switch (mb) {
          case 1: tile_rows<1, P>(tp, ng, q, d, s, o, nmask); break;
          case 2: tile_rows<2, P>(tp, ng, q, d, s, o, nmask); break;
          case 3: tile_rows<3, P>(tp, ng, q, d, s, o, nmask); break;
          default: tile_rows<4, P>(tp, ng, q, d, s, o, nmask); break;
        }
      }
    }
  });
}

// x fp32 [M, K] contiguous, packed uint8 [T, NG, 320], n_out <= 16 T, K <= 32 NG, planes 1 or 2 ->
// fp32 [M, n_out].
torch::Tensor int4_vnni_mm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out, int64_t planes) {
  RECORD_FUNCTION("kestrel::int4_vnni_mm", c10::ArrayRef<c10::IValue>{});
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "int4_vnni_mm: x must be a contiguous fp32 CPU [M, K] tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  packed.size(2) == kGroupBytes,
              "int4_vnni_mm: packed must be a contiguous uint8 [T, NG, 320] tensor");
  const int64_t m_rows = x.size(0), k = x.size(1), tiles = packed.size(0), ng = packed.size(1);
  TORCH_CHECK(k <= ng * kGroup, "int4_vnni_mm: x has ", k, " columns, the weight ",
              ng * kGroup);
  TORCH_CHECK(n_out > (tiles - 1) * kTileN && n_out <= tiles * kTileN, "int4_vnni_mm: n_out ", n_out,
              " does not fit ", tiles, " tiles of 16 rows");
  TORCH_CHECK(planes == 1 || planes == 2, "int4_vnni_mm: planes must be 1 or 2");
  auto y = torch::empty({m_rows, n_out}, x.options());
  if (m_rows == 0) return y;
  if (planes == 1)
    run<1>(x.data_ptr<float>(), m_rows, k, packed.data_ptr<uint8_t>(), tiles, ng, n_out, y.data_ptr<float>());
  else
    run<2>(x.data_ptr<float>(), m_rows, k, packed.data_ptr<uint8_t>(), tiles, ng, n_out, y.data_ptr<float>());
  return y;
}

// The kernel's view of x, for tests: (qx int8 [M, NG * P * 32] (per group P planes of 32), dx fp32 [M, NG],
// sx fp32 [M, NG]).
std::vector<torch::Tensor> quantize_x(const torch::Tensor& x, int64_t ng, int64_t planes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "quantize_x: x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK(planes == 1 || planes == 2, "quantize_x: planes must be 1 or 2");
  const int64_t m_rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k <= ng * kGroup, "quantize_x: K > 32 NG");
  auto qx = torch::empty({m_rows, ng * kGroup * planes}, x.options().dtype(torch::kInt8));
  auto dx = torch::empty({m_rows, ng}, x.options());
  auto sx = torch::empty({m_rows, ng}, x.options());
  for (int64_t m = 0; m < m_rows; ++m) {
    const float* xr = x.data_ptr<float>() + m * k;
    int8_t* qr = qx.data_ptr<int8_t>() + m * ng * kGroup * planes;
    float* dr = dx.data_ptr<float>() + m * ng;
    float* sr = sx.data_ptr<float>() + m * ng;
    if (planes == 1) quantize_row<1>(xr, k, ng, qr, dr, sr);
    else quantize_row<2>(xr, k, ng, qr, dr, sr);
  }
  return {qx, dx, sx};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  // the GIL is released while the kernel runs, as torch's own ops do (a worker's other threads go on)
  mod.def("int4_vnni_mm", &int4_vnni_mm, "int4 (q*s+m, 16-row tiles) x int8-quantized fp32 x -> fp32",
          py::call_guard<py::gil_scoped_release>());
  mod.def("quantize_x", &quantize_x, "x fp32 [M, K] -> (qx int8 planes, dx, sx) per group of 32");
}
