// CUDA kernels of the fused embedding op: word + position + token-type gather, sum, LayerNorm
// (fp32 statistics), Philox dropout; and its backward.
//
// Forward  (emb_ln_fwd_kernel): one warp per token row, 4 rows per 128-thread block. Each lane holds
//   NV vectors of VEC elements of the row in fp32 registers (VEC = 16 bytes / sizeof(T) when every
//   pointer is 16-byte aligned and H % VEC == 0, else 1), so x is read once from the tables; mean and
//   variance are two warp reductions over registers (two-pass, no cancellation). Writes y and the
//   fp32 mean/rstd [T] for backward. Rows too wide for registers take emb_ln_fwd_generic_kernel
//   (one block per row, x recomputed from the tables in each of three passes).
// Backward (emb_ln_bwd_kernel): one warp per *contiguous chunk* of rows. x is recomputed from the
//   tables (never stored), the dropout mask regenerated from the seed. dx = rstd * (g*gamma -
//   xhat*mean(g*gamma*xhat) - mean(g*gamma)). Table gradients: either fp32 atomicAdd into the
//   accumulators (token-type rows are pre-aggregated in registers while the type id does not change
//   along the warp's chunk: that table has ~2 rows, so unaggregated atomics would all collide), or,
//   in deterministic mode, dx rows go to a [T, H] fp32 workspace and emb_segment_sum_kernel sums each
//   table row's tokens in a fixed (sorted) order. dgamma/dbeta: per-block partial sums (warps of a
//   block combined in a fixed order through shared memory) written to partials[block], then
//   emb_partials_reduce_kernel sums the blocks in order: no atomics, deterministic.
// All element offsets are int64. Kernels launch on the caller's stream; errors raise RuntimeError.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "embedding_common.h"

namespace bert_fast {

namespace {

constexpr int kWarps = 4;             // rows (warps) per block, forward and backward
constexpr int kThreads = kWarps * 32;
constexpr int kGenericThreads = 256;  // block size of the wide-row fallbacks

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("bert_fast ") + what + ": CUDA error: " + cudaGetErrorString(err));
}

