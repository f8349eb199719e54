// CUDA kernels and FFI handlers of the fused single-tensor stages (FP8 cast with and without the
// transpose, NVFP4 statistics and NVFP4 quantize). Included by cuda_ops.cu inside its anonymous
// namespace, after the shared device helpers of cuda_common.cuh (block_publish, fp8_quad_signed,
// input_signs, e2m1_row, Fp8Params), which compute every output unit with the numerics.h rules (or the
// hardware conversions that match them); the kernels here only choose the data movement.
//
// Template parameters: kBf16 (input is bf16) and kRound (fp32 input rounded to bf16 where it is
// loaded: the compute dtype, docs/numerics.md §2 "Compute dtype"; never set with kBf16).
// Needs <type_traits> (included by cuda_common.cuh at file scope); load_raw16 and to_compute are
// cuda_common.cuh's, as are transpose_bytes4 and column_bytes (the grouped kernels use them too).
#pragma once

// kLastFirst: the cast kernels read their input last part first. The statistics pass before them
// (amax_kernel, nvfp4_stats_kernel) reads it first part first, so the tail it read last is still in
// L2 when the cast starts there, and the second read of that part is served from L2 instead of HBM.
// Only the order of the blocks' work changes, never a byte of the output.

// ---- FP8 rowwise cast ------------------------------------------------------------------------

// A warp converts 4 x 32 consecutive 16-byte input vectors an iteration: each lane issues its four
// loads (vectors lane, 32 + lane, ...) before any use, so every load and store instruction of the
// warp covers one contiguous span (512 input bytes; 128 or 256 output bytes). Unaligned buffers
// and the tail go element by element.
template <bool kBf16, bool kRound>
__global__ void __launch_bounds__(kThreads) fp8_rows_kernel(const void* __restrict__ x, int64_t n, Fp8Params p,
                                                            bool aligned, uint8_t* __restrict__ out) {
  constexpr int kVec = kBf16 ? 8 : 4, kLoads = 4, kWarpElems = 32 * kLoads * kVec;
  wait_for_prior_grid();  // launch_after_prior: the amax comes from the kernel before
  const float scale = p.scale();
  const int64_t spans = aligned ? n / kWarpElems : 0;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const auto* vx = static_cast<const uint4*>(x);
  for (int64_t g = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; g < spans; g += warps) {
    const int64_t w = spans - 1 - g;  // last span first: see kLastFirst
    uint4 raw[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) raw[j] = vx[(w * kLoads + j) * 32 + lane];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      float v[kVec];
      to_compute<kBf16, kRound>(raw[j], v);
      const int64_t vi = (w * kLoads + j) * 32 + lane;
      const uint32_t q0 = fp8_quad_signed(v, scale, p.e5m2, input_signs<kBf16>(raw[j], v));
      if (kBf16)
        reinterpret_cast<uint2*>(out)[vi] =
            make_uint2(q0, fp8_quad_signed(v + 4, scale, p.e5m2, input_signs<kBf16>(raw[j], v, 1)));
      else
        reinterpret_cast<uint32_t*>(out)[vi] = q0;
    }
  }
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = spans * kWarpElems + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride)
    out[i] = fp8_encode(load_compute(x, kBf16, kRound, i) * scale, p.e5m2);
}

// ---- FP8 rowwise + transposed cast, one pass -------------------------------------------------

