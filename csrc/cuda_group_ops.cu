// CUDA FFI handlers of the grouped ops: one launch per stage for every parameter of a ZeRO flat shard.
// Element math as the CPU handlers (elementwise.h / numerics.h); see cuda_ops.cu for single tensors.
#include <climits>
#include <memory>
#include <optional>

#include "jaxquant/cuda_common.cuh"

namespace jaxquant {
namespace {

// ---- grouped ops over one shard of a ZeRO flat buffer ----------------------------------------
//
// The shard index and the parameter table live in device memory (the index is lax.axis_index,
// known only on the device), so one launch serves every shard: each thread finds its parameter
// by binary search in the table. Threads own 16 local elements (or 8 chunk bytes).

constexpr int kGroupElems = 16;

// Blocks of kThreads threads for `elements` elements, kGroupElems a thread (resident_grid caps them).
int64_t group_blocks(int64_t elements) { return (elements + kGroupElems * kThreads - 1) / (kGroupElems * kThreads); }

// A grouped cast with nothing to convert: no output bytes, or no parameter (the output is all
// padding, 0). Returns the handler's result then, nothing when the kernel has work.
std::optional<ffi::Error> trivial_group_cast(void* out, int64_t bytes, int64_t num_params, cudaStream_t stream) {
  if (bytes == 0) return ffi::Error::Success();
  if (num_params > 0) return std::nullopt;
  cudaMemsetAsync(out, 0, bytes, stream);
  return last_error("group cast memset");
}

// This block's share [first, last) of `items` when each block takes one contiguous range (threads a
// block-stride apart inside it): a thread then meets few parameters and searches the table rarely.
// Kernels that use it launch resident_grid blocks: equal ranges in one wave (with more blocks than
// fit at once, a partly filled last wave leaves SMs idle for a whole range's time).
struct BlockRange {
  int64_t first, last;
};
__device__ __forceinline__ BlockRange block_range(int64_t items) {
  const int64_t per_block = (items + gridDim.x - 1) / gridDim.x, first = blockIdx.x * per_block;
  return {first, items < first + per_block ? items : first + per_block};
}


// Loads elements i0..i0+15 of the shard (i0 % 16 == 0), vectorized when the whole group is inside.
// With round_bf16 each value is rounded to bfloat16 as it is loaded (load_compute).
__device__ __forceinline__ void load16(const void* x, bool bf16, bool round_bf16, int64_t i0, int64_t n, float v[16]) {
  if (i0 + 16 <= n) {
#pragma unroll
    for (int q = 0; q < 4; ++q) load4(x, bf16, i0 + 4 * q, aligned4(x, bf16, i0 + 4 * q), v + 4 * q);
    if (round_bf16) {
#pragma unroll
      for (int k = 0; k < 16; ++k) v[k] = round_to_bf16(v[k]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = i0 + k < n ? load_compute(x, bf16, round_bf16, i0 + k) : 0.0f;
  }
}

__device__ void warp_publish_param_max(float* amax, int64_t held, float m);

// One table column (GroupTable::kOffset, kTileBase, ...) of the first kSharedKeys parameters, copied
// to shared memory by the block: a thread's search for its parameter (at its start, and at each
// parameter change) then reads shared memory instead of log2(P) dependent global loads, which dominated
// the grouped stats and cast kernels over a few hundred weights (docs/performance.md, "Grouped kernels").
// Larger tables search the global table as before; the answer is the same (GroupTable::find).
constexpr int kSharedKeys = 1024;
struct BlockKeys {
  const int64_t* keys;  // the shared copy, read only when `fits` (a flag, not a null pointer: the
  bool fits;            // compiler treats `keys` as a shared-memory address, where null is a valid offset)
  GroupTable table;
  int field;
  __device__ int64_t find(int64_t pos) const {
    if (!fits) return table.find(pos, field);
    return GroupTable::last_at_or_below(table.num_params, pos, [&](int64_t p) { return keys[p]; });
  }
};
// Called by every thread of the block (it synchronizes the block).
__device__ BlockKeys load_block_keys(int64_t* shared, const GroupTable& table, int field) {
  const bool fits = table.num_params <= kSharedKeys;
  if (fits)
    for (int64_t i = threadIdx.x; i < table.num_params; i += blockDim.x) shared[i] = table.at(i, field);
  __syncthreads();
  return {shared, fits, table, field};
}

// Tiles [t0, t1) of the tile rows that meet flat positions [g_first, g_last] of the group (a
// superset of the tiles the shard touches: the others get amax 0, as they should).
__device__ int64_t first_tile_at(const GroupTable& table, const BlockKeys& offsets, int64_t g) {
  const int64_t p = offsets.find(g);
  if (p < 0) return 0;
  const int64_t off = table.at(p, GroupTable::kOffset), numel = table.at(p, GroupTable::kNumel);
  const int64_t cols = table.at(p, GroupTable::kCols), base = table.at(p, GroupTable::kTileBase);
  if (g >= off + numel) return base + numel / (kTile * kTile);  // padding: the next parameter's first tile
  return base + (g - off) / (kTile * cols) * (cols / kTile);
}
__device__ int64_t end_tile_at(const GroupTable& table, const BlockKeys& offsets, int64_t g) {
  const int64_t p = offsets.find(g);
  if (p < 0) return 0;
  const int64_t off = table.at(p, GroupTable::kOffset), numel = table.at(p, GroupTable::kNumel);
  const int64_t cols = table.at(p, GroupTable::kCols), base = table.at(p, GroupTable::kTileBase);
  if (g >= off + numel) return base + numel / (kTile * kTile);
  return base + ((g - off) / (kTile * cols) + 1) * (cols / kTile);
}

// A slot is kSlotTiles consecutive tiles of the packed tile vector; 4 lanes own a tile (4 columns
// each, all 16 rows: 16 independent 16-byte loads in flight per lane, consecutive lanes on
// consecutive vectors of a row). A tile lies in one slot, so its amax is a plain store: no atomics
// per tile, no search per element (one table search per slot and thread, only at a new parameter).
constexpr int kSlotTiles = kThreads / 4;

template <bool bf16, bool round_bf16>
__global__ void __launch_bounds__(kThreads, 2) group_tile_amax_kernel(const void* __restrict__ x, int64_t n, const int32_t* index,
                                       GroupTable table, int64_t num_tiles, float* __restrict__ tile_amax,
                                       float* __restrict__ amax, int32_t* __restrict__ counts) {
  __shared__ int64_t offset_keys[kSharedKeys], tile_keys[kSharedKeys];
  const BlockKeys offsets = load_block_keys(offset_keys, table, GroupTable::kOffset);
  const BlockKeys tile_bases = load_block_keys(tile_keys, table, GroupTable::kTileBase);
  const int64_t a = int64_t(index[0]) * n;  // the shard's first flat position
  const int64_t t0 = first_tile_at(table, offsets, a);
  const int64_t t_end = end_tile_at(table, offsets, a + n - 1), t1 = t_end < num_tiles ? t_end : num_tiles;
  const int lane4 = threadIdx.x % 4;
  int64_t p = -1, tbeg = 0, tnext = 0;  // parameter of the thread's last tile, its tile range
  int64_t pcols = 0, poff = 0;          // and its columns and flat offset
  int64_t held = -1;                    // parameter whose running amax held_m holds
  float held_m = 0.0f;
  for (int64_t s = t0 / kSlotTiles + blockIdx.x; s * kSlotTiles < t1; s += gridDim.x) {
    const int64_t t = s * kSlotTiles + threadIdx.x / 4;
    ComputeAmax<round_bf16> acc;  // raw values in, the compute dtype's amax and count out
    int64_t tp = -1;
    if (t >= t0 && t < t1) {
      if (p < 0 || t < tbeg || t >= tnext) {
        p = tile_bases.find(t);
        tbeg = table.at(p, GroupTable::kTileBase);
        tnext = p + 1 < table.num_params ? table.at(p + 1, GroupTable::kTileBase) : INT64_MAX;
        pcols = table.at(p, GroupTable::kCols);
        poff = table.at(p, GroupTable::kOffset);
      }
      tp = p;
      const int64_t tcn = pcols / kTile, lt = t - tbeg;
      const int64_t tr = div_nonneg(lt, tcn), tc = lt - tr * tcn;
      const int64_t i0 = poff + tr * kTile * pcols + tc * kTile + lane4 * 4 - a;
      if (i0 >= 0 && i0 + (kTile - 1) * pcols + 4 <= n) {  // the whole 16x4 strip is in the shard
        const bool vec = aligned4(x, bf16, i0);  // cols % 16 == 0: every row has i0's alignment
        float v[kTile][4];
#pragma unroll
        for (int k = 0; k < kTile; ++k) load4(x, bf16, i0 + k * pcols, vec, v[k]);
#pragma unroll
        for (int k = 0; k < kTile; ++k)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc.add(v[k][j]);
      } else {  // a tile row cut by a shard boundary: elements of other shards count as 0
#pragma unroll
        for (int k = 0; k < kTile; ++k)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int64_t i = i0 + k * pcols + j;
            acc.add(i >= 0 && i < n ? load_compute(x, bf16, false, i) : 0.0f);
          }
      }
    }
    float m = acc.result();
    const int c = acc.nonfinite;
    m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));  // the tile's 4 lanes
    m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
    if (tp >= 0 && lane4 == 0) tile_amax[t] = m;
    if (c) atomicAdd(counts + tp, c);  // rare: no need to batch
    const bool change = tp >= 0 && tp != held;
    if (__any_sync(0xFFFFFFFFu, change)) warp_publish_param_max(amax, change ? held : -1, held_m);
    if (change) {
      held = tp;
      held_m = 0.0f;
    }
    if (tp >= 0) held_m = fmaxf(held_m, m);
  }
  warp_publish_param_max(amax, held, held_m);
}

ffi::Error GroupTileAmaxCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index,
                             ffi::Buffer<ffi::U32> table_words, bool round_bf16, ffi::Result<ffi::Buffer<ffi::F32>> tile_amax,
                             ffi::Result<ffi::Buffer<ffi::F32>> amax, ffi::Result<ffi::Buffer<ffi::S32>> counts) {
  int64_t num_params;
  JQ_RETURN_IF_ERROR(check_group(x, index, table_words, &num_params));
  JQ_RETURN_IF_ERROR(check_count(*amax, num_params, "amax"));
  JQ_RETURN_IF_ERROR(check_count(*counts, num_params, "counts"));
  const int64_t n = static_cast<int64_t>(x.element_count()), num_tiles = static_cast<int64_t>(tile_amax->element_count());
  cudaMemsetAsync(tile_amax->untyped_data(), 0, tile_amax->size_bytes(), stream);
  cudaMemsetAsync(amax->untyped_data(), 0, amax->size_bytes(), stream);
  cudaMemsetAsync(counts->untyped_data(), 0, counts->size_bytes(), stream);
  if (n > 0 && num_params > 0) {
    const int64_t slots = n / (kSlotTiles * kTile * kTile) + 2;  // about; the kernel grid-strides
    with_input_kind(x, round_bf16, [&](auto b, auto r) {
      const auto kernel = group_tile_amax_kernel<decltype(b)::value, decltype(r)::value>;
      kernel<<<resident_grid(kernel, slots), kThreads, 0, stream>>>(x.untyped_data(), n, index.typed_data(),
        GroupTable{as_i64(table_words), num_params}, num_tiles, tile_amax->typed_data(),
        amax->typed_data(), counts->typed_data());
    });
  }
  return last_error("group tile amax kernel");
}

