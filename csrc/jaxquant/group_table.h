// The static parameter table of a ZeRO group: one int64 row per parameter, its fields defined
// once here. Python builds the table (jaxquant.ops.group_table) and reads field positions by name
// from GROUP_TABLE_FIELDS, which tests check against group_table_fields() of the compiled module.
#pragma once

#include <climits>
#include <cstdint>

#include "jaxquant/elementwise.h"
#include "jaxquant/numerics.h"

// X(enumerator, python name): the fields, in column order.
//   offset        first element of the parameter in the (TP-local) flat buffer
//   numel         its element count
//   rows, cols    its 2-D shape (rank-1 and scalar FP8 parameters: numel x 1)
//   tile_base     NVFP4: first of its tiles in the group's packed tile vector
//   byte_base     NVFP4: first of its packed bytes in the group's param-byte space (numel/2 each)
//   scale_base    NVFP4: first byte of its padded rowwise scale_inv in the group's packed scales
//   scale_t_base  NVFP4: first byte of its padded columnwise scale_inv_t in the packed scales_t
//   block_base    first of its 64x64-element blocks in the grid of the grouped transposes
#define JQ_GROUP_TABLE_FIELDS(X) \
  X(kOffset, "offset")           \
  X(kNumel, "numel")             \
  X(kRows, "rows")               \
  X(kCols, "cols")               \
  X(kTileBase, "tile_base")      \
  X(kByteBase, "byte_base")      \
  X(kScaleBase, "scale_base")    \
  X(kScaleTBase, "scale_t_base") \
  X(kBlockBase, "block_base")

namespace jaxquant {

// a / b for a >= 0, b > 0: a 32-bit division when both fit (every tensor of a real model), which on
// the GPU costs a fraction of the 64-bit one (a called routine of ~70 instructions).
JQ_HD int64_t div_nonneg(int64_t a, int64_t b) {
  return ((static_cast<uint64_t>(a) | static_cast<uint64_t>(b)) >> 32) == 0
             ? static_cast<int64_t>(static_cast<uint32_t>(a) / static_cast<uint32_t>(b))
             : a / b;
}

struct GroupTable {
#define JQ_FIELD_ENUM(e, name) e,
  enum Field { JQ_GROUP_TABLE_FIELDS(JQ_FIELD_ENUM) kFields };
#undef JQ_FIELD_ENUM
  const int64_t* t;  // [P, kFields]
  int64_t num_params;

  JQ_HD int64_t at(int64_t p, int f) const { return t[p * kFields + f]; }

  // The last parameter p with at(p, f) <= pos (f: an ascending field: offset, byte/scale bases), or -1.
  JQ_HD int64_t find(int64_t pos, int f) const {
    return last_at_or_below(num_params, pos, [&](int64_t p) { return at(p, f); });
  }

  // The same search over any ascending key(p), p in [0, n): e.g. a copy of one column in shared memory.
  template <typename Key>
  JQ_HD static int64_t last_at_or_below(int64_t n, int64_t pos, Key key) {
    int64_t lo = 0, hi = n;  // answer in [lo - 1, hi - 1]
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (key(mid) <= pos) lo = mid + 1; else hi = mid;
    }
    return lo - 1;
  }

  // Packed tile index of element e of parameter p.
  JQ_HD int64_t tile_of(int64_t p, int64_t e) const { return tile_in(at(p, kTileBase), at(p, kCols), e); }

  // The same from the parameter's tile_base and cols (kernels that keep them in registers).
  JQ_HD static int64_t tile_in(int64_t tile_base, int64_t cols, int64_t e) {
    const int64_t row = div_nonneg(e, cols), col = e - row * cols;
    return tile_base + (row / kTile) * (cols / kTile) + col / kTile;
  }
};

// Walks a non-decreasing sequence of flat positions through the parameters of a group, keeping
// the current parameter's bounds in registers (one table lookup per parameter change).
struct ParamCursor {
  GroupTable table;
  int64_t p = -1, begin = 0, end = 0, next = 0;  // p owns [begin, end); the next one starts at next

