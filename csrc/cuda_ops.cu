// CUDA FFI handlers. Every output unit is computed by the same code as the CPU handlers
// (elementwise.h / numerics.h); the kernels only choose how work maps onto threads.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "jaxquant/elementwise.h"
#include "jaxquant/ffi_checks.h"
#include "jaxquant/handlers.h"
#include "jaxquant/numerics.h"

namespace jaxquant {
namespace {

constexpr int kThreads = 256;

ffi::Error last_error(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxquant: ") + what + ": " + cudaGetErrorString(err));
}

// Blocks for a grid-stride loop over `work` items. The cap keeps per-thread setup (scales derived
// from the device-resident amax, lookup tables) amortized over many items.
constexpr int64_t kMaxBlocks = 1024;
int grid_for(int64_t work, int per_block = kThreads) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(blocks, 1), kMaxBlocks));
}

// Grid for a grid-stride kernel: as many blocks as the GPU holds at once (capped by the work), so
// that every block is resident from the start and there is no partial last wave.
template <typename Kernel>
int resident_grid(Kernel kernel, int64_t work_blocks) {
  int device = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
  const int64_t resident = int64_t(std::max(sms, 1)) * std::max(per_sm, 1);
  return static_cast<int>(std::max<int64_t>(1, std::min(work_blocks, resident)));
}

// ---- reductions -----------------------------------------------------------------------------

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}
__device__ __forceinline__ int warp_sum(int v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// Block-wide max/sum, then one atomic each. amax values are >= 0, so their bit patterns order
// like the floats (inf included) and atomicMax on the bits is a float max.
__device__ void block_publish(float m, int c, uint32_t* amax_bits, int32_t* count) {
  __shared__ float sm[kThreads / 32];
  __shared__ int sc[kThreads / 32];
  m = warp_max(m);
  c = warp_sum(c);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) { sm[warp] = m; sc[warp] = c; }
  __syncthreads();
  if (warp == 0) {
    m = lane < kThreads / 32 ? sm[lane] : 0.0f;
    c = lane < kThreads / 32 ? sc[lane] : 0;
    m = warp_max(m);
    c = warp_sum(c);
    if (lane == 0) {
      atomicMax(amax_bits, __float_as_uint(m));
      if (c) atomicAdd(count, c);
    }
  }
}

// ---- loads of 4 consecutive elements ---------------------------------------------------------

// Elements i..i+3 of x as fp32; one 16-byte (fp32) or 8-byte (bf16) load when `vector`.
__device__ __forceinline__ void load4(const void* x, bool bf16, int64_t i, bool vector, float v[4]) {
  if (vector && !bf16) {
    const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(x) + i);
    v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
  } else if (vector) {
    const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(x) + i);
    v[0] = __uint_as_float(u.x << 16); v[1] = __uint_as_float(u.x & 0xFFFF0000u);
    v[2] = __uint_as_float(u.y << 16); v[3] = __uint_as_float(u.y & 0xFFFF0000u);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = load_as_float(x, bf16, i + k);
  }
}

// True when element i of x starts a naturally aligned 4-element vector.
__device__ __forceinline__ bool aligned4(const void* x, bool bf16, int64_t i) {
  return (reinterpret_cast<uintptr_t>(x) + uint64_t(i) * (bf16 ? 2 : 4)) % (bf16 ? 8 : 16) == 0;
}

// ---- FP8 cast -------------------------------------------------------------------------------

// fp32 pair -> two FP8 bytes (lo in bits 0-7). The hardware conversion (sm_89+) is RNE with
// saturation, as numerics.h; NaN is re-encoded so its sign is kept as the software path does.
__device__ __forceinline__ uint32_t fp8_pair(float lo, float hi, bool e5m2) {
#if __CUDA_ARCH__ >= 890
  uint16_t r;
  if (e5m2)
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %2, %1;" : "=h"(r) : "f"(lo), "f"(hi));
  else
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(r) : "f"(lo), "f"(hi));
  uint32_t out = r;
  if (is_nan(lo)) out = (out & 0xFF00u) | fp8_encode(lo, e5m2);
  if (is_nan(hi)) out = (out & 0x00FFu) | (uint32_t(fp8_encode(hi, e5m2)) << 8);
  return out;
#else
  return fp8_encode(lo, e5m2) | (uint32_t(fp8_encode(hi, e5m2)) << 8);
#endif
}

__device__ __forceinline__ uint32_t fp8_quad(const float v[4], float scale, bool e5m2) {
  return fp8_pair(v[0] * scale, v[1] * scale, e5m2) | (fp8_pair(v[2] * scale, v[3] * scale, e5m2) << 16);
}

// Every thread derives the scale from the device-resident amax (a few flops, no extra launch);
// the first thread of the grid also stores scale_inv.
struct Fp8Params {
  const float* amax;
  float fp8_max, eps;
  bool pow2, e5m2;
  float* scale_inv;

