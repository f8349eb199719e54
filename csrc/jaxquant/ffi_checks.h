// Argument checks shared by the CPU and CUDA FFI handlers. Handlers return ffi::Error and never
// throw: Python validates first, these checks guard against direct calls with bad buffers so that
// no kernel reads or writes out of bounds.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "jaxquant/gathered_space.h"
#include "jaxquant/group_table.h"
#include "jaxquant/numerics.h"
#include "xla/ffi/api/ffi.h"

namespace jaxquant {
namespace ffi = ::xla::ffi;

inline ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxquant: " + msg);
}

inline bool is_input_type(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

inline ffi::Error check_input(const ffi::AnyBuffer& x, const char* name) {
  if (!is_input_type(x.element_type())) return invalid(std::string(name) + ": dtype must be F32 or BF16");
  return ffi::Error::Success();
}

template <typename Buf>
int64_t dim_or(const Buf& b, size_t i) {
  auto d = b.dimensions();
  return i < d.size() ? d[i] : -1;
}

template <typename Buf>
ffi::Error check_2d(const Buf& b, int64_t rows, int64_t cols, const char* name) {
  auto d = b.dimensions();
  if (d.size() != 2 || d[0] != rows || d[1] != cols)
    return invalid(std::string(name) + ": expected shape [" + std::to_string(rows) + ", " +
                   std::to_string(cols) + "]");
  return ffi::Error::Success();
}

template <typename Buf>
ffi::Error check_count(const Buf& b, int64_t n, const char* name) {
  if (static_cast<int64_t>(b.element_count()) != n)
    return invalid(std::string(name) + ": expected " + std::to_string(n) + " elements, got " +
                   std::to_string(b.element_count()));
  return ffi::Error::Success();
}

inline ffi::Error check_grid(int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0 || rows % kTile || cols % kTile)
    return invalid("rows/cols: NVFP4 needs positive multiples of 16, got " + std::to_string(rows) + "x" +
                   std::to_string(cols));
  return ffi::Error::Success();
}

inline ffi::Error check_range(int64_t start, int64_t len, int64_t rows, int64_t cols) {
  if (start < 0 || len < 0 || start + len > rows * cols)
    return invalid("start: shard range [" + std::to_string(start) + ", " + std::to_string(start + len) +
                   ") lies outside the tensor of " + std::to_string(rows * cols) + " elements");
  return ffi::Error::Success();
}

// Shape of a partial cast: byte range of the shard and the scale array.
inline ffi::Error check_partial_cast(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::U8>& bytes,
                                     const ffi::Buffer<ffi::U8>& scale_inv, const ffi::Buffer<ffi::F32>& amax,
                                     const ffi::Buffer<ffi::U8>& out, int64_t rows, int64_t cols,
                                     int64_t start) {
  if (auto e = check_input(x, "shard"); e.failure()) return e;
  if (auto e = check_grid(rows, cols); e.failure()) return e;
  const int64_t len = static_cast<int64_t>(x.element_count());
  if (auto e = check_range(start, len, rows, cols); e.failure()) return e;
  const int64_t nbytes = (start + len + 1) / 2 - start / 2;
  if (auto e = check_count(bytes, nbytes, "data_bytes"); e.failure()) return e;
  if (auto e = check_count(out, nbytes, "result"); e.failure()) return e;
  if (auto e = check_2d(scale_inv, nvfp4_scale_rows(rows), nvfp4_scale_cols(cols), "scale_inv"); e.failure())
    return e;
  return check_count(amax, 1, "amax");
}

inline ffi::Error check_fp8_cast(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& amax,
                                 const ffi::AnyBuffer& data, const ffi::AnyBuffer* data_t,
                                 bool* e5m2) {
  if (auto e = check_input(x, "x"); e.failure()) return e;
  if (auto e = check_count(amax, 1, "amax"); e.failure()) return e;
  const ffi::DataType t = data.element_type();
  if (t != ffi::DataType::F8E4M3FN && t != ffi::DataType::F8E5M2)
    return invalid("data: result dtype must be F8E4M3FN or F8E5M2");
  *e5m2 = t == ffi::DataType::F8E5M2;
  if (data.element_count() != x.element_count()) return invalid("data: must have as many elements as x");
  if (data_t != nullptr) {
    auto d = x.dimensions();
    if (d.size() != 2) return invalid("x: columnwise cast needs rank 2");
    if (data_t->element_type() != t) return invalid("data_t: dtype must equal data's");
    if (auto e = check_2d(*data_t, d[1], d[0], "data_t"); e.failure()) return e;
  }
  return ffi::Error::Success();
}

