// The int8 GEMM of CPU inference on CPUs with AVX-512 VNNI, on weights packed once:
//
//   acc[m, n] = sum_k x_q[m, k] * w_q[k, n]      int32, exact: the same sums as torch._int_mm
//
// Why our own when torch._int_mm already runs oneDNN's VNNI kernel: torch._int_mm takes the plain
// [K, N] weight and lays it out for the kernel again at every call. At batch 1 a bert-base forward
// streams its 85 MB of int8 weights from DRAM once per forward, and that per-call copy showed: the
// same 48 GEMMs took 31-33 ms through torch._int_mm and 26-27 ms here (Zen 4, 2 threads, weights
// rotating through 12 layers as a forward does; benchmarks/NOTES.md, "int8 on packed weights").
// The sums are bit for bit torch._int_mm's. The one-call linear (VnniLinear, below) dequantizes in
// the epilogue instead of writing them: y = act(acc * s_x[m] * s_w[n] + b[n]) in fp32 or bf16, in
// the order and with the vector GELU of int8_cpu.cpp's dequantize pass, so the same bits as that pass
// after the sums (-ffp-contract=off on both files), without the int32 round trip through memory.
//
// How. vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes and adds the 4 products into an int32
// lane, exactly (no saturation). The weights are the unsigned operand, stored as w + 128 (packed
// once by bert_fast/ops/int8_gemm.py pack_weight_vnni):
//
//   packed[p, j, lane, t] = w_q[4j + t, 16p + lane] + 128      uint8 [ceil(N/16), ceil(K/4), 16, 4]
//
// (rows k >= K and columns n >= N hold 128, i.e. a zero weight), so one 64-byte load is 4 k-steps of
// 16 columns, and the activations (signed, 4 bytes broadcast) need no copy. The +128 adds
// 128 * sum_k x_q[m, k] to every sum of row m, which the epilogue takes off (the row sums are one
// short pass before the tiles). Tile: 8 rows x 48 columns, 24 zmm accumulators over the whole K;
// 48-column groups of panels are split over torch's OpenMP threads, each sweeping all rows over its
// panels (a panel group, 48 x K bytes, stays in L2 while the row blocks pass).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "cpu_gemm_common.h"
#include "cpu_isa.h"
#include "int8_rows.h"
#include "simd_math.h"

namespace py = pybind11;

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define BF_GEMM_VNNI 1
#include <immintrin.h>
#endif

namespace bert_fast {
namespace {

using gemm::barrier;
using gemm::on_threads;
using gemm::scratch;
using gemm::threads_for;

constexpr int kMR = 8;      // rows per tile
constexpr int kGroup = 3;   // 16-column panels per tile (48 columns)

bool vnni_usable() {
#ifdef BF_GEMM_VNNI
  __builtin_cpu_init();
  return isa_usable(Isa::kAvx512) && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

#ifdef BF_GEMM_VNNI
#define BF_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
using I32Alias = int32_t __attribute__((may_alias));

enum Act : int { kNone = 0, kGeluErf = 1, kGeluTanh = 2 };

// Where a tile's sums go: int32 into `acc`, or (y non-null) dequantized into y, dt 0 fp32 / 1 bf16.
struct Out {
  int32_t* acc;
  const float* sx;
  const float* sw;
  const float* bias;  // null: none
  void* y;
  int dt;
  int act;
  int64_t n;  // columns
};

// 16 sums (the +128 offset already off) of row m, columns [col, col + 16) masked by `mask`, to `o`.
BF_VNNI inline void store_sums(__m512i sums, int64_t m, int64_t col, __mmask16 mask, const Out& o) {
  if (o.y == nullptr) return _mm512_mask_storeu_epi32(o.acc + m * o.n + col, mask, sums);
  // (acc * s_x) * s_w + b, then the GELU: int8_cpu.cpp dequant_rows_avx512's order
  __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(o.sx[m])),
                           _mm512_maskz_loadu_ps(mask, o.sw + col));
  if (o.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, o.bias + col));
  if (o.act == kGeluErf) v = simd::gelu_erf(v);
  else if (o.act == kGeluTanh) v = simd::gelu_tanh(v);
  simd::store16(o.y, o.dt, m * o.n + col, mask, v);
}