  __device__ float scale() const {
    const Fp8Scale s = fp8_scale_from_amax(amax[0], fp8_max, eps, pow2);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) scale_inv[0] = s.scale_inv;
    return s.scale;
  }
};

// E2M1 code of f with the FPU doing the rounding (the cast is ALU-bound on Hopper): the same code
// as float_to_e2m1 for every fp32 input (checked exhaustively on the host; min.f32 maps NaN to 6,
// code 7, as float_to_e2m1 does). After saturating |f| to 6, adding 2^(e+22) (e the exponent of
// |f|, at least 0) leaves one ulp equal to the E2M1 spacing of that binade (0.5 below 2, 1 in
// [2, 4), 2 in [4, 6]), so the sum is RNE on the grid (the ulp parity is the E2M1 mantissa
// parity); k = its distance from 2^(e+22) in ulps, and the magnitude code is k + 2e.
__device__ __forceinline__ uint32_t e2m1_code_fpu(float f) {
  const float a = fminf(fabsf(f), 6.0f);
  const uint32_t magic = max(__float_as_uint(a) & 0x7F800000u, 0x3F800000u) + (22u << 23);
  // k + 2e: magic >> 22 is 2e + 298 exactly (magic is a multiple of 2^23).
  const uint32_t code = __float_as_uint(__fadd_rn(a, __uint_as_float(magic))) - magic + (magic >> 22) - 298u;
  return ((__float_as_uint(f) >> 28) & 0x8u) | code;
}

// E2M1 pair: hardware conversion where the chip has it (sm_100a and later), else e2m1_code_fpu;
// both are RNE with saturation to ±6 and keep the sign of zero (as float_to_e2m1).
__device__ __forceinline__ uint8_t e2m1_pair(float lo, float hi) {
#if defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM103_ALL)
  uint16_t out;
  asm("{ .reg .b8 t;\n cvt.rn.satfinite.e2m1x2.f32 t, %2, %1;\n mov.b16 %0, {t, 0};\n}" : "=h"(out) : "f"(lo), "f"(hi));
  return static_cast<uint8_t>(out);
#else
  return static_cast<uint8_t>(e2m1_code_fpu(lo) | (e2m1_code_fpu(hi) << 4));
#endif
}

#include "jaxquant/stage_kernels.cuh"

// ---- FP8 statistics (amax and the non-finite count, one read) --------------------------------
//
// The max is taken on magnitude bits (|x| of a non-NaN float orders like its bits): one AND and
// one integer max an element (a packed 16x2 max for bf16). A vector whose largest magnitude could
// be non-finite after the compute-dtype rounding (kFp8Suspect) goes through the per-element
// numerics path instead (rare: inf/NaN inputs). Rounding to bf16 is monotone and odd, so the max
// of the rounded magnitudes is the rounding of the max magnitude: it is rounded once per thread.

// Smallest fp32 magnitude bits that are non-finite in the compute dtype: bf16 RNE sends
// 0x7F7F8000 and above to inf (the tie goes to the even inf), NaN bits are above inf.
template <bool kRound>
constexpr uint32_t kFp8Suspect = kRound ? 0x7F7F8000u : 0x7F800000u;

// Packed max of the two unsigned 16-bit halves (one instruction on sm_90+).
__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
#if __CUDA_ARCH__ >= 900
  uint32_t r;
  asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return __vmaxu2(a, b);
#endif
}

// Exact statistics of one element (docs/numerics.md §1.1): rounding, NaN ignored, counted.
template <bool kRound>
__device__ __forceinline__ void stats_exact(float v, float& m, int& c) {
  const float a = kRound ? round_to_bf16(v) : v;
  m = fmaxf(m, abs_ignoring_nan(a));
  c += !is_finite(a);
}

// Folds one 16-byte vector into the running magnitude bits `acc` (fp32: max bits; bf16: packed
// max of 16-bit halves), or into (m, c) element by element when it holds a suspect value.
template <bool kBf16, bool kRound>
__device__ __forceinline__ void stats_vector(const uint4 raw, uint32_t& acc, float& m, int& c) {
  bool suspect;
  uint32_t vm;
  if constexpr (kBf16) {
    vm = max_u16x2(max_u16x2(raw.x & 0x7FFF7FFFu, raw.y & 0x7FFF7FFFu),
                   max_u16x2(raw.z & 0x7FFF7FFFu, raw.w & 0x7FFF7FFFu));
    suspect = ((vm + 0x00800080u) & 0x80008000u) != 0;  // a half >= 0x7F80 (no carry: halves < 0x8000)
  } else {
    vm = max(max(raw.x & 0x7FFFFFFFu, raw.y & 0x7FFFFFFFu), max(raw.z & 0x7FFFFFFFu, raw.w & 0x7FFFFFFFu));
    suspect = vm >= kFp8Suspect<kRound>;
  }
  if (__builtin_expect(!suspect, 1)) {
    acc = kBf16 ? max_u16x2(acc, vm) : max(acc, vm);
    return;
  }
  float v[kBf16 ? 8 : 4];
  to_compute<kBf16, false>(raw, v);  // raw values; stats_exact rounds
#pragma unroll
  for (int k = 0; k < (kBf16 ? 8 : 4); ++k) stats_exact<kRound>(v[k], m, c);
}

