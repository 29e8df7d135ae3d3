// Self-attention of bf16 inference on the CPU: softmax(scale * Q K^T + mask) V per (sequence, head),
// for the short sequences of BERT (up to a few thousand tokens), on AVX-512 BF16 dot products.
//
// Why our own: torch's flash CPU kernel runs bf16 attention at ~0.07 TFLOP/s on a Zen 4 without
// AMX (5.4 ms per bert-base layer at b8 s128, 13% of the forward), a sixth of what the same
// cores do in a bf16 GEMM (benchmarks/NOTES.md, "CPU attention in bf16"). A whole sequence's
// scores fit in L1/L2 at these lengths, so there is no need for flash's online softmax. Per chunk
// of sequences, K and V of every head are packed once into the pair layout vdpbf16ps wants, read
// from whole token rows (all heads of a token are contiguous; reading one head's 128-byte slice
// per token row was 2x slower once a GEMM had pushed qkv out of L2); then per block of 8 query
// rows, every head: the fp32 scores, the softmax in fp32, and P V with P rounded to bf16 (as
// torch's flash kernel does), accumulating in fp32.
//
// Layouts (elements are bf16, passed as raw pointers from bert_fast/ops/cpu_attention.py):
//   q, k, v:   token row t of head h at  base + t * row_stride + h * d   (the fused qkv view
//              [T, 3, heads, d] or three [T, H] GEMM outputs: both are one row stride)
//   out:       token row t of head h at  out + t * out_row_stride + h * d
//   starts:    int64 [nseq + 1], sequence s is token rows starts[s] .. starts[s+1] (cu_seqlens;
//              a padded batch [B, S] is starts = 0, S, 2S, ...)
//   key_mask:  uint8 [nseq, mask_stride], nonzero = attend, or null (every key of the sequence)
// A query row whose keys are all masked comes out as zeros (as torch's flash kernel does).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "attention_chunks.h"
#include "cpu_isa.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "simd_math.h"
#define BF_ATTN_X86 1
#endif

namespace py = pybind11;

namespace bert_fast {
namespace {

struct AttnArgs {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  int64_t row_stride;
  uint16_t* out;
  int64_t out_row_stride;
  const int64_t* starts;
  int64_t nseq;
  const uint8_t* key_mask;
  int64_t mask_stride;
  int heads;
  int d;
  float scale;
};

#ifdef BF_ATTN_X86
#define BF_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

// As in the fp32 kernel (attention_f32_cpu.cpp): the register blocks compiled on their own, their loops
// unrolled, so that acc[R][NB] stays in registers.
#define BF_UNROLL _Pragma("GCC unroll 16")
#define BF_BLOCK __attribute__((noinline))

constexpr int kRows = 4;  // query rows per block: 4 rows x 4 column blocks = 16 accumulators

BF_TARGET inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

BF_TARGET inline __m512bh bcast_pair(const uint16_t* p) {  // (p[0], p[1]) in every 32-bit lane
  uint32_t w;
  std::memcpy(&w, p, 4);
  return as_bh(_mm512_set1_epi32(static_cast<int>(w)));
}

// scores[r][j0 .. j0 + 16 NB) = sum_p Q[r][2p, 2p+1] . Kp[p][j][0, 1] for R rows.
template <int R, int NB>
BF_TARGET BF_BLOCK void qk_block(const uint16_t* const* qrow, const uint32_t* kp, int64_t lp, int d2, int64_t j0,
                                 float* scores) {
  __m512 acc[R][NB];
  BF_UNROLL for (int r = 0; r < R; ++r)
    BF_UNROLL for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int p = 0; p < d2; ++p) {
    const uint32_t* kr = kp + p * lp + j0;
    __m512bh kb[NB];
    BF_UNROLL for (int b = 0; b < NB; ++b) kb[b] = as_bh(_mm512_loadu_si512(kr + 16 * b));
    BF_UNROLL for (int r = 0; r < R; ++r) {
      const __m512bh qa = bcast_pair(qrow[r] + 2 * p);
      BF_UNROLL for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], qa, kb[b]);
    }
  }
  BF_UNROLL for (int r = 0; r < R; ++r)
    BF_UNROLL for (int b = 0; b < NB; ++b) _mm512_storeu_ps(scores + r * lp + j0 + 16 * b, acc[r][b]);
}

