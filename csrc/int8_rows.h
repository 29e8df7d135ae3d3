// The int8 row passes of int8_cpu.cpp (AVX-512 versions, rows [r0, r1)), for the VNNI GEMM's
// one-call linear (int8_gemm_vnni.cpp): quantize its input and, for the GEMMs a residual add and
// LayerNorm follow, finish in the same call, with the very arithmetic of the separate passes.
#pragma once

#include <cstdint>

namespace bert_fast {

// x (dt 0: fp32, 1: bf16) [.., k] -> q int8, s fp32 per row: symmetric, s = max|x_row| / 127.
void quantize_rows_avx512(const void* x, int dt, int64_t r0, int64_t r1, int64_t k, int8_t* q, float* s);

// y = LayerNorm(acc * s_x * s_w + b + res) * w + beta per row, in dt (res and y); buf: n floats.
void dequantize_ln_rows_avx512(const int32_t* acc, int64_t r0, int64_t r1, int64_t n, const float* sx,
                               const float* sw, const float* b, const void* res, const float* w, const float* beta,
                               float eps, void* y, int dt, float* buf);

}  // namespace bert_fast