// Grid-stride over 16-byte vectors, kInFlight independent loads a lane before the first use
// (consecutive lanes read consecutive vectors); full rounds unpredicated. Scalar tail.
template <bool kBf16, bool kRound>
__global__ void __launch_bounds__(kThreads) amax_kernel(const void* __restrict__ x, int64_t n, uint32_t* amax_bits,
                                                        int32_t* count) {
  constexpr int kVec = kBf16 ? 8 : 4, kInFlight = 8;
  uint32_t acc = 0;
  float m = 0.0f;
  int c = 0;
  const int64_t tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  const bool aligned = (reinterpret_cast<uintptr_t>(x) % 16) == 0;
  const int64_t nvec = aligned ? n / kVec : 0;
  const auto* vx = reinterpret_cast<const uint4*>(x);
  int64_t i0 = tid;
  for (; i0 + (kInFlight - 1) * stride < nvec; i0 += kInFlight * stride) {
    uint4 vs[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) vs[j] = vx[i0 + j * stride];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) stats_vector<kBf16, kRound>(vs[j], acc, m, c);
  }
  for (; i0 < nvec; i0 += stride) stats_vector<kBf16, kRound>(vx[i0], acc, m, c);
  for (int64_t i = nvec * kVec + tid; i < n; i += stride) stats_exact<kRound>(load_as_float(x, kBf16, i), m, c);
  if (kBf16) acc = max(acc & 0xFFFFu, acc >> 16) << 16;
  const float fast = kRound ? round_to_bf16(__uint_as_float(acc)) : __uint_as_float(acc);
  block_publish(fmaxf(m, fast), c, amax_bits, count);
}

