// A byte space that arrives as all-gather pieces instead of one buffer (docs/distributed.md, step 7):
// the columnwise transposes read the group's param-byte space (NVFP4) or flat buffer (FP8) straight
// from the pieces, so nothing assembles the space first (a copy of every gathered byte).
//
// Shard r holds space bytes [lo[r], lo[r + 1]) (the last shard's part ends at `size`) from offset 0
// of its `chunk`-byte chunk. Gather piece j holds chunk offsets [j step, j step + len_j) of every
// shard, shard r's at r len_j, with len_j = min(step, chunk - j step). One shard and one piece with
// step = chunk = size is the plain buffer. Python describes it as group_table.GatheredSpace.
#pragma once

#include <cstdint>

#include "jaxquant/group_table.h"

namespace jaxquant {

constexpr int kMaxGatherPieces = 16;
constexpr int kMaxGatherShards = 128;
// The FFI attribute "space": {size, chunk, step, lo[0], ..., lo[S - 1]} (int64).
constexpr int kSpaceHeader = 3;

struct GatheredSpace {
  const uint8_t* piece[kMaxGatherPieces];
  int64_t lo[kMaxGatherShards];
  int64_t size, chunk, step;
  int32_t num_shards, num_pieces;

  // Where space byte pos (0 <= pos < size) lies, and how many bytes from it are contiguous there
  // (to the end of its shard's part or of its piece, whichever comes first).
  JQ_HD const uint8_t* locate(int64_t pos, int64_t* run) const {
    int a = 0, b = num_shards;  // the last shard r with lo[r] <= pos: shards owning nothing are skipped
    while (a < b) {
      const int mid = (a + b) / 2;
      if (lo[mid] <= pos) a = mid + 1; else b = mid;
    }
    const int r = a - 1;
    const int64_t o = pos - lo[r], j = div_nonneg(o, step), within = o - j * step;
    const int64_t len = chunk - j * step < step ? chunk - j * step : step;
    const int64_t end = r + 1 < num_shards ? lo[r + 1] : size;
    *run = len - within < end - pos ? len - within : end - pos;
    return piece[j] + r * len + within;
  }

  JQ_HD uint8_t byte_at(int64_t pos) const {
    int64_t run;
    return *locate(pos, &run);
  }
};

}  // namespace jaxquant