// ------------------------------------------------------------------------------ dtype helpers
template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* p, float (&o)[VEC]) {
  const Vec<T, VEC> a = *reinterpret_cast<const Vec<T, VEC>*>(p);
#pragma unroll
  for (int k = 0; k < VEC; ++k) o[k] = to_f<T>(a.v[k]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const float (&o)[VEC]) {
  Vec<T, VEC> a;
#pragma unroll
  for (int k = 0; k < VEC; ++k) a.v[k] = from_f<T>(o[k]);
  *reinterpret_cast<Vec<T, VEC>*>(p) = a;
}

__device__ __forceinline__ int64_t load_index(const void* p, int i64, int64_t i) {
  return i64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

struct RowIds { int64_t w, p, t; };

template <typename P>
__device__ __forceinline__ RowIds row_ids(const P& prm, int64_t row) {
  const int64_t src = prm.indices ? prm.indices[row] : row;
  RowIds r;
  r.w = load_index(prm.ids, prm.ids_i64, src);
  r.p = prm.pos ? load_index(prm.pos, prm.pos_i64, src) : src % prm.seq_len;
  r.t = prm.tt ? load_index(prm.tt, prm.tt_i64, src) : 0;
  return r;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block (all threads get the result). `red` holds >= 32 floats.
__device__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // red may still be read from a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < nw; ++w) t += red[w];  // fixed order
  return t;
}

// Keep-mask (1/0) of VEC consecutive elements starting at column c of `row`.
template <int VEC>
__device__ __forceinline__ void keep_vec(uint64_t seed, uint64_t thr, int64_t row, int64_t c, float (&keep)[VEC]) {
  if constexpr (VEC % 4 == 0) {  // c % 4 == 0: whole Philox groups
#pragma unroll
    for (int g = 0; g < VEC / 4; ++g) {
      const U32x4 b = dropout_bits(seed, row, (c >> 2) + g);
      keep[4 * g + 0] = static_cast<uint64_t>(b.x) >= thr ? 1.f : 0.f;
      keep[4 * g + 1] = static_cast<uint64_t>(b.y) >= thr ? 1.f : 0.f;
      keep[4 * g + 2] = static_cast<uint64_t>(b.z) >= thr ? 1.f : 0.f;
      keep[4 * g + 3] = static_cast<uint64_t>(b.w) >= thr ? 1.f : 0.f;
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) keep[k] = dropout_keep(seed, thr, row, c + k) ? 1.f : 0.f;
  }
}

// ------------------------------------------------------------------------------ forward
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(kThreads) emb_ln_fwd_kernel(const EmbFwdParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= p.rows) return;
  const int64_t H = p.hidden;
  const RowIds r = row_ids(p, row);
  const T* wr = static_cast<const T*>(p.word) + r.w * H;
  const T* pr = static_cast<const T*>(p.posemb) + r.p * H;
  const T* tr = static_cast<const T*>(p.typeemb) + r.t * H;

  float x[NV][VEC];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t c = (static_cast<int64_t>(i) * 32 + lane) * VEC;
    if (c < H) {
      float a[VEC], b[VEC], t[VEC];
      load_vec<T, VEC>(wr + c, a);
      load_vec<T, VEC>(pr + c, b);
      load_vec<T, VEC>(tr + c, t);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        x[i][k] = (a[k] + b[k]) + t[k];
        sum += x[i][k];
      }
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) x[i][k] = 0.f;
    }
  }
  const float mean = warp_sum(sum) / static_cast<float>(H);
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t c = (static_cast<int64_t>(i) * 32 + lane) * VEC;
    if (c < H) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float d = x[i][k] - mean;
        sq += d * d;
      }
    }
  }
  const float rstd = 1.f / sqrtf(warp_sum(sq) / static_cast<float>(H) + static_cast<float>(p.eps));

  const T* gamma = static_cast<const T*>(p.gamma);
  const T* beta = static_cast<const T*>(p.beta);
  T* out = static_cast<T*>(p.out) + row * H;
  const bool drop = p.keep_threshold != 0;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t c = (static_cast<int64_t>(i) * 32 + lane) * VEC;
    if (c < H) {
      float g[VEC], b[VEC], y[VEC];
      load_vec<T, VEC>(gamma + c, g);
      load_vec<T, VEC>(beta + c, b);
#pragma unroll
      for (int k = 0; k < VEC; ++k) y[k] = (x[i][k] - mean) * rstd * g[k] + b[k];
      if (drop) {
        float keep[VEC];
        keep_vec<VEC>(p.seed, p.keep_threshold, row, c, keep);
#pragma unroll
        for (int k = 0; k < VEC; ++k) y[k] = keep[k] != 0.f ? y[k] * p.dropout_scale : 0.f;
      }
      store_vec<T, VEC>(out + c, y);
    }
  }
  if (lane == 0) {
    p.mean[row] = mean;
    p.rstd[row] = rstd;
  }
}

// Any H: one block per row, x recomputed from the (L2-resident) rows in each pass.
template <typename T>
__global__ void __launch_bounds__(kGenericThreads) emb_ln_fwd_generic_kernel(const EmbFwdParams p) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const int64_t H = p.hidden;
  const RowIds r = row_ids(p, row);
  const T* wr = static_cast<const T*>(p.word) + r.w * H;
  const T* pr = static_cast<const T*>(p.posemb) + r.p * H;
  const T* tr = static_cast<const T*>(p.typeemb) + r.t * H;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) s += (to_f(wr[j]) + to_f(pr[j])) + to_f(tr[j]);
  const float mean = block_sum(s, red) / static_cast<float>(H);
  float sq = 0.f;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    const float d = ((to_f(wr[j]) + to_f(pr[j])) + to_f(tr[j])) - mean;
    sq += d * d;
  }
  const float rstd = 1.f / sqrtf(block_sum(sq, red) / static_cast<float>(H) + static_cast<float>(p.eps));
  const T* gamma = static_cast<const T*>(p.gamma);
  const T* beta = static_cast<const T*>(p.beta);
  T* out = static_cast<T*>(p.out) + row * H;
  const bool drop = p.keep_threshold != 0;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    const float x = (to_f(wr[j]) + to_f(pr[j])) + to_f(tr[j]);
    float y = (x - mean) * rstd * to_f(gamma[j]) + to_f(beta[j]);
    if (drop) y = dropout_keep(p.seed, p.keep_threshold, row, j) ? y * p.dropout_scale : 0.f;
    out[j] = from_f<T>(y);
  }
  if (threadIdx.x == 0) {
    p.mean[row] = mean;
    p.rstd[row] = rstd;
  }
}