ffi::Error Fp8StatsCuda(cudaStream_t stream, ffi::AnyBuffer x, bool round_bf16,
                        ffi::Result<ffi::Buffer<ffi::F32>> amax, ffi::Result<ffi::Buffer<ffi::S32>> count) {
  JQ_RETURN_IF_ERROR(check_input(x, "x"));
  JQ_RETURN_IF_ERROR(check_count(*amax, 1, "amax"));
  JQ_RETURN_IF_ERROR(check_count(*count, 1, "count"));
  const int64_t n = static_cast<int64_t>(x.element_count());
  cudaMemsetAsync(amax->untyped_data(), 0, sizeof(float), stream);
  cudaMemsetAsync(count->untyped_data(), 0, sizeof(int32_t), stream);
  if (n > 0) {
    auto* bits = reinterpret_cast<uint32_t*>(amax->untyped_data());
    with_input_kind(x.element_type() == ffi::DataType::BF16, round_bf16, [&](auto b, auto r) {
      auto kernel = amax_kernel<decltype(b)::value, decltype(r)::value>;
      kernel<<<resident_grid(kernel, (n + 4 * kThreads - 1) / (4 * kThreads)), kThreads, 0, stream>>>(
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


// ---- grouped ops over one shard of a ZeRO flat buffer ----------------------------------------
//
// The shard index and the parameter table live in device memory (the index is lax.axis_index,
// known only on the device), so one launch serves every shard: each thread finds its parameter
// by binary search in the table. Threads own 16 local elements (or 8 chunk bytes).

constexpr int kGroupElems = 16;

__host__ __device__ __forceinline__ const int64_t* i64_words(const uint32_t* w) { return reinterpret_cast<const int64_t*>(w); }

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

// Tiles [t0, t1) of the tile rows that meet flat positions [g_first, g_last] of the group (a
// superset of the tiles the shard touches: the others get amax 0, as they should).
__device__ int64_t first_tile_at(const GroupTable& table, int64_t g) {
  const int64_t p = table.find(g, GroupTable::kOffset);
  if (p < 0) return 0;
  const int64_t off = table.at(p, GroupTable::kOffset), numel = table.at(p, GroupTable::kNumel);
  const int64_t cols = table.at(p, GroupTable::kCols), base = table.at(p, GroupTable::kTileBase);
  if (g >= off + numel) return base + numel / (kTile * kTile);  // padding: the next parameter's first tile
  return base + (g - off) / (kTile * cols) * (cols / kTile);
}
__device__ int64_t end_tile_at(const GroupTable& table, int64_t g) {
  const int64_t p = table.find(g, GroupTable::kOffset);
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

__global__ void group_tile_amax_kernel(const void* __restrict__ x, bool bf16, bool round_bf16, int64_t n, const int32_t* index,
                                       GroupTable table, int64_t num_tiles, float* __restrict__ tile_amax,
                                       float* __restrict__ amax, int32_t* __restrict__ counts) {
  const int64_t a = int64_t(index[0]) * n;  // the shard's first flat position
  const int64_t t0 = first_tile_at(table, a);
  const int64_t t_end = end_tile_at(table, a + n - 1), t1 = t_end < num_tiles ? t_end : num_tiles;
  const int lane4 = threadIdx.x % 4;
  int64_t p = -1, tbeg = 0, tnext = 0;  // parameter of the thread's last tile, its tile range
  int64_t held = -1;                    // parameter whose running amax held_m holds
  float held_m = 0.0f;
  for (int64_t s = t0 / kSlotTiles + blockIdx.x; s * kSlotTiles < t1; s += gridDim.x) {
    const int64_t t = s * kSlotTiles + threadIdx.x / 4;
    float m = 0.0f;
    int c = 0;
    int64_t tp = -1;
    if (t >= t0 && t < t1) {
      if (p < 0 || t < tbeg || t >= tnext) {
        p = table.find(t, GroupTable::kTileBase);
        tbeg = table.at(p, GroupTable::kTileBase);
        tnext = p + 1 < table.num_params ? table.at(p + 1, GroupTable::kTileBase) : INT64_MAX;
      }
      tp = p;
      const int64_t cols = table.at(p, GroupTable::kCols), tcn = cols / kTile, lt = t - tbeg;
      const int64_t tr = lt / tcn, tc = lt - tr * tcn;
      const int64_t i0 = table.at(p, GroupTable::kOffset) + tr * kTile * cols + tc * kTile + lane4 * 4 - a;
      float v[kTile][4];
      if (i0 >= 0 && i0 + (kTile - 1) * cols + 4 <= n) {  // the whole 16x4 strip is in the shard
        const bool vec = aligned4(x, bf16, i0);  // cols % 16 == 0: every row has i0's alignment
#pragma unroll
        for (int k = 0; k < kTile; ++k) load4(x, bf16, i0 + k * cols, vec, v[k]);
        if (round_bf16) {
#pragma unroll
          for (int k = 0; k < kTile; ++k)
#pragma unroll
            for (int j = 0; j < 4; ++j) v[k][j] = round_to_bf16(v[k][j]);
        }
      } else {  // a tile row cut by a shard boundary: elements of other shards count as 0
#pragma unroll
        for (int k = 0; k < kTile; ++k)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int64_t i = i0 + k * cols + j;
            v[k][j] = i >= 0 && i < n ? load_compute(x, bf16, round_bf16, i) : 0.0f;
          }
      }
#pragma unroll
      for (int k = 0; k < kTile; ++k)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          m = fmaxf(m, abs_ignoring_nan(v[k][j]));
          c += !is_finite(v[k][j]);
        }
    }
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
    group_tile_amax_kernel<<<resident_grid(group_tile_amax_kernel, slots), kThreads, 0, stream>>>(
        x.untyped_data(), x.element_type() == ffi::DataType::BF16, round_bf16, n, index.typed_data(),
        GroupTable{i64_words(table_words.typed_data()), num_params}, num_tiles, tile_amax->typed_data(),
        amax->typed_data(), counts->typed_data());
  }
  return last_error("group tile amax kernel");
}

// Threads own 8 consecutive bytes of the group's param-byte space (8-aligned, so 16 elements of
// one parameter, one row and one tile: byte bases are multiples of 128).
__global__ void group_cast_kernel(const void* __restrict__ x, bool bf16, bool round_bf16, int64_t n, const int32_t* index,
                                  GroupTable table, const int64_t* chunk_lo, int64_t num_shards,
                                  const float* __restrict__ enc, int64_t num_tiles, uint8_t* __restrict__ out,
                                  int64_t size) {
  const int64_t r = index[0];
  if (r < 0 || r >= num_shards) {  // no such shard: it owns nothing
    for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < size; j += int64_t(gridDim.x) * blockDim.x) out[j] = 0;
    return;
  }
  const int64_t lo = chunk_lo[r], g0 = lo / 8, groups = (lo + size + 7) / 8 - g0;
  // Each block one contiguous range (threads a block-stride apart): a thread meets few parameters
  // and searches the table only when it enters one.
  const int64_t per_block = (groups + gridDim.x - 1) / gridDim.x, first = blockIdx.x * per_block;
  const int64_t last = groups < first + per_block ? groups : first + per_block;
  int64_t p = -1, pbeg = 0, pnext = 0;  // parameter of the last byte group, its byte range start, next's
  for (int64_t grp = first + threadIdx.x; grp < last; grp += blockDim.x) {
    const int64_t y0 = (g0 + grp) * 8;
    uint8_t bytes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (p < 0 || y0 < pbeg || y0 >= pnext) {
      p = table.find(y0, GroupTable::kByteBase);
      pbeg = p >= 0 ? table.at(p, GroupTable::kByteBase) : 0;
      pnext = p + 1 < table.num_params ? table.at(p + 1, GroupTable::kByteBase) : INT64_MAX;
      if (p < 0) pnext = table.at(0, GroupTable::kByteBase);
    }
    if (p >= 0 && y0 - pbeg < table.at(p, GroupTable::kNumel) / 2) {
      const int64_t e0 = 2 * (y0 - table.at(p, GroupTable::kByteBase));
      const int64_t t = table.tile_of(p, e0);
      const float m = t < num_tiles ? enc[t] : 0.0f;
      const int64_t i0 = table.at(p, GroupTable::kOffset) + e0 - r * n;  // local index of element e0
      float v[16];
      if (i0 >= 0 && i0 + 16 <= n) {
#pragma unroll
        for (int q = 0; q < 4; ++q) load4(x, bf16, i0 + 4 * q, aligned4(x, bf16, i0 + 4 * q), v + 4 * q);
        if (round_bf16) {
#pragma unroll
          for (int k = 0; k < 16; ++k) v[k] = round_to_bf16(v[k]);
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) bytes[k] = e2m1_pair(v[2 * k] * m, v[2 * k + 1] * m);
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
  if (size == 0) return ffi::Error::Success();
  if (num_params == 0) {
    cudaMemsetAsync(chunk->untyped_data(), 0, size, stream);
    return last_error("group cast memset");
  }
  group_cast_kernel<<<grid_for(size / 8 + 2), kThreads, 0, stream>>>(
      x.untyped_data(), x.element_type() == ffi::DataType::BF16, round_bf16, static_cast<int64_t>(x.element_count()),
      index.typed_data(), GroupTable{i64_words(table_words.typed_data()), num_params},
      i64_words(chunk_lo_words.typed_data()), num_shards, enc.typed_data(),
      static_cast<int64_t>(enc.element_count()), chunk->typed_data(), size);
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
__global__ void fp8_group_amax_kernel(const void* __restrict__ x, bool bf16, bool round_bf16, int64_t n, const int32_t* index,
                                      GroupTable table, float* __restrict__ amax, int32_t* __restrict__ counts) {
  const int64_t r = index[0], groups = (n + kGroupElems - 1) / kGroupElems;
  const int64_t per_block = (groups + gridDim.x - 1) / gridDim.x;
  const int64_t first = blockIdx.x * per_block, last = groups < first + per_block ? groups : first + per_block;
  int64_t held = -1;
  float m = 0.0f;
  ParamCursor cur{table};  // positions only grow: one search, then steps at parameter changes
  cur.seek(r * n + (first + threadIdx.x) * kGroupElems);
  for (int64_t grp = first + threadIdx.x; grp < last; grp += blockDim.x) {
    const int64_t i0 = grp * kGroupElems, g0 = r * n + i0;
    float v[16];
    load16(x, bf16, round_bf16, i0, n, v);
    if (i0 + 16 <= n && cur.inside(g0) && g0 + 16 <= cur.end && cur.p == held) {  // all in the held parameter
      int c = 0;
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        m = fmaxf(m, abs_ignoring_nan(v[k]));
        c += !is_finite(v[k]);
      }
      if (c) atomicAdd(counts + held, c);
      continue;
    }
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      if (i0 + k >= n || !cur.inside(g0 + k)) continue;
      if (cur.p != held) {
        if (held >= 0) atomicMax(reinterpret_cast<uint32_t*>(amax + held), __float_as_uint(m));
        held = cur.p;
        m = 0.0f;
      }
      m = fmaxf(m, abs_ignoring_nan(v[k]));
      if (!is_finite(v[k])) atomicAdd(counts + held, 1);
    }
  }
  warp_publish_param_max(amax, held, m);
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
    fp8_group_amax_kernel<<<grid_for((n + kGroupElems - 1) / kGroupElems), kThreads, 0, stream>>>(
        x.untyped_data(), x.element_type() == ffi::DataType::BF16, round_bf16, n, index.typed_data(),
        GroupTable{i64_words(table_words.typed_data()), num_params}, amax->typed_data(), counts->typed_data());
  }
  return last_error("fp8 group amax kernel");
}

__global__ void fp8_group_cast_kernel(const void* __restrict__ x, bool bf16, bool round_bf16, int64_t n, const int32_t* index,
                                      GroupTable table, const float* __restrict__ scale, bool e5m2,
                                      uint8_t* __restrict__ out) {
  const int64_t r = index[0], groups = (n + kGroupElems - 1) / kGroupElems;
  const int64_t per_block = (groups + gridDim.x - 1) / gridDim.x, first = blockIdx.x * per_block;
  const int64_t last = groups < first + per_block ? groups : first + per_block;
  ParamCursor cur{table};  // positions only grow: one search, then steps at parameter changes
  cur.seek(r * n + (first + threadIdx.x) * kGroupElems);
  for (int64_t grp = first + threadIdx.x; grp < last; grp += blockDim.x) {
    const int64_t i0 = grp * kGroupElems, g0 = r * n + i0;
    float v[16];
    load16(x, bf16, round_bf16, i0, n, v);
    uint8_t q[16];
    bool inside[16];
    if (i0 + 16 <= n && cur.inside(g0) && g0 + 16 <= cur.end) {  // one parameter, one scale
      const float sc = scale[cur.p];
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        inside[k] = true;
        v[k] *= sc;
      }
    } else {
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        inside[k] = cur.inside(g0 + k);
        v[k] *= inside[k] ? scale[cur.p] : 0.0f;
      }
    }
#pragma unroll
    for (int k = 0; k < 16; k += 2) {  // hardware pair conversion; padding bytes are 0
      const uint32_t pair = fp8_pair(v[k], v[k + 1], e5m2);
      q[k] = inside[k] ? uint8_t(pair) : 0;
      q[k + 1] = inside[k + 1] ? uint8_t(pair >> 8) : 0;
    }
    if (i0 + 16 <= n && reinterpret_cast<uintptr_t>(out + i0) % 16 == 0) {
      uint4 w;
      uint32_t* wp = &w.x;
#pragma unroll
      for (int k = 0; k < 4; ++k)
        wp[k] = q[4 * k] | (q[4 * k + 1] << 8) | (q[4 * k + 2] << 16) | (uint32_t(q[4 * k + 3]) << 24);
      *reinterpret_cast<uint4*>(out + i0) = w;
    } else {
      for (int k = 0; k < 16 && i0 + k < n; ++k) out[i0 + k] = q[k];
    }
  }
}

ffi::Error Fp8GroupCastCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index,
                            ffi::Buffer<ffi::U32> table_words, ffi::Buffer<ffi::F32> scale, bool round_bf16,
                            ffi::Result<ffi::AnyBuffer> data) {
  int64_t num_params;
  bool e5m2;
  JQ_RETURN_IF_ERROR(check_fp8_group_cast(x, index, table_words, scale, *data, &num_params, &e5m2));
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (n == 0) return ffi::Error::Success();
  if (num_params == 0) {
    cudaMemsetAsync(data->untyped_data(), 0, n, stream);
    return last_error("fp8 group cast memset");
  }
  fp8_group_cast_kernel<<<grid_for((n + kGroupElems - 1) / kGroupElems), kThreads, 0, stream>>>(
      x.untyped_data(), x.element_type() == ffi::DataType::BF16, round_bf16, n, index.typed_data(),
      GroupTable{i64_words(table_words.typed_data()), num_params}, scale.typed_data(), e5m2,
      static_cast<uint8_t*>(data->untyped_data()));
  return last_error("fp8 group cast kernel");
}


// ---- grouped scales and columnwise data ------------------------------------------------------
//
// Scales: one thread per output unit (a scale byte or a tile's encode multiplier), the parameter
// found by binary search in the table; the tile amaxes are already reduced over the mesh.

__global__ void group_scale_kernel(const float* __restrict__ tiles, const float* __restrict__ amax, GroupTable table,
                                   int64_t num_tiles, uint8_t* __restrict__ scale_inv, int64_t scale_bytes,
                                   float* __restrict__ enc) {
  for (int64_t u = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; u < scale_bytes + num_tiles;
       u += int64_t(gridDim.x) * blockDim.x) {
    if (u < scale_bytes) scale_inv[u] = group_scale_byte(table, tiles, amax, u);
    else enc[u - scale_bytes] = group_tile_encode(table, tiles, amax, u - scale_bytes);
  }
}

ffi::Error GroupScaleCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> tiles, ffi::Buffer<ffi::F32> amax,
                          ffi::Buffer<ffi::U32> table_words, ffi::Result<ffi::Buffer<ffi::U8>> scale_inv,
                          ffi::Result<ffi::Buffer<ffi::F32>> enc) {
  int64_t num_params, num_tiles, scale_bytes;
  JQ_RETURN_IF_ERROR(check_group_scale(tiles, amax, table_words, *scale_inv, *enc, &num_params, &num_tiles, &scale_bytes));
  if (scale_bytes + num_tiles == 0) return ffi::Error::Success();
  group_scale_kernel<<<grid_for(scale_bytes + num_tiles), kThreads, 0, stream>>>(
      tiles.typed_data(), amax.typed_data(), GroupTable{i64_words(table_words.typed_data()), num_params}, num_tiles,
      scale_inv->typed_data(), scale_bytes, enc->typed_data());
  return last_error("group scale kernel");
}

