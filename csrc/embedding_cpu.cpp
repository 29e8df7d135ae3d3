// CPU twin of the CUDA embedding + LayerNorm kernels, and the pybind11 bindings of both.
//
// Same semantics as csrc/embedding_cuda.cu: gather word/position/token-type rows (positions default
// to src % S, token types to 0; `indices` selects rows of the flattened ids), sum in fp32, LayerNorm
// with fp32 mean/rstd (two-pass), gamma/beta, Philox dropout (same bits as the GPU for the same
// seed, see embedding_common.h). Backward recomputes x from the tables, regenerates the mask, and
// accumulates the table gradients in fp32, token by token in order (deterministic).
// float64 tables are supported here only (accumulation in double): they serve gradcheck.
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "embedding.h"
#include "embedding_common.h"

namespace py = pybind11;

namespace bert_fast {

#ifdef BERT_FAST_WITH_CUDA
// Defined in embedding_cuda.cu; they throw std::runtime_error on a CUDA error.
void embedding_fwd_cuda(const EmbFwdParams& p, uintptr_t stream);
void embedding_bwd_cuda(const EmbBwdParams& p, uintptr_t stream);
void embedding_segment_sum_cuda(const float* dx, const int64_t* perm, const int64_t* seg_offsets,
                                const int64_t* seg_rows, int64_t num_segments, int64_t hidden,
                                int64_t skip_row, void* out, int dtype, uintptr_t stream);
void dropout_mask_cuda(uint8_t* out, int64_t rows, int64_t hidden, uint64_t seed,
                       uint64_t threshold, uintptr_t stream);
#endif

namespace {

// ------------------------------------------------------------------------------ dtype conversion
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3FFu) << 13;
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | man << 13;
  } else {
    bits = sign | (exp + 112) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return sign | (ax > 0x7F800000u ? 0x7E00u : 0x7C00u);  // NaN / inf
  if (ax >= 0x477FF000u) return sign | 0x7C00u;                                   // overflow -> inf
  if (ax < 0x38800000u) {                                                         // subnormal / 0
    if (ax < 0x33000000u) return sign;
    const uint32_t e = ax >> 23;
    const uint32_t man = (ax & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24 (value = man * 2^(e-150), half ulp = 2^-24)
    uint32_t r = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = ((ax >> 13) - (112u << 10));
  const uint32_t rem = ax & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return sign | static_cast<uint16_t>(r);
}

inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

template <int DT> struct Traits;
template <> struct Traits<kF32> {
  using T = float; using Acc = float;
  static float load(const T* p, int64_t i) { return p[i]; }
  static void store(T* p, int64_t i, float v) { p[i] = v; }
};
template <> struct Traits<kF16> {
  using T = uint16_t; using Acc = float;
  static float load(const T* p, int64_t i) { return f16_to_f32(p[i]); }
  static void store(T* p, int64_t i, float v) { p[i] = f32_to_f16(v); }
};
template <> struct Traits<kBF16> {
  using T = uint16_t; using Acc = float;
  static float load(const T* p, int64_t i) { return bf16_to_f32(p[i]); }
  static void store(T* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }
};
template <> struct Traits<kF64> {
  using T = double; using Acc = double;
  static double load(const T* p, int64_t i) { return p[i]; }
  static void store(T* p, int64_t i, double v) { p[i] = v; }
};

inline int64_t load_index(const void* p, int i64, int64_t i) {
  return i64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

struct RowIds { int64_t w, p, t; };

template <typename P>
inline RowIds row_ids(const P& prm, int64_t row) {
  const int64_t src = prm.indices ? prm.indices[row] : row;
  RowIds r;
  r.w = load_index(prm.ids, prm.ids_i64, src);
  r.p = prm.pos ? load_index(prm.pos, prm.pos_i64, src) : src % prm.seq_len;
  r.t = prm.tt ? load_index(prm.tt, prm.tt_i64, src) : 0;
  return r;
}

template <int DT>
void fwd_impl(const EmbFwdParams& p) {
  using Tr = Traits<DT>;
  using T = typename Tr::T;
  using Acc = typename Tr::Acc;
  const int64_t H = p.hidden;
  const T* word = static_cast<const T*>(p.word);
  const T* pe = static_cast<const T*>(p.posemb);
  const T* te = static_cast<const T*>(p.typeemb);
  const T* gamma = static_cast<const T*>(p.gamma);
  const T* beta = static_cast<const T*>(p.beta);
  T* out = static_cast<T*>(p.out);
  std::vector<Acc> x(H), g(H), b(H);
  std::vector<uint8_t> keep(H, 1);
  for (int64_t j = 0; j < H; ++j) {
    g[j] = Tr::load(gamma, j);
    b[j] = Tr::load(beta, j);
  }
  const bool drop = p.keep_threshold != 0;
  const Acc scale = static_cast<Acc>(p.dropout_scale);
  for (int64_t row = 0; row < p.rows; ++row) {
    const RowIds r = row_ids(p, row);
    const T* wr = word + r.w * H;
    const T* pr = pe + r.p * H;
    const T* tr = te + r.t * H;
    Acc sum = 0;
    for (int64_t j = 0; j < H; ++j) {
      const Acc v = (Tr::load(wr, j) + Tr::load(pr, j)) + Tr::load(tr, j);
      x[j] = v;
      sum += v;
    }
    const Acc mean = sum / static_cast<Acc>(H);
    Acc sq = 0;
    for (int64_t j = 0; j < H; ++j) {
      const Acc d = x[j] - mean;
      sq += d * d;
    }
    const Acc rstd = Acc(1) / std::sqrt(sq / static_cast<Acc>(H) + static_cast<Acc>(p.eps));
    if (drop) row_keep_mask(p.seed, p.keep_threshold, row, H, keep.data());
    T* o = out + row * H;
    for (int64_t j = 0; j < H; ++j) {
      Acc y = (x[j] - mean) * rstd * g[j] + b[j];
      if (drop) y = keep[j] ? y * scale : Acc(0);
      Tr::store(o, j, y);
    }
    if (DT == kF64) {
      p.mean64[row] = static_cast<double>(mean);
      p.rstd64[row] = static_cast<double>(rstd);
    } else {
      p.mean[row] = static_cast<float>(mean);
      p.rstd[row] = static_cast<float>(rstd);
    }
  }
}

template <int DT>
void bwd_impl(const EmbBwdParams& p) {
  using Tr = Traits<DT>;
  using T = typename Tr::T;
  using Acc = typename Tr::Acc;
  const int64_t H = p.hidden;
  const T* word = static_cast<const T*>(p.word);
  const T* pe = static_cast<const T*>(p.posemb);
  const T* te = static_cast<const T*>(p.typeemb);
  const T* gamma = static_cast<const T*>(p.gamma);
  const T* dy = static_cast<const T*>(p.dy);
  Acc* dword = static_cast<Acc*>(p.dword);
  Acc* dpos = static_cast<Acc*>(p.dpos);
  Acc* dtt = static_cast<Acc*>(p.dtype_grad);
  Acc* dgamma = static_cast<Acc*>(p.dgamma);
  Acc* dbeta = static_cast<Acc*>(p.dbeta);
  const bool need_dx = dword || dpos || dtt;
  std::vector<Acc> xhat(H), gv(H), gam(H), dx(H);
  std::vector<uint8_t> keep(H, 1);
  for (int64_t j = 0; j < H; ++j) gam[j] = Tr::load(gamma, j);
  const bool drop = p.keep_threshold != 0;
  const Acc scale = static_cast<Acc>(p.dropout_scale);
  const Acc invH = Acc(1) / static_cast<Acc>(H);
  for (int64_t row = 0; row < p.rows; ++row) {
    const RowIds r = row_ids(p, row);
    const Acc mean = DT == kF64 ? static_cast<Acc>(p.mean64[row]) : static_cast<Acc>(p.mean[row]);
    const Acc rstd = DT == kF64 ? static_cast<Acc>(p.rstd64[row]) : static_cast<Acc>(p.rstd[row]);
    const T* wr = word + r.w * H;
    const T* pr = pe + r.p * H;
    const T* tr = te + r.t * H;
    const T* dyr = dy + row * H;
    if (drop) row_keep_mask(p.seed, p.keep_threshold, row, H, keep.data());
    Acc c1 = 0, c2 = 0;
    for (int64_t j = 0; j < H; ++j) {
      const Acc x = (Tr::load(wr, j) + Tr::load(pr, j)) + Tr::load(tr, j);
      const Acc xh = (x - mean) * rstd;
      Acc gj = Tr::load(dyr, j);
      if (drop) gj = keep[j] ? gj * scale : Acc(0);
      xhat[j] = xh;
      gv[j] = gj;
      if (dgamma) dgamma[j] += gj * xh;
      if (dbeta) dbeta[j] += gj;
      const Acc dxh = gj * gam[j];
      c1 += dxh * xh;
      c2 += dxh;
    }
    if (!need_dx) continue;
    c1 *= invH;
    c2 *= invH;
    for (int64_t j = 0; j < H; ++j) dx[j] = (gv[j] * gam[j] - xhat[j] * c1 - c2) * rstd;
    if (dword && r.w != p.padding_idx) {
      Acc* d = dword + r.w * H;
      for (int64_t j = 0; j < H; ++j) d[j] += dx[j];
    }
    if (dpos && r.p != p.pos_padding_idx) {
      Acc* d = dpos + r.p * H;
      for (int64_t j = 0; j < H; ++j) d[j] += dx[j];
    }
    if (dtt && r.t != p.type_padding_idx) {
      Acc* d = dtt + r.t * H;
      for (int64_t j = 0; j < H; ++j) d[j] += dx[j];
    }
  }
}

// ------------------------------------------------------------------------------ dict parsing
uintptr_t get_ptr(const py::dict& d, const char* key) {
  if (!d.contains(key)) return 0;
  py::object o = d[key];
  if (o.is_none()) return 0;
  return o.cast<uintptr_t>();
}
template <typename V>
V get_val(const py::dict& d, const char* key, V dflt) {
  if (!d.contains(key)) return dflt;
  py::object o = d[key];
  if (o.is_none()) return dflt;
  return o.cast<V>();
}
template <typename V>
V req_val(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw std::invalid_argument(std::string("embedding: missing argument ") + key);
  return d[key].cast<V>();
}

void fill_dropout(const py::dict& d, float& scale, uint64_t& threshold, uint64_t& seed) {
  const double pdrop = get_val<double>(d, "dropout_p", 0.0);
  if (pdrop < 0.0 || pdrop >= 1.0) throw std::invalid_argument("embedding: dropout_p must be in [0, 1)");
  threshold = keep_threshold_from_p(pdrop);
  scale = threshold ? static_cast<float>(1.0 / (1.0 - pdrop)) : 1.0f;
  // Python passes the seed as a (possibly negative) int64; reinterpret as uint64.
  seed = static_cast<uint64_t>(get_val<int64_t>(d, "seed", 0));
}

// The lookup inputs forward and backward share (ids/positions/types, the three tables, gamma,
// dtype and dropout): both parameter structs name these fields alike.
template <class Params>
void parse_lookup(const py::dict& d, Params& p) {
  p.ids = reinterpret_cast<const void*>(get_ptr(d, "ids"));
  p.pos = reinterpret_cast<const void*>(get_ptr(d, "pos"));
  p.tt = reinterpret_cast<const void*>(get_ptr(d, "tt"));
  p.ids_i64 = get_val<int>(d, "ids_i64", 1);
  p.pos_i64 = get_val<int>(d, "pos_i64", 1);
  p.tt_i64 = get_val<int>(d, "tt_i64", 1);
  p.indices = reinterpret_cast<const int64_t*>(get_ptr(d, "indices"));
  p.rows = req_val<int64_t>(d, "rows");
  p.seq_len = get_val<int64_t>(d, "seq_len", 1);
  p.hidden = req_val<int64_t>(d, "hidden");
  p.word = reinterpret_cast<const void*>(get_ptr(d, "word"));
  p.posemb = reinterpret_cast<const void*>(get_ptr(d, "posemb"));
  p.typeemb = reinterpret_cast<const void*>(get_ptr(d, "typeemb"));
  p.gamma = reinterpret_cast<const void*>(get_ptr(d, "gamma"));
  p.dtype = req_val<int>(d, "dtype");
  fill_dropout(d, p.dropout_scale, p.keep_threshold, p.seed);
}

EmbFwdParams parse_fwd(const py::dict& d) {
  EmbFwdParams p{};
  p.out = reinterpret_cast<void*>(get_ptr(d, "out"));
  p.mean = reinterpret_cast<float*>(get_ptr(d, "mean"));
  p.rstd = reinterpret_cast<float*>(get_ptr(d, "rstd"));
  p.mean64 = reinterpret_cast<double*>(get_ptr(d, "mean"));
  p.rstd64 = reinterpret_cast<double*>(get_ptr(d, "rstd"));
  parse_lookup(d, p);
  p.beta = reinterpret_cast<const void*>(get_ptr(d, "beta"));
  p.eps = get_val<double>(d, "eps", 1e-12);
  if (p.rows > 0 && (!p.out || !p.mean || !p.rstd || !p.ids || !p.word || !p.posemb || !p.typeemb ||
                     !p.gamma || !p.beta))
    throw std::invalid_argument("embedding_fwd: a required pointer is null");
  if (p.hidden <= 0 || p.seq_len <= 0) throw std::invalid_argument("embedding_fwd: hidden and seq_len must be > 0");
  return p;
}

EmbBwdParams parse_bwd(const py::dict& d) {
  EmbBwdParams p{};
  p.dy = reinterpret_cast<const void*>(get_ptr(d, "dy"));
  parse_lookup(d, p);
  p.mean = reinterpret_cast<const float*>(get_ptr(d, "mean"));
  p.rstd = reinterpret_cast<const float*>(get_ptr(d, "rstd"));
  p.mean64 = reinterpret_cast<const double*>(get_ptr(d, "mean"));
  p.rstd64 = reinterpret_cast<const double*>(get_ptr(d, "rstd"));
  p.padding_idx = get_val<int64_t>(d, "padding_idx", -1);
  p.pos_padding_idx = get_val<int64_t>(d, "pos_padding_idx", -1);
  p.type_padding_idx = get_val<int64_t>(d, "type_padding_idx", -1);
  p.dword = reinterpret_cast<void*>(get_ptr(d, "dword"));
  p.dpos = reinterpret_cast<void*>(get_ptr(d, "dpos"));
  p.dtype_grad = reinterpret_cast<void*>(get_ptr(d, "dtype_grad"));
  p.dgamma = reinterpret_cast<void*>(get_ptr(d, "dgamma"));
  p.dbeta = reinterpret_cast<void*>(get_ptr(d, "dbeta"));
  p.dx_ws = reinterpret_cast<float*>(get_ptr(d, "dx_ws"));
  p.partials = reinterpret_cast<float*>(get_ptr(d, "partials"));
  p.num_partials = get_val<int64_t>(d, "num_partials", 0);
  if (p.rows > 0 && (!p.dy || !p.ids || !p.word || !p.posemb || !p.typeemb || !p.gamma || !p.mean || !p.rstd))
    throw std::invalid_argument("embedding_bwd: a required pointer is null");
  if (p.hidden <= 0 || p.seq_len <= 0) throw std::invalid_argument("embedding_bwd: hidden and seq_len must be > 0");
  return p;
}

void fwd_cpu(const py::dict& d) {
  const EmbFwdParams p = parse_fwd(d);
  if (p.rows == 0) return;
  py::gil_scoped_release nogil;
  switch (p.dtype) {
    case kF32: fwd_impl<kF32>(p); break;
    case kF16: fwd_impl<kF16>(p); break;
    case kBF16: fwd_impl<kBF16>(p); break;
    case kF64: fwd_impl<kF64>(p); break;
    default: throw std::invalid_argument("embedding_fwd_cpu: bad dtype code");
  }
}

void bwd_cpu(const py::dict& d) {
  const EmbBwdParams p = parse_bwd(d);
  if (p.rows == 0) return;
  py::gil_scoped_release nogil;
  switch (p.dtype) {
    case kF32: bwd_impl<kF32>(p); break;
    case kF16: bwd_impl<kF16>(p); break;
    case kBF16: bwd_impl<kBF16>(p); break;
    case kF64: bwd_impl<kF64>(p); break;
    default: throw std::invalid_argument("embedding_bwd_cpu: bad dtype code");
  }
}

}  // namespace

void bind_embedding(py::module_& m) {
  m.def("embedding_fwd_cpu", &fwd_cpu, py::arg("params"),
        "Embedding sum + LayerNorm (+dropout) forward on host pointers (see embedding_common.h)");
  m.def("embedding_bwd_cpu", &bwd_cpu, py::arg("params"),
        "Backward: accumulates into the zeroed accumulators given (dword/dpos/dtype_grad/dgamma/dbeta)");
#ifdef BERT_FAST_WITH_CUDA
  m.def("embedding_fwd_cuda", [](const py::dict& d) {
    const EmbFwdParams p = parse_fwd(d);
    if (p.dtype == kF64) throw std::invalid_argument("embedding_fwd_cuda: float64 is not supported");
    const uintptr_t stream = get_val<uintptr_t>(d, "stream", 0);
    if (p.rows == 0) return;
    embedding_fwd_cuda(p, stream);
  }, py::arg("params"));
  m.def("embedding_bwd_cuda", [](const py::dict& d) {
    const EmbBwdParams p = parse_bwd(d);
    if (p.dtype == kF64) throw std::invalid_argument("embedding_bwd_cuda: float64 is not supported");
    const uintptr_t stream = get_val<uintptr_t>(d, "stream", 0);
    if (p.rows == 0) return;
    if ((p.dgamma || p.dbeta) && (!p.partials || p.num_partials <= 0))
      throw std::invalid_argument("embedding_bwd_cuda: dgamma/dbeta need a partials workspace");
    embedding_bwd_cuda(p, stream);
  }, py::arg("params"));
  m.def("embedding_segment_sum_cuda",
        [](uintptr_t dx, uintptr_t perm, uintptr_t seg_offsets, uintptr_t seg_rows, int64_t num_segments,
           int64_t hidden, int64_t skip_row, uintptr_t out, int dtype, uintptr_t stream) {
          if (num_segments == 0) return;
          if (dtype == kF64) throw std::invalid_argument("embedding_segment_sum_cuda: float64 is not supported");
          embedding_segment_sum_cuda(reinterpret_cast<const float*>(dx), reinterpret_cast<const int64_t*>(perm),
                                     reinterpret_cast<const int64_t*>(seg_offsets),
                                     reinterpret_cast<const int64_t*>(seg_rows), num_segments, hidden, skip_row,
                                     reinterpret_cast<void*>(out), dtype, stream);
        },
        py::arg("dx"), py::arg("perm"), py::arg("seg_offsets"), py::arg("seg_rows"), py::arg("num_segments"),
        py::arg("hidden"), py::arg("skip_row"), py::arg("out"), py::arg("dtype"), py::arg("stream"),
        "Deterministic table gradient: out[seg_rows[s]] = sum of dx[perm[seg_offsets[s]:seg_offsets[s+1]]] in order");
  m.def("dropout_mask_cuda", [](uintptr_t out, int64_t rows, int64_t hidden, int64_t seed, double pdrop,
                                uintptr_t stream) {
    if (rows == 0 || hidden == 0) return;
    dropout_mask_cuda(reinterpret_cast<uint8_t*>(out), rows, hidden, static_cast<uint64_t>(seed),
                      keep_threshold_from_p(pdrop), stream);
  }, py::arg("out"), py::arg("rows"), py::arg("hidden"), py::arg("seed"), py::arg("dropout_p"), py::arg("stream"));
#endif
}

}  // namespace bert_fast