inline ffi::Error check_tile_amax(const ffi::AnyBuffer& x, int64_t rows, int64_t cols, int64_t start,
                                  const ffi::Buffer<ffi::F32>& tile_amax) {
  if (auto e = check_input(x, "shard"); e.failure()) return e;
  if (auto e = check_grid(rows, cols); e.failure()) return e;
  if (auto e = check_range(start, static_cast<int64_t>(x.element_count()), rows, cols); e.failure()) return e;
  return check_2d(tile_amax, rows / kTile, cols / kTile, "tile_amax");
}

inline ffi::Error check_scale(const ffi::Buffer<ffi::F32>& tile_amax, const ffi::Buffer<ffi::F32>& amax,
                              const ffi::Buffer<ffi::U8>& scale_inv, int64_t* rows, int64_t* cols) {
  auto d = tile_amax.dimensions();
  if (d.size() != 2 || d[0] <= 0 || d[1] <= 0) return invalid("tile_amax: must be a non-empty rank-2 array");
  *rows = d[0] * kTile;
  *cols = d[1] * kTile;
  if (auto e = check_count(amax, 1, "amax"); e.failure()) return e;
  return check_2d(scale_inv, nvfp4_scale_rows(*rows), nvfp4_scale_cols(*cols), "scale_inv");
}

inline ffi::Error check_transpose(const ffi::Buffer<ffi::U8>& data, const ffi::Buffer<ffi::U8>& data_t,
                                  int64_t* rows, int64_t* cols) {
  auto d = data.dimensions();
  if (d.size() != 2) return invalid("data: must be rank 2 [M, K/2]");
  *rows = d[0];
  *cols = d[1] * 2;
  if (auto e = check_grid(*rows, *cols); e.failure()) return e;
  return check_2d(data_t, *cols, *rows / 2, "data_t");
}

inline ffi::Error check_scale_transpose(const ffi::Buffer<ffi::U8>& scale_inv, int64_t rows, int64_t cols,
                                        const ffi::Buffer<ffi::U8>& scale_inv_t) {
  if (auto e = check_grid(rows, cols); e.failure()) return e;
  if (auto e = check_2d(scale_inv, nvfp4_scale_rows(rows), nvfp4_scale_cols(cols), "scale_inv"); e.failure())
    return e;
  return check_2d(scale_inv_t, nvfp4_scale_rows(cols), nvfp4_scale_cols(rows), "scale_inv_t");
}

// Single-tensor NVFP4 stages: x is [M, K] on the 16-grid (sets rows, cols).
inline ffi::Error check_nvfp4_x(const ffi::AnyBuffer& x, int64_t* rows, int64_t* cols) {
  if (auto e = check_input(x, "x"); e.failure()) return e;
  if (x.dimensions().size() != 2) return invalid("x: must be rank 2 [M, K]");
  *rows = x.dimensions()[0];
  *cols = x.dimensions()[1];
  return check_grid(*rows, *cols);
}

inline ffi::Error check_nvfp4_stats(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& tile_amax,
                                    const ffi::Buffer<ffi::F32>& amax, const ffi::Buffer<ffi::S32>& count,
                                    int64_t* rows, int64_t* cols) {
  if (auto e = check_nvfp4_x(x, rows, cols); e.failure()) return e;
  if (auto e = check_2d(tile_amax, *rows / kTile, *cols / kTile, "tile_amax"); e.failure()) return e;
  if (auto e = check_count(amax, 1, "amax"); e.failure()) return e;
  return check_count(count, 1, "count");
}