  JQ_HD void seek(int64_t g) { start_at(table.find(g, GroupTable::kOffset)); }
  // The same when the caller found g's parameter (table.find(g, kOffset)) another way.
  JQ_HD void start_at(int64_t param) {
    p = param;
    load();
  }
  JQ_HD void load() {
    begin = p >= 0 ? table.at(p, GroupTable::kOffset) : 0;
    end = p >= 0 ? begin + table.at(p, GroupTable::kNumel) : 0;
    next = p + 1 < table.num_params ? table.at(p + 1, GroupTable::kOffset) : INT64_MAX;
  }
  // Moves to the parameter holding or preceding g; true when g is one of its elements.
  JQ_HD bool inside(int64_t g) {
    while (g >= next) {
      ++p;
      load();
    }
    return p >= 0 && g < end;
  }
};

// Shard elements are read with load_compute (elementwise.h): compute_dtype rounding fused into the load.

// ---- per-output-unit pieces of the grouped ops, shared by the CPU loops and the CUDA kernels ----

// Strip u of the group's packed rowwise scales: the 16 scale rows of one tile row (ti) in one scale
// column (j) of parameter p (p's strips are numbered from kScaleBase / 16, row-major over
// [nvfp4_scale_rows(rows) / 16, nvfp4_scale_cols(cols)]; every scale base is a multiple of 128 rows).
// All 16 bytes store tile (ti, j)'s E4M3 scale (docs/numerics.md §2.4), computed once; rows and
// columns past the weight hold 0 (§2.7). The strip also writes that tile's encode multiplier
// (§2.5) to enc. Every tile of the group lies in exactly one strip.
JQ_HD void group_scale_strip(const GroupTable& table, const float* tiles, int64_t num_tiles, const float* amax,
                             int64_t u, uint8_t* scale_inv, int64_t scale_bytes, float* enc) {
  const int64_t p = table.find(u * kTile, GroupTable::kScaleBase);
  if (p < 0) return;
  const int64_t rows = table.at(p, GroupTable::kRows), cols = table.at(p, GroupTable::kCols);
  const int64_t pc = nvfp4_scale_cols(cols), base = table.at(p, GroupTable::kScaleBase);
  const int64_t w = u - base / kTile, ti = w / pc, j = w - ti * pc;
  uint8_t byte = 0;
  if (ti * kTile < rows && j < cols / kTile) {
    const int64_t t = table.at(p, GroupTable::kTileBase) + ti * (cols / kTile) + j;
    if (t < num_tiles) {
      const float s_enc = nvfp4_global_encode_scale(amax[p]);
      byte = nvfp4_tile_scale_bits(tiles[t], s_enc);
      enc[t] = nvfp4_tile_encode(byte, 1.0f / s_enc);
    }
  }
  for (int r = 0; r < kTile; ++r) {
    const int64_t y = base + (ti * kTile + r) * pc + j;
    if (y < scale_bytes) scale_inv[y] = ti * kTile + r < rows ? byte : 0;
  }
}

// Strips of a group whose packed rowwise (or columnwise) scales are scale_bytes long.
JQ_HD int64_t group_scale_strips(int64_t scale_bytes) { return (scale_bytes + kTile - 1) / kTile; }

// Strip u of the group's packed columnwise scales (scale_inv_t, §2.7): the 16 rows k = 16 kt.. of one
// column i of parameter p's [ru(cols,128), ru(rows/16,4)] block, numbered from kScaleTBase / 16
// row-major over [ru(cols,128) / 16, ru(rows/16,4)]. All 16 hold s8[i, kt], read once from the
// rowwise scale_inv (its row 16 i, column kt); rows and columns past the weight hold 0. Written to
// out_of(p), parameter p's own scale_inv_t; u < group_scale_strips(the table's scale_t bytes).
template <typename OutOf>
JQ_HD void group_scale_t_strip(const GroupTable& table, const uint8_t* scale_inv, int64_t u, OutOf out_of) {
  const int64_t p = table.find(u * kTile, GroupTable::kScaleTBase);
  if (p < 0) return;
  const int64_t rows = table.at(p, GroupTable::kRows), cols = table.at(p, GroupTable::kCols);
  const int64_t pct = nvfp4_scale_cols(rows), base = table.at(p, GroupTable::kScaleTBase);
  const int64_t w = u - base / kTile, kt = w / pct, i = w - kt * pct;
  const uint8_t byte = kt * kTile < cols && i < rows / kTile
                           ? scale_inv[table.at(p, GroupTable::kScaleBase) + (i * kTile) * nvfp4_scale_cols(cols) + kt]
                           : 0;
  uint8_t* out = out_of(p);
  for (int r = 0; r < kTile; ++r) out[(kt * kTile + r) * pct + i] = kt * kTile + r < cols ? byte : 0;
}

}  // namespace jaxquant