// Block: a 64x64 tile. Loads first (4 fp32 or 2 bf16 16-byte vectors a thread), rowwise bytes
// stored straight from registers and kept in shared memory; then each thread gathers 16 rows of
// one column into a 16-byte store of the transpose (4 lanes write 64 contiguous bytes).
// Full interior tiles take the vector path; edge tiles (or unaligned shapes) go element by element.
constexpr int kFp8T = 64;
template <bool kBf16, bool kRound>
__global__ void __launch_bounds__(kThreads) fp8_rows_cols_kernel(const void* __restrict__ x, int64_t rows,
                                                                 int64_t cols, Fp8Params p, bool aligned,
                                                                 uint8_t* __restrict__ out,
                                                                 uint8_t* __restrict__ out_t) {
  constexpr int kVec = kBf16 ? 8 : 4, kPerRow = kFp8T / kVec, kLoads = kFp8T * kPerRow / kThreads;
  constexpr int kWords = kFp8T / 4 + 1;  // one padding word a row
  __shared__ uint32_t tile[kFp8T][kWords];
  wait_for_prior_grid();  // launch_after_prior: the amax comes from the kernel before
  const float scale = p.scale();
  // last tile first: see kLastFirst
  const int64_t r0 = int64_t(gridDim.y - 1 - blockIdx.y) * kFp8T, c0 = int64_t(gridDim.x - 1 - blockIdx.x) * kFp8T;
  const bool full = aligned && r0 + kFp8T <= rows && c0 + kFp8T <= cols;
  if (full) {
    const auto* in = static_cast<const uint8_t*>(x);
    uint4 raw[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int v = threadIdx.x + j * kThreads, dr = v / kPerRow, dc = (v % kPerRow) * kVec;
      raw[j] = load_raw16<kBf16>(in + ((r0 + dr) * cols + c0 + dc) * (kBf16 ? 2 : 4), true);
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int v = threadIdx.x + j * kThreads, dr = v / kPerRow, dc = (v % kPerRow) * kVec;
      float f[kVec];
      to_compute<kBf16, kRound>(raw[j], f);
      uint8_t* dst = out + (r0 + dr) * cols + c0 + dc;
      const uint32_t q0 = fp8_quad_signed(f, scale, p.e5m2, input_signs<kBf16>(raw[j], f));
      tile[dr][dc / 4] = q0;
      if (kBf16) {
        const uint32_t q1 = fp8_quad_signed(f + 4, scale, p.e5m2, input_signs<kBf16>(raw[j], f, 1));
        tile[dr][dc / 4 + 1] = q1;
        *reinterpret_cast<uint2*>(dst) = make_uint2(q0, q1);
      } else {
        *reinterpret_cast<uint32_t*>(dst) = q0;
      }
    }
    __syncthreads();
    const int c = threadIdx.x / 4, dr0 = (threadIdx.x % 4) * 16;
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w[k] = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) w[k] |= ((tile[dr0 + 4 * k + b][c / 4] >> (8 * (c % 4))) & 0xFFu) << (8 * b);
    }
    *reinterpret_cast<uint4*>(out_t + (c0 + c) * rows + r0 + dr0) = make_uint4(w[0], w[1], w[2], w[3]);
    return;
  }
  auto* bytes = reinterpret_cast<uint8_t*>(tile);  // [kFp8T][kWords * 4]
  for (int i = threadIdx.x; i < kFp8T * kFp8T; i += blockDim.x) {
    const int dr = i / kFp8T, dc = i % kFp8T;
    const int64_t r = r0 + dr, c = c0 + dc;
    if (r < rows && c < cols) {
      const uint8_t q = fp8_encode(load_compute(x, kBf16, kRound, r * cols + c) * scale, p.e5m2);
      out[r * cols + c] = q;
      bytes[dr * kWords * 4 + dc] = q;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kFp8T * kFp8T; i += blockDim.x) {
    const int dc = i / kFp8T, dr = i % kFp8T;
    const int64_t r = r0 + dr, c = c0 + dc;
    if (r < rows && c < cols) out_t[c * rows + r] = bytes[dr * kWords * 4 + dc];
  }
}