// sum_k x[m, k] for rows [r0, r1) (K a multiple of 4, as the caller pads it).
BF_VNNI void row_sums(const int8_t* x, int64_t k, int64_t r0, int64_t r1, int32_t* out) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t m = r0; m < r1; ++m) {
    const int8_t* row = x + m * k;
    __m512i acc = _mm512_setzero_si512();
    int64_t c = 0;
    for (; c + 64 <= k; c += 64) acc = _mm512_dpbusd_epi32(acc, ones, _mm512_loadu_si512(row + c));
    int32_t s = _mm512_reduce_add_epi32(acc);
    for (; c < k; ++c) s += row[c];
    out[m] = s;
  }
}

// The sums of rows [0, MR) of `a` (row stride lda bytes) x NP panels starting at `bp` (panel stride
// `pstride` bytes, kq 4-byte k-steps each), the whole K in registers, into sums[MR][NP * 16].
// Unrolled so that the 24 accumulators stay in registers; GCC 12 is touchy here (without the
// pragmas, with them on the zeroing loop too, or with the dequantizing epilogue in the same
// function it kept a copy of all 24 on the stack and stored them at every k-step: half the speed),
// hence a function of its own. The speed check (bert_fast/model/int8_speed.py) times this GEMM
// against torch._int_mm in every process, so a build that comes out slow is never the one used.
template <int MR, int NP>
BF_VNNI __attribute__((noinline)) void sums_of(const int8_t* a, int64_t lda, const uint8_t* bp, int64_t pstride,
                                                int64_t kq, int32_t* sums) {
  __m512i acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_setzero_si512();
  for (int64_t j = 0; j < kq; ++j) {
    __m512i b[NP];
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) b[q] = _mm512_loadu_si512(bp + q * pstride + j * 64);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512i av = _mm512_set1_epi32(*reinterpret_cast<const I32Alias*>(a + r * lda + 4 * j));
#pragma GCC unroll 4
      for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_dpbusd_epi32(acc[r][q], b[q], av);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) _mm512_store_si512(sums + (r * NP + q) * 16, acc[r][q]);
}

// Rows [m0, m0 + MR) of x (`a` points at row m0) x NP panels: the sums, less 128 * rowsum, to `o`'s
// columns [n0, n0 + 16 NP) that are < n.
template <int MR, int NP>
BF_VNNI void tile(const int8_t* a, int64_t lda, const uint8_t* bp, int64_t pstride, int64_t kq, const int32_t* rsum,
                  int64_t m0, int64_t n0, const Out& o) {
  alignas(64) int32_t sums[MR * NP * 16];
  sums_of<MR, NP>(a, lda, bp, pstride, kq, sums);
  for (int r = 0; r < MR; ++r) {
    const __m512i offset = _mm512_set1_epi32(rsum[m0 + r] * 128);
    for (int q = 0; q < NP; ++q) {
      const int64_t left = o.n - (n0 + 16 * q);
      if (left <= 0) continue;
      const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      const __m512i s = _mm512_load_si512(sums + (r * NP + q) * 16);
      store_sums(_mm512_sub_epi32(s, offset), m0 + r, n0 + 16 * q, mask, o);
    }
  }
}

using TileFn = void (*)(const int8_t*, int64_t, const uint8_t*, int64_t, int64_t, const int32_t*, int64_t, int64_t,
                        const Out&);
template <int NP>
constexpr TileFn kRow[kMR + 1] = {nullptr,       tile<1, NP>, tile<2, NP>, tile<3, NP>, tile<4, NP>,
                                  tile<5, NP>, tile<6, NP>, tile<7, NP>, tile<8, NP>};

TileFn tile_for(int rows, int panels) {
  return panels == 3 ? kRow<3>[rows] : panels == 2 ? kRow<2>[rows] : kRow<1>[rows];
}

// Thread t of nt: its share of the 48-column panel groups, every row.
void tiles_part(int t, int nt, const int8_t* x, int64_t rows, int64_t k, const uint8_t* w, const int32_t* rsum,
                const Out& o) {
  const int64_t kq = k / 4, panels = (o.n + 15) / 16, groups = (panels + kGroup - 1) / kGroup;
  for (int64_t g = groups * t / nt; g < groups * (t + 1) / nt; ++g) {
    const int64_t p = g * kGroup;
    const int np = static_cast<int>(std::min<int64_t>(kGroup, panels - p));
    for (int64_t m0 = 0; m0 < rows; m0 += kMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kMR, rows - m0));
      tile_for(mr, np)(x + m0 * k, k, w + p * kq * 64, kq * 64, kq, rsum, m0, p * 16, o);
    }
  }
}

