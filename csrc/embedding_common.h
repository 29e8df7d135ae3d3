// Shared by the CPU twin (embedding_cpu.cpp) and the CUDA kernels (embedding_cuda.cu): the launch
// parameter structs, the dtype/index codes and the Philox4x32-10 dropout stream. Nothing here
// includes pybind11 or libtorch, so nvcc compiles it as is.
//
// Dropout mask definition (identical on both sides, bit for bit):
//   element j of output row t (t = row of the output, i.e. after unpadding) is KEPT iff
//     philox4x32_10(counter = {j / 4, 0, lo32(t), hi32(t)}, key = {lo32(seed), hi32(seed)})[j % 4]
//       >= keep_threshold,
//   keep_threshold = round(p * 2^32) (a uint64 in [0, 2^32]); kept values are scaled by 1 / (1 - p).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define BF_HD __host__ __device__ __forceinline__
#else
#define BF_HD inline
#endif

namespace bert_fast {

// Float dtype codes (Python: bert_fast/ops/embedding.py _DTYPE_CODES). float64 is CPU-only.
enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kF64 = 3 };
// Index dtype codes: 0 = int32, 1 = int64.

struct EmbFwdParams {
  void* out;                 // [T, H] table dtype
  float* mean;               // [T] fp32 (double for the CPU float64 path: see mean64)
  float* rstd;               // [T]
  double* mean64;            // CPU float64 only
  double* rstd64;
  const void* ids;           // [N] flattened input ids
  const void* pos;           // [N] flattened position ids, or null -> (src % seq_len)
  const void* tt;            // [N] flattened token type ids, or null -> 0
  int ids_i64, pos_i64, tt_i64;
  const int64_t* indices;    // [T] rows of the flattened ids to keep, or null (T == N)
  int64_t rows;              // T
  int64_t seq_len;           // S (last dim of ids), for the default positions
  int64_t hidden;            // H
  const void* word;          // [V, H]
  const void* posemb;        // [P, H]
  const void* typeemb;       // [TT, H]
  const void* gamma;         // [H]
  const void* beta;          // [H]
  int dtype;                 // DType
  double eps;
  float dropout_scale;       // 1 / (1 - p), or 1
  uint64_t keep_threshold;   // 0 -> no dropout
  uint64_t seed;
};

struct EmbBwdParams {
  const void* dy;            // [T, H] table dtype, contiguous
  const void* ids;
  const void* pos;
  const void* tt;
  int ids_i64, pos_i64, tt_i64;
  const int64_t* indices;
  int64_t rows, seq_len, hidden;
  const void* word;
  const void* posemb;
  const void* typeemb;
  const void* gamma;
  const float* mean;
  const float* rstd;
  const double* mean64;      // CPU float64 only
  const double* rstd64;
  int dtype;
  float dropout_scale;
  uint64_t keep_threshold;
  uint64_t seed;
  // Rows that get no gradient (nn.Embedding's padding_idx), -1: none. RoBERTa / XLM-R gather the
  // position row pad_token_id at every pad, and transformers leaves that row's gradient zero.
  int64_t padding_idx;       // word table
  int64_t pos_padding_idx;   // position table
  int64_t type_padding_idx;  // token-type table
  // Outputs, each may be null (that gradient is not needed). Accumulators are fp32 (double for
  // float64) [rows_of_table, H] and must be zeroed by the caller. Each table's accumulator may
  // alias the final gradient when the table is fp32 (float64 on the CPU).
  void* dword;
  void* dpos;
  void* dtype_grad;
  void* dgamma;              // [H] accumulator type (CPU); on CUDA see the partials
  void* dbeta;
  // CUDA only
  float* dx_ws;              // deterministic mode: [T, H] fp32 dx rows instead of atomics
  float* partials;           // [num_partials, 2, H] fp32 dgamma/dbeta partial sums
  int64_t num_partials;
};

// ------------------------------------------------------------------------------ Philox4x32-10
struct U32x4 { uint32_t x, y, z, w; };

BF_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  lo = a * b;
  hi = __umulhi(a, b);
#else
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
#endif
}

BF_HD U32x4 philox4x32_10(U32x4 c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  constexpr uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(M0, c.x, hi0, lo0);
    mulhilo32(M1, c.z, hi1, lo1);
    c = U32x4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += W0;
    k1 += W1;
  }
  return c;
}

// The 4 random words of group g (elements 4g..4g+3) of output row t.
BF_HD U32x4 dropout_bits(uint64_t seed, int64_t row, int64_t group) {
  const uint64_t r = static_cast<uint64_t>(row);
  return philox4x32_10(U32x4{static_cast<uint32_t>(group), 0u, static_cast<uint32_t>(r),
                             static_cast<uint32_t>(r >> 32)},
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

BF_HD uint32_t u32x4_get(const U32x4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

BF_HD bool dropout_keep(uint64_t seed, uint64_t threshold, int64_t row, int64_t j) {
  return static_cast<uint64_t>(u32x4_get(dropout_bits(seed, row, j >> 2), static_cast<int>(j & 3))) >=
         threshold;
}

// Host only: fills keep[0..H) with row `row`'s keep-mask (1/0), one Philox call at a time (the CPU
// twin's dropout, and the portable version of keep_mask_cpu.cpp).
inline void row_keep_mask(uint64_t seed, uint64_t threshold, int64_t row, int64_t H, uint8_t* keep) {
  for (int64_t g = 0; g * 4 < H; ++g) {
    const U32x4 b = dropout_bits(seed, row, g);
    const uint32_t w[4] = {b.x, b.y, b.z, b.w};
    for (int k = 0; k < 4 && g * 4 + k < H; ++k) keep[g * 4 + k] = static_cast<uint64_t>(w[k]) >= threshold;
  }
}

// round(p * 2^32), clamped to [0, 2^32]; p == 0 -> 0 (every element kept).
inline uint64_t keep_threshold_from_p(double p) {
  if (!(p > 0.0)) return 0;
  double t = p * 4294967296.0 + 0.5;
  if (t >= 4294967296.0) return 4294967296ull;
  return static_cast<uint64_t>(t);
}

}  // namespace bert_fast