void launch_fp8_cast(cudaStream_t stream, const void* x, bool bf16, bool round_bf16, int64_t rows, int64_t cols,
                     const Fp8Params& p, uint8_t* out, uint8_t* out_t) {
  const uintptr_t in_addr = reinterpret_cast<uintptr_t>(x);
  with_input_kind(bf16, round_bf16, [&](auto b, auto r) {
    constexpr bool kBf16 = decltype(b)::value, kRound = decltype(r)::value;
    if (out_t == nullptr) {
      const int64_t n = rows * cols;
      const bool aligned = in_addr % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
      // One span a warp (the kernel grid-strides past 2^31 - 1 blocks); n == 0 still launches one
      // block so that scale_inv is written. A resident grid-striding grid measured 2-4% slower in wall
      // clock (docs/decisions.md, "The FP8 rowwise cast launches one warp span per warp").
      const int64_t blocks = std::min<int64_t>(n / (kThreads * (kBf16 ? 32 : 16)) + 1, 0x7FFFFFFF);
      launch_after_prior(fp8_rows_kernel<kBf16, kRound>, dim3(static_cast<unsigned>(blocks)), stream, x, n, p,
                         aligned, out);
    } else {
      const bool aligned = in_addr % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                           reinterpret_cast<uintptr_t>(out_t) % 16 == 0 && rows % 16 == 0 && cols % 16 == 0;
      dim3 grid(static_cast<unsigned>(std::max<int64_t>((cols + kFp8T - 1) / kFp8T, 1)),
                static_cast<unsigned>(std::max<int64_t>((rows + kFp8T - 1) / kFp8T, 1)));
      launch_after_prior(fp8_rows_cols_kernel<kBf16, kRound>, grid, stream, x, rows, cols, p, aligned, out, out_t);
    }
  });
}

ffi::Error Fp8CastImpl(cudaStream_t stream, ffi::AnyBuffer& x, ffi::Buffer<ffi::F32>& amax, float eps, bool pow2,
                       bool round_bf16, ffi::AnyBuffer& data, ffi::Buffer<ffi::F32>& scale_inv, ffi::AnyBuffer* data_t) {
  bool e5m2;
  JQ_RETURN_IF_ERROR(check_fp8_cast(x, amax, data, data_t, &e5m2));
  const Fp8Params p{amax.typed_data(), e5m2 ? kE5M2Max : kE4M3Max, eps, pow2, e5m2, scale_inv.typed_data()};
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t rows = data_t ? x.dimensions()[0] : n, cols = data_t ? x.dimensions()[1] : 1;
  launch_fp8_cast(stream, x.untyped_data(), x.element_type() == ffi::DataType::BF16, round_bf16, rows, cols, p,
                  static_cast<uint8_t*>(data.untyped_data()),
                  data_t ? static_cast<uint8_t*>(data_t->untyped_data()) : nullptr);
  return last_error("fp8 cast kernel");
}

ffi::Error Fp8CastCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax, float eps, bool pow2,
                       ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::Buffer<ffi::F32>> scale_inv) {
  return Fp8CastImpl(stream, x, amax, eps, pow2, false, *data, *scale_inv, nullptr);
}

ffi::Error Fp8CastTCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax, float eps, bool pow2,
                        ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                        ffi::Result<ffi::AnyBuffer> data_t) {
  return Fp8CastImpl(stream, x, amax, eps, pow2, false, *data, *scale_inv, &*data_t);
}

ffi::Error Fp8QuantizeCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax, float eps, bool pow2,
                           bool round_bf16, ffi::Result<ffi::AnyBuffer> data,
                           ffi::Result<ffi::Buffer<ffi::F32>> scale_inv) {
  return Fp8CastImpl(stream, x, amax, eps, pow2, round_bf16, *data, *scale_inv, nullptr);
}

ffi::Error Fp8QuantizeTCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax, float eps, bool pow2,
                            bool round_bf16, ffi::Result<ffi::AnyBuffer> data,
                            ffi::Result<ffi::Buffer<ffi::F32>> scale_inv, ffi::Result<ffi::AnyBuffer> data_t) {
  return Fp8CastImpl(stream, x, amax, eps, pow2, round_bf16, *data, *scale_inv, &*data_t);
}

// ---- NVFP4 statistics and quantize -----------------------------------------------------------
//
// Block item: 64 rows (4 tile rows) x kSpan columns, 8 warps. Warp w covers tile row w % 4 and
// column half w / 4; each lane holds 16 rows x kVec columns (one 16-byte vector a row, all 16
// loads in flight together), so a tile spans 16 / kVec neighbouring lanes and a warp's loads of
// one row are 512 contiguous bytes.