// data_t / scale_inv_t are null for the rowwise-only stage.
inline ffi::Error check_nvfp4_quantize(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& tile_amax,
                                       const ffi::Buffer<ffi::F32>& amax, const ffi::Buffer<ffi::U8>& data,
                                       const ffi::Buffer<ffi::U8>& scale_inv, const ffi::Buffer<ffi::U8>* data_t,
                                       const ffi::Buffer<ffi::U8>* scale_inv_t, int64_t* rows, int64_t* cols) {
  if (auto e = check_nvfp4_x(x, rows, cols); e.failure()) return e;
  if (auto e = check_2d(tile_amax, *rows / kTile, *cols / kTile, "tile_amax"); e.failure()) return e;
  if (auto e = check_count(amax, 1, "amax"); e.failure()) return e;
  if (auto e = check_2d(data, *rows, *cols / 2, "data"); e.failure()) return e;
  if (auto e = check_2d(scale_inv, nvfp4_scale_rows(*rows), nvfp4_scale_cols(*cols), "scale_inv"); e.failure())
    return e;
  if (data_t != nullptr) {
    if (auto e = check_2d(*data_t, *cols, *rows / 2, "data_t"); e.failure()) return e;
    if (auto e = check_2d(*scale_inv_t, nvfp4_scale_rows(*cols), nvfp4_scale_cols(*rows), "scale_inv_t");
        e.failure())
      return e;
  }
  return ffi::Error::Success();
}

inline ffi::Error check_nvfp4_bf16_operand(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& amax,
                                           const ffi::Buffer<ffi::BF16>& out, int64_t* rows, int64_t* cols) {
  if (auto e = check_nvfp4_x(x, rows, cols); e.failure()) return e;
  if (auto e = check_count(amax, 1, "amax"); e.failure()) return e;
  return check_2d(out, *rows, *cols, "out");
}

// int64 operands (the group table, chunk_lo) travel as uint32 word pairs; their values as int64.
inline const int64_t* as_i64(const ffi::Buffer<ffi::U32>& words) {
  return reinterpret_cast<const int64_t*>(words.typed_data());
}

// Shapes of the grouped ops' operands; the table contents are checked where the host can read
// them (CPU: check_group_table_contents), the GPU kernels bound every index they derive from it.
inline ffi::Error check_group(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& index,
                              const ffi::Buffer<ffi::U32>& table, int64_t* num_params) {
  if (auto e = check_input(x, "shard"); e.failure()) return e;
  if (x.dimensions().size() != 1) return invalid("shard: must be rank 1");
  if (auto e = check_count(index, 1, "shard_index"); e.failure()) return e;
  constexpr size_t kWords = 2 * GroupTable::kFields;
  if (table.element_count() % kWords != 0)
    return invalid("table: must be the int64 [P, " + std::to_string(GroupTable::kFields) +
                   "] group table (ops.group_table) as uint32 words");
  *num_params = static_cast<int64_t>(table.element_count() / kWords);
  return ffi::Error::Success();
}

// data holds shard elements [first, first + data.element_count()).
inline ffi::Error check_fp8_group_cast(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& index,
                                       const ffi::Buffer<ffi::U32>& table, const ffi::Buffer<ffi::F32>& scale,
                                       int64_t first, const ffi::AnyBuffer& data, int64_t* num_params, bool* e5m2) {
  if (auto e = check_group(x, index, table, num_params); e.failure()) return e;
  if (auto e = check_count(scale, *num_params, "scale"); e.failure()) return e;
  const ffi::DataType t = data.element_type();
  if (t != ffi::DataType::F8E4M3FN && t != ffi::DataType::F8E5M2) return invalid("data: dtype must be F8E4M3FN or F8E5M2");
  if (first < 0 || first + static_cast<int64_t>(data.element_count()) > static_cast<int64_t>(x.element_count()))
    return invalid("first: data must hold shard elements [first, first + len(data)) inside the shard");
  *e5m2 = t == ffi::DataType::F8E5M2;
  return ffi::Error::Success();
}