// ------------------------------------------------------------------------------ backward
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(kThreads) emb_ln_bwd_kernel(const EmbBwdParams p, const int64_t rows_per_warp) {
  extern __shared__ float smem[];  // [kWarps, 2, H]: each warp's own dgamma/dbeta sums (no sharing, no atomics)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t H = p.hidden;
  const int64_t warp_id = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  const int64_t row_begin = warp_id * rows_per_warp;
  const int64_t row_end = min(p.rows, row_begin + rows_per_warp);
  const T* word = static_cast<const T*>(p.word);
  const T* pe = static_cast<const T*>(p.posemb);
  const T* te = static_cast<const T*>(p.typeemb);
  const T* gamma = static_cast<const T*>(p.gamma);
  const T* dy = static_cast<const T*>(p.dy);
  float* dword = static_cast<float*>(p.dword);
  float* dpos = static_cast<float*>(p.dpos);
  float* dtt = static_cast<float*>(p.dtype_grad);
  const bool need_dx = dword || dpos || dtt || p.dx_ws;
  const bool drop = p.keep_threshold != 0;
  const float invH = 1.f / static_cast<float>(H);

  // dgamma/dbeta sums live in shared memory (registers hold x-hat, g and the token-type sums).
  float* wdg = smem + static_cast<int64_t>(warp) * 2 * H;
  float* wdb = wdg + H;
  for (int64_t j = lane; j < H; j += 32) wdg[j] = wdb[j] = 0.f;
  __syncwarp();  // the zeroing stride differs from the vector stride of the updates below
  float tacc[NV][VEC];
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) tacc[i][k] = 0.f;
  int64_t cur_t = -1;  // token-type row aggregated in tacc

  for (int64_t row = row_begin; row < row_end; ++row) {
    const RowIds r = row_ids(p, row);
    const float mean = p.mean[row], rstd = p.rstd[row];
    float xh[NV][VEC], gv[NV][VEC];
    float c1 = 0.f, c2 = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = (static_cast<int64_t>(i) * 32 + lane) * VEC;
      if (c < H) {
        float a[VEC], b[VEC], t[VEC], d[VEC], gm[VEC];
        load_vec<T, VEC>(word + r.w * H + c, a);
        load_vec<T, VEC>(pe + r.p * H + c, b);
        load_vec<T, VEC>(te + r.t * H + c, t);
        load_vec<T, VEC>(dy + row * H + c, d);
        load_vec<T, VEC>(gamma + c, gm);
        if (drop) {
          float keep[VEC];
          keep_vec<VEC>(p.seed, p.keep_threshold, row, c, keep);
#pragma unroll
          for (int k = 0; k < VEC; ++k) d[k] = keep[k] != 0.f ? d[k] * p.dropout_scale : 0.f;
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float xv = ((a[k] + b[k]) + t[k] - mean) * rstd;
          xh[i][k] = xv;
          gv[i][k] = d[k];
          wdg[c + k] += d[k] * xv;
          wdb[c + k] += d[k];
          const float dxh = d[k] * gm[k];
          c1 += dxh * xv;
          c2 += dxh;
        }
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) xh[i][k] = gv[i][k] = 0.f;
      }
    }
    if (!need_dx) continue;
    c1 = warp_sum(c1) * invH;
    c2 = warp_sum(c2) * invH;
    if (dtt && p.dx_ws == nullptr && r.t != cur_t) {  // flush the aggregated token-type gradient
      if (cur_t >= 0 && cur_t != p.type_padding_idx) {
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          const int64_t c = (static_cast<int64_t>(i) * 32 + lane) * VEC;
          if (c < H)
#pragma unroll
            for (int k = 0; k < VEC; ++k) atomicAdd(dtt + cur_t * H + c + k, tacc[i][k]);
        }
      }
