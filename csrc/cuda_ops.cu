// CUDA FFI handlers of single tensors. Every output unit is computed by the same code as the CPU handlers
// (elementwise.h / numerics.h); the kernels only choose how work maps onto threads. Grouped ops (a ZeRO shard
// of many parameters) are in cuda_group_ops.cu.
#include "jaxquant/cuda_common.cuh"

namespace jaxquant {
namespace {

#include "jaxquant/stage_kernels.cuh"

// ---- FP8 statistics (amax and the non-finite count, one read) --------------------------------
//
// The max is taken on magnitude bits (vector_magnitude_bits): one AND and one integer max an
// element (a packed 16x2 max for bf16). A vector whose largest magnitude could be non-finite
// after the compute-dtype rounding (kNonFiniteBits) goes through the per-element
// ComputeAmax instead (rare: inf/NaN inputs). Rounding to bf16 is monotone and odd, so the max
// of the rounded magnitudes is the rounding of the max magnitude: it is rounded once per thread.

// Folds one 16-byte vector into the running magnitude bits `acc` (fp32: max bits; bf16: packed
// max of 16-bit halves), or into `exact` element by element when it holds a suspect value.
template <bool kBf16, bool kRound>
__device__ __forceinline__ void stats_vector(const uint4 raw, uint32_t& acc, ComputeAmax<kRound>& exact) {
  const uint32_t vm = vector_magnitude_bits<kBf16>(raw);
  const bool suspect = kBf16 ? ((vm + 0x00800080u) & 0x80008000u) != 0  // a half >= 0x7F80 (no carry: halves < 0x8000)
                             : vm >= kNonFiniteBits<kRound>;
  if (__builtin_expect(!suspect, 1)) acc = max_magnitude_bits<kBf16>(acc, vm);
  else exact.add_vector<kBf16>(raw);
}

// Block b reads rounds b, b + gridDim.x, ... of kInFlight x blockDim 16-byte vectors (one round
// each when the grid covers the tensor): a block's loads are one contiguous span, kInFlight a lane
// in flight before the first use (consecutive lanes read consecutive vectors); full rounds
// unpredicated, the last one predicated. Scalar tail grid-strided.
constexpr int kAmaxInFlight = 8;
template <bool kBf16>
constexpr int64_t amax_round_elements() { return int64_t(kAmaxInFlight) * kThreads * (kBf16 ? 8 : 4); }

template <bool kBf16, bool kRound>
__global__ void __launch_bounds__(kThreads) amax_kernel(const void* __restrict__ x, int64_t n, uint32_t* amax_bits,
                                                        int32_t* count) {
  constexpr int kVec = kBf16 ? 8 : 4, kInFlight = kAmaxInFlight;
  uint32_t acc = 0;
  ComputeAmax<kRound> exact;  // suspect vectors and the scalar tail
  const int64_t tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  const bool aligned = (reinterpret_cast<uintptr_t>(x) % 16) == 0;
  const int64_t nvec = aligned ? n / kVec : 0;
  const auto* vx = reinterpret_cast<const uint4*>(x);
  const int64_t per_round = int64_t(kInFlight) * blockDim.x;
  for (int64_t r = blockIdx.x; r * per_round < nvec; r += gridDim.x) {
    const int64_t i0 = r * per_round + threadIdx.x;
    uint4 vs[kInFlight];
    if ((r + 1) * per_round <= nvec) {
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) vs[j] = vx[i0 + j * blockDim.x];
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) stats_vector<kBf16, kRound>(vs[j], acc, exact);
    } else {  // the last round: its loads still all in flight together
#pragma unroll
      for (int j = 0; j < kInFlight; ++j)
        if (i0 + j * blockDim.x < nvec) vs[j] = vx[i0 + j * blockDim.x];
#pragma unroll
      for (int j = 0; j < kInFlight; ++j)
        if (i0 + j * blockDim.x < nvec) stats_vector<kBf16, kRound>(vs[j], acc, exact);
    }
  }
  for (int64_t i = nvec * kVec + tid; i < n; i += stride) exact.add(load_as_float(x, kBf16, i));
  acc = widen_magnitude_bits<kBf16>(acc);
  const float fast = kRound ? round_to_bf16(__uint_as_float(acc)) : __uint_as_float(acc);
  block_publish(fmaxf(exact.result(), fast), exact.nonfinite, amax_bits, count);
}

