// Helpers shared by the CUDA handler files (cuda_ops.cu: single tensors; cuda_group_ops.cu: groups):
// launch shapes, block reductions, vector loads and the FP8 / E2M1 pair conversions. Each file gets its
// own copy (anonymous namespace): nothing here is called across files.
#pragma once

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

// Calls f(bool_constant<kBf16>, bool_constant<kRound>) for an input dtype and rounding flag, so that
// kernels take both as template parameters (no per-element branches). bf16 input needs no rounding.
template <typename F>
void with_input_kind(bool bf16, bool round_bf16, F&& f) {
  if (bf16)
    f(std::true_type{}, std::false_type{});
  else if (round_bf16)
    f(std::false_type{}, std::true_type{});
  else
    f(std::false_type{}, std::false_type{});
}
template <typename F>
void with_input_kind(const ffi::AnyBuffer& x, bool round_bf16, F&& f) {
  with_input_kind(x.element_type() == ffi::DataType::BF16, round_bf16, std::forward<F>(f));
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

// ---- Programmatic dependent launch (sm_90+) ---------------------------------------------------
//
// A kernel started by launch_after_prior may be scheduled while the kernel before it in the stream
// is still running (its launch latency and ramp overlap that kernel's tail). Until it calls
// wait_for_prior_grid(), which returns once every earlier grid has completed and its writes are
// visible, it must neither read what earlier work writes nor write what earlier work may still
// read. Without the launch attribute (an ordinary launch) the wait returns at once.
__device__ __forceinline__ void wait_for_prior_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// Lets the next kernel (if launched by launch_after_prior) be scheduled before this grid exits.
__device__ __forceinline__ void allow_dependent_launch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

template <typename... Params, typename... Args>
void launch_after_prior(void (*kernel)(Params...), dim3 grid, cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

// Zeroes the amax and count that a statistics pass accumulates into. One tiny kernel, not two
// memsets: the pass is launched after it with launch_after_prior, so it reads its input while this
// runs (this kernel is an ordinary launch: the input's producers have completed before it starts)
// and waits for it only in block_publish.
__global__ void zero_stats_kernel(uint32_t* amax_bits, int32_t* count) {
  allow_dependent_launch();
  *amax_bits = 0;
  *count = 0;
}

void zero_stats(cudaStream_t stream, void* amax_bits, int32_t* count) {
  zero_stats_kernel<<<1, 1, 0, stream>>>(static_cast<uint32_t*>(amax_bits), count);
}

// Block-wide max/sum, then one atomic each. amax values are >= 0, so their bit patterns order
// like the floats (inf included) and atomicMax on the bits is a float max. The targets were zeroed
// by the kernel before this one (zero_stats), which a pass launched by launch_after_prior waits for
// here, after its reads; the pass lets the cast after it be scheduled from here on.
__device__ void block_publish(float m, int c, uint32_t* amax_bits, int32_t* count) {
  __shared__ float sm[kThreads / 32];
  __shared__ int sc[kThreads / 32];
  allow_dependent_launch();
  wait_for_prior_grid();
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
      // amax only grows, so a block whose max is not above the value already there skips the atomic
      // (with one block a round, thousands of blocks would otherwise queue on one address)
      if (__float_as_uint(m) > *reinterpret_cast<volatile uint32_t*>(amax_bits)) atomicMax(amax_bits, __float_as_uint(m));
      if (c) atomicAdd(count, c);
    }
  }
}

// 16 bytes of input at p: one vector load when aligned, else element loads (same bytes).
template <bool kBf16>
__device__ __forceinline__ uint4 load_raw16(const uint8_t* p, bool aligned) {
  if (aligned) return *reinterpret_cast<const uint4*>(p);
  uint4 r;
  uint32_t* w = &r.x;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (kBf16) {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
      w[k] = uint32_t(h[2 * k]) | (uint32_t(h[2 * k + 1]) << 16);
    } else {
      w[k] = reinterpret_cast<const uint32_t*>(p)[k];
    }
  }
  return r;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
constexpr bool kHardwareBf16 = true;
#else
constexpr bool kHardwareBf16 = false;
#endif