// Threads own 8 consecutive bytes of the group's param-byte space (8-aligned, so 16 elements of
// one parameter, one row and one tile: byte bases are multiples of 128).
template <bool bf16, bool round_bf16>
__global__ void group_cast_kernel(const void* __restrict__ x, int64_t n, const int32_t* index,
                                  GroupTable table, const int64_t* chunk_lo, int64_t num_shards,
                                  const float* __restrict__ enc, int64_t num_tiles, uint8_t* __restrict__ out,
                                  int64_t size) {
  const int64_t r = index[0];
  if (r < 0 || r >= num_shards) {  // no such shard: it owns nothing
    for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < size; j += int64_t(gridDim.x) * blockDim.x) out[j] = 0;
    return;
  }
  __shared__ int64_t byte_keys[kSharedKeys];
  const BlockKeys byte_bases = load_block_keys(byte_keys, table, GroupTable::kByteBase);
  const int64_t lo = chunk_lo[r], g0 = lo / 8, groups = (lo + size + 7) / 8 - g0;
  const auto [first, last] = block_range(groups);
  // The parameter of the last byte group: its byte range [pbeg, pbeg + pbytes), the next one's start,
  // and what the tile and input index need (read from the table once per parameter).
  int64_t p = -1, pbeg = 0, pnext = 0, pbytes = 0, pcols = 1, poff = 0, ptiles = 0;
  for (int64_t grp = first + threadIdx.x; grp < last; grp += blockDim.x) {
    const int64_t y0 = (g0 + grp) * 8;
    uint8_t bytes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (p < 0 || y0 < pbeg || y0 >= pnext) {
      p = byte_bases.find(y0);
      pbeg = p >= 0 ? table.at(p, GroupTable::kByteBase) : 0;
      pnext = p + 1 < table.num_params ? table.at(p + 1, GroupTable::kByteBase) : INT64_MAX;
      if (p < 0) pnext = table.at(0, GroupTable::kByteBase);
      if (p >= 0) {
        pbytes = table.at(p, GroupTable::kNumel) / 2;
        pcols = table.at(p, GroupTable::kCols);
        poff = table.at(p, GroupTable::kOffset);
        ptiles = table.at(p, GroupTable::kTileBase);
      }
    }
    if (p >= 0 && y0 - pbeg < pbytes) {
      const int64_t e0 = 2 * (y0 - pbeg);
      const int64_t t = GroupTable::tile_in(ptiles, pcols, e0);
      const float m = t < num_tiles ? enc[t] : 0.0f;
      const int64_t i0 = poff + e0 - r * n;  // local index of element e0
      if (i0 >= 0 && i0 + 16 <= n) {
        // 16 elements = 64 (fp32) or 32 (bf16) bytes: kLoads 16-byte rows of kVec codes each. NaN input
        // is outside the byte contract (docs/numerics.md §2.6): the hardware bf16 rounding may serve.
        constexpr int kVec = bf16 ? 8 : 4, kLoads = 16 / kVec;
        const uint8_t* src = static_cast<const uint8_t*>(x) + i0 * (bf16 ? 2 : 4);
        const bool aligned = reinterpret_cast<uintptr_t>(src) % 16 == 0;
        uint4 raw[kLoads];
#pragma unroll
        for (int q = 0; q < kLoads; ++q) raw[q] = load_raw16<bf16>(src + 16 * q, aligned);
        uint32_t codes[kLoads];  // element k of row q at bits 4k
#pragma unroll
        for (int q = 0; q < kLoads; ++q) {
          float v[kVec];
          to_compute<bf16, round_bf16, true>(raw[q], v);
          codes[q] = e2m1_row<kVec>(raw[q], v, m);
        }
        const uint32_t lo = bf16 ? codes[0] : codes[0] | (codes[1 % kLoads] << 16);
        const uint32_t hi = bf16 ? codes[1] : codes[2 % kLoads] | (codes[3 % kLoads] << 16);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          bytes[k] = uint8_t(lo >> (8 * k));
          bytes[k + 4] = uint8_t(hi >> (8 * k));
        }
      } else {  // the shard owns part of these 16 elements (or none)
#pragma unroll
        for (int k = 0; k < 16; ++k) {
          const int64_t i = i0 + k;
          if (i >= 0 && i < n) bytes[k / 2] |= float_to_e2m1(load_compute(x, bf16, round_bf16, i) * m) << (4 * (k % 2));
        }
      }
    }
    const int64_t j0 = y0 - lo;
    uint8_t* dst = out + j0;
    if (j0 >= 0 && j0 + 8 <= size && reinterpret_cast<uintptr_t>(dst) % 8 == 0) {
      uint2 w;
      w.x = bytes[0] | (bytes[1] << 8) | (bytes[2] << 16) | (uint32_t(bytes[3]) << 24);
      w.y = bytes[4] | (bytes[5] << 8) | (bytes[6] << 16) | (uint32_t(bytes[7]) << 24);
      *reinterpret_cast<uint2*>(dst) = w;
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (j0 + k >= 0 && j0 + k < size) out[j0 + k] = bytes[k];
    }
  }
}

