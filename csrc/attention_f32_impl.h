// The fp32 attention kernel of attention_f32_cpu.cpp, written once over a vector type and included
// once per instruction set (no include guard, on purpose): before each inclusion the includer defines
//   F32A_NS       the namespace of this copy (avx512 / avx2)
//   F32A_TARGET   its function attribute (target("avx512f,...") / target("avx2,fma"))
//   Vec           a struct of static inline functions over W fp32 lanes (see attention_f32_cpu.cpp)
// (and, once, F32A_UNROLL and F32A_BLOCK: what keeps the register blocks' accumulators in registers)
// and includes it inside namespace bert_fast::<anonymous>. Every function here takes F32A_TARGET, so
// the compiler emits each copy with its own instructions and the caller picks one at run time.
//
// Per (sequence, head), as the bf16 kernel (attention_cpu.cpp) does, without its bf16 pairs:
//   kp[h][c][j]  = K[token j][head h][dim c]     (K transposed: a row of tokens per dim)
//   vp[h][j][c]  = V[token j][head h][dim c]     (dims padded to dp, a multiple of 16)
// scores[r][j] = sum_c q[r][c] kp[c][j]: per dim, one broadcast of q times a row of kp; softmax in
// fp32; out[r][c] = sum_j p[r][j] vp[j][c] / sum_j p[r][j]: per token, one broadcast of p times a row
// of vp. Tokens are padded to lp = a multiple of 16 with zero K and V rows and -inf bias.