#pragma unroll
      for (int i = 0; i < NV; ++i)
#pragma unroll
        for (int k = 0; k < VEC; ++k) tacc[i][k] = 0.f;
      cur_t = r.t;
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = (static_cast<int64_t>(i) * 32 + lane) * VEC;
      if (c < H) {
        float gm[VEC];
        load_vec<T, VEC>(gamma + c, gm);
        float dx[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) dx[k] = (gv[i][k] * gm[k] - xh[i][k] * c1 - c2) * rstd;
        if (p.dx_ws) {
          float* o = p.dx_ws + row * H + c;
#pragma unroll
          for (int k = 0; k < VEC; ++k) o[k] = dx[k];
        } else {
          if (dword && r.w != p.padding_idx)
#pragma unroll
            for (int k = 0; k < VEC; ++k) atomicAdd(dword + r.w * H + c + k, dx[k]);
          if (dpos && r.p != p.pos_padding_idx)
#pragma unroll
            for (int k = 0; k < VEC; ++k) atomicAdd(dpos + r.p * H + c + k, dx[k]);
          if (dtt)
#pragma unroll
            for (int k = 0; k < VEC; ++k) tacc[i][k] += dx[k];
        }
      }
    }
  }
  if (dtt && p.dx_ws == nullptr && cur_t >= 0 && cur_t != p.type_padding_idx) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = (static_cast<int64_t>(i) * 32 + lane) * VEC;
      if (c < H)
#pragma unroll
        for (int k = 0; k < VEC; ++k) atomicAdd(dtt + cur_t * H + c + k, tacc[i][k]);
    }
  }
  if (p.partials == nullptr) return;
  // Combine the warps' dgamma/dbeta in a fixed order (warp 0, 1, 2, 3), write the block's partial.
  __syncthreads();
  float* part = p.partials + static_cast<int64_t>(blockIdx.x) * 2 * H;
  for (int64_t j = threadIdx.x; j < 2 * H; j += blockDim.x) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += smem[static_cast<int64_t>(w) * 2 * H + j];
    part[j] = s;
  }
}