ffi::Error Fp8StatsCuda(cudaStream_t stream, ffi::AnyBuffer x, bool round_bf16,
                        ffi::Result<ffi::Buffer<ffi::F32>> amax, ffi::Result<ffi::Buffer<ffi::S32>> count) {
  JQ_RETURN_IF_ERROR(check_input(x, "x"));
  JQ_RETURN_IF_ERROR(check_count(*amax, 1, "amax"));
  JQ_RETURN_IF_ERROR(check_count(*count, 1, "count"));
  const int64_t n = static_cast<int64_t>(x.element_count());
  zero_stats(stream, amax->untyped_data(), count->typed_data());
  if (n > 0) {
    auto* bits = reinterpret_cast<uint32_t*>(amax->untyped_data());
    with_input_kind(x, round_bf16, [&](auto b, auto r) {
      auto kernel = amax_kernel<decltype(b)::value, decltype(r)::value>;
      // One round a block, in waves (block order is address order, so the pass ends at the tensor's
      // end, where the cast starts: kLastFirst); measured faster than a resident grid-stride grid.
      constexpr int64_t kRoundElems = amax_round_elements<decltype(b)::value>();
      const int64_t rounds = (n + kRoundElems - 1) / kRoundElems;
      launch_after_prior(kernel, dim3(static_cast<unsigned>(std::min<int64_t>(rounds, 0x7FFFFFFF))), stream,
                         x.untyped_data(), n, bits, count->typed_data());
    });
  }
  return last_error("amax kernel");
}

ffi::Error AmaxCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                    ffi::Result<ffi::Buffer<ffi::S32>> count) {
  return Fp8StatsCuda(stream, x, false, amax, count);
}

// ---- NVFP4 tile amax of a partial shard -----------------------------------------------------

// Elements i..i+7 of a bf16 array as fp32 from one 16-byte load.
__device__ __forceinline__ void load8_bf16(const void* x, int64_t i, float v[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(x) + i);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = __uint_as_float(w[k] << 16);
    v[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
  }
}

// Block: one 16-row tile row x 64 vectors of 16 bytes (256 fp32 or 512 bf16 columns). A thread
// reads one vector of rows rg, rg+4, rg+8, rg+12 (rg = its row group, 0..3); consecutive lanes
// read consecutive vectors, 16/kVec lanes share a tile.
template <bool kBf16>
__global__ void tile_amax_kernel(const void* __restrict__ x, int64_t start, int64_t len, int64_t cols,
                                 int64_t tile_row0, float* __restrict__ tile_amax, int32_t* count) {
  constexpr int kVec = kBf16 ? 8 : 4, kLanesPerTile = kTile / kVec, kTilesPerBlock = 64 / kLanesPerTile;
  __shared__ float part[4][kTilesPerBlock];
  __shared__ int cnt[kThreads / 32];
  const int64_t tile_row = tile_row0 + blockIdx.y, tcols = cols / kTile;
  const int lane64 = threadIdx.x % 64, row_group = threadIdx.x / 64;
  const int64_t col = int64_t(blockIdx.x) * 64 * kVec + lane64 * kVec;
  float m = 0.0f;
  int c = 0;
  if (col < cols) {  // cols % 16 == 0, so the whole vector is inside
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t e = (tile_row * kTile + row_group + 4 * i) * cols + col;
      if (e + kVec <= start || e >= start + len) continue;
      float v[kVec];
      const int64_t j = e - start;
      const bool vec = e >= start && e + kVec <= start + len &&
                       (reinterpret_cast<uintptr_t>(x) + uint64_t(j) * (kBf16 ? 2 : 4)) % 16 == 0;
      if (vec && kBf16) {
        load8_bf16(x, j, v);
      } else if (vec) {
        load4(x, false, j, true, v);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) v[k] = (e + k >= start && e + k < start + len) ? load_as_float(x, kBf16, j + k) : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        m = fmaxf(m, abs_ignoring_nan(v[k]));
        c += !is_finite(v[k]);
      }
    }
  }
  for (int o = 1; o < kLanesPerTile; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  c = warp_sum(c);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane % kLanesPerTile == 0) part[row_group][lane64 / kLanesPerTile] = m;
  if (lane == 0) cnt[warp] = c;
  __syncthreads();
  if (threadIdx.x < kTilesPerBlock) {
    const int t = threadIdx.x;
    const int64_t tcol = int64_t(blockIdx.x) * kTilesPerBlock + t;
    if (tcol < tcols)
      tile_amax[tile_row * tcols + tcol] = fmaxf(fmaxf(part[0][t], part[1][t]), fmaxf(part[2][t], part[3][t]));
  }
  if (threadIdx.x == 0) {
    int total = 0;
    for (int w = 0; w < kThreads / 32; ++w) total += cnt[w];
    if (total) atomicAdd(count, total);
  }
}