// Transposes: block b < num_blocks is one 64x64-element block of parameter p = the last with
// block_base <= b (row-major over the parameter's [ru(rows,64)/64, ru(cols,64)/64] blocks); it
// stages the block in shared memory so that reads and writes are both row-contiguous. Blocks past
// num_blocks grid-stride over the columnwise scales (NVFP4).
template <bool kNibbles>
__device__ void group_transpose_block(const uint8_t* __restrict__ data, uint8_t* __restrict__ out,
                                      const GroupTable& table, int64_t b, int64_t base_field) {
  __shared__ uint8_t tile[64][64 + 4];
  const int64_t p = table.find(b, GroupTable::kBlockBase);
  if (p < 0) return;
  const int64_t rows = table.at(p, GroupTable::kRows), cols = table.at(p, GroupTable::kCols);
  const int64_t nbx = (cols + 63) / 64, local = b - table.at(p, GroupTable::kBlockBase);
  const int64_t m0 = (local / nbx) * 64, k0 = (local % nbx) * 64, base = table.at(p, base_field);
  if (m0 >= rows) return;
  const uint8_t* src = data + base;
  uint8_t* dst = out + base;
  // kThreads threads, 4 a row: each moves 16 elements of its row in (8 or 16 bytes, one vector
  // load where aligned and whole) and 16 of its output row out, so memory sees full sectors.
  static_assert(kThreads == 256, "one 64x64 block: 64 rows x 4 threads");
  constexpr int kInBytes = kNibbles ? 8 : 16;  // source bytes holding 16 elements
  const int row = threadIdx.x / 4, part = threadIdx.x % 4, c0 = part * 16;  // c0: first of 16 columns
  {
    const int64_t m = m0 + row, pitch = kNibbles ? cols / 2 : cols;
    const uint8_t* s = src + m * pitch + (kNibbles ? (k0 + c0) / 2 : k0 + c0);
    alignas(16) uint8_t in[kInBytes];
    if (m < rows && k0 + c0 + 16 <= cols && reinterpret_cast<uintptr_t>(s) % kInBytes == 0) {
      if (kNibbles) *reinterpret_cast<uint2*>(in) = *reinterpret_cast<const uint2*>(s);
      else *reinterpret_cast<uint4*>(in) = *reinterpret_cast<const uint4*>(s);
    } else {
#pragma unroll
      for (int j = 0; j < kInBytes; ++j) in[j] = m < rows && k0 + c0 + (kNibbles ? 2 * j : j) < cols ? s[j] : 0;
    }
#pragma unroll
    for (int j = 0; j < kInBytes; ++j) {
      if (kNibbles) {
        tile[row][c0 + 2 * j] = in[j] & 0xFu;
        tile[row][c0 + 2 * j + 1] = in[j] >> 4;
      } else {
        tile[row][c0 + j] = in[j];
      }
    }
  }
  __syncthreads();
  // Output row k = k0 + row holds block rows m0.. as bytes (FP8) or nibble pairs (NVFP4).
  const int64_t k = k0 + row;
  if (k >= cols) return;
  constexpr int kOutBytes = kNibbles ? 8 : 16;  // output bytes of 16 block rows
  alignas(16) uint8_t o[kOutBytes];
#pragma unroll
  for (int j = 0; j < kOutBytes; ++j)
    o[j] = kNibbles ? uint8_t(tile[c0 + 2 * j][row] | (tile[c0 + 2 * j + 1][row] << 4)) : tile[c0 + j][row];
  const int64_t opitch = kNibbles ? rows / 2 : rows, first = kNibbles ? (m0 + c0) / 2 : m0 + c0;
  uint8_t* d = dst + k * opitch + first;
  if (m0 + c0 + 16 <= rows && reinterpret_cast<uintptr_t>(d) % kOutBytes == 0) {
    if (kNibbles) *reinterpret_cast<uint2*>(d) = *reinterpret_cast<const uint2*>(o);
    else *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(o);
  } else {
#pragma unroll
    for (int j = 0; j < kOutBytes; ++j)
      if (m0 + c0 + (kNibbles ? 2 * j : j) < rows) d[j] = o[j];
  }
}