template <bool kBf16>
struct Nvfp4Block {
  static constexpr int kVec = kBf16 ? 8 : 4, kLanesPerTile = kTile / kVec, kSpan = 2 * 32 * kVec;
  static constexpr int kTileCols = kSpan / kTile;  // tile columns of a block item
  int warp, lane;
  int64_t tile_row, col;  // this lane's tile row and first column
  bool valid;

  // item_row: the 64-row block item (blockIdx.y, or a grid-stride index)
  __device__ Nvfp4Block(int64_t rows, int64_t cols, int64_t item_row)
      : warp(threadIdx.x / 32), lane(threadIdx.x % 32),
        tile_row(item_row * 4 + warp % 4),
        col(int64_t(blockIdx.x) * kSpan + (warp / 4) * 32 * kVec + lane * kVec),
        valid(tile_row < rows / kTile && col < cols) {}

  // Column of this lane's first element inside the block item.
  __device__ int block_col() const { return (warp / 4) * 32 * kVec + lane * kVec; }

  __device__ void load(const void* x, int64_t cols, bool aligned, uint4 raw[kTile]) const {
    constexpr int64_t kSize = kBf16 ? 2 : 4;
    const auto* base = static_cast<const uint8_t*>(x) + (tile_row * kTile * cols + col) * kSize;
#pragma unroll
    for (int r = 0; r < kTile; ++r) raw[r] = load_raw16<kBf16>(base + r * cols * kSize, aligned);
  }
};

// A lane's share of its tile's amax from the 16 rows it loaded (the max over the tile's lanes follows): the magnitude
// bits' max, one AND and one integer max an element (vector_magnitude_bits; kRound: the max rounded once,
// docs/numerics.md §2 "Compute dtype"); only a lane whose rows hold a value non-finite in the compute dtype takes
// them again element by element (ComputeAmax), whose non-finite count is added to *nonfinite.
template <bool kBf16, bool kRound>
__device__ __forceinline__ float lane_tile_amax(const uint4 (&raw)[kTile], int* nonfinite) {
  uint32_t acc = 0;
#pragma unroll
  for (int r = 0; r < kTile; ++r) acc = max_magnitude_bits<kBf16>(acc, vector_magnitude_bits<kBf16>(raw[r]));
  const uint32_t top = widen_magnitude_bits<kBf16>(acc);
  if (__builtin_expect(top < kNonFiniteBits<kRound>, 1))
    return kRound ? round_to_bf16(__uint_as_float(top)) : __uint_as_float(top);
  ComputeAmax<kRound> exact;
#pragma unroll
  for (int r = 0; r < kTile; ++r) exact.add_vector<kBf16>(raw[r]);
  *nonfinite += exact.nonfinite;
  return exact.result();
}

// Grid-stride over 64-row block items (gridDim.y of them at a time; the launcher caps it for bf16):
// with one item per block, bf16 input ran in ~6 short waves at 8192² whose fixed latency was as long
// as their transfer; a block publishes its amax and count once. A lane's 16 rows are all in flight
// before the first use, and they stay live until the tile's max is known: only a tile holding a
// value that is non-finite in the compute dtype is taken again element by element (ComputeAmax),
// the rest costs one AND and one integer max an element (vector_magnitude_bits; kRound: the max
// rounded once, docs/numerics.md §2 "Compute dtype").
template <bool kBf16, bool kRound>
__global__ void __launch_bounds__(kThreads, 3) nvfp4_stats_kernel(const void* __restrict__ x, int64_t rows,
                                                               int64_t cols, bool aligned,
                                                               float* __restrict__ tile_amax, uint32_t* amax_bits,
                                                               int32_t* count) {
  using B = Nvfp4Block<kBf16>;
  float m = 0.0f;
  int c = 0;
  for (int64_t item = blockIdx.y; item < (rows + 63) / 64; item += gridDim.y) {
    const B blk(rows, cols, item);
    float t = 0.0f;
    if (blk.valid) {
      uint4 raw[kTile];
      blk.load(x, cols, aligned, raw);
      t = lane_tile_amax<kBf16, kRound>(raw, &c);
    }
    m = fmaxf(m, t);
#pragma unroll
    for (int o = 1; o < B::kLanesPerTile; o <<= 1) t = fmaxf(t, __shfl_xor_sync(0xFFFFFFFFu, t, o));
    if (blk.valid && blk.lane % B::kLanesPerTile == 0) tile_amax[blk.tile_row * (cols / kTile) + blk.col / kTile] = t;
  }
  block_publish(m, c, amax_bits, count);
}

