// AVX-512 math shared by the CPU kernels (attention_cpu.cpp, int8_cpu.cpp, int8_gemm_vnni.cpp,
// cpu_linear.cpp): exp of non-positive arguments and the two GELUs, in fp32, to ~1e-7 (torch's own
// vectorized versions are of the same kind: a polynomial times 2^n, and Abramowitz-Stegun 7.1.26 for
// erf), and LayerNorm's last passes over a row.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#define BF_SIMD_MATH_TARGET __attribute__((target("avx512f,avx512dq,fma")))

namespace bert_fast {
namespace simd {

// exp(x) for x <= 0: 2^n * poly(r), r in [-ln2/2, ln2/2], degree-6 Taylor (relative error < 3e-7);
// below -87 (and -inf) exactly 0.
BF_SIMD_MATH_TARGET inline __m512 exp_nonpos(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}

// GELU(x) = x/2 (1 + erf(x / sqrt 2)); erf by Abramowitz-Stegun 7.1.26 (absolute error < 1.5e-7)
BF_SIMD_MATH_TARGET inline __m512 gelu_erf(__m512 v) {
  const __m512 x = _mm512_mul_ps(v, _mm512_set1_ps(0.70710678118654752f));
  const __m512 ax = _mm512_abs_ps(x);
  const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(ax, _mm512_set1_ps(0.3275911f), _mm512_set1_ps(1.0f)));
  __m512 p = _mm512_set1_ps(1.061405429f);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
  p = _mm512_mul_ps(p, t);
  const __m512 e = exp_nonpos(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), ax), ax));
  __m512 erf_abs = _mm512_fnmadd_ps(p, e, _mm512_set1_ps(1.0f));
  // copy the sign of x
  const __m512 sign = _mm512_and_ps(x, _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u))));
  const __m512 erf = _mm512_or_ps(erf_abs, sign);
  return _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(0.5f)), _mm512_add_ps(erf, _mm512_set1_ps(1.0f)));
}

// GELU, tanh form: x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(u) = sign(u) (1 - e) / (1 + e),
// e = exp(-2 |u|)
BF_SIMD_MATH_TARGET inline __m512 gelu_tanh(__m512 v) {
  const __m512 v3 = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
  const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.79788456080286536f), _mm512_fmadd_ps(v3, _mm512_set1_ps(0.044715f), v));
  const __m512 au = _mm512_abs_ps(u);
  const __m512 e = exp_nonpos(_mm512_mul_ps(au, _mm512_set1_ps(-2.0f)));
  const __m512 th_abs = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  const __m512 sign = _mm512_and_ps(u, _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u))));
  const __m512 th = _mm512_or_ps(th_abs, sign);
  return _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(0.5f)), _mm512_add_ps(th, _mm512_set1_ps(1.0f)));
}

// 16 lanes of fp32 from x (dt 0: fp32, 1: bf16), masked tail.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const void* x, int dt, int64_t i,
                                                                          __mmask16 m) {
  if (dt == 0) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(x) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(x) + i);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 lanes of fp32 into y (dt 0: fp32, 1: bf16 rounded to nearest even: finite values only, which
// the int8 GEMMs, GELU and LayerNorm here always give), masked tail.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void store16(void* y, int dt, int64_t i, __mmask16 m,
                                                                         __m512 v) {
  if (dt == 0) return _mm512_mask_storeu_ps(static_cast<float*>(y) + i, m, v);
  __m512i u = _mm512_castps_si512(v);
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                           _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + i, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

// LayerNorm's last two passes over one row h of n fp32 values whose lanewise sum the caller's first
// pass gave (vsum; it made h there, from its own sums): the centred squares, then y[at, at + n) =
// (h - mean) * rstd * w + beta in dt. The int8 dequantize pass, the VNNI one-call linear and the bf16 /
// fp32 one-call linear share it. static and always inlined: each caller's file keeps its own
// -ffp-contract (int8_cpu.cpp compiles with it off, for bits equal to the separate passes').
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) static inline void layer_norm_row(
    const float* h, __m512 vsum, int64_t n, const float* w, const float* beta, float eps, void* y, int dt, int64_t at) {
  const __m512 vmean = _mm512_set1_ps(_mm512_reduce_add_ps(vsum) / static_cast<float>(n));
  __m512 vsq = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = (n - j >= 16) ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 d = _mm512_maskz_sub_ps(m, _mm512_maskz_loadu_ps(m, h + j), vmean);
    vsq = _mm512_add_ps(vsq, _mm512_mul_ps(d, d));
  }
  const __m512 vrstd = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(vsq) / static_cast<float>(n) + eps));
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = (n - j >= 16) ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, h + j), vmean);
    const __m512 o = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(d, vrstd), _mm512_maskz_loadu_ps(m, w + j)),
                                   _mm512_maskz_loadu_ps(m, beta + j));
    store16(y, dt, at + j, m, o);
  }
}

}  // namespace simd
}  // namespace bert_fast
#endif