// Thread t of nt: its rows' sums, then (after all are known) its panel groups.
void gemm_part(int t, int nt, const int8_t* x, int64_t rows, int64_t k, const uint8_t* w, int32_t* rsum,
               const Out& o) {
  row_sums(x, k, rows * t / nt, rows * (t + 1) / nt, rsum);
  barrier();
  tiles_part(t, nt, x, rows, k, w, rsum, o);
}

#endif

// A linear layer's int8 weights, packed (pack_weight_vnni), with their per-column scales and bias,
// and the whole layer in one call: x (fp32 / bf16) quantized per row, the GEMM, the dequantization
// (in the epilogue, or with the residual add and LayerNorm after the sums), on one parallel region;
// the same passes' arithmetic, so the same bits as quantize_rows + int8_gemm_vnni + the dequantize pass.
// The caller keeps the tensors behind the pointers alive (bert_fast/model/int8.py _Int8Linear).
struct VnniLinear {
  uintptr_t w, sw, bias;  // packed weights, s_w [n] fp32, b [n] fp32 or 0
  int64_t k, n;           // k a multiple of 4

  // out [rows, n] (out_dt 0: fp32, 1: bf16) = act(x W^T + b) for x [rows, k] (x_dt 0 / 1).
  void linear(uintptr_t x, int x_dt, int64_t rows, uintptr_t out, int out_dt, int act, int threads) const {
    run(x, x_dt, rows, out, out_dt, act, threads, 0, 0, 0, 0.0f);
  }

  // out = LayerNorm(x W^T + b + residual) * ln_w + ln_b, in the residual's dtype (dt 0 / 1).
  void linear_residual_ln(uintptr_t x, int x_dt, int64_t rows, uintptr_t out, uintptr_t residual, int dt,
                          uintptr_t ln_w, uintptr_t ln_b, float eps, int threads) const {
    run(x, x_dt, rows, out, dt, kNone, threads, residual, ln_w, ln_b, eps);
  }

 private:
  void run(uintptr_t x, int x_dt, int64_t rows, uintptr_t out, int out_dt, int act, int threads, uintptr_t res,
           uintptr_t ln_w, uintptr_t ln_b, float eps) const {
    if (!vnni_usable()) throw std::invalid_argument("Int8VnniLinear: needs AVX-512 VNNI");
    if ((x_dt != 0 && x_dt != 1) || (out_dt != 0 && out_dt != 1) || act < kNone || act > kGeluTanh)
      throw std::invalid_argument("Int8VnniLinear: dtypes must be 0 or 1 and act 0, 1 or 2");
    if (rows <= 0) return;
#ifdef BF_GEMM_VNNI
    const int nt = threads_for(rows, k, n, kGroup, threads);
    // Scratch: kept per calling thread up to kKeepBytes each (batch 1 to ~8 x 128 reuse it, no
    // allocation per call), taken per call beyond (a large batch does not pin its buffers for good).
    // (Pointers taken here: inside the parallel region a thread_local names each thread's own copy.)
    thread_local std::vector<int8_t> xq_keep;
    thread_local std::vector<int32_t> acc_keep;
    thread_local std::vector<float> f_keep;
    std::vector<int8_t> xq_call;
    std::vector<int32_t> acc_call;
    std::vector<float> f_call;
    int8_t* xq = scratch(xq_keep, xq_call, rows * k);
    int32_t* acc = scratch(acc_keep, acc_call, rows * (res ? n + 1 : 1));  // [rows] row sums, then the sums
    float* fbuf = scratch(f_keep, f_call, rows + (res ? nt * n : 0));       // [rows] s_x, then LN row buffers
    int32_t* rsum = acc;
    float* sx = fbuf;
    float* rowp = fbuf + rows;
    const float* swp = reinterpret_cast<const float*>(sw);
    const float* bp = reinterpret_cast<const float*>(bias);
    const Out o{acc + rows, sx, swp, bp, res ? nullptr : reinterpret_cast<void*>(out), out_dt, act, n};
    const void* xp = reinterpret_cast<const void*>(x);
    const uint8_t* wp = reinterpret_cast<const uint8_t*>(w);
    py::gil_scoped_release nogil;
    on_threads(nt, [&](int t, int nth) {
      const int64_t r0 = rows * t / nth, r1 = rows * (t + 1) / nth;
      quantize_rows_avx512(xp, x_dt, r0, r1, k, xq, sx);
      row_sums(xq, k, r0, r1, rsum);
      barrier();
      tiles_part(t, nth, xq, rows, k, wp, rsum, o);
      if (!res) return;
      barrier();
      dequantize_ln_rows_avx512(o.acc, r0, r1, n, sx, swp, bp, reinterpret_cast<const void*>(res),
                                reinterpret_cast<const float*>(ln_w), reinterpret_cast<const float*>(ln_b), eps,
                                reinterpret_cast<void*>(out), out_dt, rowp + t * n);
    });
#endif
  }
};

