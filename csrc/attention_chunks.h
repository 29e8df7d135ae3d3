// What the CPU attention kernels (attention_cpu.cpp: bf16, attention_f32_cpu.cpp: fp32) share around
// their arithmetic: how a call's sequences are cut into chunks whose packed K and V stay L2-sized, the
// work items of a chunk, and how many threads a call is worth.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace bert_fast {
namespace attention_chunks {

constexpr int kBlockRows = 8;              // query rows per work item (every head)
// tokens packed per work item: K's transposed rows are then written a cache line (16 fp32 / 16 bf16
// pairs) at a time; one token at a time wrote 4 bytes into each of d lines per head
constexpr int kPackTile = 16;  // divides every padded length (round16), so no tile spans two sequences
constexpr int64_t kChunkBytes = 2 << 20;   // a chunk's packs: L2-sized (each is read by every query block)
constexpr double kMinMacsPerThread = 4e6;  // below this per extra thread, one thread does it all

inline int64_t round16(int64_t x) { return (x + 15) / 16 * 16; }

// One chunk of sequences [s0, s1): where each sequence's packs start (in padded token rows), the
// tiles of kPackTile tokens to pack (every padded position) and the query blocks to attend.
struct Plan {
  std::vector<int64_t> lp_off;                      // per sequence of the chunk
  std::vector<std::pair<int64_t, int64_t>> tiles;   // (sequence, first token) to pack
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (sequence, first query row) to attend
  int64_t rows = 0;                                 // padded token rows of the chunk
};

// Plans the chunk that starts at sequence s0: sequences while their packs (row_bytes per padded token
// row, every head) stay under kChunkBytes, at least one. Returns s1.
inline int64_t plan(const int64_t* starts, int64_t nseq, int64_t s0, int64_t row_bytes, Plan& p) {
  p.lp_off.clear();
  p.tiles.clear();
  p.blocks.clear();
  p.rows = 0;
  int64_t s1 = s0;
  while (s1 < nseq) {
    const int64_t lp = round16(starts[s1 + 1] - starts[s1]);
    if (s1 > s0 && (p.rows + lp) * row_bytes > kChunkBytes) break;
    p.lp_off.push_back(p.rows);
    p.rows += lp;
    ++s1;
  }
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t len = starts[s + 1] - starts[s];
    for (int64_t j = 0; j < round16(len); j += kPackTile) p.tiles.emplace_back(s, j);
    for (int64_t r = 0; r < len; r += kBlockRows) p.blocks.emplace_back(s, r);
  }
  return s1;
}

// Threads for a call: at most ``threads``, and no more than its multiply-adds keep busy.
inline int threads_for(const int64_t* starts, int64_t nseq, int d, int heads, int threads) {
  double macs = 0.0;
  for (int64_t s = 0; s < nseq; ++s) {
    const double len = static_cast<double>(starts[s + 1] - starts[s]);
    macs += 2.0 * len * len * d * heads;
  }
  const int64_t by_size = static_cast<int64_t>(macs / kMinMacsPerThread);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, by_size)));
}

}  // namespace attention_chunks
}  // namespace bert_fast