// Grouped scale op: tiles [T] and amax [P] f32, scale_inv [sum of padded scales] u8, enc [T] f32.
inline ffi::Error check_group_scale(const ffi::Buffer<ffi::F32>& tiles, const ffi::Buffer<ffi::F32>& amax,
                                    const ffi::Buffer<ffi::U32>& table, const ffi::Buffer<ffi::U8>& scale_inv,
                                    const ffi::Buffer<ffi::F32>& enc, int64_t* num_params, int64_t* num_tiles,
                                    int64_t* scale_bytes) {
  constexpr size_t kWords = 2 * GroupTable::kFields;
  if (table.element_count() % kWords != 0) return invalid("table: must be the int64 group table as uint32 words");
  *num_params = static_cast<int64_t>(table.element_count() / kWords);
  if (auto e = check_count(amax, *num_params, "amax"); e.failure()) return e;
  *num_tiles = static_cast<int64_t>(tiles.element_count());
  if (enc.element_count() != tiles.element_count()) return invalid("enc: must have one entry per tile");
  *scale_bytes = static_cast<int64_t>(scale_inv.element_count());
  return ffi::Error::Success();
}

// The gathered pieces (every argument of `pieces`) and the "space" attribute {size, chunk, step,
// lo[0..S-1]} as a GatheredSpace, after checking that every piece has the bytes the map reads.
inline ffi::Error read_gathered_space(const ffi::RemainingArgs& pieces, ffi::Span<const int64_t> space,
                                      GatheredSpace* out) {
  const int64_t num_shards = static_cast<int64_t>(space.size()) - kSpaceHeader;
  if (num_shards < 1 || num_shards > kMaxGatherShards)
    return invalid("space: must be {size, chunk, step, lo[0], ..., lo[S-1]} with 1 <= S <= " +
                   std::to_string(kMaxGatherShards) + " shards");
  const int64_t size = space[0], chunk = space[1], step = space[2];
  if (size < 0 || chunk < 0 || step <= 0) return invalid("space: size and chunk must be >= 0 and step > 0");
  const int64_t num_pieces = chunk == 0 ? 1 : (chunk + step - 1) / step;
  if (num_pieces > kMaxGatherPieces)
    return invalid("space: a chunk in at most " + std::to_string(kMaxGatherPieces) + " gather pieces, got " +
                   std::to_string(num_pieces));
  if (static_cast<int64_t>(pieces.size()) != num_pieces)
    return invalid("pieces: the space's chunk of " + std::to_string(chunk) + " bytes in steps of " +
                   std::to_string(step) + " needs " + std::to_string(num_pieces) + " gather pieces, got " +
                   std::to_string(pieces.size()));
  *out = GatheredSpace{};
  for (int64_t j = 0; j < num_pieces; ++j) {
    auto piece = pieces.get<ffi::AnyBuffer>(j);
    if (!piece.has_value()) return piece.error();
    const int64_t len = std::min(step, chunk - j * step);
    if (piece->element_type() != ffi::DataType::U8 || static_cast<int64_t>(piece->element_count()) != num_shards * len)
      return invalid("pieces[" + std::to_string(j) + "]: must be uint8 [" + std::to_string(num_shards * len) +
                     "] (shards x its chunk bytes)");
    out->piece[j] = static_cast<const uint8_t*>(piece->untyped_data());
  }
  for (int64_t r = 0; r < num_shards; ++r) {
    const int64_t lo = space[kSpaceHeader + r], end = r + 1 < num_shards ? space[kSpaceHeader + r + 1] : size;
    if ((r == 0 && lo != 0) || end < lo || end - lo > chunk)
      return invalid("space: shard " + std::to_string(r) + "'s part must start where the previous one ends (0 for "
                     "shard 0) and fit its chunk");
    out->lo[r] = lo;
  }
  out->size = size;
  out->chunk = chunk;
  out->step = step;
  out->num_shards = static_cast<int32_t>(num_shards);
  out->num_pieces = static_cast<int32_t>(num_pieces);
  return ffi::Error::Success();
}