__global__ void group_columnwise_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scale_inv,
                                        GroupTable table, int64_t num_blocks, uint8_t* __restrict__ data_t,
                                        uint8_t* __restrict__ scale_inv_t, int64_t scale_t_bytes) {
  if (blockIdx.x < num_blocks) {
    group_transpose_block<true>(data, data_t, table, blockIdx.x, GroupTable::kByteBase);
    return;
  }
  const int64_t stride = (int64_t(gridDim.x) - num_blocks) * blockDim.x;
  for (int64_t y = (blockIdx.x - num_blocks) * int64_t(blockDim.x) + threadIdx.x; y < scale_t_bytes; y += stride)
    scale_inv_t[y] = group_scale_t_byte(table, scale_inv, y);
}

__global__ void fp8_group_transpose_kernel(const uint8_t* __restrict__ data, GroupTable table,
                                           uint8_t* __restrict__ data_t) {
  group_transpose_block<false>(data, data_t, table, blockIdx.x, GroupTable::kOffset);
}

ffi::Error GroupColumnwiseCuda(cudaStream_t stream, ffi::Buffer<ffi::U8> data, ffi::Buffer<ffi::U8> scale_inv,
                               ffi::Buffer<ffi::U32> table_words, int64_t num_blocks,
                               ffi::Result<ffi::Buffer<ffi::U8>> data_t, ffi::Result<ffi::Buffer<ffi::U8>> scale_inv_t) {
  int64_t num_params;
  JQ_RETURN_IF_ERROR(check_group_columnwise(data, scale_inv, table_words, *data_t, *scale_inv_t, &num_params));
  if (num_blocks < 0 || num_blocks > INT32_MAX / 2) return invalid("num_blocks: out of range");
  const int64_t scale_t_bytes = static_cast<int64_t>(scale_inv_t->element_count());
  const int64_t grid = num_blocks + std::min<int64_t>(grid_for(scale_t_bytes), 264);
  if (num_params == 0) return ffi::Error::Success();
  group_columnwise_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      data.typed_data(), scale_inv.typed_data(), GroupTable{i64_words(table_words.typed_data()), num_params},
      num_blocks, data_t->typed_data(), scale_inv_t->typed_data(), scale_t_bytes);
  return last_error("group columnwise kernel");
}

