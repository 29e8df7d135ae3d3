// The int8 GEMM of CPU inference on CPUs without VNNI (AVX2 + FMA: AMD Zen 2/3, Intel Haswell to
// Cascade Lake without VNNI), with the dequantization and GELU in its epilogue:
//
//   y[m, n] = act(acc[m, n] * s_x[m] * s_w[n] + b[n]),  acc = sum_k x_q[m, k] * w_q[k, n]  (int32, exact)
//
// Why our own: torch._int_mm runs oneDNN's int8 GEMM only where the CPU has AVX-512 VNNI; elsewhere
// it takes a plain C++ loop, 35-55x slower than fp32 (issue #32). Why int16 pairs and not u8 x s8:
// vpmaddubsw (what ONNX Runtime's MLAS and FBGEMM use on AVX2) adds two u8 x s8 products into a
// saturating int16, which overflows for full-range operands (255 * 127 * 2 > 32767) unless one
// operand is cut to 7 bits, a coarser grid than the per-row / per-channel int8 recipe keeps
// (bert_fast/model/int8.py). Sign-extended to int16, vpmaddwd multiplies 16 pairs and adds them
// into 8 int32 lanes exactly: the same accumulator torch._int_mm gives, bit for bit, so the
// epilogue's result equals the dequantize pass's (int8_cpu.cpp). The weights are packed once
// (bert_fast/ops/int8_gemm.py pack_weight_avx2) as int16 pairs, 16 output columns per panel:
//
//   w_packed[p, j, lane, t] = w_q[2j + t, 16p + lane]     int16 [ceil(N/16), ceil(K/2), 16, 2], zero padded
//
// so one 64-byte load gives the pairs (k = 2j, 2j + 1) of 16 columns, and a broadcast of the pair
// x_q[m, 2j..2j+1] multiplies all of them. Tile: 6 rows x 16 columns, 12 ymm accumulators in registers
// over the whole K; the panel (K x 16 int16, 24 KB at K = 768) stays in L1/L2 while every row block of
// x passes over it. Panels are split over torch's OpenMP threads.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu_isa.h"

namespace py = pybind11;

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define BF_GEMM_AVX2 1
#include <immintrin.h>

#include "simd_math_avx2.h"
#endif

namespace bert_fast {
namespace {

enum Dtype : int { kF32 = 0, kBF16 = 1 };
enum Act : int { kNone = 0, kGeluErf = 1, kGeluTanh = 2 };

constexpr int kMR = 4;   // rows per tile
constexpr int kNR = 16;  // columns per panel (two ymm of int32)

#ifdef BF_GEMM_AVX2
#define BF_AVX2 __attribute__((target("avx2,fma")))

struct Epilogue {
  const float* sx;
  const float* sw;
  const float* bias;  // null: none
  void* y;
  int64_t n;  // columns of y
  int dt;
  int act;
};

// 8 columns [n0, n0 + 8) of row m: act(acc * s_x[m] * s_w + b), in int8_cpu.cpp's order, stored
// as fp32 or bf16 (round to nearest even), only the columns < n.
BF_AVX2 inline void store8(__m256i acc, int64_t m, int64_t n0, const Epilogue& e) {
  const int64_t left = e.n - n0;
  if (left <= 0) return;
  alignas(32) float tmp[8];
  __m256 sw, b = _mm256_setzero_ps();
  if (left >= 8) {
    sw = _mm256_loadu_ps(e.sw + n0);
    if (e.bias) b = _mm256_loadu_ps(e.bias + n0);
  } else {
    std::fill(tmp, tmp + 8, 0.0f);
    std::memcpy(tmp, e.sw + n0, left * sizeof(float));
    sw = _mm256_load_ps(tmp);
    if (e.bias) {
      std::memcpy(tmp, e.bias + n0, left * sizeof(float));
      b = _mm256_load_ps(tmp);
    }
  }
  __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(e.sx[m])), sw);
  if (e.bias) v = _mm256_add_ps(v, b);
  if (e.act == kGeluErf) v = simd2::gelu_erf(v);
  else if (e.act == kGeluTanh) v = simd2::gelu_tanh(v);
  const int64_t cnt = std::min<int64_t>(left, 8);
  if (e.dt == kF32) {
    float* out = static_cast<float*>(e.y) + m * e.n + n0;
    if (cnt == 8) {
      _mm256_storeu_ps(out, v);
    } else {
      _mm256_store_ps(tmp, v);
      std::memcpy(out, tmp, cnt * sizeof(float));
    }
  } else {  // round to nearest even (finite values)
    __m256i u = _mm256_castps_si256(v);
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                             _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    u = _mm256_srli_epi32(u, 16);
    // 8 x 32-bit -> 8 x 16-bit in order: pack within 128-bit lanes, then gather the two low quarters
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
    uint16_t* out = static_cast<uint16_t*>(e.y) + m * e.n + n0;
    alignas(32) uint16_t h[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(h), packed);
    std::memcpy(out, h, cnt * sizeof(uint16_t));
  }
}

