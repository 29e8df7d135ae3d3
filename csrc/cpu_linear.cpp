// A linear layer of CPU inference in one call, on weights packed once, in bf16 (AVX-512 BF16) or fp32
// (AVX-512 F + FMA):
//
//   y = act(x W^T + b)                                   GELU in the epilogue, or
//   y = LayerNorm(x W^T + b + residual) * ln_w + ln_b    the residual add and LayerNorm after the sums
//
// Why our own when oneDNN's packed linear (freeze()) already runs near the hardware rate: at batch 1
// a MiniLM forward spent ~2.8 ms of its 11.3 outside the kernels, in Python and torch's dispatcher
// between ~10 calls per layer (benchmarks/NOTES.md, "int8 on packed weights": the same lever took
// 0.75 ms off the int8 forward). One call per linear, the add and LayerNorm included, removes most of
// them; oneDNN's kernel is reachable only through torch's dispatcher (this module links no libtorch).
//
// How. The weights are packed once (bert_fast/ops/cpu_linear.py pack_weight) so that one 64-byte load
// is 16 columns of one k-step (fp32) or of two (bf16: vdpbf16ps multiplies pairs of bf16 and adds both
// products into an fp32 lane):
//
//   fp32  packed[p, k, lane]    = W^T[k, 16p + lane]         [ceil(N/16), K, 16], zero padded
//   bf16  packed[p, j, lane, t] = W^T[2j + t, 16p + lane]    [ceil(N/16), K/2, 16, 2]
//
// and a broadcast element of x (a bf16 pair) multiplies all of them. Tiles of 8 rows x 48 columns (24
// zmm accumulators over the whole K), threads and scratch as the int8 GEMM's (int8_gemm_vnni.cpp,
// cpu_gemm_common.h). The sums run in fp32 in another order than oneDNN's: not the same bits, held to
// the float64 oracle by the 2x rule (tests/cpu/test_cpu_linear.py), and bert_fast/model/frozen.py uses
// it only where it measured faster than the packed oneDNN call it replaces.
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "cpu_gemm_common.h"
#include "cpu_isa.h"
#include "simd_math.h"

namespace py = pybind11;

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define CL_AVX512 1
#include <immintrin.h>
#endif

namespace bert_fast {
namespace {

constexpr int kMR = 8;     // rows per tile
constexpr int kGroup = 3;  // 16-column panels per tile
constexpr int kF32 = 0, kBf16 = 1;  // the activations' dtype: simd::load16 / store16's codes
enum Act : int { kNone = 0, kGeluErf = 1, kGeluTanh = 2 };

template <int DT>
using Elem = std::conditional_t<DT == kBf16, uint16_t, float>;

template <int DT>
bool usable() {
#ifdef CL_AVX512
  __builtin_cpu_init();
  return isa_usable(DT == kBf16 ? Isa::kAvx512Bf16 : Isa::kAvx512) && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

#ifdef CL_AVX512
#define CL_F32 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define CL_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
using I32Alias = int32_t __attribute__((may_alias));

// Where a tile's sums (+ bias) go: y in the activations' dtype with the GELU, or fp32 `sums` rows for
// the LayerNorm.
struct Out {
  const float* bias;  // null: none
  void* y;            // null: into sums
  float* sums;
  int act;
  int64_t n;
};

// The fp32 sums of rows [0, MR) of `a` (row stride lda elements) x NP panels at `bp` (panel stride
// `pstride` elements), into sums[MR][NP * 16]: each k-loop alone in its own function, unrolled, so
// that GCC keeps the 24 accumulators in registers (int8_gemm_vnni.cpp). bf16: kp pair-steps.
template <int MR, int NP>
CL_BF16 __attribute__((noinline)) void sums_bf16(const uint16_t* a, int64_t lda, const uint16_t* bp, int64_t pstride,
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

// fp32: one FMA per accumulator and k-step, over blocks of kKBlock k-steps whose sums are added up
// in memory. One running sum over all of K rounded ~K times: at K = 1536 that was 4x oneDNN's error
// (which blocks K too) and failed the 2x rule; blocks of 128 round ~K / 128 + 128 times.
constexpr int64_t kKBlock = 128;

template <int MR, int NP>
CL_F32 __attribute__((noinline)) void block_f32(const float* a, int64_t lda, const float* bp, int64_t pstride,
                                                 int64_t j0, int64_t j1, float* sums, bool first) {
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    __m512 b[NP];
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) b[q] = _mm512_loadu_ps(bp + q * pstride + j * 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * lda + j]);
#pragma GCC unroll 4
      for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_fmadd_ps(av, b[q], acc[r][q]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) {
      float* s = sums + (r * NP + q) * 16;
      _mm512_store_ps(s, first ? acc[r][q] : _mm512_add_ps(_mm512_load_ps(s), acc[r][q]));
    }
}

template <int MR, int NP>
CL_F32 void sums_f32(const float* a, int64_t lda, const float* bp, int64_t pstride, int64_t k, float* sums) {
  if (k == 0) {
    for (int i = 0; i < MR * NP * 16; ++i) sums[i] = 0.0f;
    return;
  }
  for (int64_t j0 = 0; j0 < k; j0 += kKBlock)
    block_f32<MR, NP>(a, lda, bp, pstride, j0, std::min(k, j0 + kKBlock), sums, j0 == 0);
}

// Rows [m0, m0 + MR) x NP panels from column n0 (`steps` k-steps of the packed layout): sums + bias,
// then the GELU and y, or into o.sums.
template <int DT, int MR, int NP>
CL_F32 void tile(const Elem<DT>* a, int64_t lda, const Elem<DT>* bp, int64_t pstride, int64_t steps, int64_t m0,
                 int64_t n0, const Out& o) {
  alignas(64) float sums[MR * NP * 16];
  if constexpr (DT == kBf16) sums_bf16<MR, NP>(a, lda, bp, pstride, steps, sums);
  else sums_f32<MR, NP>(a, lda, bp, pstride, steps, sums);
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
      simd::store16(o.y, DT, at, mask, v);
    }
  }
}