// k must be a multiple of 4 (bert_fast/ops/int8_gemm.py pads x and the packed weights to one).
void int8_gemm_vnni(uintptr_t xq, int64_t rows, int64_t k, uintptr_t w_packed, int64_t n, uintptr_t acc,
                    int threads) {
  if (!vnni_usable())
    throw std::invalid_argument("int8_gemm_vnni: needs AVX-512 VNNI (" + isa_refusal("avx512") + " or no VNNI)");
  if (k % 4 != 0) throw std::invalid_argument("int8_gemm_vnni: k must be a multiple of 4");
  if (rows <= 0 || n <= 0) return;
#ifdef BF_GEMM_VNNI
  const int8_t* x = reinterpret_cast<const int8_t*>(xq);
  const uint8_t* w = reinterpret_cast<const uint8_t*>(w_packed);
  const Out o{reinterpret_cast<int32_t*>(acc), nullptr, nullptr, nullptr, nullptr, 0, kNone, n};
  thread_local std::vector<int32_t> rsum_buf;
  rsum_buf.resize(static_cast<size_t>(rows));
  int32_t* rsum = rsum_buf.data();
  const int nt = threads_for(rows, k, n, kGroup, threads);
  py::gil_scoped_release nogil;
  on_threads(nt, [&](int t, int nth) { gemm_part(t, nth, x, rows, k, w, rsum, o); });
#endif
}

}  // namespace

void bind_int8_gemm_vnni(py::module_& m) {
  py::class_<VnniLinear>(m, "Int8VnniLinear",
                         "One int8 linear layer on packed weights, each call one parallel region: quantize, GEMM, "
                         "dequantize (bert_fast/ops/int8_gemm.py VnniLinear)")
      .def(py::init([](uintptr_t w, int64_t k, int64_t n, uintptr_t sw, uintptr_t bias) {
             if (k % 4 != 0) throw std::invalid_argument("Int8VnniLinear: k must be a multiple of 4");
             return VnniLinear{w, sw, bias, k, n};
           }),
           py::arg("w_packed"), py::arg("k"), py::arg("n"), py::arg("col_scale"), py::arg("bias"))
      .def("linear", &VnniLinear::linear, py::arg("x"), py::arg("x_dtype"), py::arg("rows"), py::arg("out"),
           py::arg("out_dtype"), py::arg("act"), py::arg("threads"))
      .def("linear_residual_ln", &VnniLinear::linear_residual_ln, py::arg("x"), py::arg("x_dtype"), py::arg("rows"),
           py::arg("out"), py::arg("residual"), py::arg("dtype"), py::arg("ln_weight"), py::arg("ln_bias"),
           py::arg("eps"), py::arg("threads"));
  m.def("int8_gemm_vnni_usable", &vnni_usable, "This CPU (and BERT_FAST_CPU_ISA) runs int8_gemm_vnni");
  m.def("int8_gemm_vnni", &int8_gemm_vnni, py::arg("x_q"), py::arg("rows"), py::arg("k"), py::arg("w_packed"),
        py::arg("n"), py::arg("acc"), py::arg("threads"),
        "acc int32 [rows, n] = x_q int8 [rows, k] . w_q, with w_q packed by bert_fast/ops/int8_gemm.py "
        "pack_weight_vnni (uint8 [ceil(n/16), k/4, 16, 4], w + 128); k a multiple of 4; AVX-512 VNNI, exact: "
        "torch._int_mm's sums bit for bit");
}

}  // namespace bert_fast