// Rows [m0, m0 + MR) x panel columns [16p, 16p + 16): the whole K in registers, then the epilogue.
// a: int16 rows of x (row stride lda, K padded to 2 kp with zeros); bp: the panel, kp pairs.
template <int MR>
BF_AVX2 void tile(const int16_t* a, int64_t lda, const int16_t* bp, int64_t kp, int64_t m0, int64_t n0,
                  const Epilogue& e) {
  __m256i acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int64_t j = 0; j < kp; ++j) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + j * 32));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + j * 32 + 16));
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * j, 4);
      const __m256i av = _mm256_set1_epi32(pair);
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(av, b0));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(av, b1));
    }
  }
  for (int r = 0; r < MR; ++r) {
    store8(acc[r][0], m0 + r, n0, e);
    store8(acc[r][1], m0 + r, n0 + 8, e);
  }
}

using TileFn = void (*)(const int16_t*, int64_t, const int16_t*, int64_t, int64_t, int64_t, const Epilogue&);
const TileFn kTiles[kMR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>};
#endif

void int8_linear_avx2(uintptr_t xq, int64_t rows, int64_t k, uintptr_t w_packed, int64_t n, uintptr_t sx,
                      uintptr_t sw, uintptr_t bias, uintptr_t y, int dt, int act, int threads) {
  if (dt != kF32 && dt != kBF16) throw std::invalid_argument("int8_linear_avx2: dtype code must be 0 or 1");
  if (act != kNone && act != kGeluErf && act != kGeluTanh)
    throw std::invalid_argument("int8_linear_avx2: act must be 0 (none), 1 (GELU erf) or 2 (GELU tanh)");
  if (!isa_usable(Isa::kAvx2)) throw std::invalid_argument("int8_linear_avx2: " + isa_refusal("avx2"));
  if (rows <= 0 || n <= 0) return;
#ifdef BF_GEMM_AVX2
  const int64_t kp = (k + 1) / 2, lda = 2 * kp;
  const int64_t panels = (n + kNR - 1) / kNR;
  const int8_t* x = reinterpret_cast<const int8_t*>(xq);
  const int16_t* w = reinterpret_cast<const int16_t*>(w_packed);
  const Epilogue e{reinterpret_cast<const float*>(sx), reinterpret_cast<const float*>(sw),
                   reinterpret_cast<const float*>(bias), reinterpret_cast<void*>(y), n, dt, act};
  // x as int16 rows, K padded to even (the extra column is 0 and meets the packed weights' zero row)
  thread_local std::vector<int16_t> a16;
  a16.resize(static_cast<size_t>(rows * lda));
  int16_t* a = a16.data();
  py::gil_scoped_release nogil;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < k; ++c) a[r * lda + c] = x[r * k + c];
    if (lda != k) a[r * lda + k] = 0;
  }
  // Work per thread by panels; below ~2 MFLOP per extra thread one thread does it.
  const int64_t by_size = std::max<int64_t>(1, rows * n * k / (1 << 20));
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({threads, by_size, panels})));
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static)
#endif
  for (int64_t p = 0; p < panels; ++p) {
    const int16_t* bp = w + p * kp * 32;
    for (int64_t m0 = 0; m0 < rows; m0 += kMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kMR, rows - m0));
      kTiles[mr](a + m0 * lda, lda, bp, kp, m0, p * kNR, e);
    }
  }
  (void)nt;
#endif
}

}  // namespace

void bind_int8_gemm_avx2(py::module_& m) {
  m.def("int8_linear_avx2", &int8_linear_avx2, py::arg("x_q"), py::arg("rows"), py::arg("k"), py::arg("w_packed"),
        py::arg("n"), py::arg("row_scale"), py::arg("col_scale"), py::arg("bias"), py::arg("out"),
        py::arg("dtype"), py::arg("act"), py::arg("threads"),
        "out [rows, n] (dtype 0: fp32, 1: bf16) = act(x_q int8 [rows, k] . w_q * row_scale[r] * col_scale[c] + "
        "bias[c]) with w_q packed as int16 pairs (bert_fast/ops/int8_gemm.py pack_weight_avx2); AVX2, exact int32 "
        "accumulation; act 0: none, 1: GELU erf, 2: GELU tanh; bias 0: none");
}

}  // namespace bert_fast
