// A bf16 linear layer of CPU inference in one call, on weights packed once (AVX-512 BF16):
//
//   y = act(x W^T + b)                                   bf16 out, GELU in the epilogue, or
//   y = LayerNorm(x W^T + b + residual) * ln_w + ln_b    the residual add and LayerNorm after the sums
//
// Why our own when oneDNN's packed bf16 linear (freeze()) already runs at the hardware rate: at batch 1
// a MiniLM forward spent ~2.8 ms of its 11.3 outside the kernels, in Python and torch's dispatcher
// between ~10 calls per layer (benchmarks/NOTES.md, "int8 on packed weights": the same lever took
// 0.75 ms off the int8 forward). One call per linear, the add and LayerNorm included, removes most of
// them; oneDNN's kernel is reachable only through torch's dispatcher (this module links no libtorch).
//
// How. vdpbf16ps multiplies pairs of bf16 and adds both products into an fp32 lane. The weights are
// packed once (bert_fast/ops/bf16_gemm.py pack_weight):
//
//   packed[p, j, lane, t] = W^T[2j + t, 16p + lane]      bf16 [ceil(N/16), K/2, 16, 2], zero padded
//
// so one 64-byte load is 2 k-steps of 16 columns, and a broadcast 32-bit pair of x multiplies all of
// them. Tiles, threads and scratch as the int8 GEMM's (int8_gemm_vnni.cpp, cpu_gemm_common.h). The sums
// run in fp32 in a different order than oneDNN's: not the same bits, held to the float64 oracle by the
// 2x rule (tests/cpu/test_bf16_linear.py), and bert_fast/model/frozen.py uses it only where it measured
// faster than the packed oneDNN call it replaces.
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "cpu_gemm_common.h"
#include "cpu_isa.h"
#include "simd_math.h"

namespace py = pybind11;

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define BF_GEMM_BF16 1
#include <immintrin.h>
#endif

namespace bert_fast {
namespace {

constexpr int kMR = 8;     // rows per tile
constexpr int kGroup = 3;  // 16-column panels per tile
enum Act : int { kNone = 0, kGeluErf = 1, kGeluTanh = 2 };

bool bf16_usable() {
#ifdef BF_GEMM_BF16
  __builtin_cpu_init();
  return isa_usable(Isa::kAvx512Bf16) && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

#ifdef BF_GEMM_BF16
#define BF_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
using I32Alias = int32_t __attribute__((may_alias));

// Where a tile's sums (+ bias) go: bf16 y with the activation, or fp32 `sums` rows for the LayerNorm.
struct Out {
  const float* bias;  // null: none
  uint16_t* y;        // null: into sums
  float* sums;
  int act;
  int64_t n;
};

// The fp32 sums of rows [0, MR) of `a` (bf16, row stride lda elements) x NP panels at `bp` (panel
// stride `pstride` elements, kp pair-steps), into sums[MR][NP * 16]: the k-loop alone in its own
// function, unrolled, so that GCC keeps the 24 accumulators in registers (int8_gemm_vnni.cpp).
template <int MR, int NP>
BF_BF16 __attribute__((noinline)) void sums_of(const uint16_t* a, int64_t lda, const uint16_t* bp, int64_t pstride,
                                                int64_t kp, float* sums) {
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int64_t j = 0; j < kp; ++j) {
    __m512i b[NP];
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) b[q] = _mm512_loadu_si512(bp + q * pstride + j * 32);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512i av = _mm512_set1_epi32(*reinterpret_cast<const I32Alias*>(a + r * lda + 2 * j));
#pragma GCC unroll 4
      for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], (__m512bh)av, (__m512bh)b[q]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) _mm512_store_ps(sums + (r * NP + q) * 16, acc[r][q]);
}

// Rows [m0, m0 + MR) x NP panels from column n0: sums + bias, then the GELU and bf16 y, or into o.sums.
template <int MR, int NP>
BF_BF16 void tile(const uint16_t* a, int64_t lda, const uint16_t* bp, int64_t pstride, int64_t kp, int64_t m0,
                  int64_t n0, const Out& o) {
  alignas(64) float sums[MR * NP * 16];
  sums_of<MR, NP>(a, lda, bp, pstride, kp, sums);
  for (int r = 0; r < MR; ++r) {
    for (int q = 0; q < NP; ++q) {
      const int64_t col = n0 + 16 * q, left = o.n - col;
      if (left <= 0) continue;
      const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      __m512 v = _mm512_load_ps(sums + (r * NP + q) * 16);
      if (o.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, o.bias + col));
      const int64_t at = (m0 + r) * o.n + col;
      if (o.y == nullptr) {
        _mm512_mask_storeu_ps(o.sums + at, mask, v);
        continue;
      }
      if (o.act == kGeluErf) v = simd::gelu_erf(v);
      else if (o.act == kGeluTanh) v = simd::gelu_tanh(v);
      simd::store16(o.y, 1, at, mask, v);
    }
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, int64_t, const Out&);
template <int NP>
constexpr TileFn kRow[kMR + 1] = {nullptr,       tile<1, NP>, tile<2, NP>, tile<3, NP>, tile<4, NP>,
                                  tile<5, NP>, tile<6, NP>, tile<7, NP>, tile<8, NP>};