ffi::Error TileAmaxCuda(cudaStream_t stream, ffi::AnyBuffer x, int64_t rows, int64_t cols, int64_t start,
                        ffi::Result<ffi::Buffer<ffi::F32>> tile_amax, ffi::Result<ffi::Buffer<ffi::S32>> count) {
  JQ_RETURN_IF_ERROR(check_tile_amax(x, rows, cols, start, *tile_amax));
  const int64_t len = static_cast<int64_t>(x.element_count());
  cudaMemsetAsync(tile_amax->untyped_data(), 0, tile_amax->size_bytes(), stream);
  cudaMemsetAsync(count->untyped_data(), 0, sizeof(int32_t), stream);
  if (len > 0) {
    // Only the tile rows the shard touches.
    const int64_t first = start / cols / kTile, last = (start + len - 1) / cols / kTile;
    if (last - first + 1 > 65535) return invalid("rows: more than 65535 tile rows in one shard");
    const bool bf16 = x.element_type() == ffi::DataType::BF16;
    const int64_t block_cols = bf16 ? 512 : 256;
    dim3 grid(static_cast<unsigned>((cols + block_cols - 1) / block_cols), static_cast<unsigned>(last - first + 1));
    if (bf16)
      tile_amax_kernel<true><<<grid, kThreads, 0, stream>>>(x.untyped_data(), start, len, cols, first,
                                                           tile_amax->typed_data(), count->typed_data());
    else
      tile_amax_kernel<false><<<grid, kThreads, 0, stream>>>(x.untyped_data(), start, len, cols, first,
                                                            tile_amax->typed_data(), count->typed_data());
  }
  return last_error("tile amax kernel");
}

// ---- NVFP4 scales ---------------------------------------------------------------------------

__global__ void scale_kernel(const float* __restrict__ tile_amax, const float* amax, int64_t rows, int64_t cols,
                             uint8_t* __restrict__ out) {
  const int64_t pc = nvfp4_scale_cols(cols), total = nvfp4_scale_rows(rows) * pc;
  const float s_enc = nvfp4_global_encode_scale(amax[0]);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = scale_entry(tile_amax, rows, cols, s_enc, i / pc, i % pc);
}

ffi::Error ScaleCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> tile_amax, ffi::Buffer<ffi::F32> amax,
                     ffi::Result<ffi::Buffer<ffi::U8>> scale_inv) {
  int64_t rows, cols;
  JQ_RETURN_IF_ERROR(check_scale(tile_amax, amax, *scale_inv, &rows, &cols));
  scale_kernel<<<grid_for(nvfp4_scale_rows(rows) * nvfp4_scale_cols(cols)), kThreads, 0, stream>>>(
      tile_amax.typed_data(), amax.typed_data(), rows, cols, scale_inv->typed_data());
  return last_error("scale kernel");
}