// out block [R rows][16 NB dims from c0] = sum_q P[r][2q, 2q+1] . Vp[q][c][0, 1], scaled per row
template <int R, int NB>
BF_TARGET BF_BLOCK void pv_block(const uint16_t* pb, const uint16_t* vp, int64_t lp, int dp, int c0, int d,
                                 const float* inv, uint16_t* const* orow) {
  __m512 acc[R][NB];
  BF_UNROLL for (int r = 0; r < R; ++r)
    BF_UNROLL for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t q = 0; q < lp / 2; ++q) {
    const uint16_t* vr = vp + (q * dp + c0) * 2;
    __m512bh vb[NB];
    BF_UNROLL for (int b = 0; b < NB; ++b) vb[b] = as_bh(_mm512_loadu_si512(vr + 32 * b));
    BF_UNROLL for (int r = 0; r < R; ++r) {
      const __m512bh pa = bcast_pair(pb + r * lp + 2 * q);
      BF_UNROLL for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], pa, vb[b]);
    }
  }
  BF_UNROLL for (int r = 0; r < R; ++r) {
    const __m512 s = _mm512_set1_ps(inv[r]);
    BF_UNROLL for (int b = 0; b < NB; ++b) {
      const int c = c0 + 16 * b;
      const int left = d - c;
      const __mmask16 m = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      const __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][b], s));
      _mm256_mask_storeu_epi16(orow[r] + c, m, reinterpret_cast<__m256i>(o));
    }
  }
}

template <int R>
BF_TARGET void qk_rows(const uint16_t* const* qrow, const uint32_t* kp, int64_t lp, int d2, float* scores) {
  const int64_t nb = lp / 16;
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) qk_block<R, 4>(qrow, kp, lp, d2, 16 * b, scores);
  switch (nb - b) {
    case 3: qk_block<R, 3>(qrow, kp, lp, d2, 16 * b, scores); break;
    case 2: qk_block<R, 2>(qrow, kp, lp, d2, 16 * b, scores); break;
    case 1: qk_block<R, 1>(qrow, kp, lp, d2, 16 * b, scores); break;
    default: break;
  }
}

template <int R>
BF_TARGET void pv_rows(const uint16_t* pb, const uint16_t* vp, int64_t lp, int dp, int d, const float* inv,
                       uint16_t* const* orow) {
  const int nb = dp / 16;
  int b = 0;
  for (; b + 4 <= nb; b += 4) pv_block<R, 4>(pb, vp, lp, dp, 16 * b, d, inv, orow);
  switch (nb - b) {
    case 3: pv_block<R, 3>(pb, vp, lp, dp, 16 * b, d, inv, orow); break;
    case 2: pv_block<R, 2>(pb, vp, lp, dp, 16 * b, d, inv, orow); break;
    case 1: pv_block<R, 1>(pb, vp, lp, dp, 16 * b, d, inv, orow); break;
    default: break;
  }
}

// Softmax of one score row in place: p = exp(scale * s + bias - max) as bf16 into prow; returns
// 1 / sum (0 when every key is masked, which zeroes the output row).
BF_TARGET float softmax_row(const float* s, const float* bias, int64_t lp, float scale, uint16_t* prow) {
  const __m512 vs = _mm512_set1_ps(scale);
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < lp; j += 16)
    vmax = _mm512_max_ps(vmax, _mm512_fmadd_ps(_mm512_loadu_ps(s + j), vs, _mm512_loadu_ps(bias + j)));
  const float m = _mm512_reduce_max_ps(vmax);
  if (m == -std::numeric_limits<float>::infinity()) {
    std::memset(prow, 0, lp * sizeof(uint16_t));
    return 0.0f;
  }
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < lp; j += 32) {  // lp is a multiple of 16: the second half may be absent
    const __m512 e0 =
        simd::exp_nonpos(_mm512_sub_ps(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), vs, _mm512_loadu_ps(bias + j)), vm));
    __m512 e1 = _mm512_setzero_ps();
    if (j + 16 < lp)
      e1 = simd::exp_nonpos(
          _mm512_sub_ps(_mm512_fmadd_ps(_mm512_loadu_ps(s + j + 16), vs, _mm512_loadu_ps(bias + j + 16)), vm));
    vsum = _mm512_add_ps(vsum, _mm512_add_ps(e0, e1));
    const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0));  // e0 low, e1 high
    if (j + 16 < lp)
      _mm512_storeu_si512(prow + j, packed);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), _mm512_castsi512_si256(packed));
  }
  return 1.0f / _mm512_reduce_add_ps(vsum);
}