ffi::Error GroupCastCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index,
                         ffi::Buffer<ffi::U32> table_words, ffi::Buffer<ffi::U32> chunk_lo_words,
                         ffi::Buffer<ffi::F32> enc, bool round_bf16, ffi::Result<ffi::Buffer<ffi::U8>> chunk) {
  int64_t num_params;
  JQ_RETURN_IF_ERROR(check_group(x, index, table_words, &num_params));
  if (chunk_lo_words.element_count() % 2) return invalid("chunk_lo: must be int64 values as uint32 words");
  const int64_t num_shards = static_cast<int64_t>(chunk_lo_words.element_count() / 2);
  const int64_t size = static_cast<int64_t>(chunk->element_count());
  if (auto done = trivial_group_cast(chunk->untyped_data(), size, num_params, stream)) return *std::move(done);
  with_input_kind(x, round_bf16, [&](auto b, auto r) {
    const auto kernel = group_cast_kernel<decltype(b)::value, decltype(r)::value>;
    kernel<<<resident_grid(kernel, (size / 8 + 2 + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      x.untyped_data(), static_cast<int64_t>(x.element_count()),
      index.typed_data(), GroupTable{as_i64(table_words), num_params},
      as_i64(chunk_lo_words), num_shards, enc.typed_data(),
      static_cast<int64_t>(enc.element_count()), chunk->typed_data(), size);
  });
  return last_error("group cast kernel");
}

// One atomic per distinct parameter per warp: lanes holding the same parameter are combined first.
// Called by all 32 lanes (full warps); held < 0 means nothing to publish.
__device__ void warp_publish_param_max(float* amax, int64_t held, float m) {
  const int lane = threadIdx.x % 32;
  unsigned pending = __ballot_sync(0xFFFFFFFFu, held >= 0);
  while (pending) {
    const int leader = __ffs(pending) - 1;
    const int64_t p = __shfl_sync(0xFFFFFFFFu, held, leader);
    const float v = warp_max(held == p ? m : 0.0f);
    if (lane == leader) atomicMax(reinterpret_cast<uint32_t*>(amax + p), __float_as_uint(v));
    pending &= ~__ballot_sync(0xFFFFFFFFu, held == p);
  }
}

// Each block reduces one contiguous range of the shard (coalesced within the block), so a thread
// meets few parameters and the per-parameter atomics (few addresses, all blocks) stay rare.
template <bool bf16, bool round_bf16>
__global__ void fp8_group_amax_kernel(const void* __restrict__ x, int64_t n, const int32_t* index,
                                      GroupTable table, float* __restrict__ amax, int32_t* __restrict__ counts) {
  __shared__ int64_t offset_keys[kSharedKeys];
  const BlockKeys offsets = load_block_keys(offset_keys, table, GroupTable::kOffset);
  const int64_t r = index[0];
  const auto [first, last] = block_range((n + kGroupElems - 1) / kGroupElems);
  int64_t held = -1;
  ComputeAmax<round_bf16> acc;  // the held parameter's amax and non-finite count so far
  const auto publish_held = [&] {   // single thread; the end of the kernel combines the warp first
    if (held < 0) return;
    atomicMax(reinterpret_cast<uint32_t*>(amax + held), __float_as_uint(acc.result()));
    if (acc.nonfinite) atomicAdd(counts + held, acc.nonfinite);
  };
  ParamCursor cur{table};  // positions only grow: one search, then steps at parameter changes
  cur.start_at(offsets.find(r * n + (first + threadIdx.x) * kGroupElems));
  for (int64_t grp = first + threadIdx.x; grp < last; grp += blockDim.x) {
    const int64_t i0 = grp * kGroupElems, g0 = r * n + i0;
    float v[16];
    load16(x, bf16, false, i0, n, v);  // raw values: acc rounds the max once
    if (i0 + 16 <= n && cur.inside(g0) && g0 + 16 <= cur.end && cur.p == held) {  // all in the held parameter
#pragma unroll
      for (int k = 0; k < 16; ++k) acc.add(v[k]);
      continue;
    }
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      if (i0 + k >= n || !cur.inside(g0 + k)) continue;
      if (cur.p != held) {
        publish_held();
        held = cur.p;
        acc = ComputeAmax<round_bf16>{};
      }
      acc.add(v[k]);
    }
  }
  warp_publish_param_max(amax, held, acc.result());
  if (held >= 0 && acc.nonfinite) atomicAdd(counts + held, acc.nonfinite);
}