// Any H: one block per contiguous chunk of rows, two passes over each row.
template <typename T>
__global__ void __launch_bounds__(kGenericThreads) emb_ln_bwd_generic_kernel(const EmbBwdParams p,
                                                                              const int64_t rows_per_block) {
  __shared__ float red[32];
  const int64_t H = p.hidden;
  const T* word = static_cast<const T*>(p.word);
  const T* pe = static_cast<const T*>(p.posemb);
  const T* te = static_cast<const T*>(p.typeemb);
  const T* gamma = static_cast<const T*>(p.gamma);
  const T* dy = static_cast<const T*>(p.dy);
  float* dword = static_cast<float*>(p.dword);
  float* dpos = static_cast<float*>(p.dpos);
  float* dtt = static_cast<float*>(p.dtype_grad);
  const bool drop = p.keep_threshold != 0;
  const float invH = 1.f / static_cast<float>(H);
  float* part = p.partials ? p.partials + static_cast<int64_t>(blockIdx.x) * 2 * H : nullptr;
  // Zero part[j] and part[H + j] with the thread that updates both below (the loop over j < H):
  // a single loop over 2H would give part[H + j] to thread (H + j) % blockDim, another thread than
  // j's whenever H % blockDim != 0, and with no barrier in between that is a data race (the
  // workspace is torch.empty, so a lost zeroing reads garbage / a late one drops a row).
  if (part)
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) part[j] = part[H + j] = 0.f;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t row_end = min(p.rows, row_begin + rows_per_block);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const RowIds r = row_ids(p, row);
    const float mean = p.mean[row], rstd = p.rstd[row];
    const T* wr = word + r.w * H;
    const T* pr = pe + r.p * H;
    const T* tr = te + r.t * H;
    const T* dyr = dy + row * H;
    float c1 = 0.f, c2 = 0.f;
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      const float xv = ((to_f(wr[j]) + to_f(pr[j])) + to_f(tr[j]) - mean) * rstd;
      float g = to_f(dyr[j]);
      if (drop) g = dropout_keep(p.seed, p.keep_threshold, row, j) ? g * p.dropout_scale : 0.f;
      if (part) {
        part[j] += g * xv;
        part[H + j] += g;
      }
      const float dxh = g * to_f(gamma[j]);
      c1 += dxh * xv;
      c2 += dxh;
    }
    c1 = block_sum(c1, red) * invH;
    c2 = block_sum(c2, red) * invH;
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      const float xv = ((to_f(wr[j]) + to_f(pr[j])) + to_f(tr[j]) - mean) * rstd;
      float g = to_f(dyr[j]);
      if (drop) g = dropout_keep(p.seed, p.keep_threshold, row, j) ? g * p.dropout_scale : 0.f;
      const float dx = (g * to_f(gamma[j]) - xv * c1 - c2) * rstd;
      if (p.dx_ws) {
        p.dx_ws[row * H + j] = dx;
      } else {
        if (dword && r.w != p.padding_idx) atomicAdd(dword + r.w * H + j, dx);
        if (dpos && r.p != p.pos_padding_idx) atomicAdd(dpos + r.p * H + j, dx);
        if (dtt && r.t != p.type_padding_idx) atomicAdd(dtt + r.t * H + j, dx);
      }
    }
  }
}

// dgamma[j] = sum_b partials[b][0][j], dbeta[j] = sum_b partials[b][1][j], blocks in order.
__global__ void emb_partials_reduce_kernel(const float* __restrict__ partials, int64_t num_partials, int64_t H,
                                           float* __restrict__ dgamma, float* __restrict__ dbeta) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= H) return;
  float g = 0.f, b = 0.f;
  for (int64_t i = 0; i < num_partials; ++i) {
    g += partials[i * 2 * H + j];
    b += partials[i * 2 * H + H + j];
  }
  if (dgamma) dgamma[j] = g;
  if (dbeta) dbeta[j] = b;
}

// Deterministic table gradient: segment s owns table row seg_rows[s]; its tokens are
// perm[seg_offsets[s] .. seg_offsets[s+1]) (stable-sorted), summed in that order in fp32.
template <typename T>
__global__ void emb_segment_sum_kernel(const float* __restrict__ dx, const int64_t* __restrict__ perm,
                                       const int64_t* __restrict__ seg_offsets, const int64_t* __restrict__ seg_rows,
                                       int64_t H, int64_t skip_row, T* __restrict__ out) {
  const int64_t s = blockIdx.y;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= H) return;
  const int64_t row = seg_rows[s];
  if (row == skip_row) return;
  const int64_t lo = seg_offsets[s], hi = seg_offsets[s + 1];
  float acc = 0.f;
  int64_t i = lo;
  for (; i + 4 <= hi; i += 4) {  // four loads in flight, added in order
    const float v0 = dx[perm[i] * H + j], v1 = dx[perm[i + 1] * H + j];
    const float v2 = dx[perm[i + 2] * H + j], v3 = dx[perm[i + 3] * H + j];
    acc += v0;
    acc += v1;
    acc += v2;
    acc += v3;
  }
  for (; i < hi; ++i) acc += dx[perm[i] * H + j];
  out[row * H + j] = from_f<T>(acc);
}