__global__ void scale_transpose_kernel(const uint8_t* __restrict__ scale_inv, int64_t rows, int64_t cols,
                                       uint8_t* __restrict__ out) {
  const int64_t pc = nvfp4_scale_cols(rows), total = nvfp4_scale_rows(cols) * pc;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = scale_t_entry(scale_inv, rows, cols, i / pc, i % pc);
}

ffi::Error ScaleTransposeCuda(cudaStream_t stream, ffi::Buffer<ffi::U8> scale_inv, int64_t rows, int64_t cols,
                              ffi::Result<ffi::Buffer<ffi::U8>> scale_inv_t) {
  JQ_RETURN_IF_ERROR(check_scale_transpose(scale_inv, rows, cols, *scale_inv_t));
  scale_transpose_kernel<<<grid_for(nvfp4_scale_rows(cols) * nvfp4_scale_cols(rows)), kThreads, 0, stream>>>(
      scale_inv.typed_data(), rows, cols, scale_inv_t->typed_data());
  return last_error("scale transpose kernel");
}

// ---- NVFP4 partial cast ---------------------------------------------------------------------

// A thread owns 8 consecutive bytes of the global packed data (16 elements, aligned to 16 in the
// row-major element order, so one row and one tile): one scale lookup and one division per thread.
// Interior groups use vector loads and one 8-byte store where the addresses allow.
// The encode multiplier depends only on the tile's E4M3 scale byte, so each block tabulates it
// for all 256 bytes once (the same nvfp4_tile_encode, so the same bits).
template <bool kIndex32>
__global__ void cast_partial_kernel(PartialCast pc, const float* amax, int64_t first_byte, int64_t nbytes,
                                    const uint8_t* in, uint8_t* out) {
  __shared__ float enc_table[256];
  pc.s_dec = 1.0f / nvfp4_global_encode_scale(amax[0]);
  enc_table[threadIdx.x] = nvfp4_tile_encode(static_cast<uint8_t>(threadIdx.x), pc.s_dec);  // blockDim == 256
  __syncthreads();
  const int64_t group0 = first_byte / 8, groups = (first_byte + nbytes + 7) / 8 - group0;
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < groups; g += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b0 = (group0 + g) * 8, e0 = 2 * b0, i0 = b0 - first_byte;
    int64_t row, col;
    if (kIndex32) {  // 32-bit division is far cheaper than 64-bit on the GPU
      row = uint32_t(e0) / uint32_t(pc.cols);
      col = uint32_t(e0) - uint32_t(row) * uint32_t(pc.cols);
    } else {
      row = e0 / pc.cols;
      col = e0 - row * pc.cols;
    }
    const float enc = enc_table[pc.scale_inv[row * pc.scale_cols + col / kTile]];
    const bool whole = e0 >= pc.start && e0 + 16 <= pc.start + pc.len;
    if (whole) {
      uint32_t word[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v[8];
        const int64_t j = e0 + 8 * h - pc.start;
        load4(pc.x, pc.is_bf16, j, aligned4(pc.x, pc.is_bf16, j), v);
        load4(pc.x, pc.is_bf16, j + 4, aligned4(pc.x, pc.is_bf16, j + 4), v + 4);
        word[h] = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) word[h] |= uint32_t(e2m1_pair(v[2 * k] * enc, v[2 * k + 1] * enc)) << (8 * k);
      }
      uint8_t* dst = out + i0;
      if (reinterpret_cast<uintptr_t>(dst) % 8 == 0) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(word[0], word[1]);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) dst[k] = uint8_t(word[k / 4] >> (8 * (k % 4)));
      }
      continue;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t i = i0 + k;
      if (i < 0 || i >= nbytes) continue;
      out[i] = pc.byte(b0 + k, enc, in[i]);  // boundary group: keep the neighbour's nibbles
    }
  }
}