// Grouped transposes: the gathered pieces and "space" (read_gathered_space), the table, and their
// results, one 1-byte buffer per parameter (NVFP4: every parameter's data_t, then every parameter's
// scale_inv_t; *data_t_bytes: the data_t results' bytes together). "ranges" holds, for each parameter and then for the end, its first 64x64 block and
// (NVFP4) first columnwise scale strip: the launches take the parameters in batches and need those
// bounds on the host.
inline ffi::Error check_group_transpose(const ffi::RemainingArgs& pieces, ffi::Span<const int64_t> space_attr,
                                        const ffi::Buffer<ffi::U32>& table, const ffi::RemainingRets& rets,
                                        ffi::Span<const int64_t> ranges, bool nvfp4, GatheredSpace* space,
                                        int64_t* num_params, int64_t* data_t_bytes) {
  if (auto e = read_gathered_space(pieces, space_attr, space); e.failure()) return e;
  constexpr size_t kWords = 2 * GroupTable::kFields;
  if (table.element_count() % kWords != 0) return invalid("table: must be the int64 group table as uint32 words");
  *num_params = static_cast<int64_t>(table.element_count() / kWords);
  if (static_cast<int64_t>(rets.size()) != (nvfp4 ? 2 : 1) * *num_params)
    return invalid(std::string("results: one ") + (nvfp4 ? "data_t and one scale_inv_t" : "data_t") +
                   " per parameter of the table (" + std::to_string(*num_params) + "), got " +
                   std::to_string(rets.size()));
  if (static_cast<int64_t>(ranges.size()) != 2 * (*num_params + 1))
    return invalid("ranges: must hold (first block, first scale strip) of each parameter and of the end");
  for (int64_t p = 0; p < 2 * *num_params; ++p)
    if (ranges[p] < 0 || ranges[p + 2] < ranges[p]) return invalid("ranges: must be non-negative and non-decreasing");
  if (ranges[2 * *num_params] > INT32_MAX / 2 || ranges[2 * *num_params + 1] > INT32_MAX / 2)
    return invalid("ranges: more blocks or scale strips than a grid holds");
  *data_t_bytes = 0;
  for (int64_t r = 0; r < static_cast<int64_t>(rets.size()); ++r) {
    auto ret = rets.get<ffi::AnyBuffer>(r);
    if (!ret.has_value()) return ret.error();
    if ((*ret.value()).size_bytes() != (*ret.value()).element_count())
      return invalid("results: must have 1-byte elements (uint8, fp8)");
    if (r < *num_params) *data_t_bytes += static_cast<int64_t>((*ret.value()).size_bytes());
  }
  return ffi::Error::Success();
}

// Host-readable table (CPU): the group's packed bytes and scales fit in data and scale_inv.
inline ffi::Error check_group_columnwise_bounds(const int64_t* table, int64_t num_params, int64_t data_bytes,
                                                const ffi::Buffer<ffi::U8>& scale_inv) {
  const GroupTable t{table, num_params};
  if (num_params > 0) {
    const int64_t last = num_params - 1, rows = t.at(last, GroupTable::kRows), cols = t.at(last, GroupTable::kCols);
    if (t.at(last, GroupTable::kByteBase) + rows * cols / 2 > data_bytes)
      return invalid("data: shorter than the group's packed bytes");
    if (t.at(last, GroupTable::kScaleBase) + nvfp4_scale_rows(rows) * nvfp4_scale_cols(cols) >
        static_cast<int64_t>(scale_inv.element_count()))
      return invalid("scale_inv: shorter than the group's packed scales");
  }
  return ffi::Error::Success();
}

// Host-readable table: parameters in order, inside the flat buffer, tiles and bytes inside bounds.
inline ffi::Error check_group_table_contents(const int64_t* t, int64_t num_params, int64_t flat_size,
                                             int64_t num_tiles, bool nvfp4) {
  int64_t end = 0;
  for (int64_t p = 0; p < num_params; ++p) {
    const GroupTable table{t, num_params};
    const int64_t off = table.at(p, GroupTable::kOffset), numel = table.at(p, GroupTable::kNumel);
    const int64_t rows = table.at(p, GroupTable::kRows), cols = table.at(p, GroupTable::kCols);
    if (off < end || numel < 0 || off + numel > flat_size || rows * cols != numel || cols <= 0)
      return invalid("table: row " + std::to_string(p) + " is not a parameter inside the flat buffer, in order");
    if (nvfp4 && (rows % kTile || cols % kTile || table.at(p, GroupTable::kTileBase) + numel / (kTile * kTile) > num_tiles))
      return invalid("table: row " + std::to_string(p) + " breaks the 16x16 grid or the tile vector");
    end = off + numel;
  }
  return ffi::Error::Success();
}