__global__ void dropout_mask_kernel(uint8_t* out, int64_t rows, int64_t H, uint64_t seed, uint64_t thr) {
  const int64_t n = rows * H;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = e / H, j = e % H;
    out[e] = dropout_keep(seed, thr, row, j) ? 1 : 0;
  }
}

// ------------------------------------------------------------------------------ dispatch
bool aligned16(const void* ptr) { return ptr == nullptr || (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Forward: registers hold NV * VEC <= 64 fp32 values per lane; wider rows take the generic kernel.
template <typename T, int VEC>
void launch_fwd(const EmbFwdParams& p, cudaStream_t stream) {
  const int64_t nv = cdiv(cdiv(p.hidden, VEC), 32);
  const dim3 grid(static_cast<unsigned>(cdiv(p.rows, kWarps)));
#define BF_FWD(N)                                                                     \
  if constexpr (N * VEC <= 64) {                                                      \
    if (nv <= N) {                                                                    \
      emb_ln_fwd_kernel<T, VEC, N><<<grid, kThreads, 0, stream>>>(p);                 \
      return;                                                                         \
    }                                                                                 \
  }
  // 3 and 6 besides the powers of two: H = 768 (BERT-base) is 3 vectors per lane in 16-bit, 6 in
  // fp32, and the next power of two would size the kernel for H = 1024 (more registers, less
  // occupancy: 198 -> 158 registers in the bf16 backward, sm_90 ptxas).
  BF_FWD(1) BF_FWD(2) BF_FWD(3) BF_FWD(4) BF_FWD(6) BF_FWD(8) BF_FWD(16) BF_FWD(32)
#undef BF_FWD
  emb_ln_fwd_generic_kernel<T><<<static_cast<unsigned>(p.rows), kGenericThreads, 0, stream>>>(p);
}

template <typename T>
void fwd_typed(const EmbFwdParams& p, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const bool vec_ok = p.hidden % V == 0 && aligned16(p.word) && aligned16(p.posemb) && aligned16(p.typeemb) &&
                      aligned16(p.gamma) && aligned16(p.beta) && aligned16(p.out);
  if (vec_ok) {
    launch_fwd<T, V>(p, stream);
  } else {
    launch_fwd<T, 1>(p, stream);
  }
}

// Backward: NV * VEC <= 32 per lane (x-hat, g and the token-type sums live in registers).
template <typename T, int VEC>
void launch_bwd(const EmbBwdParams& p, cudaStream_t stream) {
  const int64_t nv = cdiv(cdiv(p.hidden, VEC), 32);
  const int64_t blocks = p.num_partials > 0 ? p.num_partials : cdiv(p.rows, kWarps);
  const size_t smem = static_cast<size_t>(kWarps * 2 * p.hidden) * sizeof(float);  // <= 32 KiB (H <= 1024)
  const int64_t rows_per_warp = cdiv(p.rows, blocks * kWarps);
#define BF_BWD(N)                                                                                    \
  if constexpr (N * VEC <= 32) {                                                                     \
    if (nv <= N) {                                                                                   \
      emb_ln_bwd_kernel<T, VEC, N><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p, rows_per_warp); \
      return;                                                                                        \
    }                                                                                                \
  }
  BF_BWD(1) BF_BWD(2) BF_BWD(3) BF_BWD(4) BF_BWD(6) BF_BWD(8) BF_BWD(16) BF_BWD(32)   // 3, 6: see launch_fwd
#undef BF_BWD
  const int64_t rows_per_block = cdiv(p.rows, blocks);
  emb_ln_bwd_generic_kernel<T><<<static_cast<unsigned>(blocks), kGenericThreads, 0, stream>>>(p, rows_per_block);
}

template <typename T>
void bwd_typed(const EmbBwdParams& p, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const bool vec_ok = p.hidden % V == 0 && aligned16(p.word) && aligned16(p.posemb) && aligned16(p.typeemb) &&
                      aligned16(p.gamma) && aligned16(p.dy);
  if (vec_ok) {
    launch_bwd<T, V>(p, stream);
  } else {
    launch_bwd<T, 1>(p, stream);
  }
}

}  // namespace