// The 16 loaded bytes as kVec (4 fp32 or 8 bf16) values of the compute dtype, in fp32.
// kAnyNan: the caller does not depend on which NaN a NaN rounds to (NVFP4: NaN input is outside
// the bit-exact contract, docs/numerics.md §2.6; statistics ignore NaN and count it either way),
// so the bf16 rounding may use the hardware pair conversion (RNE, subnormals kept; NaN becomes the
// canonical NaN) instead of round_to_bf16 (same bits for every non-NaN value).
template <bool kBf16, bool kRound, bool kAnyNan = false>
__device__ __forceinline__ void to_compute(const uint4 raw, float* v) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  if constexpr (kBf16) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[2 * k] = __uint_as_float(w[k] << 16);
      v[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
    }
  } else if constexpr (kRound && kAnyNan && kHardwareBf16) {
#pragma unroll
    for (int k = 0; k < 4; k += 2) {  // d.hi = bf16(a), d.lo = bf16(b)
      uint32_t pair;
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(__uint_as_float(w[k + 1])), "f"(__uint_as_float(w[k])));
      v[k] = __uint_as_float(pair << 16);
      v[k + 1] = __uint_as_float(pair & 0xFFFF0000u);
    }
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = kRound ? round_to_bf16(__uint_as_float(w[k])) : __uint_as_float(w[k]);
  }
}

// ---- compute-dtype statistics without rounding each value --------------------------------------

// Smallest fp32 magnitude bits that are non-finite in the compute dtype: bf16 RNE sends 0x7F7F8000
// (0x1.FFp127, halfway from the largest bf16 to 2^128) and above to inf (the tie goes to the even
// inf); NaN bits lie above inf's.
template <bool kRound>
constexpr uint32_t kNonFiniteBits = kRound ? 0x7F7F8000u : 0x7F800000u;

// Running amax and non-finite count of values as the compute dtype sees them (docs/numerics.md §2,
// "Compute dtype"), fed the raw input values: rounding to bf16 is monotonic in |x|, so the max of the
// rounded |x| is the rounded max of |x| (rounded once, in result()), and x rounds to ±inf or is NaN
// exactly when its magnitude bits reach kNonFiniteBits. fmaxf drops NaN as abs_ignoring_nan does.
// Three instructions an element instead of a rounding each.
template <bool kRound>
struct ComputeAmax {
  float m = 0.0f;
  int nonfinite = 0;
  __device__ __forceinline__ void add(float x) {
    m = fmaxf(m, fabsf(x));
    nonfinite += !(fabsf(x) < __uint_as_float(kNonFiniteBits<kRound>));
  }
  // The values of a 16-byte input vector (4 fp32 or 8 bf16), raw: this struct rounds.
  template <bool kBf16>
  __device__ __forceinline__ void add_vector(const uint4 raw) {
    float v[kBf16 ? 8 : 4];
    to_compute<kBf16, false>(raw, v);
#pragma unroll
    for (int k = 0; k < (kBf16 ? 8 : 4); ++k) add(v[k]);
  }
  __device__ __forceinline__ float result() const { return kRound ? round_to_bf16(m) : m; }
};

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

// Magnitude bits, for the statistics passes: |x| of a non-NaN float orders like its bits with the
// sign cleared, so a max over bits is the amax (NaN bits are larger than inf's, which is how a
// caller spots the rare vector that needs ComputeAmax). fp32: one word per element; bf16: both
// halves at once (packed max), the even elements' in bits 0-15 and the odd ones' in 16-31.
template <bool kBf16>
__device__ __forceinline__ uint32_t max_magnitude_bits(uint32_t a, uint32_t b) {
  return kBf16 ? max_u16x2(a, b) : max(a, b);
}

// The largest magnitude bits of a 16-byte vector (packed halves for bf16).
template <bool kBf16>
__device__ __forceinline__ uint32_t vector_magnitude_bits(const uint4 raw) {
  constexpr uint32_t kMask = kBf16 ? 0x7FFF7FFFu : 0x7FFFFFFFu;
  return max_magnitude_bits<kBf16>(max_magnitude_bits<kBf16>(raw.x & kMask, raw.y & kMask),
                                   max_magnitude_bits<kBf16>(raw.z & kMask, raw.w & kMask));
}