// ---- grouped split: byte ranges of a few packed buffers copied into many results ----------------

// One copy of a grouped split: `bytes` bytes from src to dst.
struct CopySegment {
  const uint8_t* src;
  uint8_t* dst;
  int64_t bytes;
};

// A split plan row: (result index, byte offset in the result, source argument, byte offset in the
// source, byte count). Every result must be covered exactly by its rows (Python builds them so),
// or at most covered with `partial` (below).
constexpr int kSplitFields = 5;

// partial: one stage of a split in several calls (ops.group_split's stage_of_source), whose
// results arrive aliased to the previous stage's: each gets at most its size here, and the stages
// together cover it (checked in Python, where the plan is built).
// Per call this is host work on every result (up to ~900 for 300 weights), ahead of the launches:
// each buffer is decoded once and messages are built only on failure.
inline ffi::Error split_segments(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                                 ffi::Span<const int64_t> plan, bool partial, std::vector<CopySegment>* out) {
  if (plan.size() % kSplitFields) return invalid("plan: must hold 5 int64 values per segment");
  const int64_t nseg = static_cast<int64_t>(plan.size() / kSplitFields);
  const int64_t nargs = static_cast<int64_t>(args.size()), nrets = static_cast<int64_t>(rets.size());
  struct Bytes {
    uint8_t* data;
    int64_t size;
  };
  std::vector<Bytes> src_bytes(nargs), dst_bytes(nrets);
  for (int64_t a = 0; a < nargs; ++a) {
    auto in = args.get<ffi::AnyBuffer>(a);
    if (!in.has_value()) return in.error();
    src_bytes[a] = {static_cast<uint8_t*>(in->untyped_data()), static_cast<int64_t>(in->size_bytes())};
  }
  for (int64_t r = 0; r < nrets; ++r) {
    auto ret = rets.get<ffi::AnyBuffer>(r);
    if (!ret.has_value()) return ret.error();
    dst_bytes[r] = {static_cast<uint8_t*>((*ret.value()).untyped_data()), static_cast<int64_t>((*ret.value()).size_bytes())};
  }
  std::vector<int64_t> covered(nrets, 0);
  out->clear();
  out->reserve(nseg);
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t* row = plan.begin() + s * kSplitFields;
    const int64_t res = row[0], dst_off = row[1], src = row[2], src_off = row[3], bytes = row[4];
    if (res < 0 || res >= nrets)
      return invalid("plan: segment " + std::to_string(s) + " names result " + std::to_string(res) + " of " +
                     std::to_string(nrets));
    if (src < 0 || src >= nargs)
      return invalid("plan: segment " + std::to_string(s) + " names source " + std::to_string(src) + " of " +
                     std::to_string(nargs));
    const Bytes in = src_bytes[src], dst = dst_bytes[res];
    if (bytes < 0 || src_off < 0 || dst_off < 0 || src_off + bytes > in.size || dst_off + bytes > dst.size)
      return invalid("plan: segment " + std::to_string(s) + " reads or writes outside its buffers");
    covered[res] += bytes;
    out->push_back({in.data + src_off, dst.data + dst_off, bytes});
  }
  for (int64_t r = 0; r < nrets; ++r) {
    if (partial ? covered[r] > dst_bytes[r].size : covered[r] != dst_bytes[r].size)
      return invalid("plan: result " + std::to_string(r) + " gets " + std::to_string(covered[r]) + " bytes, has " +
                     std::to_string(dst_bytes[r].size));
  }
  return ffi::Error::Success();
}

// The GEMMs on cuBLASLt (cuda_gemm.cu) take cuBLASLt's workspace as a result of this size (jaxquant/primitives/ops/
// single.py CUBLASLT_WORKSPACE_BYTES).
constexpr int64_t kCublasLtWorkspaceBytes = int64_t(32) << 20;

// The FP8 GEMM (cuda_gemm.cu): a [M, K] x b [N, K] (both contracted on K, their minor axis), float8 operands of
// which at most one is E5M2 (cuBLASLt has no E5M2 x E5M2 GEMM), one-element fp32 factors, result [M, N] BF16 or F32.
// cuBLASLt's FP8 GEMM needs 16-byte aligned leading dimensions: K (the operands') and N (the result's) multiples of
// 16; M is free. Python sends only such problems (others stay XLA's dot).