void embedding_fwd_cuda(const EmbFwdParams& p, uintptr_t stream_handle) {
  if (p.rows == 0) return;
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  cudaGetLastError();  // do not report someone else's earlier error as ours
  switch (p.dtype) {
    case kF32: fwd_typed<float>(p, stream); break;
    case kF16: fwd_typed<__half>(p, stream); break;
    case kBF16: fwd_typed<__nv_bfloat16>(p, stream); break;
    default: throw std::invalid_argument("embedding_fwd_cuda: unsupported dtype code");
  }
  check_launch("embedding forward");
}

void embedding_bwd_cuda(const EmbBwdParams& p, uintptr_t stream_handle) {
  if (p.rows == 0) return;
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  cudaGetLastError();
  switch (p.dtype) {
    case kF32: bwd_typed<float>(p, stream); break;
    case kF16: bwd_typed<__half>(p, stream); break;
    case kBF16: bwd_typed<__nv_bfloat16>(p, stream); break;
    default: throw std::invalid_argument("embedding_bwd_cuda: unsupported dtype code");
  }
  check_launch("embedding backward");
  if (p.partials && (p.dgamma || p.dbeta)) {
    const int threads = 256;
    emb_partials_reduce_kernel<<<static_cast<unsigned>(cdiv(p.hidden, threads)), threads, 0, stream>>>(
        p.partials, p.num_partials, p.hidden, static_cast<float*>(p.dgamma), static_cast<float*>(p.dbeta));
    check_launch("embedding backward (dgamma/dbeta reduction)");
  }
}

void embedding_segment_sum_cuda(const float* dx, const int64_t* perm, const int64_t* seg_offsets,
                                const int64_t* seg_rows, int64_t num_segments, int64_t hidden, int64_t skip_row,
                                void* out, int dtype, uintptr_t stream_handle) {
  if (num_segments <= 0) return;
  constexpr int64_t kMaxGridY = 65535;
  if (num_segments > kMaxGridY) {  // grid.y limit: split into launches of <= 65535 segments
    for (int64_t s0 = 0; s0 < num_segments; s0 += kMaxGridY) {
      const int64_t n = num_segments - s0 < kMaxGridY ? num_segments - s0 : kMaxGridY;
      embedding_segment_sum_cuda(dx, perm, seg_offsets + s0, seg_rows + s0, n, hidden, skip_row, out, dtype,
                                 stream_handle);
    }
    return;
  }
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  cudaGetLastError();
  const int threads = 128;
  const dim3 grid(static_cast<unsigned>(cdiv(hidden, threads)), static_cast<unsigned>(num_segments));
  switch (dtype) {
    case kF32:
      emb_segment_sum_kernel<float><<<grid, threads, 0, stream>>>(dx, perm, seg_offsets, seg_rows, hidden, skip_row,
                                                                  static_cast<float*>(out));
      break;
    case kF16:
      emb_segment_sum_kernel<__half><<<grid, threads, 0, stream>>>(dx, perm, seg_offsets, seg_rows, hidden, skip_row,
                                                                   static_cast<__half*>(out));
      break;
    case kBF16:
      emb_segment_sum_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(dx, perm, seg_offsets, seg_rows, hidden,
                                                                          skip_row, static_cast<__nv_bfloat16*>(out));
      break;
    default: throw std::invalid_argument("embedding_segment_sum_cuda: unsupported dtype code");
  }
  check_launch("embedding backward (segment sum)");
}

void dropout_mask_cuda(uint8_t* out, int64_t rows, int64_t hidden, uint64_t seed, uint64_t threshold,
                       uintptr_t stream_handle) {
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  cudaGetLastError();
  const int64_t n = rows * hidden;
  const int64_t blocks = cdiv(n, 256) < 65535 ? cdiv(n, 256) : 65535;
  dropout_mask_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(out, rows, hidden, seed, threshold);
  check_launch("dropout mask");
}

}  // namespace bert_fast