// Zeroes the padding rows [rows, ru(rows, 128)) of a padded scale array [*, pc] (grid-stride).
__device__ void zero_scale_padding_rows(uint8_t* scale, int64_t rows, int64_t pc) {
  const int64_t first = rows * pc, total = (nvfp4_scale_rows(rows) - rows) * pc;
  const int64_t tid = (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * gridDim.y * blockDim.x;
  for (int64_t i = tid; i < total; i += stride) scale[first + i] = 0;
}

// One read of x writes data, scale_inv and (kColumnwise) data_t, scale_inv_t. Tile scales come
// from tile_amax and amax in the kernel (nvfp4_tile_scale_bits / nvfp4_tile_encode). The tile
// scales of the block item and the column-packed codes go through shared memory so that the
// scale rows and the transpose are written in whole 32-byte sectors.
template <bool kBf16, bool kRound, bool kColumnwise>
__global__ void __launch_bounds__(kThreads) nvfp4_quantize_kernel(const void* __restrict__ x, int64_t rows,
                                                                  int64_t cols, bool aligned,
                                                                  const float* __restrict__ tile_amax,
                                                                  const float* amax, uint8_t* __restrict__ data,
                                                                  uint8_t* __restrict__ scale_inv,
                                                                  uint8_t* __restrict__ data_t,
                                                                  uint8_t* __restrict__ scale_inv_t) {
  using B = Nvfp4Block<kBf16>;
  constexpr int kVec = B::kVec;
  wait_for_prior_grid();  // launch_after_prior: tile_amax and amax come from the kernel before
  __shared__ uint8_t s8_tile[4][B::kTileCols];
  // [tile row][padded column]: one spare entry after every kVec columns makes a warp's stores of one
  // q (lanes kVec columns apart) conflict-free, and 4 more a row put the 4 tile rows that the
  // transposed-code reads mix 8 banks apart
  constexpr int kRowEntries = B::kSpan + B::kSpan / kVec + 4;
  __shared__ uint2 codes_t[kColumnwise ? 4 : 1][kColumnwise ? kRowEntries : 1];
  const auto padded_col = [](int c) { return c + c / kVec; };
  const int64_t trows = rows / kTile, tcols = cols / kTile, pc = nvfp4_scale_cols(cols);
  zero_scale_padding_rows(scale_inv, rows, pc);
  if (kColumnwise) zero_scale_padding_rows(scale_inv_t, cols, nvfp4_scale_cols(rows));
  const float s_enc = nvfp4_global_encode_scale(amax[0]), s_dec = 1.0f / s_enc;
  const int64_t item = gridDim.y - 1 - blockIdx.y;  // last block item first: see kLastFirst
  const B blk(rows, cols, item);
  uint32_t rw[kTile];  // row r's kVec codes, 4 bits each
  if (blk.valid) {
    uint4 raw[kTile];
    blk.load(x, cols, aligned, raw);
    const uint8_t s8 = nvfp4_tile_scale_bits(tile_amax[blk.tile_row * tcols + blk.col / kTile], s_enc);
    const float enc = nvfp4_tile_encode(s8, s_dec);
    if (blk.lane % B::kLanesPerTile == 0) s8_tile[blk.warp % 4][blk.block_col() / kTile] = s8;
    uint8_t* dst = data + (blk.tile_row * kTile * cols + blk.col) / 2;
#pragma unroll
    for (int r = 0; r < kTile; ++r) {
      float v[kVec];
      to_compute<kBf16, kRound, true>(raw[r], v);
      rw[r] = e2m1_row<kVec>(raw[r], v, enc);
      if (kBf16)
        *reinterpret_cast<uint32_t*>(dst + r * cols / 2) = rw[r];
      else
        *reinterpret_cast<uint16_t*>(dst + r * cols / 2) = static_cast<uint16_t>(rw[r]);
    }
    if (kColumnwise) {
      uint2 cb[kVec];
      column_bytes<kVec>(rw, cb);
      const int c0 = padded_col(blk.block_col());
#pragma unroll
      for (int q = 0; q < kVec; ++q) codes_t[blk.warp % 4][c0 + q] = cb[q];
    }
  }
  __syncthreads();
  // Rowwise scales: 64 rows x kTileCols entries, 4-byte words (padding columns as zeros).
  const int64_t row0 = item * 64, j0 = int64_t(blockIdx.x) * B::kTileCols;
  for (int i = threadIdx.x; i < 64 * B::kTileCols / 4; i += blockDim.x) {
    const int dr = i / (B::kTileCols / 4), dj = (i % (B::kTileCols / 4)) * 4;
    const int64_t r = row0 + dr, j = j0 + dj;
    if (r >= rows || j >= pc) continue;
    uint32_t w = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) w |= (j + k < tcols ? uint32_t(s8_tile[dr / kTile][dj + k]) : 0u) << (8 * k);
    *reinterpret_cast<uint32_t*>(scale_inv + r * pc + j) = w;
  }
  if (!kColumnwise) return;
  // Transposed codes: per column, 8 bytes per tile row (4 lanes write a column's 32 bytes).
  const int64_t c0 = int64_t(blockIdx.x) * B::kSpan, half = rows / 2;
  for (int i = threadIdx.x; i < 4 * B::kSpan; i += blockDim.x) {
    const int dc = i / 4, tr = i % 4;
    const int64_t k = c0 + dc, ti = item * 4 + tr;
    if (k < cols && ti < trows) *reinterpret_cast<uint2*>(data_t + k * half + ti * 8) = codes_t[tr][padded_col(dc)];
  }
  // Transposed scales: scale_inv_t[k, i] = s8[i, k / 16]; one word covers this block's 4 tile rows.
  const int64_t pct = nvfp4_scale_cols(rows);
  for (int dc = threadIdx.x; dc < B::kSpan; dc += blockDim.x) {
    const int64_t k = c0 + dc;
    if (k >= cols) continue;
    uint32_t w = 0;
#pragma unroll
    for (int tr = 0; tr < 4; ++tr)
      w |= (item * 4 + tr < trows ? uint32_t(s8_tile[tr][dc / kTile]) : 0u) << (8 * tr);
    *reinterpret_cast<uint32_t*>(scale_inv_t + k * pct + item * 4) = w;
  }
}

