// The two memory passes around an int8 GEMM on the CPU (bert_fast/model/int8.py):
//   quantize_rows:  x [M, K] fp32|bf16 -> x_q int8 [M, K], s_x fp32 [M]   (symmetric per row)
//   dequantize:     acc int32 [M, N] -> y = act(acc * s_x[m] * s_w[n] + b[n]), fp32|bf16 [M, N]
//                   (act: none, GELU (erf) or GELU (tanh), in fp32 before the cast)
//   dequantize_residual_ln: y = LayerNorm(acc * s_x[m] * s_w[n] + b[n] + residual) for the GEMMs a
//                   residual + LayerNorm follows (attention output, FFN down): the add and the
//                   LayerNorm in the same pass over each row, instead of two more torch ops and passes
// torch._int_mm does the GEMM between them. Why our own code: written with torch ops, the
// quantization is 5 passes over x (abs, amax, div, round, cast) and the dequantization 3-4 over
// the int32 output (cast, two scales, bias), which on all-MiniLM-L6-v2 shapes cost more than int8
// saves over bf16 (benchmarks/NOTES.md, "int8 on the CPU"). Here each is one pass: a row of x
// (K <= a few thousand) stays in L1 between its max and its quantization.
//
// Rounding: to nearest, ties to even (the vector conversion's default mode, and torch.round's),
// so results equal the torch-op version in bert_fast/model/int8.py bit for bit (tested).
#include <pybind11/pybind11.h>

#include "cpu_isa.h"
#include "int8_rows.h"
#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace bert_fast {
namespace {

enum Dtype : int { kF32 = 0, kBF16 = 1 };

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch's conversion (NaN kept NaN)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline int8_t q8(float v) {  // nearbyint under the default rounding mode: ties to even
  float r = std::nearbyint(v);
  r = std::min(127.0f, std::max(-127.0f, r));
  return static_cast<int8_t>(r);
}

// ----------------------------------------------------------------------------- portable versions
void quant_rows_scalar(const void* x, int dt, int64_t r0, int64_t r1, int64_t k, int8_t* q, float* s) {
  for (int64_t r = r0; r < r1; ++r) {
    float amax = 0.0f;
    if (dt == kF32) {
      const float* row = static_cast<const float*>(x) + r * k;
      for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::fabs(row[j]));
    } else {
      const uint16_t* row = static_cast<const uint16_t*>(x) + r * k;
      for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::fabs(bf16_to_f32(row[j])));
    }
    const float scale = std::max(amax, 1e-12f) / 127.0f;
    s[r] = scale;
    int8_t* out = q + r * k;
    if (dt == kF32) {
      const float* row = static_cast<const float*>(x) + r * k;
      for (int64_t j = 0; j < k; ++j) out[j] = q8(row[j] / scale);
    } else {
      const uint16_t* row = static_cast<const uint16_t*>(x) + r * k;
      for (int64_t j = 0; j < k; ++j) out[j] = q8(bf16_to_f32(row[j]) / scale);
    }
  }
}

enum Act : int { kNone = 0, kGeluErf = 1, kGeluTanh = 2 };

inline float act_scalar(float v, int act) {
  if (act == kGeluErf) return 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
  if (act == kGeluTanh) return 0.5f * v * (1.0f + std::tanh(0.79788456080286536f * (v + 0.044715f * v * v * v)));
  return v;
}

// Element i of x (fp32 or bf16) as fp32; v into element i of y (fp32, or bf16 rounded to nearest even).
inline float load_any(const void* x, int dt, int64_t i) {
  return dt == kF32 ? static_cast<const float*>(x)[i] : bf16_to_f32(static_cast<const uint16_t*>(x)[i]);
}

inline void store_any(void* y, int dt, int64_t i, float v) {
  if (dt == kF32)
    static_cast<float*>(y)[i] = v;
  else
    static_cast<uint16_t*>(y)[i] = f32_to_bf16(v);
}

void dequant_rows_scalar(const int32_t* acc, int64_t r0, int64_t r1, int64_t n, const float* sx, const float* sw,
                         const float* b, void* y, int dt, int act) {
  for (int64_t r = r0; r < r1; ++r) {
    const int32_t* a = acc + r * n;
    for (int64_t j = 0; j < n; ++j) {
      float v = static_cast<float>(a[j]) * sx[r] * sw[j];
      if (b) v += b[j];
      store_any(y, dt, r * n + j, act_scalar(v, act));
    }
  }
}