template <int DT>
using TileFn = void (*)(const Elem<DT>*, int64_t, const Elem<DT>*, int64_t, int64_t, int64_t, int64_t, const Out&);
template <int DT, int NP>
constexpr TileFn<DT> kRow[kMR + 1] = {nullptr,           tile<DT, 1, NP>, tile<DT, 2, NP>,
                                      tile<DT, 3, NP>,   tile<DT, 4, NP>, tile<DT, 5, NP>,
                                      tile<DT, 6, NP>,   tile<DT, 7, NP>, tile<DT, 8, NP>};

// y = LayerNorm(v + residual) * w + beta for rows [r0, r1) of v (fp32 sums + bias, [.., n]); residual
// and y in dtype `dt`: the add and the row sum here, the rest simd::layer_norm_row (int8_cpu.cpp's too).
CL_F32 void residual_ln_rows(const float* v, const void* res, const float* w, const float* beta, float eps, int64_t r0,
                             int64_t r1, int64_t n, int dt, void* y, float* buf) {
  for (int64_t r = r0; r < r1; ++r) {
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = (n - j >= 16) ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
      const __m512 x = _mm512_add_ps(_mm512_maskz_loadu_ps(m, v + r * n + j), simd::load16(res, dt, r * n + j, m));
      _mm512_mask_storeu_ps(buf + j, m, x);
      vsum = _mm512_add_ps(vsum, x);
    }
    simd::layer_norm_row(buf, vsum, n, w, beta, eps, y, dt, r * n);
  }
}
#endif

// One linear layer on packed weights in dtype DT (see the top of the file). The caller keeps the
// tensors behind the pointers alive (bert_fast/ops/cpu_linear.py).
template <int DT>
struct OneCallLinear {
  uintptr_t w, bias;  // packed weights, b [n] fp32 or 0
  int64_t k, n;       // bf16: k even

  // out [rows, n] = act(x W^T + b) for x [rows, k].
  void linear(uintptr_t x, int64_t rows, uintptr_t out, int act, int threads) const {
    run(x, rows, out, act, threads, 0, 0, 0, 0.0f);
  }

  // out = LayerNorm(x W^T + b + residual) * ln_w + ln_b (residual and out in DT, ln_w / ln_b fp32).
  void linear_residual_ln(uintptr_t x, int64_t rows, uintptr_t out, uintptr_t residual, uintptr_t ln_w,
                          uintptr_t ln_b, float eps, int threads) const {
    run(x, rows, out, kNone, threads, residual, ln_w, ln_b, eps);
  }