ffi::Error CastPartialCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> bytes,
                           ffi::Buffer<ffi::U8> scale_inv, ffi::Buffer<ffi::F32> amax, int64_t rows, int64_t cols,
                           int64_t start, ffi::Result<ffi::Buffer<ffi::U8>> out) {
  JQ_RETURN_IF_ERROR(check_partial_cast(x, bytes, scale_inv, amax, *out, rows, cols, start));
  const int64_t nbytes = static_cast<int64_t>(bytes.element_count());
  if (nbytes == 0) return ffi::Error::Success();
  // `out` may alias `bytes`; a thread reads a boundary byte of `bytes` before writing it.
  PartialCast pc{x.untyped_data(), x.element_type() == ffi::DataType::BF16, start,
                 static_cast<int64_t>(x.element_count()), cols, nvfp4_scale_cols(cols), scale_inv.typed_data(),
                 0.0f /* s_dec: set in the kernel from the device-resident amax */};
  const int64_t first = start / 2, groups = (first + nbytes + 7) / 8 - first / 8;
  if (rows * cols < (int64_t(1) << 32))
    cast_partial_kernel<true><<<grid_for(groups), kThreads, 0, stream>>>(pc, amax.typed_data(), first, nbytes,
                                                                        bytes.typed_data(), out->typed_data());
  else
    cast_partial_kernel<false><<<grid_for(groups), kThreads, 0, stream>>>(pc, amax.typed_data(), first, nbytes,
                                                                         bytes.typed_data(), out->typed_data());
  return last_error("cast partial kernel");
}

// ---- NVFP4 packed transpose -----------------------------------------------------------------

// Block: 64 rows (m) x 64 columns (k) of elements. Codes are unpacked into shared memory from
// 4-byte loads of `data` and repacked along m into 4-byte stores of the transpose; tiles at the
// edge (M or K not a multiple of 64) go byte by byte.
__global__ void transpose_kernel(const uint8_t* __restrict__ data, int64_t rows, int64_t cols,
                                 uint8_t* __restrict__ out) {
  __shared__ uint8_t codes[64][64 + 4];
  const int64_t m0 = int64_t(blockIdx.y) * 64, k0 = int64_t(blockIdx.x) * 64;
  const int64_t in_half = cols / 2, out_half = rows / 2;
  const bool full = m0 + 64 <= rows && k0 + 64 <= cols && in_half % 4 == 0 && out_half % 4 == 0;
  if (full) {
    for (int i = threadIdx.x; i < 64 * 8; i += blockDim.x) {
      const int dm = i / 8, w = i % 8;
      const uint32_t v = *reinterpret_cast<const uint32_t*>(data + (m0 + dm) * in_half + k0 / 2 + 4 * w);
#pragma unroll
      for (int k = 0; k < 8; ++k) codes[dm][8 * w + k] = (v >> (4 * k)) & 0xFu;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 64 * 8; i += blockDim.x) {
      const int dk = i / 8, w = i % 8;
      uint32_t v = 0;
#pragma unroll
      for (int k = 0; k < 8; ++k) v |= uint32_t(codes[8 * w + k][dk]) << (4 * k);
      *reinterpret_cast<uint32_t*>(out + (k0 + dk) * out_half + m0 / 2 + 4 * w) = v;
    }
    return;
  }
  for (int i = threadIdx.x; i < 64 * 32; i += blockDim.x) {
    const int dk = i / 32, db = i % 32;
    const int64_t k = k0 + dk, mb = m0 / 2 + db;
    if (k < cols && mb < out_half) out[k * out_half + mb] = transpose_byte(data, cols, k, mb);
  }
}

ffi::Error TransposeCuda(cudaStream_t stream, ffi::Buffer<ffi::U8> data, ffi::Result<ffi::Buffer<ffi::U8>> data_t) {
  int64_t rows, cols;
  JQ_RETURN_IF_ERROR(check_transpose(data, *data_t, &rows, &cols));
  dim3 grid(static_cast<unsigned>((cols + 63) / 64), static_cast<unsigned>((rows + 63) / 64));
  transpose_kernel<<<grid, kThreads, 0, stream>>>(data.typed_data(), rows, cols, data_t->typed_data());
  return last_error("transpose kernel");
}

// ---- NVFP4 bf16 operand ----------------------------------------------------------------------