inline bool is_fp8_type(ffi::DataType t) { return t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2; }

inline ffi::Error check_fp8_gemm(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, const ffi::Buffer<ffi::F32>& a_scale,
                                 const ffi::Buffer<ffi::F32>& b_scale, const ffi::AnyBuffer& out, int64_t* m,
                                 int64_t* n, int64_t* k) {
  auto da = a.dimensions(), db = b.dimensions();
  if (da.size() != 2 || db.size() != 2) return invalid("fp8_gemm: a and b must have rank 2 ([M, K], [N, K])");
  *m = da[0];
  *n = db[0];
  *k = da[1];
  if (db[1] != *k) return invalid("fp8_gemm: b must be [N, K] with a's K = " + std::to_string(*k));
  if (!is_fp8_type(a.element_type()) || !is_fp8_type(b.element_type()))
    return invalid("fp8_gemm: a and b must be F8E4M3FN or F8E5M2");
  if (a.element_type() == ffi::DataType::F8E5M2 && b.element_type() == ffi::DataType::F8E5M2)
    return invalid("fp8_gemm: cuBLASLt has no F8E5M2 x F8E5M2 GEMM");
  if (*m <= 0 || *n <= 0 || *k <= 0 || *k % 16 || *n % 16)
    return invalid("fp8_gemm: needs M > 0 and N, K positive multiples of 16, got M, N, K = " + std::to_string(*m) +
                   ", " + std::to_string(*n) + ", " + std::to_string(*k));
  if (auto e = check_count(a_scale, 1, "a_scale"); e.failure()) return e;
  if (auto e = check_count(b_scale, 1, "b_scale"); e.failure()) return e;
  if (out.element_type() != ffi::DataType::BF16 && out.element_type() != ffi::DataType::F32)
    return invalid("fp8_gemm: the result's dtype must be BF16 or F32");
  return check_2d(out, *m, *n, "result");
}

// The scaled bf16 GEMM (cuda_gemm.cu, NVFP4's GEMMs on Hopper): a [M, K] x b, b [N, K] (contracted on its minor
// axis, TN) or, with b_kn, [K, N] (on its major axis, NN); a one-element fp32 factor; result [M, N] BF16. N and K
// positive multiples of 16, as the FP8 GEMM's (16-byte aligned rows, and NVFP4's 16-element tiles); M is free.
inline ffi::Error check_bf16_gemm(const ffi::Buffer<ffi::BF16>& a, const ffi::Buffer<ffi::BF16>& b, bool b_kn,
                                  const ffi::Buffer<ffi::F32>& factor, const ffi::Buffer<ffi::BF16>& out, int64_t* m,
                                  int64_t* n, int64_t* k) {
  auto da = a.dimensions(), db = b.dimensions();
  if (da.size() != 2 || db.size() != 2)
    return invalid(std::string("bf16_gemm: a and b must have rank 2 ([M, K], ") + (b_kn ? "[K, N])" : "[N, K])"));
  *m = da[0];
  *k = da[1];
  *n = b_kn ? db[1] : db[0];
  if ((b_kn ? db[0] : db[1]) != *k)
    return invalid(std::string("bf16_gemm: b must be ") + (b_kn ? "[K, N]" : "[N, K]") + " with a's K = " +
                   std::to_string(*k));
  if (*m <= 0 || *n <= 0 || *k <= 0 || *k % 16 || *n % 16)
    return invalid("bf16_gemm: needs M > 0 and N, K positive multiples of 16, got M, N, K = " + std::to_string(*m) +
                   ", " + std::to_string(*n) + ", " + std::to_string(*k));
  if (auto e = check_count(factor, 1, "factor"); e.failure()) return e;
  return check_2d(out, *m, *n, "result");
}

#define JQ_RETURN_IF_ERROR(expr)        \
  do {                                  \
    ::xla::ffi::Error _jq_err = (expr); \
    if (_jq_err.failure()) return _jq_err; \
  } while (0)

}  // namespace jaxquant