// y = LayerNorm(v + residual) * w + beta for rows [r0, r1) of v (fp32 sums + bias, [.., n]); residual
// and y bf16. Two passes over the row (mean, then the centred squares), as int8_cpu.cpp's.
BF_BF16 void residual_ln_rows(const float* v, const uint16_t* res, const float* w, const float* beta, float eps,
                              int64_t r0, int64_t r1, int64_t n, uint16_t* y, float* buf) {
  for (int64_t r = r0; r < r1; ++r) {
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = (n - j >= 16) ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
      const __m512 x = _mm512_add_ps(_mm512_maskz_loadu_ps(m, v + r * n + j), simd::load16(res, 1, r * n + j, m));
      _mm512_mask_storeu_ps(buf + j, m, x);
      vsum = _mm512_add_ps(vsum, x);
    }
    const __m512 vmean = _mm512_set1_ps(_mm512_reduce_add_ps(vsum) / static_cast<float>(n));
    __m512 vsq = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = (n - j >= 16) ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
      const __m512 d = _mm512_maskz_sub_ps(m, _mm512_maskz_loadu_ps(m, buf + j), vmean);
      vsq = _mm512_add_ps(vsq, _mm512_mul_ps(d, d));
    }
    const __m512 vrstd = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(vsq) / static_cast<float>(n) + eps));
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = (n - j >= 16) ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
      const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, buf + j), vmean);
      const __m512 o = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(d, vrstd), _mm512_maskz_loadu_ps(m, w + j)),
                                     _mm512_maskz_loadu_ps(m, beta + j));
      simd::store16(y, 1, r * n + j, m, o);
    }
  }
}
#endif

// One bf16 linear layer on packed weights (see the top of the file). The caller keeps the tensors
// behind the pointers alive (bert_fast/ops/bf16_gemm.py Bf16Linear).
struct Bf16Linear {
  uintptr_t w, bias;  // packed weights, b [n] fp32 or 0
  int64_t k, n;       // k even

  // out [rows, n] bf16 = act(x W^T + b) for x [rows, k] bf16.
  void linear(uintptr_t x, int64_t rows, uintptr_t out, int act, int threads) const {
    run(x, rows, out, act, threads, 0, 0, 0, 0.0f);
  }

  // out = LayerNorm(x W^T + b + residual) * ln_w + ln_b (residual and out bf16, ln_w / ln_b fp32).
  void linear_residual_ln(uintptr_t x, int64_t rows, uintptr_t out, uintptr_t residual, uintptr_t ln_w,
                          uintptr_t ln_b, float eps, int threads) const {
    run(x, rows, out, kNone, threads, residual, ln_w, ln_b, eps);
  }

 private:
  void run(uintptr_t x, int64_t rows, uintptr_t out, int act, int threads, uintptr_t res, uintptr_t ln_w,
           uintptr_t ln_b, float eps) const {
    if (!bf16_usable()) throw std::invalid_argument("Bf16Linear: needs AVX-512 BF16");
    if (act < kNone || act > kGeluTanh) throw std::invalid_argument("Bf16Linear: act must be 0, 1 or 2");
    if (rows <= 0) return;
#ifdef BF_GEMM_BF16
    const int nt = gemm::threads_for(rows, k, n, kGroup, threads);
    thread_local std::vector<float> keep;  // (pointer taken here: a thread_local is per thread)
    std::vector<float> call;
    float* fbuf = res ? gemm::scratch(keep, call, rows * n + nt * n) : nullptr;  // sums, then LN row buffers
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x);
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w);
    uint16_t* yp = reinterpret_cast<uint16_t*>(out);
    const Out o{reinterpret_cast<const float*>(bias), res ? nullptr : yp, fbuf, act, n};
    const int64_t kp = k / 2, panels = (n + 15) / 16, groups = (panels + kGroup - 1) / kGroup;
    py::gil_scoped_release nogil;
    gemm::on_threads(nt, [&](int t, int nth) {
      for (int64_t g = groups * t / nth; g < groups * (t + 1) / nth; ++g) {
        const int64_t p = g * kGroup;
        const int np = static_cast<int>(std::min<int64_t>(kGroup, panels - p));
        for (int64_t m0 = 0; m0 < rows; m0 += kMR) {
          const int mr = static_cast<int>(std::min<int64_t>(kMR, rows - m0));
          const TileFn fn = np == 3 ? kRow<3>[mr] : np == 2 ? kRow<2>[mr] : kRow<1>[mr];
          fn(xp + m0 * k, k, wp + p * kp * 32, kp * 32, kp, m0, p * 16, o);
        }
      }
      if (!res) return;
      gemm::barrier();
      residual_ln_rows(fbuf, reinterpret_cast<const uint16_t*>(res), reinterpret_cast<const float*>(ln_w),
                       reinterpret_cast<const float*>(ln_b), eps, rows * t / nth, rows * (t + 1) / nth, n, yp,
                       fbuf + rows * n + t * n);
    });
#endif
  }
};

}  // namespace

void bind_bf16_linear(py::module_& m) {
  m.def("bf16_linear_usable", &bf16_usable, "This CPU (and BERT_FAST_CPU_ISA) runs Bf16Linear");
  py::class_<Bf16Linear>(m, "Bf16Linear",
                         "One bf16 linear layer on packed weights, each call one parallel region: GEMM, bias, GELU "
                         "or residual + LayerNorm (bert_fast/ops/bf16_gemm.py)")
      .def(py::init([](uintptr_t w, int64_t k, int64_t n, uintptr_t bias) {
             if (k % 2 != 0) throw std::invalid_argument("Bf16Linear: k must be even");
             return Bf16Linear{w, bias, k, n};
           }),
           py::arg("w_packed"), py::arg("k"), py::arg("n"), py::arg("bias"))
      .def("linear", &Bf16Linear::linear, py::arg("x"), py::arg("rows"), py::arg("out"), py::arg("act"),
           py::arg("threads"))
      .def("linear_residual_ln", &Bf16Linear::linear_residual_ln, py::arg("x"), py::arg("rows"), py::arg("out"),
           py::arg("residual"), py::arg("ln_weight"), py::arg("ln_bias"), py::arg("eps"), py::arg("threads"));
}

}  // namespace bert_fast