// Grid of the NVFP4 block items; false when the tensor has too many 64-row blocks for gridDim.y.
template <bool kBf16>
bool nvfp4_grid(int64_t rows, int64_t cols, dim3* grid) {
  const int64_t gy = (rows + 63) / 64, gx = (cols + Nvfp4Block<kBf16>::kSpan - 1) / Nvfp4Block<kBf16>::kSpan;
  if (gy > 65535 || gx > 0x7FFFFFFF) return false;
  *grid = dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  return true;
}

// What every NVFP4 block-item launcher does: `launch(b, r, grid)` with x's input kind as compile-time flags
// (with_input_kind) and the grid of 64-row block items over [rows, cols]; the one-line error when that grid is too
// tall to launch.
template <typename Launch>
ffi::Error launch_on_nvfp4_grid(bool bf16, bool round_bf16, int64_t rows, int64_t cols, Launch&& launch) {
  bool launched = false;
  with_input_kind(bf16, round_bf16, [&](auto b, auto r) {
    dim3 grid;
    if ((launched = nvfp4_grid<decltype(b)::value>(rows, cols, &grid))) launch(b, r, grid);
  });
  return launched ? ffi::Error::Success() : invalid("x: more than 65535 blocks of 64 rows");
}

// ---- NVFP4 stage handlers ---------------------------------------------------------------------