namespace F32A_NS {

constexpr int kRows = 4;  // query rows per register block

// scores[r][j0 .. j0 + W NB) for R rows
template <int R, int NB>
F32A_TARGET F32A_BLOCK void qk_block(const float* const* qrow, const float* kp, int64_t lp, int d, int64_t j0,
                                     float* scores) {
  typename Vec::T acc[R][NB];
  F32A_UNROLL for (int r = 0; r < R; ++r)
    F32A_UNROLL for (int b = 0; b < NB; ++b) acc[r][b] = Vec::zero();
  for (int c = 0; c < d; ++c) {
    const float* kr = kp + c * lp + j0;
    typename Vec::T kb[NB];
    F32A_UNROLL for (int b = 0; b < NB; ++b) kb[b] = Vec::load(kr + Vec::W * b);
    F32A_UNROLL for (int r = 0; r < R; ++r) {
      const typename Vec::T qa = Vec::set1(qrow[r][c]);
      F32A_UNROLL for (int b = 0; b < NB; ++b) acc[r][b] = Vec::fma(qa, kb[b], acc[r][b]);
    }
  }
  F32A_UNROLL for (int r = 0; r < R; ++r)
    F32A_UNROLL for (int b = 0; b < NB; ++b) Vec::store(scores + r * lp + j0 + Vec::W * b, acc[r][b]);
}

// out[r][c0 .. c0 + W NB) (the first d columns kept) for R rows, scaled by inv[r]
template <int R, int NB>
F32A_TARGET F32A_BLOCK void pv_block(const float* pb, const float* vp, int64_t lp, int dp, int c0, int d,
                                     const float* inv, float* const* orow) {
  typename Vec::T acc[R][NB];
  F32A_UNROLL for (int r = 0; r < R; ++r)
    F32A_UNROLL for (int b = 0; b < NB; ++b) acc[r][b] = Vec::zero();
  for (int64_t j = 0; j < lp; ++j) {
    const float* vr = vp + j * dp + c0;
    typename Vec::T vb[NB];
    F32A_UNROLL for (int b = 0; b < NB; ++b) vb[b] = Vec::load(vr + Vec::W * b);
    F32A_UNROLL for (int r = 0; r < R; ++r) {
      const typename Vec::T pa = Vec::set1(pb[r * lp + j]);
      F32A_UNROLL for (int b = 0; b < NB; ++b) acc[r][b] = Vec::fma(pa, vb[b], acc[r][b]);
    }
  }
  F32A_UNROLL for (int r = 0; r < R; ++r) {
    const typename Vec::T s = Vec::set1(inv[r]);
    F32A_UNROLL for (int b = 0; b < NB; ++b) {
      const int c = c0 + Vec::W * b;
      const typename Vec::T o = Vec::mul(acc[r][b], s);
      if (d - c >= Vec::W) {
        Vec::store(orow[r] + c, o);
      } else if (d > c) {  // the head dim's tail: through a lane buffer
        alignas(64) float lanes[Vec::W];
        Vec::store(lanes, o);
        std::memcpy(orow[r] + c, lanes, (d - c) * sizeof(float));
      }
    }
  }
}

template <int R>
F32A_TARGET void qk_rows(const float* const* qrow, const float* kp, int64_t lp, int d, float* scores) {
  const int64_t nv = lp / Vec::W;
  int64_t b = 0;
  for (; b + Vec::kNb <= nv; b += Vec::kNb) qk_block<R, Vec::kNb>(qrow, kp, lp, d, Vec::W * b, scores);
  switch (nv - b) {
    case 3: qk_block<R, 3>(qrow, kp, lp, d, Vec::W * b, scores); break;
    case 2: qk_block<R, 2>(qrow, kp, lp, d, Vec::W * b, scores); break;
    case 1: qk_block<R, 1>(qrow, kp, lp, d, Vec::W * b, scores); break;
    default: break;
  }
}

template <int R>
F32A_TARGET void pv_rows(const float* pb, const float* vp, int64_t lp, int dp, int d, const float* inv,
                         float* const* orow) {
  const int nv = dp / Vec::W;
  int b = 0;
  for (; b + Vec::kNb <= nv; b += Vec::kNb) pv_block<R, Vec::kNb>(pb, vp, lp, dp, Vec::W * b, d, inv, orow);
  switch (nv - b) {
    case 3: pv_block<R, 3>(pb, vp, lp, dp, Vec::W * b, d, inv, orow); break;
    case 2: pv_block<R, 2>(pb, vp, lp, dp, Vec::W * b, d, inv, orow); break;
    case 1: pv_block<R, 1>(pb, vp, lp, dp, Vec::W * b, d, inv, orow); break;
    default: break;
  }
}

// p = exp(scale s + bias - max) in place; returns 1 / sum (0 when every key is masked: a zero row)
F32A_TARGET float softmax_row(float* s, const float* bias, int64_t lp, float scale) {
  const typename Vec::T vs = Vec::set1(scale);
  typename Vec::T vmax = Vec::set1(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < lp; j += Vec::W) {
    const typename Vec::T x = Vec::fma(Vec::load(s + j), vs, Vec::load(bias + j));
    Vec::store(s + j, x);
    vmax = Vec::max(vmax, x);
  }
  const float m = Vec::reduce_max(vmax);
  if (m == -std::numeric_limits<float>::infinity()) {
    std::memset(s, 0, lp * sizeof(float));
    return 0.0f;
  }
  const typename Vec::T vm = Vec::set1(m);
  typename Vec::T vsum = Vec::zero();
  for (int64_t j = 0; j < lp; j += Vec::W) {
    const typename Vec::T e = Vec::exp_nonpos(Vec::sub(Vec::load(s + j), vm));
    Vec::store(s + j, e);
    vsum = Vec::add(vsum, e);
  }
  return 1.0f / Vec::reduce_add(vsum);
}

// Tokens j0 .. j0 + 16 (j0 a multiple of 16, < lp) of sequence s into the packs of every head (zeros
// past the sequence's end). A tile of 16 tokens at a time, so that K's transposed rows are written
// 16 floats (a cache line) at once: one token at a time, every dim wrote 4 bytes into its own line
// (d lines per token and head), and that strided store loop took about a third of a d = 64 call.
F32A_TARGET void pack_tile(const F32Args& a, int64_t s, int64_t j0, float* kp, float* vp) {
  constexpr int kTile = attention_chunks::kPackTile;
  const int64_t t0 = a.starts[s], len = a.starts[s + 1] - t0, lp = round16(len);
  const int d = a.d, dp = pad16(d);
  const int real = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(kTile, len - j0)));
  for (int h = 0; h < a.heads; ++h) {
    const int64_t hoff = static_cast<int64_t>(h) * d;
    float* kh = kp + static_cast<int64_t>(h) * d * lp + j0;
    float* vh = vp + (static_cast<int64_t>(h) * lp + j0) * dp;
    const float* krow[kTile];
    for (int t = 0; t < real; ++t) krow[t] = a.k + (t0 + j0 + t) * a.row_stride + hoff;
    for (int c = 0; c < d; ++c) {
      float* dst = kh + c * lp;
      for (int t = 0; t < real; ++t) dst[t] = krow[t][c];
      for (int t = real; t < kTile; ++t) dst[t] = 0.0f;
    }
    for (int t = 0; t < kTile; ++t) {
      float* vt = vh + static_cast<int64_t>(t) * dp;
      if (t < real) {
        std::memcpy(vt, a.v + (t0 + j0 + t) * a.row_stride + hoff, d * sizeof(float));
        if (dp > d) std::memset(vt + d, 0, (dp - d) * sizeof(float));
      } else {
        std::memset(vt, 0, dp * sizeof(float));
      }
    }
  }
}