// Scratch of a chunk of sequences, shared by the threads: K and V of every head packed once.
//   kp: per sequence [heads][d/2][lp] pairs of K along d;  vp: [heads][lp/2][dp][2] pairs of V
// Filled from whole token rows (every head of a token at once: contiguous reads), then read by
// every query block of the sequence.
// A sequence's packs start at heads * d/2 * lp_off (kp) and heads * dp * lp_off (vp), lp_off = the
// padded lengths of the chunk's sequences before it.
struct ChunkPack {
  std::vector<uint32_t> kp;
  std::vector<uint16_t> vp;
  attention_chunks::Plan plan;  // the chunk's sequences, tiles to pack and query blocks
};

struct RowScratch {          // per thread
  std::vector<float> bias;   // [lp] 0 or -inf
  std::vector<float> scores; // [kRows][lp]
  std::vector<uint16_t> pb;  // [kRows][lp] bf16 probabilities
};

using attention_chunks::kBlockRows;
using attention_chunks::round16;

// Tokens j0 .. j0 + 16 (j0 a multiple of 16, < lp) of sequence s into the packs of every head (zeros
// past the sequence's end). A tile at a time so that each K pair row gets 16 pairs (a cache line) at
// once and each V pair row is written in order: one token at a time wrote 4 bytes into each of d/2
// lines per head (the fp32 twin's pack took about a third of a d = 64 call that way).
BF_TARGET void pack_tile(const AttnArgs& a, int64_t s, int64_t j0, uint32_t* kp, uint16_t* vp) {
  constexpr int kTile = attention_chunks::kPackTile;
  const int64_t t0 = a.starts[s], len = a.starts[s + 1] - t0, lp = round16(len);
  const int d = a.d, d2 = d / 2, dp = (d + 15) / 16 * 16;
  const int real = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(kTile, len - j0)));
  static const uint16_t kZeros[1] = {0};
  for (int h = 0; h < a.heads; ++h) {
    const int64_t hoff = static_cast<int64_t>(h) * d;
    const uint16_t* krow[kTile];
    const uint16_t* vrow[kTile];
    for (int t = 0; t < real; ++t) {
      krow[t] = a.k + (t0 + j0 + t) * a.row_stride + hoff;
      vrow[t] = a.v + (t0 + j0 + t) * a.row_stride + hoff;
    }
    uint32_t* kh = kp + static_cast<int64_t>(h) * d2 * lp + j0;
    for (int p = 0; p < d2; ++p) {
      uint32_t* dst = kh + p * lp;
      for (int t = 0; t < real; ++t) std::memcpy(dst + t, krow[t] + 2 * p, 4);
      for (int t = real; t < kTile; ++t) dst[t] = 0u;
    }
    // pair row j / 2 holds (token 2i, token 2i + 1) of every dim, dims padded to dp with zeros
    for (int t = 0; t < kTile; t += 2) {
      uint16_t* vh = vp + (static_cast<int64_t>(h) * (lp / 2) + (j0 + t) / 2) * dp * 2;
      const uint16_t* v0 = t < real ? vrow[t] : kZeros;
      const uint16_t* v1 = t + 1 < real ? vrow[t + 1] : kZeros;
      const int step0 = t < real ? 1 : 0, step1 = t + 1 < real ? 1 : 0;  // a padding token reads kZeros[0]
      for (int c = 0; c < d; ++c) {
        vh[2 * c] = v0[c * step0];
        vh[2 * c + 1] = v1[c * step1];
      }
      std::memset(vh + 2 * d, 0, (dp - d) * 2 * sizeof(uint16_t));
    }
  }
}