ffi::Error Nvfp4StatsCuda(cudaStream_t stream, ffi::AnyBuffer x, bool round_bf16,
                          ffi::Result<ffi::Buffer<ffi::F32>> tile_amax, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                          ffi::Result<ffi::Buffer<ffi::S32>> count) {
  int64_t rows, cols;
  JQ_RETURN_IF_ERROR(check_nvfp4_stats(x, *tile_amax, *amax, *count, &rows, &cols));
  zero_stats(stream, amax->untyped_data(), count->typed_data());
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  const bool aligned = reinterpret_cast<uintptr_t>(x.untyped_data()) % 16 == 0;
  JQ_RETURN_IF_ERROR(launch_on_nvfp4_grid(bf16, round_bf16, rows, cols, [&](auto b, auto r, dim3 grid) {
    constexpr bool kBf16 = decltype(b)::value, kRound = decltype(r)::value;
    // bf16: as many block items at a time as the GPU holds (the kernel grid-strides over the rest).
    // fp32 keeps one item per block: its waves are long enough, and it measured 3-6% faster so.
    const auto kernel = nvfp4_stats_kernel<kBf16, kRound>;
    if (kBf16)
      grid.y = static_cast<unsigned>(
          std::max<int64_t>(1, std::min<int64_t>(grid.y, resident_grid(kernel, int64_t(grid.y) * grid.x) / grid.x)));
    launch_after_prior(kernel, grid, stream, x.untyped_data(), rows, cols, aligned, tile_amax->typed_data(),
                       reinterpret_cast<uint32_t*>(amax->untyped_data()), count->typed_data());
  }));
  return last_error("nvfp4 stats kernel");
}

ffi::Error Nvfp4QuantizeImpl(cudaStream_t stream, const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& tile_amax,
                             const ffi::Buffer<ffi::F32>& amax, bool round_bf16, ffi::Buffer<ffi::U8>& data,
                             ffi::Buffer<ffi::U8>& scale_inv, ffi::Buffer<ffi::U8>* data_t,
                             ffi::Buffer<ffi::U8>* scale_inv_t) {
  int64_t rows, cols;
  JQ_RETURN_IF_ERROR(check_nvfp4_quantize(x, tile_amax, amax, data, scale_inv, data_t, scale_inv_t, &rows, &cols));
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  const bool aligned = reinterpret_cast<uintptr_t>(x.untyped_data()) % 16 == 0;
  uint8_t* dt = data_t ? data_t->typed_data() : nullptr;
  uint8_t* st = scale_inv_t ? scale_inv_t->typed_data() : nullptr;
  JQ_RETURN_IF_ERROR(launch_on_nvfp4_grid(bf16, round_bf16, rows, cols, [&](auto b, auto r, dim3 grid) {
    constexpr bool kBf16 = decltype(b)::value, kRound = decltype(r)::value;
    auto kernel = dt ? nvfp4_quantize_kernel<kBf16, kRound, true> : nvfp4_quantize_kernel<kBf16, kRound, false>;
    launch_after_prior(kernel, grid, stream, x.untyped_data(), rows, cols, aligned, tile_amax.typed_data(),
                       amax.typed_data(), data.typed_data(), scale_inv.typed_data(), dt, st);
  }));
  return last_error("nvfp4 quantize kernel");
}

ffi::Error Nvfp4QuantizeCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> tile_amax,
                             ffi::Buffer<ffi::F32> amax, bool round_bf16, ffi::Result<ffi::Buffer<ffi::U8>> data,
                             ffi::Result<ffi::Buffer<ffi::U8>> scale_inv) {
  return Nvfp4QuantizeImpl(stream, x, tile_amax, amax, round_bf16, *data, *scale_inv, nullptr, nullptr);
}

ffi::Error Nvfp4QuantizeTCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> tile_amax,
                              ffi::Buffer<ffi::F32> amax, bool round_bf16, ffi::Result<ffi::Buffer<ffi::U8>> data,
                              ffi::Result<ffi::Buffer<ffi::U8>> scale_inv, ffi::Result<ffi::Buffer<ffi::U8>> data_t,
                              ffi::Result<ffi::Buffer<ffi::U8>> scale_inv_t) {
  return Nvfp4QuantizeImpl(stream, x, tile_amax, amax, round_bf16, *data, *scale_inv, &*data_t, &*scale_inv_t);
}