ffi::Error Fp8GroupTransposeCuda(cudaStream_t stream, ffi::Buffer<ffi::U8> data, ffi::Buffer<ffi::U32> table_words,
                                 int64_t num_blocks, ffi::Result<ffi::Buffer<ffi::U8>> data_t) {
  int64_t num_params;
  JQ_RETURN_IF_ERROR(check_fp8_group_transpose(data, table_words, *data_t, &num_params));
  if (num_blocks < 0 || num_blocks > INT32_MAX / 2) return invalid("num_blocks: out of range");
  // Alignment padding between parameters is not written by the blocks: zero it first.
  cudaMemsetAsync(data_t->untyped_data(), 0, data_t->size_bytes(), stream);
  if (num_params == 0 || num_blocks == 0) return last_error("fp8 group transpose memset");
  fp8_group_transpose_kernel<<<static_cast<unsigned>(num_blocks), kThreads, 0, stream>>>(
      data.typed_data(), GroupTable{i64_words(table_words.typed_data()), num_params}, data_t->typed_data());
  return last_error("fp8 group transpose kernel");
}

// ---- grouped split ---------------------------------------------------------------------------
//
// One launch per kSplitBatch results (instead of one XLA copy per result): the segments travel by
// value in the kernel parameters, so the launch needs no host-to-device copy and graphs capture it.