// Query rows [r0, r1) of sequence s, every head: scores, softmax, P V from the chunk's packs.
BF_TARGET void attend_rows(const AttnArgs& a, int64_t s, int64_t r0, int64_t r1, const uint32_t* kp,
                           const uint16_t* vp, RowScratch& w) {
  const int64_t t0 = a.starts[s], len = a.starts[s + 1] - t0, lp = round16(len);
  const int d = a.d, d2 = d / 2, dp = (d + 15) / 16 * 16;
  w.bias.resize(lp);
  w.scores.resize(kRows * lp);
  w.pb.resize(kRows * lp);
  const float ninf = -std::numeric_limits<float>::infinity();
  const uint8_t* km = a.key_mask ? a.key_mask + s * a.mask_stride : nullptr;
  for (int64_t j = 0; j < lp; ++j) w.bias[j] = (j < len && (!km || km[j])) ? 0.0f : ninf;
  const uint16_t* qrow[kRows];
  uint16_t* orow[kRows];
  float inv[kRows];
  for (int h = 0; h < a.heads; ++h) {
    const int64_t hoff = static_cast<int64_t>(h) * d;
    const uint32_t* kh = kp + static_cast<int64_t>(h) * d2 * lp;
    const uint16_t* vh = vp + static_cast<int64_t>(h) * lp * dp;
    for (int64_t b0 = r0; b0 < r1; b0 += kRows) {
      const int nr = static_cast<int>(std::min<int64_t>(kRows, r1 - b0));
      for (int r = 0; r < nr; ++r) {
        qrow[r] = a.q + (t0 + b0 + r) * a.row_stride + hoff;
        orow[r] = a.out + (t0 + b0 + r) * a.out_row_stride + hoff;
      }
      switch (nr) {
        case 4: qk_rows<4>(qrow, kh, lp, d2, w.scores.data()); break;
        case 3: qk_rows<3>(qrow, kh, lp, d2, w.scores.data()); break;
        case 2: qk_rows<2>(qrow, kh, lp, d2, w.scores.data()); break;
        default: qk_rows<1>(qrow, kh, lp, d2, w.scores.data()); break;
      }
      for (int r = 0; r < nr; ++r)
        inv[r] = softmax_row(w.scores.data() + r * lp, w.bias.data(), lp, a.scale, w.pb.data() + r * lp);
      switch (nr) {
        case 4: pv_rows<4>(w.pb.data(), vh, lp, dp, d, inv, orow); break;
        case 3: pv_rows<3>(w.pb.data(), vh, lp, dp, d, inv, orow); break;
        case 2: pv_rows<2>(w.pb.data(), vh, lp, dp, d, inv, orow); break;
        default: pv_rows<1>(w.pb.data(), vh, lp, dp, d, inv, orow); break;
      }
    }
  }
}