ffi::Error Fp8GroupAmaxCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index,
                            ffi::Buffer<ffi::U32> table_words, bool round_bf16, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                            ffi::Result<ffi::Buffer<ffi::S32>> counts) {
  int64_t num_params;
  JQ_RETURN_IF_ERROR(check_group(x, index, table_words, &num_params));
  JQ_RETURN_IF_ERROR(check_count(*amax, num_params, "amax"));
  JQ_RETURN_IF_ERROR(check_count(*counts, num_params, "counts"));
  const int64_t n = static_cast<int64_t>(x.element_count());
  cudaMemsetAsync(amax->untyped_data(), 0, amax->size_bytes(), stream);
  cudaMemsetAsync(counts->untyped_data(), 0, counts->size_bytes(), stream);
  if (n > 0 && num_params > 0) {
    with_input_kind(x, round_bf16, [&](auto b, auto r) {
      const auto kernel = fp8_group_amax_kernel<decltype(b)::value, decltype(r)::value>;
      kernel<<<resident_grid(kernel, group_blocks(n)), kThreads, 0, stream>>>(
          x.untyped_data(), n, index.typed_data(),
        GroupTable{as_i64(table_words), num_params}, amax->typed_data(), counts->typed_data());
    });
  }
  return last_error("fp8 group amax kernel");
}