// fp32 bits of the larger magnitude held in running magnitude bits (bf16: the larger half).
template <bool kBf16>
__device__ __forceinline__ uint32_t widen_magnitude_bits(uint32_t acc) {
  return kBf16 ? max(acc & 0xFFFFu, acc >> 16) << 16 : acc;
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

// fp32 pair -> two FP8 bytes (lo in bits 0-7): RNE with saturation, as numerics.h (the hardware
// conversion on sm_89+). A NaN gives sign | 0x7F with the sign of the value passed in, which the GPU's
// multiply has already dropped for a NaN product: callers put the input's sign bits in (fp8_with_signs).
__device__ __forceinline__ uint32_t fp8_pair(float lo, float hi, bool e5m2) {
#if __CUDA_ARCH__ >= 890
  uint16_t r;
  if (e5m2)
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %2, %1;" : "=h"(r) : "f"(lo), "f"(hi));
  else
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(r) : "f"(lo), "f"(hi));
  return r;
#else
  return fp8_encode(lo, e5m2) | (uint32_t(fp8_encode(hi, e5m2)) << 8);
#endif
}

// FP8 bytes q with bit 7 of each byte taken from bit 7 of the same byte of `signs`, the sign of the
// input element. That bit already is the byte's sign for every non-NaN input (a positive scale keeps
// the sign, -0 included); for a NaN it keeps the input's sign, which the GPU's multiply drops
// (docs/decisions.md, "FP8 casts take the sign bit from the input"; docs/numerics.md §1 only asks
// that NaN stays NaN). One select for 4 bytes
// instead of a NaN test and fix-up an element: the FP8 casts are ALU-bound on Hopper.
__device__ __forceinline__ uint32_t fp8_with_signs(uint32_t q, uint32_t signs) {
  return (q & 0x7F7F7F7Fu) | (signs & 0x80808080u);
}

// Four FP8 bytes of v[k] * scale (scale > 0), byte k's sign bit from byte k of `signs`.
__device__ __forceinline__ uint32_t fp8_quad_signed(const float v[4], float scale, bool e5m2, uint32_t signs) {
  const uint32_t q = fp8_pair(v[0] * scale, v[1] * scale, e5m2) | (fp8_pair(v[2] * scale, v[3] * scale, e5m2) << 16);
  return fp8_with_signs(q, signs);
}

// Bit 7 of byte k: the sign of v[k], k < 4 (three byte permutes).
__device__ __forceinline__ uint32_t signs_of4(const float* v) {
  const auto bits = [&](int k) { return __float_as_uint(v[k]); };
  return __byte_perm(__byte_perm(bits(0), bits(1), 0x0073), __byte_perm(bits(2), bits(3), 0x0073), 0x5410);
}

