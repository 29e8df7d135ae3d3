// AVX2 twins of simd_math.h's exp and GELUs (8 lanes, same formulas, same ~1e-7 accuracy), for the
// passes that run on CPUs without AVX-512 (int8_gemm_avx2.cpp's epilogue).
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include <cstdint>

#define BF_SIMD2_TARGET __attribute__((target("avx2,fma")))

namespace bert_fast {
namespace simd2 {

BF_SIMD2_TARGET inline __m256 abs_ps(__m256 x) {
  return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
}

BF_SIMD2_TARGET inline __m256 sign_of(__m256 x) {
  return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u))));
}

// exp(x) for x <= 0: 2^n * poly(r), r in [-ln2/2, ln2/2], degree-6 Taylor; below -87 exactly 0.
// 2^n is built in the exponent field (n >= -126 here, so never subnormal).
BF_SIMD2_TARGET inline __m256 exp_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// GELU(x) = x/2 (1 + erf(x / sqrt 2)); erf by Abramowitz-Stegun 7.1.26 (absolute error < 1.5e-7)
BF_SIMD2_TARGET inline __m256 gelu_erf(__m256 v) {
  const __m256 x = _mm256_mul_ps(v, _mm256_set1_ps(0.70710678118654752f));
  const __m256 ax = abs_ps(x);
  const __m256 t =
      _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(ax, _mm256_set1_ps(0.3275911f), _mm256_set1_ps(1.0f)));
  __m256 p = _mm256_set1_ps(1.061405429f);
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.453152027f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.421413741f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.284496736f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.254829592f));
  p = _mm256_mul_ps(p, t);
  const __m256 e = exp_nonpos(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), ax), ax));
  const __m256 erf = _mm256_or_ps(_mm256_fnmadd_ps(p, e, _mm256_set1_ps(1.0f)), sign_of(x));
  return _mm256_mul_ps(_mm256_mul_ps(v, _mm256_set1_ps(0.5f)), _mm256_add_ps(erf, _mm256_set1_ps(1.0f)));
}

// GELU, tanh form: x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(u) = sign(u) (1 - e) / (1 + e),
// e = exp(-2 |u|)
BF_SIMD2_TARGET inline __m256 gelu_tanh(__m256 v) {
  const __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
  const __m256 u =
      _mm256_mul_ps(_mm256_set1_ps(0.79788456080286536f), _mm256_fmadd_ps(v3, _mm256_set1_ps(0.044715f), v));
  const __m256 e = exp_nonpos(_mm256_mul_ps(abs_ps(u), _mm256_set1_ps(-2.0f)));
  const __m256 th_abs =
      _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), e), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  const __m256 th = _mm256_or_ps(th_abs, sign_of(u));
  return _mm256_mul_ps(_mm256_mul_ps(v, _mm256_set1_ps(0.5f)), _mm256_add_ps(th, _mm256_set1_ps(1.0f)));
}

}  // namespace simd2
}  // namespace bert_fast
#endif