// 16 elements that are not all of one parameter (or run past the end of the range): each times
// its own parameter's scale, padding bytes 0. Out of line, so that the common path keeps few
// registers. It loads the elements again (rare: parameter boundaries and the range's end) and takes
// and returns the cursor by value, so that the caller's values need not live in memory.
template <bool bf16, bool round_bf16>
__device__ __noinline__ ParamCursor fp8_cast_mixed16(const void* __restrict__ x, ParamCursor cur,
                                                     int64_t g0, int64_t i0, int64_t first, int64_t end,
                                                     const float* __restrict__ scale, bool e5m2, uint8_t* __restrict__ out) {
  float v[16];
  load16(x, bf16, round_bf16, i0, end, v);
  for (int k = 0; k < 16; k += 2) {  // hardware pair conversion
    const bool in0 = cur.inside(g0 + k);
    const float s0 = in0 ? scale[cur.p] : 0.0f;
    const bool in1 = cur.inside(g0 + k + 1);
    const float s1 = in1 ? scale[cur.p] : 0.0f;
    const uint32_t signs = (__float_as_uint(v[k]) >> 24) | ((__float_as_uint(v[k + 1]) >> 16) & 0x8000u);
    const uint32_t pair = fp8_with_signs(fp8_pair(v[k] * s0, v[k + 1] * s1, e5m2), signs);
    if (i0 + k < end) out[i0 + k - first] = in0 ? uint8_t(pair) : 0;
    if (i0 + k + 1 < end) out[i0 + k + 1 - first] = in1 ? uint8_t(pair >> 8) : 0;
  }
  return cur;
}

// Shard elements [first, end) (first % 16 == 0 keeps the vector path) to out[0, end - first).
template <bool bf16, bool round_bf16>
__global__ void __launch_bounds__(kThreads, 4)
    fp8_group_cast_kernel(const void* __restrict__ x, int64_t n, int64_t first, int64_t end,
                          const int32_t* index, GroupTable table, const float* __restrict__ scale, bool e5m2,
                          uint8_t* __restrict__ out) {
  __shared__ int64_t offset_keys[kSharedKeys];
  const BlockKeys offsets = load_block_keys(offset_keys, table, GroupTable::kOffset);
  const int64_t r = index[0];
  const auto [gfirst, glast] = block_range((end - first + kGroupElems - 1) / kGroupElems);
  ParamCursor cur{table};  // positions only grow: one search, then steps at parameter changes
  cur.start_at(offsets.find(r * n + first + (gfirst + threadIdx.x) * kGroupElems));
  for (int64_t grp = gfirst + threadIdx.x; grp < glast; grp += blockDim.x) {
    const int64_t i0 = first + grp * kGroupElems, g0 = r * n + i0;
    float v[16];
    load16(x, bf16, round_bf16, i0, end, v);
    if (!(i0 + 16 <= end && cur.inside(g0) && g0 + 16 <= cur.end)) {
      cur = fp8_cast_mixed16<bf16, round_bf16>(x, cur, g0, i0, first, end, scale, e5m2, out);
      continue;
    }
    const float sc = scale[cur.p];  // one parameter, one scale
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = fp8_quad_signed(v + 4 * k, sc, e5m2, signs_of4(v + 4 * k));
    uint8_t* dst = out + (i0 - first);
    if (reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
#pragma unroll
      for (int k = 0; k < 16; ++k) dst[k] = uint8_t(w[k / 4] >> (8 * (k % 4)));
    }
  }
}

ffi::Error Fp8GroupCastCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index,
                            ffi::Buffer<ffi::U32> table_words, ffi::Buffer<ffi::F32> scale, bool round_bf16,
                            int64_t first, ffi::Result<ffi::AnyBuffer> data) {
  int64_t num_params;
  bool e5m2;
  JQ_RETURN_IF_ERROR(check_fp8_group_cast(x, index, table_words, scale, first, *data, &num_params, &e5m2));
  const int64_t n = static_cast<int64_t>(x.element_count()), count = static_cast<int64_t>(data->element_count());
  if (auto done = trivial_group_cast(data->untyped_data(), count, num_params, stream)) return *std::move(done);
  with_input_kind(x, round_bf16, [&](auto b, auto r) {
    const auto kernel = fp8_group_cast_kernel<decltype(b)::value, decltype(r)::value>;
    kernel<<<resident_grid(kernel, group_blocks(count)), kThreads, 0, stream>>>(
      x.untyped_data(), n, first, first + count,
      index.typed_data(), GroupTable{as_i64(table_words), num_params}, scale.typed_data(), e5m2,
      static_cast<uint8_t*>(data->untyped_data()));
  });
  return last_error("fp8 group cast kernel");
}


// ---- grouped scales and columnwise data ------------------------------------------------------
//
// Scales: one thread per 16-row strip of one scale column (group_scale_strip), the parameter found
// by binary search in the table; the tile amaxes are already reduced over the mesh.

__global__ void group_scale_kernel(const float* __restrict__ tiles, const float* __restrict__ amax, GroupTable table,
                                   int64_t num_tiles, uint8_t* __restrict__ scale_inv, int64_t scale_bytes,
                                   float* __restrict__ enc) {
  // Neighbouring threads take neighbouring scale columns: each of the 16 row stores is coalesced.
  for (int64_t u = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; u < group_scale_strips(scale_bytes);
       u += int64_t(gridDim.x) * blockDim.x)
    group_scale_strip(table, tiles, num_tiles, amax, u, scale_inv, scale_bytes, enc);
}

ffi::Error GroupScaleCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> tiles, ffi::Buffer<ffi::F32> amax,
                          ffi::Buffer<ffi::U32> table_words, ffi::Result<ffi::Buffer<ffi::U8>> scale_inv,
                          ffi::Result<ffi::Buffer<ffi::F32>> enc) {
  int64_t num_params, num_tiles, scale_bytes;
  JQ_RETURN_IF_ERROR(check_group_scale(tiles, amax, table_words, *scale_inv, *enc, &num_params, &num_tiles, &scale_bytes));
  if (group_scale_strips(scale_bytes) == 0) return ffi::Error::Success();
  group_scale_kernel<<<grid_for(group_scale_strips(scale_bytes)), kThreads, 0, stream>>>(
      tiles.typed_data(), amax.typed_data(), GroupTable{as_i64(table_words), num_params}, num_tiles,
      scale_inv->typed_data(), scale_bytes, enc->typed_data());
  return last_error("group scale kernel");
}

