// What the CPU GEMMs on packed weights share (int8_gemm_vnni.cpp, cpu_linear.cpp): their threads
// (torch's OpenMP pool: this module's libgomp.so.1 resolves to the copy torch loaded) and scratch.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace bert_fast {
namespace gemm {

inline void barrier() {
#ifdef _OPENMP
#pragma omp barrier
#endif
}

// Run f(t, nt) on nt threads of torch's OpenMP pool (one, without OpenMP).
template <class F>
void on_threads(int nt, F f) {
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
  f(omp_get_thread_num(), omp_get_num_threads());
#else
  (void)nt;
  f(0, 1);
#endif
}

// Threads for a rows x k x n GEMM split by groups of `group` 16-column panels: below ~1 M
// multiply-adds per extra thread one thread does it (as int8_gemm_avx2.cpp).
inline int threads_for(int64_t rows, int64_t k, int64_t n, int group, int threads) {
  const int64_t groups = ((n + 15) / 16 + group - 1) / group;
  const int64_t by_size = std::max<int64_t>(1, rows * n * k / (1 << 20));
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({static_cast<int64_t>(threads), by_size, groups})));
}

constexpr size_t kKeepBytes = size_t(4) << 20;

// n elements of scratch: from `keep` (a thread_local of the caller, grown up to kKeepBytes: batch 1
// to ~8 x 128 reuse it, no allocation per call) or else from `call` (a large batch does not pin its
// buffers for good).
template <class T>
T* scratch(std::vector<T>& keep, std::vector<T>& call, int64_t n) {
  const size_t count = static_cast<size_t>(n);
  std::vector<T>& v = count * sizeof(T) <= kKeepBytes ? keep : call;
  if (v.size() < count) v.resize(count);
  return v.data();
}

}  // namespace gemm
}  // namespace bert_fast