// The whole call on ``n`` threads: per chunk, pack every token of its sequences (threads split the
// tiles of 16 tokens), then the query blocks (threads take them one by one). Without OpenMP the
// pragmas are ignored and the calling thread does it all.
BF_TARGET void run_chunks(const AttnArgs& a, int n, ChunkPack& pk) {
  const int d = a.d, d2 = d / 2, dp = (d + 15) / 16 * 16;
  const int64_t k_per_row = static_cast<int64_t>(a.heads) * d2, v_per_row = static_cast<int64_t>(a.heads) * dp;
  attention_chunks::Plan& p = pk.plan;
  int64_t s0 = 0;
  while (s0 < a.nseq) {
    // the chunk [s0, s1): packs of at most kChunkBytes (or one sequence)
    const int64_t s1 = attention_chunks::plan(a.starts, a.nseq, s0, k_per_row * 4 + v_per_row * 2, p);
    if (static_cast<int64_t>(pk.kp.size()) < p.rows * k_per_row) pk.kp.resize(p.rows * k_per_row);
    if (static_cast<int64_t>(pk.vp.size()) < p.rows * v_per_row) pk.vp.resize(p.rows * v_per_row);
    const int64_t nt = static_cast<int64_t>(p.tiles.size()), nb = static_cast<int64_t>(p.blocks.size());
    const std::pair<int64_t, int64_t>* tiles = p.tiles.data();
    const std::pair<int64_t, int64_t>* blocks = p.blocks.data();
    uint32_t* kp = pk.kp.data();
    uint16_t* vp = pk.vp.data();
    const int64_t* off = p.lp_off.data();
#pragma omp parallel num_threads(n)
    {
      RowScratch w;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t s = tiles[i].first, o = off[s - s0];
        pack_tile(a, s, tiles[i].second, kp + o * k_per_row, vp + o * v_per_row);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < nb; ++i) {
        const int64_t s = blocks[i].first, r = blocks[i].second, o = off[s - s0];
        const int64_t len = a.starts[s + 1] - a.starts[s];
        attend_rows(a, s, r, std::min(len, r + kBlockRows), kp + o * k_per_row, vp + o * v_per_row, w);
      }
    }
    s0 = s1;
  }
}
#endif  // BF_ATTN_X86

// AVX-512 F/BW/VL/DQ + BF16 on this CPU, not ruled out by BERT_FAST_CPU_ISA (cpu_isa.h).
bool cpu_has_bf16_dot() {
#ifdef BF_ATTN_X86
  return isa_usable(Isa::kAvx512Bf16);
#else
  return false;
#endif
}

void attention_bf16(uintptr_t q, uintptr_t k, uintptr_t v, int64_t row_stride, uintptr_t out, int64_t out_row_stride,
                    uintptr_t starts, int64_t nseq, uintptr_t key_mask, int64_t mask_stride, int heads, int d,
                    double scale, int threads) {
  if (!cpu_has_bf16_dot()) throw std::runtime_error("attention_bf16: " + isa_refusal("avx512_bf16"));
  if (d <= 0 || d % 2 != 0) throw std::invalid_argument("attention_bf16 needs an even head dim");
#ifdef BF_ATTN_X86
  AttnArgs a{reinterpret_cast<const uint16_t*>(q),
             reinterpret_cast<const uint16_t*>(k),
             reinterpret_cast<const uint16_t*>(v),
             row_stride,
             reinterpret_cast<uint16_t*>(out),
             out_row_stride,
             reinterpret_cast<const int64_t*>(starts),
             nseq,
             reinterpret_cast<const uint8_t*>(key_mask),
             mask_stride,
             heads,
             d,
             static_cast<float>(scale)};
  const int n = attention_chunks::threads_for(a.starts, nseq, d, heads, threads);
  // The packs stay allocated with the calling thread between calls (no page faults per call);
  // bounded by kChunkBytes or by one sequence's K and V.
  thread_local ChunkPack pack;
  py::gil_scoped_release nogil;
  // On torch's own OpenMP pool: this module's libgomp.so.1 resolves to the copy torch loaded, so
  // the GEMMs before and after this call and this call share one set of threads (std::threads
  // started per call measured 1.5-2x slower next to oneDNN's: benchmarks/NOTES.md).
  run_chunks(a, n, pack);
#endif
}

}  // namespace

void bind_attention(py::module_& m) {
  m.def("cpu_has_bf16_dot", &cpu_has_bf16_dot, "Whether this CPU runs attention_bf16 (AVX-512 BF16)");
  m.def("attention_bf16", &attention_bf16, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("row_stride"),
        py::arg("out"), py::arg("out_row_stride"), py::arg("starts"), py::arg("nseq"), py::arg("key_mask"),
        py::arg("mask_stride"), py::arg("heads"), py::arg("d"), py::arg("scale"), py::arg("threads"),
        "softmax(scale Q K^T + key mask) V of bf16 sequences on the CPU (csrc/attention_cpu.cpp)");
}

}  // namespace bert_fast