// Transposes: block b < num_blocks is one 64x64-element block of parameter p = the last with
// block_base <= b (row-major over the parameter's [ru(rows,64)/64, ru(cols,64)/64] blocks). Both
// work in registers, a warp a block (byte_transpose_block, nibble_transpose_block): lane l takes the
// 16 x 8-element piece at rows m0 + 16 (l / 8) .. +15 and columns k0 + 8 (l % 8) .. +7. They read
// the gathered space in place and write each parameter's own result (no split copy afterwards).

// The results of one launch: parameters [p0, p0 + kTransposeBatch) at most, whose blocks are
// [block0, block0 + blocks) and (NVFP4) columnwise scale strips [strip0, strip0 + strips). Travels
// in the kernel parameters (with the GatheredSpace about 3.3 KB of the 4 KB), so graphs capture it.
constexpr int kTransposeBatch = 128;
struct TransposeOutputs {
  uint8_t* data_t[kTransposeBatch];
  uint8_t* scale_t[kTransposeBatch];  // NVFP4
  int64_t p0, block0, blocks, strip0, strips;
};

struct TransposePiece {
  int64_t src;   // the parameter's first source byte in the gathered space
  uint8_t* dst;  // its result
  int64_t rows, cols, m, k;  // its shape; the piece's first row and column
};

// This lane's piece of block b; false where it holds nothing (no parameter, or past its rows or
// columns). One table search a block: a warp handles a single block.
__device__ bool transpose_piece_at(const GroupTable& table, int64_t b, int64_t base_field, const TransposeOutputs& out,
                                   TransposePiece* piece) {
  const int64_t p = table.find(b, GroupTable::kBlockBase);
  if (p < 0) return false;
  const int64_t rows = table.at(p, GroupTable::kRows), cols = table.at(p, GroupTable::kCols);
  const int64_t nbx = (cols + 63) / 64, local = b - table.at(p, GroupTable::kBlockBase);
  const int lane = threadIdx.x % 32;
  *piece = {table.at(p, base_field), out.data_t[p - out.p0], rows, cols, (local / nbx) * 64 + 16 * (lane / 8),
            (local % nbx) * 64 + 8 * (lane % 8)};
  return piece->m < rows && piece->k < cols;
}

// Sixteen W-byte rows of the gathered space, row r at pos + r * pitch: from one address when they
// lie in one run of it and are aligned (every lane but those whose rows cross a shard's or a gather
// piece's edge), else row by row, bytewise where a row crosses an edge or is not aligned.
template <typename W>
__device__ void load_rows(const GatheredSpace& space, int64_t pos, int64_t pitch, W out[kTile]) {
  constexpr int kW = sizeof(W);
  int64_t run;
  const uint8_t* p = space.locate(pos, &run);
  if (run >= (kTile - 1) * pitch + kW && reinterpret_cast<uintptr_t>(p) % kW == 0 && pitch % kW == 0) {
#pragma unroll
    for (int r = 0; r < kTile; ++r) out[r] = *reinterpret_cast<const W*>(p + r * pitch);
    return;
  }
#pragma unroll
  for (int r = 0; r < kTile; ++r) {
    const uint8_t* q = space.locate(pos + r * pitch, &run);
    if (run >= kW && reinterpret_cast<uintptr_t>(q) % kW == 0) {
      out[r] = *reinterpret_cast<const W*>(q);
    } else {  // in registers: a byte array here would put out[] in local memory
      uint64_t v = 0;
      for (int i = 0; i < kW; ++i) v |= uint64_t(space.byte_at(pos + r * pitch + i)) << (8 * i);
      if constexpr (kW == 8) out[r] = make_uint2(static_cast<uint32_t>(v), static_cast<uint32_t>(v >> 32));
      else out[r] = static_cast<W>(v);
    }
  }
}

// FP8 data_t of 64x64-element block b, one warp, in registers: a lane makes sixteen 8-byte loads of
// its piece (the 8 lanes of a row group read 64 contiguous bytes a row), transposes its 16 x 8 bytes
// with 4x4 byte permutes and stores each column's 16 bytes at once (the 4 lanes of a column group
// write 64 contiguous bytes). FP8 weights have any shape and offset: a lane whose piece crosses the
// weight's edge, or whose rows or columns are not aligned for the vectors, moves its bytes one at a
// time. Faster than a shared-memory transpose with single-byte staging, which also needed a memset of the
// whole output (docs/performance.md, "Grouped kernels").
__device__ void byte_transpose_block(const GroupTable& table, int64_t b, const GatheredSpace& data,
                                     const TransposeOutputs& out) {
  TransposePiece pc;
  if (!transpose_piece_at(table, b, GroupTable::kOffset, out, &pc)) return;
  const int64_t src = pc.src + pc.m * pc.cols + pc.k;
  uint8_t* dst = pc.dst + pc.k * pc.rows + pc.m;
  const bool vector = pc.m + 16 <= pc.rows && pc.k + 8 <= pc.cols && pc.cols % 8 == 0 && pc.rows % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  if (vector) {
    uint2 in[kTile];
    load_rows(data, src, pc.cols, in);
    uint32_t t[4][8];  // [row group][column]: the column's bytes of the group's 4 rows
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const uint32_t lo[4] = {in[4 * g].x, in[4 * g + 1].x, in[4 * g + 2].x, in[4 * g + 3].x};
      const uint32_t hi[4] = {in[4 * g].y, in[4 * g + 1].y, in[4 * g + 2].y, in[4 * g + 3].y};
      transpose_bytes4(lo, t[g]);
      transpose_bytes4(hi, t[g] + 4);
    }
#pragma unroll
    for (int q = 0; q < 8; ++q)
      *reinterpret_cast<uint4*>(dst + q * pc.rows) = make_uint4(t[0][q], t[1][q], t[2][q], t[3][q]);
    return;
  }
  const int64_t nr = pc.rows - pc.m < 16 ? pc.rows - pc.m : 16, nc = pc.cols - pc.k < 8 ? pc.cols - pc.k : 8;
  for (int64_t q = 0; q < nc; ++q)
    for (int64_t r = 0; r < nr; ++r) dst[q * pc.rows + r] = data.byte_at(src + r * pc.cols + q);
}

