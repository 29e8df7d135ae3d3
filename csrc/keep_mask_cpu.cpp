// The dropout keep-mask of the torch and reference implementations on the CPU: the Philox4x32-10
// stream defined in embedding_common.h (element j of row r is kept iff word j % 4 of
// philox({j / 4, 0, lo32(r), hi32(r)}, {lo32(seed), hi32(seed)}) >= round(p * 2^32)), the same bits
// as the embedding twin's dropout (row_keep_mask), but fast enough to be drawn for every dropout of a
// training step, forward and backward (bert_fast/ops/_dispatch.py: reference_dropout_mask).
//
// Why its own code: the scalar loop (row_keep_mask) (one Philox call at a time) costs ~1.8 ns per element,
// and torch.rand + compare, which this replaces, ~3.7 ns on one thread (mt19937). Here 16 (AVX-512)
// or 8 (AVX2) counters run side by side in vector registers, the version picked at run time from
// what the CPU has, and the rows are split over `threads` std::threads (the caller passes
// torch.get_num_threads()). Figures: benchmarks/NOTES.md, "Dropout keep-masks on the CPU".
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cpu_isa.h"
#include "embedding_common.h"

namespace py = pybind11;

namespace bert_fast {
namespace {

constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;

using RowsFn = void (*)(uint8_t*, int64_t, int64_t, int64_t, uint64_t, uint32_t);

// Rows [r0, r1) of the [rows, cols] mask, one Philox call at a time; `thr` is the keep threshold
// (< 2^32). The portable version, and the oracle of the vector ones (tests/ops/test_keep_mask.py).
void keep_rows_scalar(uint8_t* out, int64_t r0, int64_t r1, int64_t cols, uint64_t seed, uint32_t thr) {
  for (int64_t r = r0; r < r1; ++r) row_keep_mask(seed, thr, r, cols, out + r * cols);
}

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define BF_HAVE_X86_VECTORS 1
#include <immintrin.h>

// 16 counters per zmm register (one 32-bit lane each). _mm512_mul_epu32 multiplies the even
// lanes into 64-bit products; the odd lanes go through a 32-bit shift first; the blends put the
// low and high words back in lane order. The 4 keep bytes of a group are packed into its lane
// (byte k = word k), so one 64-byte store writes 16 groups in the mask's element order.
__attribute__((target("avx512f")))
void keep_rows_avx512(uint8_t* out, int64_t r0, int64_t r1, int64_t cols, uint64_t seed, uint32_t thr) {
  const int64_t groups = (cols + 3) / 4;
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(kM0)), m1 = _mm512_set1_epi32(static_cast<int>(kM1));
  const __m512i vthr = _mm512_set1_epi32(static_cast<int>(thr));
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) uint8_t tail[64];
  for (int64_t r = r0; r < r1; ++r) {
    uint8_t* row = out + r * cols;
    const __m512i lo_r = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(static_cast<uint64_t>(r))));
    const __m512i hi_r = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(static_cast<uint64_t>(r) >> 32)));
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      __m512i c0 = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(g0))), lane);
      __m512i c1 = _mm512_setzero_si512(), c2 = lo_r, c3 = hi_r;
      uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
      for (int round = 0; round < 10; ++round) {
        const __m512i e0 = _mm512_mul_epu32(c0, m0), o0 = _mm512_mul_epu32(_mm512_srli_epi64(c0, 32), m0);
        const __m512i e1 = _mm512_mul_epu32(c2, m1), o1 = _mm512_mul_epu32(_mm512_srli_epi64(c2, 32), m1);
        const __m512i lo0 = _mm512_mask_blend_epi32(0xAAAA, e0, _mm512_slli_epi64(o0, 32));
        const __m512i hi0 = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(e0, 32), o0);
        const __m512i lo1 = _mm512_mask_blend_epi32(0xAAAA, e1, _mm512_slli_epi64(o1, 32));
        const __m512i hi1 = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(e1, 32), o1);
        c0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1), _mm512_set1_epi32(static_cast<int>(k0)));
        c2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3), _mm512_set1_epi32(static_cast<int>(k1)));
        c1 = lo1;
        c3 = lo0;
        k0 += kW0;
        k1 += kW1;
      }
      const __m512i b0 = _mm512_maskz_mov_epi32(_mm512_cmpge_epu32_mask(c0, vthr), one);
      const __m512i b1 = _mm512_maskz_mov_epi32(_mm512_cmpge_epu32_mask(c1, vthr), one);
      const __m512i b2 = _mm512_maskz_mov_epi32(_mm512_cmpge_epu32_mask(c2, vthr), one);
      const __m512i b3 = _mm512_maskz_mov_epi32(_mm512_cmpge_epu32_mask(c3, vthr), one);
      const __m512i packed = _mm512_or_si512(_mm512_or_si512(b0, _mm512_slli_epi32(b1, 8)),
                                             _mm512_or_si512(_mm512_slli_epi32(b2, 16), _mm512_slli_epi32(b3, 24)));
      const int64_t first = g0 * 4;
      if (cols - first >= 64) {
        _mm512_storeu_si512(row + first, packed);
      } else {
        _mm512_store_si512(tail, packed);
        std::memcpy(row + first, tail, static_cast<size_t>(cols - first));
      }
    }
  }
}

