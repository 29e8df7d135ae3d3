// Self-attention of fp32 inference on the CPU (#32 item 3): the fp32 twin of the bf16 kernel
// (attention_cpu.cpp), for AVX-512 and for AVX2 CPUs, chosen at run time.
//
// Why our own: at BERT's head dims (32-64) and lengths (up to a few hundred tokens) torch's flash
// CPU kernel spends most of its time in fixed costs per block; an int8 MiniLM forward at batch 1 spent
// a quarter of its time there (benchmarks/NOTES.md, "An int8 model's attention in bf16"). A whole
// sequence's scores fit in L1/L2, so one pass computes them, the softmax and P V, with K and V packed
// once per chunk of sequences. Python (bert_fast/ops/cpu_attention.py) takes it only where a
// first-use measurement finds it faster than torch's kernel.
//
// Layouts (fp32, raw pointers; the same as attention_bf16's):
//   q, k, v:   token row t of head h at  base + t * row_stride + h * d
//   out:       token row t of head h at  out + t * out_row_stride + h * d
//   starts:    int64 [nseq + 1], sequence s is token rows starts[s] .. starts[s+1]
//   key_mask:  uint8 [nseq, mask_stride], nonzero = attend, or null (every key of the sequence)
// A query row whose keys are all masked comes out as zeros (as torch's flash kernel does).
// The sums run in fp32 with fused multiply-adds, in another order than torch's: held to the 2x rule
// against a float64 oracle (tests/cpu/test_cpu_attention_f32.py).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "attention_chunks.h"
#include "cpu_isa.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "simd_math.h"
#include "simd_math_avx2.h"
#define F32A_X86 1
#endif

namespace py = pybind11;