// Query rows [r0, r1) of sequence s, every head.
F32A_TARGET void attend_rows(const F32Args& a, int64_t s, int64_t r0, int64_t r1, const float* kp, const float* vp,
                             F32Scratch& w) {
  const int64_t t0 = a.starts[s], len = a.starts[s + 1] - t0, lp = round16(len);
  const int d = a.d, dp = pad16(d);
  w.bias.resize(lp);
  w.scores.resize(kRows * lp);
  const float ninf = -std::numeric_limits<float>::infinity();
  const uint8_t* km = a.key_mask ? a.key_mask + s * a.mask_stride : nullptr;
  for (int64_t j = 0; j < lp; ++j) w.bias[j] = (j < len && (!km || km[j])) ? 0.0f : ninf;
  const float* qrow[kRows];
  float* orow[kRows];
  float inv[kRows];
  for (int h = 0; h < a.heads; ++h) {
    const int64_t hoff = static_cast<int64_t>(h) * d;
    const float* kh = kp + static_cast<int64_t>(h) * d * lp;
    const float* vh = vp + static_cast<int64_t>(h) * lp * dp;
    for (int64_t b0 = r0; b0 < r1; b0 += kRows) {
      const int nr = static_cast<int>(std::min<int64_t>(kRows, r1 - b0));
      for (int r = 0; r < nr; ++r) {
        qrow[r] = a.q + (t0 + b0 + r) * a.row_stride + hoff;
        orow[r] = a.out + (t0 + b0 + r) * a.out_row_stride + hoff;
      }
      float* sc = w.scores.data();
      switch (nr) {
        case 4: qk_rows<4>(qrow, kh, lp, d, sc); break;
        case 3: qk_rows<3>(qrow, kh, lp, d, sc); break;
        case 2: qk_rows<2>(qrow, kh, lp, d, sc); break;
        default: qk_rows<1>(qrow, kh, lp, d, sc); break;
      }
      for (int r = 0; r < nr; ++r) inv[r] = softmax_row(sc + r * lp, w.bias.data(), lp, a.scale);
      switch (nr) {
        case 4: pv_rows<4>(sc, vh, lp, dp, d, inv, orow); break;
        case 3: pv_rows<3>(sc, vh, lp, dp, d, inv, orow); break;
        case 2: pv_rows<2>(sc, vh, lp, dp, d, inv, orow); break;
        default: pv_rows<1>(sc, vh, lp, dp, d, inv, orow); break;
      }
    }
  }
}

// The whole call on n threads: per chunk of sequences (attention_chunks::plan: L2-sized packs),
// pack every token (threads split the tiles of 16 tokens), then the query blocks (threads take them one
// by one).
F32A_TARGET void run_chunks(const F32Args& a, int n, F32Pack& pk) {
  const int d = a.d, dp = pad16(d);
  const int64_t k_per_row = static_cast<int64_t>(a.heads) * d, v_per_row = static_cast<int64_t>(a.heads) * dp;
  attention_chunks::Plan& p = pk.plan;
  int64_t s0 = 0;
  while (s0 < a.nseq) {
    const int64_t s1 = attention_chunks::plan(a.starts, a.nseq, s0, (k_per_row + v_per_row) * 4, p);
    if (static_cast<int64_t>(pk.kp.size()) < p.rows * k_per_row) pk.kp.resize(p.rows * k_per_row);
    if (static_cast<int64_t>(pk.vp.size()) < p.rows * v_per_row) pk.vp.resize(p.rows * v_per_row);
    const int64_t nt = static_cast<int64_t>(p.tiles.size()), nb = static_cast<int64_t>(p.blocks.size());
    const std::pair<int64_t, int64_t>* tiles = p.tiles.data();
    const std::pair<int64_t, int64_t>* blocks = p.blocks.data();
    float* kp = pk.kp.data();
    float* vp = pk.vp.data();
    const int64_t* off = p.lp_off.data();
#pragma omp parallel num_threads(n)
    {
      F32Scratch w;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t s = tiles[i].first, o = off[s - s0];
        pack_tile(a, s, tiles[i].second, kp + o * k_per_row, vp + o * v_per_row);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < nb; ++i) {
        const int64_t s = blocks[i].first, r = blocks[i].second, o = off[s - s0];
        const int64_t len = a.starts[s + 1] - a.starts[s];
        const int64_t r1 = std::min<int64_t>(len, r + attention_chunks::kBlockRows);
        attend_rows(a, s, r, r1, kp + o * k_per_row, vp + o * v_per_row, w);
      }
    }
    s0 = s1;
  }
}

}  // namespace F32A_NS