// dequantize + residual + LayerNorm of one row (the attention output's and the FFN's down GEMM, whose
// N is the hidden size): v = acc * s_x * s_w + b + residual, y = (v - mean) * rstd * w + beta, the
// statistics over the row in two passes (mean, then the centred squares), all in fp32, one cast at
// the end. ``buf``: a row of n floats.
void dequant_ln_rows_scalar(const int32_t* acc, int64_t r0, int64_t r1, int64_t n, const float* sx, const float* sw,
                            const float* b, const void* res, const float* w, const float* beta, float eps,
                            void* y, int dt, float* buf) {
  for (int64_t r = r0; r < r1; ++r) {
    const int32_t* a = acc + r * n;
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      float v = static_cast<float>(a[j]) * sx[r] * sw[j];
      if (b) v += b[j];
      v += load_any(res, dt, r * n + j);
      buf[j] = v;
      sum += v;
    }
    const float mean = sum / static_cast<float>(n);
    float sq = 0.0f;
    for (int64_t j = 0; j < n; ++j) sq += (buf[j] - mean) * (buf[j] - mean);
    const float rstd = 1.0f / std::sqrt(sq / static_cast<float>(n) + eps);
    for (int64_t j = 0; j < n; ++j) {
      store_any(y, dt, r * n + j, (buf[j] - mean) * rstd * w[j] + beta[j]);
    }
  }
}

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define BF_INT8_X86 1
#include <immintrin.h>

using simd::load16;
using simd::store16;

__attribute__((target("avx512f,avx512bw,avx512vl"))) void quant_rows_avx512(const void* x, int dt, int64_t r0,
                                                                             int64_t r1, int64_t k, int8_t* q,
                                                                             float* s) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t base = r * k;
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) {
      const __mmask16 m = (k - j >= 16) ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (k - j)) - 1);
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(x, dt, base + j, m)));
    }
    const float scale = std::max(_mm512_reduce_max_ps(vmax), 1e-12f) / 127.0f;
    s[r] = scale;
    const __m512 vs = _mm512_set1_ps(scale);
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int64_t j = 0; j < k; j += 16) {
      const __mmask16 m = (k - j >= 16) ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (k - j)) - 1);
      // x / scale (a division, not a multiply by 127/amax: the torch version's numbers exactly)
      __m512 v = _mm512_div_ps(load16(x, dt, base + j, m), vs);
      v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
      const __m512i iv = _mm512_cvtps_epi32(v);  // round to nearest even
      _mm_mask_storeu_epi8(q + base + j, m, _mm512_cvtsepi32_epi8(iv));
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void dequant_rows_avx512(const int32_t* acc, int64_t r0,
                                                                               int64_t r1, int64_t n, const float* sx,
                                                                               const float* sw, const float* b,
                                                                               void* y, int dt, int act) {
  for (int64_t r = r0; r < r1; ++r) {
    const __m512 vsx = _mm512_set1_ps(sx[r]);
    const int32_t* a = acc + r * n;
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = (n - j >= 16) ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
      // (acc * s_x) * s_w + b, in the scalar version's order
      __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, a + j)), vsx),
                               _mm512_maskz_loadu_ps(m, sw + j));
      if (b) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, b + j));
      if (act == kGeluErf) v = simd::gelu_erf(v);
      else if (act == kGeluTanh) v = simd::gelu_tanh(v);
      store16(y, dt, r * n + j, m, v);
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void dequant_ln_rows_avx512(
    const int32_t* acc, int64_t r0, int64_t r1, int64_t n, const float* sx, const float* sw, const float* b,
    const void* res, const float* w, const float* beta, float eps, void* y, int dt, float* buf) {
  for (int64_t r = r0; r < r1; ++r) {
    const __m512 vsx = _mm512_set1_ps(sx[r]);
    const int32_t* a = acc + r * n;
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {  // masked tails load zeros: they add nothing to the sum
      const __mmask16 m = (n - j >= 16) ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
      __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, a + j)), vsx),
                               _mm512_maskz_loadu_ps(m, sw + j));
      if (b) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, b + j));
      v = _mm512_add_ps(v, load16(res, dt, r * n + j, m));
      _mm512_mask_storeu_ps(buf + j, m, v);
      vsum = _mm512_add_ps(vsum, v);
    }
    simd::layer_norm_row(buf, vsum, n, w, beta, eps, y, dt, r * n);
  }
}
#endif

// Whether a pass runs its AVX-512 version: the widest this CPU runs (capped by BERT_FAST_CPU_ISA:
// cpu_isa.h) for isa "", or the one named (avx512 | scalar; an error where it cannot run here).
// Checked before any size test, so a call of zero rows tells whether that version is available.
bool use_avx512(const std::string& isa) {
  if (!isa.empty() && isa != "avx512" && isa != "scalar")
    throw std::invalid_argument("int8 passes: isa must be \"\", avx512 or scalar, got " + isa);
#ifdef BF_INT8_X86
  const bool has = isa_usable(Isa::kAvx512);
  if (isa == "avx512" && !has) throw std::invalid_argument("int8 passes: " + isa_refusal(isa));
  return has && isa != "scalar";
#else
  if (isa == "avx512") throw std::invalid_argument("int8 passes: this build has no AVX-512 code");
  return false;
#endif
}