// Bit 7 of byte k: the sign of element k of a 16-byte input vector raw, whose compute-dtype values are v
// (same signs): elements [4 * half, 4 * half + 4) of bf16 input (8 elements) from raw, one byte permute;
// the 4 of fp32 input from v, so that raw need not stay live past the conversion.
template <bool kBf16>
__device__ __forceinline__ uint32_t input_signs(const uint4 raw, const float* v, int half = 0) {
  if (kBf16) return half ? __byte_perm(raw.z, raw.w, 0x7531) : __byte_perm(raw.x, raw.y, 0x7531);
  return signs_of4(v);
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

// E2M1 code of f with the FPU doing the rounding (e2m1_magnitude_bits; the cast is ALU-bound on Hopper).
__device__ __forceinline__ uint32_t e2m1_code_fpu(float f) {
  return ((__float_as_uint(f) >> 28) & 0x8u) | (e2m1_magnitude_bits(f) & 0x7u);
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

// prmt.b32 in its generic form: a selector nibble with bit 3 set gives 0xFF or 0x00 by the sign bit
// of the byte it picks (CUDA's __byte_perm ignores that bit).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

// kVec E2M1 codes of v[k] * enc, element k in bits 4k..4k+3, where v holds the compute-dtype values of the
// 16 input bytes raw (4 fp32 or 8 bf16; enc > 0). Without the hardware conversion the magnitudes come from
// e2m1_magnitude_bits, and the sign bits straight from raw (x * enc keeps the sign of x, -0 included) with
// byte permutes: 6 ALU instructions for a bf16 row instead of 2 an element (the cast is ALU-bound on Hopper);
// the codes go together by adds of shifted values and one byte permute, not a shift and a mask each.
template <int kVec>
__device__ __forceinline__ uint32_t e2m1_row(const uint4 raw, const float* v, float enc) {
#if defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM103_ALL)
  uint32_t row = 0;
#pragma unroll
  for (int k = 0; k < kVec; k += 2) row |= uint32_t(e2m1_pair(v[k] * enc, v[k + 1] * enc)) << (4 * k);
  return row;
#else
  // Codes from e2m1_magnitude_bits have zeros in bits 3-21, so shifted sums assemble a row's low bytes
  // without masks (the bits above 21 never carry down): p[j] bits 0-7 = codes 2j and 2j+1, bits 8-21 zero.
  uint32_t p[kVec / 2];
#pragma unroll
  for (int j = 0; j < kVec / 2; ++j)
    p[j] = e2m1_magnitude_bits(v[2 * j + 1] * enc) * 16u + e2m1_magnitude_bits(v[2 * j] * enc);
  uint32_t row;
  if constexpr (kVec == 8)
    row = prmt(p[0] + (p[1] << 8), p[2] + (p[3] << 8), 0x5410);
  else
    row = prmt(p[0], p[1], 0x1140);  // byte 1 of p[0] is zero
  // Per byte j, 0xFF where the sign of element 2j (lo) or 2j+1 (hi) is set.
  uint32_t lo, hi;
  if constexpr (kVec == 8) {  // bf16: element 2i in bits 0-15 of word i, 2i+1 in bits 16-31
    const uint32_t l = prmt(raw.x, raw.y, 0xFBD9), m = prmt(raw.z, raw.w, 0xFBD9);  // signs of 0 2 1 3, 4 6 5 7
    lo = prmt(l, m, 0x5410);
    hi = prmt(l, m, 0x7632);
  } else {  // fp32: element i is word i
    lo = prmt(raw.x, raw.z, 0xFB) & 0xFFFFu;
    hi = prmt(raw.y, raw.w, 0xFB) & 0xFFFFu;
  }
  return row | (lo & 0x08080808u) | (hi & 0x80808080u);
#endif
}

// 4x4 byte transpose: t[i] byte k = a[k] byte i (two rounds of byte permutes).
__device__ __forceinline__ void transpose_bytes4(const uint32_t a[4], uint32_t t[4]) {
  const uint32_t b0 = __byte_perm(a[0], a[1], 0x5140), b1 = __byte_perm(a[0], a[1], 0x7362);
  const uint32_t b2 = __byte_perm(a[2], a[3], 0x5140), b3 = __byte_perm(a[2], a[3], 0x7362);
  t[0] = __byte_perm(b0, b2, 0x5410);
  t[1] = __byte_perm(b0, b2, 0x7632);
  t[2] = __byte_perm(b1, b3, 0x5410);
  t[3] = __byte_perm(b1, b3, 0x7632);
}

// Columns of a lane's 16 x kVec codes, packed along the rows: rw[r] holds row r's kVec codes
// (4 bits each, column q at bit 4q); cb[q] byte b = rows 2b (low nibble) and 2b+1 of column q.
// Rows 2b and 2b+1 merge into one word of the even columns' bytes and one of the odd columns'
// (byte i: column 2i or 2i+1), then 4x4 byte transposes gather each column's 8 bytes.
template <int kVec>
__device__ __forceinline__ void column_bytes(const uint32_t rw[kTile], uint2 cb[kVec]) {
  uint32_t even[8], odd[8];
#pragma unroll
  for (int b = 0; b < 8; ++b) {
    const uint32_t lo = rw[2 * b], hi = rw[2 * b + 1];
    even[b] = (lo & 0x0F0F0F0Fu) | ((hi & 0x0F0F0F0Fu) << 4);
    odd[b] = ((lo >> 4) & 0x0F0F0F0Fu) | (hi & 0xF0F0F0F0u);
  }
  uint32_t e0[4], e1[4], o0[4], o1[4];  // [byte i]: rows 0-7 / 8-15 of column 2i (e) or 2i+1 (o)
  transpose_bytes4(even, e0);
  transpose_bytes4(even + 4, e1);
  transpose_bytes4(odd, o0);
  transpose_bytes4(odd + 4, o1);
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) {
    cb[2 * i] = make_uint2(e0[i], e1[i]);
    cb[2 * i + 1] = make_uint2(o0[i], o1[i]);
  }
}

}  // namespace
}  // namespace jaxquant