int64_t transpose_ctas(int64_t num_blocks, int per_cta) { return (num_blocks + per_cta - 1) / per_cta; }

// NVFP4 data_t of 64x64-element block b, one warp, in registers: a lane makes sixteen 4-byte loads
// of its piece (the 8 lanes of a row group read one whole 32-byte sector a row), gathers each of its
// 8 columns' 16 nibbles into 8 bytes (column_bytes) and stores them: the 4 lanes of a column group
// fill one output sector. rows, cols % 16 == 0 (the NVFP4 table rule), so a lane's piece is wholly
// inside the weight or wholly outside it. Replaces a shared-memory transpose with single-byte staging
// (docs/performance.md, "Grouped kernels").
__device__ void nibble_transpose_block(const GroupTable& table, int64_t b, const GatheredSpace& data,
                                       const TransposeOutputs& out) {
  TransposePiece pc;
  if (!transpose_piece_at(table, b, GroupTable::kByteBase, out, &pc)) return;
  // Byte bases are multiples of 128, pitches multiples of 8, k / 2 of 4 and m / 2 of 8: the output
  // is aligned, and so is the input except where a shard's part of the space starts unaligned.
  const int64_t pitch = pc.cols / 2, opitch = pc.rows / 2;
  uint32_t rw[kTile];
  load_rows(data, pc.src + pc.m * pitch + pc.k / 2, pitch, rw);
  uint2 cb[8];
  column_bytes<8>(rw, cb);
  uint8_t* dst = pc.dst + pc.k * opitch + pc.m / 2;
#pragma unroll
  for (int q = 0; q < 8; ++q) *reinterpret_cast<uint2*>(dst + q * opitch) = cb[q];
}

constexpr int kWarpsPerCta = kThreads / 32;

// CTAs [0, data_ctas): the packed data transpose, one 64x64 block a warp; the rest grid-stride over
// the columnwise scale strips (group_scale_t_strip).
__global__ void group_columnwise_kernel(const __grid_constant__ GatheredSpace data, const uint8_t* __restrict__ scale_inv,
                                        GroupTable table, int64_t data_ctas, const __grid_constant__ TransposeOutputs out) {
  if (blockIdx.x < data_ctas) {
    const int64_t i = blockIdx.x * int64_t(kWarpsPerCta) + threadIdx.x / 32;
    if (i < out.blocks) nibble_transpose_block(table, out.block0 + i, data, out);
    return;
  }
  const int64_t stride = (int64_t(gridDim.x) - data_ctas) * blockDim.x;
  for (int64_t u = (blockIdx.x - data_ctas) * int64_t(blockDim.x) + threadIdx.x; u < out.strips; u += stride)
    group_scale_t_strip(table, scale_inv, out.strip0 + u, [&](int64_t p) { return out.scale_t[p - out.p0]; });
}

__global__ void fp8_group_transpose_kernel(const __grid_constant__ GatheredSpace data, GroupTable table,
                                           const __grid_constant__ TransposeOutputs out) {
  const int64_t i = blockIdx.x * int64_t(kWarpsPerCta) + threadIdx.x / 32;
  if (i < out.blocks) byte_transpose_block(table, out.block0 + i, data, out);
}

// Launches `kernel(out)` for each batch of kTransposeBatch parameters, filling its TransposeOutputs
// from the results (data_t of parameter p: result p; NVFP4 scale_inv_t: result P + p) and ranges.
template <typename Launch>
void for_each_transpose_batch(ffi::RemainingRets& rets, ffi::Span<const int64_t> ranges, int64_t num_params, bool nvfp4,
                              Launch launch) {
  for (int64_t p0 = 0; p0 < num_params; p0 += kTransposeBatch) {
    const int64_t p1 = std::min<int64_t>(num_params, p0 + kTransposeBatch);
    TransposeOutputs out{};
    for (int64_t p = p0; p < p1; ++p) {
      out.data_t[p - p0] = static_cast<uint8_t*>((*rets.get<ffi::AnyBuffer>(p).value()).untyped_data());
      if (nvfp4)
        out.scale_t[p - p0] = static_cast<uint8_t*>((*rets.get<ffi::AnyBuffer>(num_params + p).value()).untyped_data());
    }
    out.p0 = p0;
    out.block0 = ranges[2 * p0];
    out.blocks = ranges[2 * p1] - out.block0;
    out.strip0 = ranges[2 * p0 + 1];
    out.strips = ranges[2 * p1 + 1] - out.strip0;
    if (out.blocks + out.strips > 0) launch(out);
  }
}

ffi::Error GroupColumnwiseCuda(cudaStream_t stream, ffi::Buffer<ffi::U8> scale_inv, ffi::Buffer<ffi::U32> table_words,
                               ffi::RemainingArgs pieces, ffi::Span<const int64_t> ranges,
                               ffi::Span<const int64_t> space_attr, ffi::RemainingRets rets) {
  GatheredSpace space;
  int64_t num_params;
  int64_t data_t_bytes;
  JQ_RETURN_IF_ERROR(check_group_transpose(pieces, space_attr, table_words, rets, ranges, true, &space, &num_params,
                                           &data_t_bytes));
  if (data_t_bytes != space.size) return invalid("results: the data_t must hold the space's bytes");
  const GroupTable table{as_i64(table_words), num_params};
  for_each_transpose_batch(rets, ranges, num_params, true, [&](const TransposeOutputs& out) {
    const int64_t data_ctas = transpose_ctas(out.blocks, kWarpsPerCta);
    const int64_t grid = data_ctas + (out.strips ? grid_for(out.strips) : 0);
    group_columnwise_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(space, scale_inv.typed_data(), table,
                                                                                  data_ctas, out);
  });
  return last_error("group columnwise kernel");
}