// Below this many elements per thread one thread does it: waking a thread costs ~5-50 us, and 2^17
// elements of the plain dequantize pass are ~10 us of work on a Zen 5 core.
constexpr int64_t kMinElementsPerThread = 1 << 17;
// What an element costs beside the plain dequantize pass (measured on a Zen 5, 128 x 1536, one thread):
// the GELU epilogue 4.5x (67 us against 15), the LayerNorm one ~2x. split_rows weighs the element count
// by it, so batch 1's FFN-up dequantize (196,608 elements, 67 us on one core) runs on both cores.
constexpr int64_t kCostPlain = 1, kCostLayerNorm = 2, kCostGelu = 4;

// Rows split in equal parts over up to ``threads`` threads: torch's OpenMP pool where the build has
// OpenMP (this module's libgomp.so.1 resolves to the copy torch loaded, so the GEMMs around these
// passes and the passes share one set of threads: std::threads started next to oneDNN's measured
// 1.5-2x slower), else std::threads.
template <class F>
void split_rows(int64_t rows, int64_t cols, int threads, int64_t cost, F f) {
  const int64_t by_size = std::max<int64_t>(1, rows * cols * cost / kMinElementsPerThread);
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>({static_cast<int64_t>(threads), by_size, rows}));
  if (n == 1) {
    f(0, rows);
    return;
  }
  const int64_t per = (rows + n - 1) / n;
#ifdef _OPENMP
#pragma omp parallel for num_threads(static_cast<int>(n)) schedule(static, 1)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r0 = i * per, r1 = std::min(rows, r0 + per);
    if (r0 < r1) f(r0, r1);
  }
#else
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < n; ++i) {
    const int64_t r0 = i * per, r1 = std::min(rows, r0 + per);
    if (r0 < r1) pool.emplace_back(f, r0, r1);
  }
  f(0, std::min(rows, per));
  for (auto& t : pool) t.join();
#endif
}

void quantize_rows(uintptr_t x, int dt, int64_t rows, int64_t k, uintptr_t q, uintptr_t s, int threads,
                   const std::string& isa) {
  if (dt != kF32 && dt != kBF16) throw std::invalid_argument("int8_quantize_rows: dtype code must be 0 or 1");
  const bool v = use_avx512(isa);
  if (rows <= 0 || k <= 0) return;
  const void* xp = reinterpret_cast<const void*>(x);
  int8_t* qp = reinterpret_cast<int8_t*>(q);
  float* sp = reinterpret_cast<float*>(s);
  py::gil_scoped_release nogil;
  split_rows(rows, k, threads, kCostPlain, [=](int64_t r0, int64_t r1) {
#ifdef BF_INT8_X86
    if (v) return quant_rows_avx512(xp, dt, r0, r1, k, qp, sp);
#endif
    quant_rows_scalar(xp, dt, r0, r1, k, qp, sp);
  });
}

void dequantize(uintptr_t acc, int64_t rows, int64_t n, uintptr_t sx, uintptr_t sw, uintptr_t bias, uintptr_t y,
                int dt, int threads, const std::string& isa, int act) {
  if (dt != kF32 && dt != kBF16) throw std::invalid_argument("int8_dequantize: dtype code must be 0 or 1");
  if (act != kNone && act != kGeluErf && act != kGeluTanh)
    throw std::invalid_argument("int8_dequantize: act must be 0 (none), 1 (GELU erf) or 2 (GELU tanh)");
  const bool v = use_avx512(isa);
  if (rows <= 0 || n <= 0) return;
  const int32_t* ap = reinterpret_cast<const int32_t*>(acc);
  const float* sxp = reinterpret_cast<const float*>(sx);
  const float* swp = reinterpret_cast<const float*>(sw);
  const float* bp = reinterpret_cast<const float*>(bias);  // 0: no bias
  void* yp = reinterpret_cast<void*>(y);
  py::gil_scoped_release nogil;
  split_rows(rows, n, threads, act == kNone ? kCostPlain : kCostGelu, [=](int64_t r0, int64_t r1) {
#ifdef BF_INT8_X86
    if (v) return dequant_rows_avx512(ap, r0, r1, n, sxp, swp, bp, yp, dt, act);
#endif
    dequant_rows_scalar(ap, r0, r1, n, sxp, swp, bp, yp, dt, act);
  });
}