constexpr int kSplitBatch = 96;  // 96 x 24 bytes: well inside the 4 KiB kernel parameter space
struct SplitBatch {
  CopySegment seg[kSplitBatch];
};

// blockIdx.y: the segment; the blocks along x grid-stride over its bytes, 16-byte vectors (four in
// flight) where source and destination agree modulo 16, single bytes for the rest.
__global__ void split_kernel(SplitBatch batch) {
  const CopySegment s = batch.seg[blockIdx.y];
  const int64_t tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  const uintptr_t sa = reinterpret_cast<uintptr_t>(s.src), da = reinterpret_cast<uintptr_t>(s.dst);
  int64_t head = s.bytes, nvec = 0;
  if (sa % 16 == da % 16) {
    head = static_cast<int64_t>((16 - sa % 16) % 16);
    if (head > s.bytes) head = s.bytes;
    nvec = (s.bytes - head) / 16;
  }
  const uint4* __restrict__ src4 = reinterpret_cast<const uint4*>(s.src + head);
  uint4* __restrict__ dst4 = reinterpret_cast<uint4*>(s.dst + head);
  int64_t i = tid;
  for (; i + 3 * stride < nvec; i += 4 * stride) {
    const uint4 a = src4[i], b = src4[i + stride], c = src4[i + 2 * stride], d = src4[i + 3 * stride];
    dst4[i] = a;
    dst4[i + stride] = b;
    dst4[i + 2 * stride] = c;
    dst4[i + 3 * stride] = d;
  }
  for (; i < nvec; i += stride) dst4[i] = src4[i];
  for (int64_t j = tid; j < head; j += stride) s.dst[j] = s.src[j];
  for (int64_t j = head + 16 * nvec + tid; j < s.bytes; j += stride) s.dst[j] = s.src[j];
}

ffi::Error GroupSplitCuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                          ffi::Span<const int64_t> plan) {
  std::vector<CopySegment> segments;
  JQ_RETURN_IF_ERROR(split_segments(args, rets, plan, &segments));
  // Largest first: each launch's grid fits its segments, small ones do not idle behind big ones.
  std::sort(segments.begin(), segments.end(), [](const CopySegment& a, const CopySegment& b) { return a.bytes > b.bytes; });
  for (size_t b0 = 0; b0 < segments.size(); b0 += kSplitBatch) {
    const int count = static_cast<int>(std::min<size_t>(kSplitBatch, segments.size() - b0));
    if (segments[b0].bytes == 0) break;
    SplitBatch batch{};
    for (int k = 0; k < count; ++k) batch.seg[k] = segments[b0 + k];
    split_kernel<<<dim3(grid_for(segments[b0].bytes, kThreads * 64), count), kThreads, 0, stream>>>(batch);
  }
  return last_error("group split kernel");
}

}  // namespace

JQ_DEFINE_HANDLERS(Cuda, JQ_CUDA_CTX)

}  // namespace jaxquant