namespace bert_fast {
namespace {

struct F32Args {
  const float* q;
  const float* k;
  const float* v;
  int64_t row_stride;
  float* out;
  int64_t out_row_stride;
  const int64_t* starts;
  int64_t nseq;
  const uint8_t* key_mask;
  int64_t mask_stride;
  int heads;
  int d;
  float scale;
};

struct F32Pack {  // a chunk's packed K and V (shared by the threads; kept with the calling thread)
  std::vector<float> kp;
  std::vector<float> vp;
  attention_chunks::Plan plan;  // the chunk's sequences, tiles to pack and query blocks
};

struct F32Scratch {  // per thread
  std::vector<float> bias;
  std::vector<float> scores;
};

using attention_chunks::round16;
inline int pad16(int d) { return (d + 15) / 16 * 16; }

#ifdef F32A_X86
#define F32A_AVX512 __attribute__((target("avx512f,avx512dq,fma")))
#define F32A_AVX2 __attribute__((target("avx2,fma")))
// The register blocks (qk_block, pv_block) keep their accumulators in registers only when GCC unrolls
// their loops fully and compiles them on their own: inlined into the OpenMP body, or with loops left
// rolled, it kept some of acc[R][NB] on the stack (a store and reload in every step of the P V loop;
// fixing both made the d = 32 call 1.4x faster, benchmarks/NOTES.md).
#define F32A_UNROLL _Pragma("GCC unroll 16")
#define F32A_BLOCK __attribute__((noinline))

struct Vec512 {
  using T = __m512;
  static constexpr int W = 16;
  static constexpr int kNb = 4;  // 4 rows x 4 vectors = 16 accumulators of 32 zmm
  F32A_AVX512 static inline T zero() { return _mm512_setzero_ps(); }
  F32A_AVX512 static inline T set1(float x) { return _mm512_set1_ps(x); }
  F32A_AVX512 static inline T load(const float* p) { return _mm512_loadu_ps(p); }
  F32A_AVX512 static inline void store(float* p, T x) { _mm512_storeu_ps(p, x); }
  F32A_AVX512 static inline T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  F32A_AVX512 static inline T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  F32A_AVX512 static inline T add(T a, T b) { return _mm512_add_ps(a, b); }
  F32A_AVX512 static inline T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  F32A_AVX512 static inline T max(T a, T b) { return _mm512_max_ps(a, b); }
  F32A_AVX512 static inline float reduce_max(T x) { return _mm512_reduce_max_ps(x); }
  F32A_AVX512 static inline float reduce_add(T x) { return _mm512_reduce_add_ps(x); }
  F32A_AVX512 static inline T exp_nonpos(T x) { return simd::exp_nonpos(x); }
};

struct Vec256 {
  using T = __m256;
  static constexpr int W = 8;
  static constexpr int kNb = 3;  // 4 rows x 3 vectors = 12 accumulators of 16 ymm
  F32A_AVX2 static inline T zero() { return _mm256_setzero_ps(); }
  F32A_AVX2 static inline T set1(float x) { return _mm256_set1_ps(x); }
  F32A_AVX2 static inline T load(const float* p) { return _mm256_loadu_ps(p); }
  F32A_AVX2 static inline void store(float* p, T x) { _mm256_storeu_ps(p, x); }
  F32A_AVX2 static inline T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  F32A_AVX2 static inline T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  F32A_AVX2 static inline T add(T a, T b) { return _mm256_add_ps(a, b); }
  F32A_AVX2 static inline T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  F32A_AVX2 static inline T max(T a, T b) { return _mm256_max_ps(a, b); }
  F32A_AVX2 static inline float reduce_max(T x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  F32A_AVX2 static inline float reduce_add(T x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  F32A_AVX2 static inline T exp_nonpos(T x) { return simd2::exp_nonpos(x); }
};

#define F32A_NS avx512
#define F32A_TARGET F32A_AVX512
#define Vec Vec512
#include "attention_f32_impl.h"
#undef Vec
#undef F32A_TARGET
#undef F32A_NS

#define F32A_NS avx2
#define F32A_TARGET F32A_AVX2
#define Vec Vec256
#include "attention_f32_impl.h"
#undef Vec
#undef F32A_TARGET
#undef F32A_NS
#endif  // F32A_X86

// The instruction set attention_f32 runs here: "avx512", "avx2", or "" (none: the caller keeps torch's).
std::string attention_f32_isa() {
#ifdef F32A_X86
  if (isa_usable(Isa::kAvx512)) return "avx512";
  if (isa_usable(Isa::kAvx2)) return "avx2";
#endif
  return "";
}

void attention_f32(uintptr_t q, uintptr_t k, uintptr_t v, int64_t row_stride, uintptr_t out, int64_t out_row_stride,
                   uintptr_t starts, int64_t nseq, uintptr_t key_mask, int64_t mask_stride, int heads, int d,
                   double scale, int threads) {
  const std::string isa = attention_f32_isa();
  if (isa.empty()) throw std::runtime_error("attention_f32: " + isa_refusal("avx2"));
  if (d <= 0 || heads <= 0) throw std::invalid_argument("attention_f32 needs heads > 0 and d > 0");
#ifdef F32A_X86
  F32Args a{reinterpret_cast<const float*>(q),
            reinterpret_cast<const float*>(k),
            reinterpret_cast<const float*>(v),
            row_stride,
            reinterpret_cast<float*>(out),
            out_row_stride,
            reinterpret_cast<const int64_t*>(starts),
            nseq,
            reinterpret_cast<const uint8_t*>(key_mask),
            mask_stride,
            heads,
            d,
            static_cast<float>(scale)};
  const int n = attention_chunks::threads_for(a.starts, nseq, d, heads, threads);
  thread_local F32Pack pack;  // kept between calls: no page faults per call
  py::gil_scoped_release nogil;
  // On torch's OpenMP pool (libgomp resolved to torch's copy, as for the bf16 kernel).
  if (isa == "avx512")
    avx512::run_chunks(a, n, pack);
  else
    avx2::run_chunks(a, n, pack);
#endif
}

}  // namespace

void bind_attention_f32(py::module_& m) {
  m.def("attention_f32_isa", &attention_f32_isa,
        "The instruction set attention_f32 runs on this CPU (avx512 / avx2), or '' where it cannot run");
  m.def("attention_f32", &attention_f32, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("row_stride"),
        py::arg("out"), py::arg("out_row_stride"), py::arg("starts"), py::arg("nseq"), py::arg("key_mask"),
        py::arg("mask_stride"), py::arg("heads"), py::arg("d"), py::arg("scale"), py::arg("threads"),
        "softmax(scale Q K^T + key mask) V of fp32 sequences on the CPU (csrc/attention_f32_cpu.cpp)");
}

}  // namespace bert_fast