 private:
  void run(uintptr_t x, int64_t rows, uintptr_t out, int act, int threads, uintptr_t res, uintptr_t ln_w,
           uintptr_t ln_b, float eps) const {
    if (!usable<DT>()) throw std::invalid_argument(DT == kBf16 ? "Bf16Linear: needs AVX-512 BF16" : "F32Linear: needs AVX-512");
    if (act < kNone || act > kGeluTanh) throw std::invalid_argument("OneCallLinear: act must be 0, 1 or 2");
    if (rows <= 0) return;
#ifdef CL_AVX512
    const int nt = gemm::threads_for(rows, k, n, kGroup, threads);
    thread_local std::vector<float> keep;  // (pointer taken here: a thread_local is per thread)
    std::vector<float> call;
    float* fbuf = res ? gemm::scratch(keep, call, rows * n + nt * n) : nullptr;  // sums, then LN row buffers
    const Elem<DT>* xp = reinterpret_cast<const Elem<DT>*>(x);
    const Elem<DT>* wp = reinterpret_cast<const Elem<DT>*>(w);
    const Out o{reinterpret_cast<const float*>(bias), res ? nullptr : reinterpret_cast<void*>(out), fbuf, act, n};
    // per panel: `steps` k-steps of 16 elements (fp32) or of 16 pairs (bf16): 64 bytes each
    const int64_t steps = DT == kBf16 ? k / 2 : k, pstride = steps * (DT == kBf16 ? 32 : 16);
    const int64_t panels = (n + 15) / 16, groups = (panels + kGroup - 1) / kGroup;
    py::gil_scoped_release nogil;
    gemm::on_threads(nt, [&](int t, int nth) {
      for (int64_t g = groups * t / nth; g < groups * (t + 1) / nth; ++g) {
        const int64_t p = g * kGroup;
        const int np = static_cast<int>(std::min<int64_t>(kGroup, panels - p));
        for (int64_t m0 = 0; m0 < rows; m0 += kMR) {
          const int mr = static_cast<int>(std::min<int64_t>(kMR, rows - m0));
          const TileFn<DT> fn = np == 3 ? kRow<DT, 3>[mr] : np == 2 ? kRow<DT, 2>[mr] : kRow<DT, 1>[mr];
          fn(xp + m0 * k, k, wp + p * pstride, pstride, steps, m0, p * 16, o);
        }
      }
      if (!res) return;
      gemm::barrier();
      residual_ln_rows(fbuf, reinterpret_cast<const void*>(res), reinterpret_cast<const float*>(ln_w),
                       reinterpret_cast<const float*>(ln_b), eps, rows * t / nth, rows * (t + 1) / nth, n, DT,
                       reinterpret_cast<void*>(out), fbuf + rows * n + t * n);
    });
#endif
  }
};

template <int DT>
void bind(py::module_& m, const char* name, const char* usable_name, const char* what) {
  m.def(usable_name, &usable<DT>, what);
  py::class_<OneCallLinear<DT>>(m, name,
                                "One linear layer on packed weights, each call one parallel region: GEMM, bias, GELU "
                                "or residual + LayerNorm (bert_fast/ops/cpu_linear.py)")
      .def(py::init([](uintptr_t w, int64_t k, int64_t n, uintptr_t bias) {
             if (DT == kBf16 && k % 2 != 0) throw std::invalid_argument("Bf16Linear: k must be even");
             return OneCallLinear<DT>{w, bias, k, n};
           }),
           py::arg("w_packed"), py::arg("k"), py::arg("n"), py::arg("bias"))
      .def("linear", &OneCallLinear<DT>::linear, py::arg("x"), py::arg("rows"), py::arg("out"), py::arg("act"),
           py::arg("threads"))
      .def("linear_residual_ln", &OneCallLinear<DT>::linear_residual_ln, py::arg("x"), py::arg("rows"), py::arg("out"),
           py::arg("residual"), py::arg("ln_weight"), py::arg("ln_bias"), py::arg("eps"), py::arg("threads"));
}

}  // namespace

void bind_cpu_linear(py::module_& m) {
  bind<kBf16>(m, "Bf16Linear", "bf16_linear_usable", "This CPU (and BERT_FAST_CPU_ISA) runs Bf16Linear");
  bind<kF32>(m, "F32Linear", "f32_linear_usable", "This CPU (and BERT_FAST_CPU_ISA) runs F32Linear");
}

}  // namespace bert_fast