// One read of x, one bf16 write, for the GEMM operand value(q) * s8 of a weight quantized with a given global amax.
// The block items of the statistics and cast passes (Nvfp4Block: a lane holds 16 rows x kVec columns of one tile,
// every load in flight before the first use); the tile's amax is taken as nvfp4_stats_kernel takes it
// (lane_tile_amax, then a max over the tile's lanes), its scale and encode multiplier as nvfp4_quantize_kernel
// derives them, and each code decoded to bf16 (nvfp4_blockwise_bf16): the bytes of the two passes and the decode,
// without the packed data or the scales in memory.
template <bool kBf16, bool kRound>
__global__ void __launch_bounds__(kThreads) nvfp4_bf16_operand_kernel(const void* __restrict__ x, int64_t rows,
                                                                      int64_t cols, bool aligned, const float* amax,
                                                                      uint16_t* __restrict__ out) {
  using B = Nvfp4Block<kBf16>;
  constexpr int kVec = B::kVec;
  const B blk(rows, cols, blockIdx.y);
  uint4 raw[kTile];
  float t = 0.0f;
  if (blk.valid) {
    blk.load(x, cols, aligned, raw);
    int nonfinite = 0;   // not reported: the statistics pass that found the amax counted them
    t = lane_tile_amax<kBf16, kRound>(raw, &nonfinite);
  }
  // every lane takes part in the shuffles (a tile's lanes are all valid or all not: cols % 16 == 0)
#pragma unroll
  for (int o = 1; o < B::kLanesPerTile; o <<= 1) t = fmaxf(t, __shfl_xor_sync(0xFFFFFFFFu, t, o));
  if (!blk.valid) return;
  const float s_enc = nvfp4_global_encode_scale(amax[0]), s_dec = 1.0f / s_enc;
  const uint8_t s8 = nvfp4_tile_scale_bits(t, s_enc);
  const float enc = nvfp4_tile_encode(s8, s_dec), s8f = e4m3_to_float(s8);
  uint16_t* dst = out + blk.tile_row * kTile * cols + blk.col;
#pragma unroll
  for (int r = 0; r < kTile; ++r) {
    float v[kVec];
    to_compute<kBf16, kRound, true>(raw[r], v);
    const uint32_t codes = e2m1_row<kVec>(raw[r], v, enc);  // element k in bits 4k..4k+3
    uint32_t w[kVec / 2];
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k)
      w[k] = uint32_t(nvfp4_blockwise_bf16((codes >> (8 * k)) & 0xFu, s8f)) |
             (uint32_t(nvfp4_blockwise_bf16((codes >> (8 * k + 4)) & 0xFu, s8f)) << 16);
    if constexpr (kVec == 8)
      *reinterpret_cast<uint4*>(dst + r * cols) = make_uint4(w[0], w[1], w[2], w[3]);
    else
      *reinterpret_cast<uint2*>(dst + r * cols) = make_uint2(w[0], w[1]);
  }
}

ffi::Error Nvfp4Bf16OperandCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax, bool round_bf16,
                                ffi::Result<ffi::Buffer<ffi::BF16>> out) {
  int64_t rows, cols;
  JQ_RETURN_IF_ERROR(check_nvfp4_bf16_operand(x, amax, *out, &rows, &cols));
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  const bool aligned = reinterpret_cast<uintptr_t>(x.untyped_data()) % 16 == 0;
  JQ_RETURN_IF_ERROR(launch_on_nvfp4_grid(bf16, round_bf16, rows, cols, [&](auto b, auto r, dim3 grid) {
    constexpr bool kBf16 = decltype(b)::value, kRound = decltype(r)::value;
    // an ordinary launch: x and amax may come from the kernel just before
    nvfp4_bf16_operand_kernel<kBf16, kRound><<<grid, kThreads, 0, stream>>>(
        x.untyped_data(), rows, cols, aligned, amax.typed_data(), reinterpret_cast<uint16_t*>(out->untyped_data()));
  }));
  return last_error("nvfp4 bf16 operand kernel");
}

}  // namespace

JQ_DEFINE_TENSOR_HANDLERS(Cuda, JQ_CUDA_CTX)

}  // namespace jaxquant