// 1 where c >= thr, as 32-bit lanes. AVX2 has no unsigned compare: c >= thr is !(thr > c) on the
// values with their sign bits flipped (vthr comes flipped).
__attribute__((target("avx2"))) inline __m256i keep_lanes_avx2(__m256i c, __m256i vthr, __m256i sign, __m256i one) {
  return _mm256_andnot_si256(_mm256_cmpgt_epi32(vthr, _mm256_xor_si256(c, sign)), one);
}

// The same with 8 counters per ymm register.
__attribute__((target("avx2")))
void keep_rows_avx2(uint8_t* out, int64_t r0, int64_t r1, int64_t cols, uint64_t seed, uint32_t thr) {
  const int64_t groups = (cols + 3) / 4;
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(kM0)), m1 = _mm256_set1_epi32(static_cast<int>(kM1));
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i vthr = _mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(thr)), sign);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  alignas(32) uint8_t tail[32];
  for (int64_t r = r0; r < r1; ++r) {
    uint8_t* row = out + r * cols;
    const __m256i lo_r = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(static_cast<uint64_t>(r))));
    const __m256i hi_r = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(static_cast<uint64_t>(r) >> 32)));
    for (int64_t g0 = 0; g0 < groups; g0 += 8) {
      __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(g0))), lane);
      __m256i c1 = _mm256_setzero_si256(), c2 = lo_r, c3 = hi_r;
      uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
      for (int round = 0; round < 10; ++round) {
        const __m256i e0 = _mm256_mul_epu32(c0, m0), o0 = _mm256_mul_epu32(_mm256_srli_epi64(c0, 32), m0);
        const __m256i e1 = _mm256_mul_epu32(c2, m1), o1 = _mm256_mul_epu32(_mm256_srli_epi64(c2, 32), m1);
        const __m256i lo0 = _mm256_blend_epi32(e0, _mm256_slli_epi64(o0, 32), 0xAA);
        const __m256i hi0 = _mm256_blend_epi32(_mm256_srli_epi64(e0, 32), o0, 0xAA);
        const __m256i lo1 = _mm256_blend_epi32(e1, _mm256_slli_epi64(o1, 32), 0xAA);
        const __m256i hi1 = _mm256_blend_epi32(_mm256_srli_epi64(e1, 32), o1, 0xAA);
        c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(static_cast<int>(k0)));
        c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
        c1 = lo1;
        c3 = lo0;
        k0 += kW0;
        k1 += kW1;
      }
      const __m256i packed = _mm256_or_si256(
          _mm256_or_si256(keep_lanes_avx2(c0, vthr, sign, one), _mm256_slli_epi32(keep_lanes_avx2(c1, vthr, sign, one), 8)),
          _mm256_or_si256(_mm256_slli_epi32(keep_lanes_avx2(c2, vthr, sign, one), 16),
                          _mm256_slli_epi32(keep_lanes_avx2(c3, vthr, sign, one), 24)));
      const int64_t first = g0 * 4;
      if (cols - first >= 32) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + first), packed);
      } else {
        _mm256_store_si256(reinterpret_cast<__m256i*>(tail), packed);
        std::memcpy(row + first, tail, static_cast<size_t>(cols - first));
      }
    }
  }
}
#endif