ffi::Error Fp8GroupTransposeCuda(cudaStream_t stream, ffi::Buffer<ffi::U32> table_words, ffi::RemainingArgs pieces,
                                 ffi::Span<const int64_t> ranges, ffi::Span<const int64_t> space_attr,
                                 ffi::RemainingRets rets) {
  GatheredSpace space;
  int64_t num_params;
  int64_t data_t_bytes;
  JQ_RETURN_IF_ERROR(check_group_transpose(pieces, space_attr, table_words, rets, ranges, false, &space, &num_params,
                                           &data_t_bytes));
  if (data_t_bytes > space.size) return invalid("results: more data_t bytes than the flat buffer");
  const GroupTable table{as_i64(table_words), num_params};
  for_each_transpose_batch(rets, ranges, num_params, false, [&](const TransposeOutputs& out) {
    fp8_group_transpose_kernel<<<static_cast<unsigned>(transpose_ctas(out.blocks, kWarpsPerCta)), kThreads, 0,
                                 stream>>>(space, table, out);
  });
  return last_error("fp8 group transpose kernel");
}

// ---- grouped split ---------------------------------------------------------------------------
//
// One launch for up to kSplitBatch segments (a 300-weight group's ~900 results in one): the segments
// travel by value in the kernel parameters (CUDA 12.1+ large kernel parameters, up to 32,764 bytes),
// so the launch needs no host-to-device copy and graphs capture it. Each block copies one
// kSplitChunk-byte chunk of one segment, found by a binary search of the blocks' prefix: big and
// small segments share one balanced grid, and the host pays one launch instead of one per 96
// segments (that host time, not the copy, bounded a 300-weight step).
constexpr int kSplitBatch = 1000;
constexpr int64_t kSplitChunk = 32 * 1024;
struct SplitBatch {
  CopySegment seg[kSplitBatch];
  int32_t first_block[kSplitBatch + 1];  // segment k's chunks are blocks [first_block[k], first_block[k + 1])
  int32_t count;
};
static_assert(sizeof(SplitBatch) <= 32764, "SplitBatch must fit the kernel parameter space");

// 16-byte vectors (four in flight) where source and destination agree modulo 16, single bytes for
// the rest. __grid_constant__: the parameters are read in place, never copied to local memory.
__global__ void split_kernel(const __grid_constant__ SplitBatch batch) {
  const int32_t block = static_cast<int32_t>(blockIdx.x);
  int lo = 0, hi = batch.count;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (batch.first_block[mid] <= block) lo = mid; else hi = mid;
  }
  const CopySegment s = batch.seg[lo];
  const int64_t begin = int64_t(block - batch.first_block[lo]) * kSplitChunk;
  const int64_t n = (s.bytes - begin < kSplitChunk) ? s.bytes - begin : kSplitChunk;
  const uint8_t* __restrict__ src = s.src + begin;
  uint8_t* __restrict__ dst = s.dst + begin;
  const uintptr_t sa = reinterpret_cast<uintptr_t>(src), da = reinterpret_cast<uintptr_t>(dst);
  int64_t head = n, nvec = 0;
  if (sa % 16 == da % 16) {
    head = static_cast<int64_t>((16 - sa % 16) % 16);
    if (head > n) head = n;
    nvec = (n - head) / 16;
  }
  const uint4* __restrict__ src4 = reinterpret_cast<const uint4*>(src + head);
  uint4* __restrict__ dst4 = reinterpret_cast<uint4*>(dst + head);
  const int64_t stride = blockDim.x;
  int64_t i = threadIdx.x;
  for (; i + 3 * stride < nvec; i += 4 * stride) {
    const uint4 a = src4[i], b = src4[i + stride], c = src4[i + 2 * stride], d = src4[i + 3 * stride];
    dst4[i] = a;
    dst4[i + stride] = b;
    dst4[i + 2 * stride] = c;
    dst4[i + 3 * stride] = d;
  }
  for (; i < nvec; i += stride) dst4[i] = src4[i];
  for (int64_t j = threadIdx.x; j < head; j += stride) dst[j] = src[j];
  for (int64_t j = head + 16 * nvec + threadIdx.x; j < n; j += stride) dst[j] = src[j];
}

ffi::Error GroupSplitCuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                          ffi::Span<const int64_t> plan, bool partial) {
  std::vector<CopySegment> segments;
  JQ_RETURN_IF_ERROR(split_segments(args, rets, plan, partial, &segments));
  std::unique_ptr<SplitBatch> batch(new SplitBatch);  // 28 KB: off the host stack
  for (size_t b0 = 0; b0 < segments.size(); b0 += kSplitBatch) {
    const size_t count = std::min<size_t>(kSplitBatch, segments.size() - b0);
    int64_t blocks = 0;
    batch->count = 0;
    for (size_t k = 0; k < count; ++k) {
      const CopySegment& seg = segments[b0 + k];
      if (seg.bytes == 0) continue;
      batch->seg[batch->count] = seg;
      batch->first_block[batch->count++] = static_cast<int32_t>(blocks);
      blocks += (seg.bytes + kSplitChunk - 1) / kSplitChunk;
    }
    if (blocks > INT32_MAX) return invalid("results: a split launch would exceed 2^31 blocks");
    batch->first_block[batch->count] = static_cast<int32_t>(blocks);
    if (blocks > 0) split_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(*batch);
  }
  return last_error("group split kernel");
}

}  // namespace

JQ_DEFINE_GROUP_HANDLERS(Cuda, JQ_CUDA_CTX)

}  // namespace jaxquant