void dequantize_residual_ln(uintptr_t acc, int64_t rows, int64_t n, uintptr_t sx, uintptr_t sw, uintptr_t bias,
                            uintptr_t residual, uintptr_t ln_w, uintptr_t ln_b, double eps, uintptr_t y,
                            int dt, int threads, const std::string& isa) {
  if (dt != kF32 && dt != kBF16) throw std::invalid_argument("int8_dequantize_residual_ln: dtype code must be 0 or 1");
  const bool v = use_avx512(isa);
  if (rows <= 0 || n <= 0) return;
  const int32_t* ap = reinterpret_cast<const int32_t*>(acc);
  const float* sxp = reinterpret_cast<const float*>(sx);
  const float* swp = reinterpret_cast<const float*>(sw);
  const float* bp = reinterpret_cast<const float*>(bias);  // 0: no bias
  const void* rp = reinterpret_cast<const void*>(residual);
  const float* wp = reinterpret_cast<const float*>(ln_w);
  const float* lbp = reinterpret_cast<const float*>(ln_b);
  void* yp = reinterpret_cast<void*>(y);
  const float e = static_cast<float>(eps);
  py::gil_scoped_release nogil;
  split_rows(rows, n, threads, kCostLayerNorm, [=](int64_t r0, int64_t r1) {
    std::vector<float> buf(static_cast<size_t>(n));  // the row of v between the passes (L1)
#ifdef BF_INT8_X86
    if (v) return dequant_ln_rows_avx512(ap, r0, r1, n, sxp, swp, bp, rp, wp, lbp, e, yp, dt, buf.data());
#endif
    dequant_ln_rows_scalar(ap, r0, r1, n, sxp, swp, bp, rp, wp, lbp, e, yp, dt, buf.data());
  });
}

}  // namespace

#ifdef BF_INT8_X86
// For the VNNI GEMM's one-call linear (int8_gemm_vnni.cpp): the same row passes, by row range.
void quantize_rows_avx512(const void* x, int dt, int64_t r0, int64_t r1, int64_t k, int8_t* q, float* s) {
  quant_rows_avx512(x, dt, r0, r1, k, q, s);
}
void dequantize_ln_rows_avx512(const int32_t* acc, int64_t r0, int64_t r1, int64_t n, const float* sx,
                               const float* sw, const float* b, const void* res, const float* w, const float* beta,
                               float eps, void* y, int dt, float* buf) {
  dequant_ln_rows_avx512(acc, r0, r1, n, sx, sw, b, res, w, beta, eps, y, dt, buf);
}
#endif

void bind_int8(py::module_& m) {
  m.def("int8_quantize_rows", &quantize_rows, py::arg("x"), py::arg("dtype"), py::arg("rows"), py::arg("cols"),
        py::arg("q"), py::arg("scale"), py::arg("threads"), py::arg("isa") = "",
        "x [rows, cols] (dtype 0: fp32, 1: bf16; contiguous) -> q int8 [rows, cols], scale fp32 [rows]: "
        "symmetric per row, round to nearest even; isa: \"\" (widest) | avx512 | scalar");
  m.def("int8_dequantize", &dequantize, py::arg("acc"), py::arg("rows"), py::arg("cols"), py::arg("row_scale"),
        py::arg("col_scale"), py::arg("bias"), py::arg("out"), py::arg("dtype"), py::arg("threads"),
        py::arg("isa") = "", py::arg("act") = 0,
        "out [rows, cols] (dtype 0: fp32, 1: bf16) = act(acc int32 * row_scale[r] * col_scale[c] + bias[c]) "
        "(bias 0: none; act 0: none, 1: GELU erf, 2: GELU tanh); one pass");
  m.def("int8_dequantize_residual_ln", &dequantize_residual_ln, py::arg("acc"), py::arg("rows"), py::arg("cols"),
        py::arg("row_scale"), py::arg("col_scale"), py::arg("bias"), py::arg("residual"),
        py::arg("ln_weight"), py::arg("ln_bias"), py::arg("eps"), py::arg("out"), py::arg("dtype"), py::arg("threads"),
        py::arg("isa") = "",
        "out [rows, cols] = LayerNorm(acc int32 * row_scale[r] * col_scale[c] + bias[c] + residual) * ln_weight + "
        "ln_bias, in fp32 (residual and out of one dtype: 0 fp32, 1 bf16; weights fp32); one pass over acc");
  m.def("int8_isa", []() { return std::string(use_avx512("") ? "avx512" : "scalar"); },
        "The version the int8 passes run on this CPU (capped by BERT_FAST_CPU_ISA)");
}

}  // namespace bert_fast