// The widest version this CPU runs (capped by BERT_FAST_CPU_ISA: cpu_isa.h), or the one named by
// `isa` (scalar|avx2|avx512; nullptr where it cannot run here).
RowsFn pick_rows_fn(const std::string& isa) {
#ifdef BF_HAVE_X86_VECTORS
  const bool has512 = isa_usable(Isa::kAvx512), has2 = isa_usable(Isa::kAvx2);
  if (isa == "avx512") return has512 ? keep_rows_avx512 : nullptr;
  if (isa == "avx2") return has2 ? keep_rows_avx2 : nullptr;
  if (isa == "scalar") return keep_rows_scalar;
  if (!isa.empty()) return nullptr;
  if (has512) return keep_rows_avx512;
  if (has2) return keep_rows_avx2;
  return keep_rows_scalar;
#else
  return (isa.empty() || isa == "scalar") ? keep_rows_scalar : nullptr;
#endif
}

const char* rows_fn_name(RowsFn f) {
#ifdef BF_HAVE_X86_VECTORS
  if (f == keep_rows_avx512) return "avx512";
  if (f == keep_rows_avx2) return "avx2";
#endif
  return "scalar";
}

// Below this many elements one thread does it: starting a thread (~20-50 us) would cost more.
constexpr int64_t kMinElementsPerThread = 1 << 16;

void keep_mask_cpu(uintptr_t out_ptr, int64_t rows, int64_t cols, int64_t seed, double pdrop, int threads,
                   const std::string& isa) {
  const RowsFn keep_rows = pick_rows_fn(isa);
  if (keep_rows == nullptr) throw std::invalid_argument("keep_mask_cpu: " + isa_refusal(isa));
  uint8_t* out = reinterpret_cast<uint8_t*>(out_ptr);
  if (rows <= 0 || cols <= 0) return;
  const uint64_t thr = keep_threshold_from_p(pdrop);
  py::gil_scoped_release nogil;
  if (thr == 0) {                      // p == 0: keep everything
    std::memset(out, 1, static_cast<size_t>(rows * cols));
    return;
  }
  if (thr > 0xFFFFFFFFull) {           // p rounds to 1: keep nothing
    std::memset(out, 0, static_cast<size_t>(rows * cols));
    return;
  }
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint32_t t32 = static_cast<uint32_t>(thr);
  const int64_t by_size = std::max<int64_t>(1, rows * cols / kMinElementsPerThread);
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>({static_cast<int64_t>(threads), by_size, rows}));
  if (n == 1) {
    keep_rows(out, 0, rows, cols, s, t32);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(n - 1));
  const int64_t per = (rows + n - 1) / n;
  for (int64_t i = 1; i < n; ++i) {
    const int64_t r0 = i * per, r1 = std::min(rows, r0 + per);
    if (r0 < r1) pool.emplace_back(keep_rows, out, r0, r1, cols, s, t32);
  }
  keep_rows(out, 0, std::min(rows, per), cols, s, t32);
  for (auto& t : pool) t.join();
}

}  // namespace

void bind_keep_mask(py::module_& m) {
  m.def("keep_mask_cpu", &keep_mask_cpu, py::arg("out"), py::arg("rows"), py::arg("cols"), py::arg("seed"),
        py::arg("dropout_p"), py::arg("threads"), py::arg("isa") = "",
        "The uint8 dropout keep-mask [rows, cols] of a seed (embedding_common.h's Philox stream), "
        "vectorized and split over `threads` threads; isa: \"\" (the widest this CPU has) | avx512 | avx2 | scalar");
  m.def("keep_mask_isa", []() { return std::string(rows_fn_name(pick_rows_fn(""))); },
        "The vector width keep_mask_cpu uses on this CPU");
}

}  // namespace bert_fast
