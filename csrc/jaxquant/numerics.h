// jaxquant numerics: docs/numerics.md §1 and §2 written once, for host (CPU handlers) and device (CUDA kernels).
//
// Everything is plain IEEE fp32 arithmetic with round-to-nearest-even and integer bit manipulation,
// so host and device give identical bits. Build without fast-math and with -fmad=false on nvcc
// (no expression here contains an add that could be contracted, but the flag keeps it that way).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define JQ_HD __host__ __device__ __forceinline__
#else
#define JQ_HD inline
#endif

namespace jaxquant {

constexpr float kFltMax = 3.402823466e+38f;
constexpr float kFltMin = 1.175494351e-38f;
constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr float kNvfp4GlobalRange = 2688.0f;  // 6 * 448
constexpr int kTile = 16;

JQ_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

JQ_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

JQ_HD bool is_nan(float f) { return (float_bits(f) & 0x7FFFFFFFu) > 0x7F800000u; }
JQ_HD bool is_finite(float f) { return (float_bits(f) & 0x7F800000u) != 0x7F800000u; }
// C's fminf/fmaxf semantics: a NaN operand is ignored.
JQ_HD float fmin_ignore_nan(float a, float b) { return is_nan(a) ? b : (is_nan(b) ? a : (a < b ? a : b)); }
JQ_HD float fmax_ignore_nan(float a, float b) { return is_nan(a) ? b : (is_nan(b) ? a : (a > b ? a : b)); }

// |x| with NaN mapped to 0: a max over it ignores NaN (docs/numerics.md §1.1).
JQ_HD float abs_ignoring_nan(float x) { return is_nan(x) ? 0.0f : bits_float(float_bits(x) & 0x7FFFFFFFu); }

JQ_HD float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// fp32 -> small float magnitude code, RNE, saturating to max_code (NaN handled by callers).
// kMant mantissa bits, kEmin the smallest normal exponent, kBias the exponent bias.
template <int kMant, int kEmin, int kBias>
JQ_HD uint32_t round_magnitude(uint32_t abs_bits, uint32_t max_code) {
  const int exp = static_cast<int>(abs_bits >> 23) - 127;
  if (exp >= kEmin) {
    constexpr int shift = 23 - kMant;
    const uint32_t rounded =
        (abs_bits + ((1u << (shift - 1)) - 1u) + ((abs_bits >> shift) & 1u)) >> shift;
    const uint32_t code = rounded - (static_cast<uint32_t>(127 - kBias) << kMant);
    return code > max_code ? max_code : code;
  }
  // Below the smallest normal: count units of 2^(kEmin - kMant), rounding half to even.
  const int s = 23 + kEmin - kMant - exp;
  if (s > 24 || exp == -127) return 0;  // < half a unit (fp32 subnormals included)
  const uint32_t m = (abs_bits & 0x7FFFFFu) | 0x800000u;
  uint32_t q = m >> s;
  const uint32_t rem = m & ((1u << s) - 1u);
  const uint32_t half = 1u << (s - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return q;  // q == 1 << kMant is the smallest normal's code: still correct
}

// fp32 -> E4M3 (float8_e4m3fn) bits, RNE, finite overflow and ±inf saturate to ±448, NaN -> NaN.
JQ_HD uint8_t float_to_e4m3(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  if (is_nan(f)) return static_cast<uint8_t>(sign | 0x7Fu);
  return static_cast<uint8_t>(sign | round_magnitude<3, -6, 7>(u & 0x7FFFFFFFu, 0x7Eu));
}

// fp32 -> E5M2 bits, RNE, saturating to ±57344, NaN -> NaN.
JQ_HD uint8_t float_to_e5m2(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  if (is_nan(f)) return static_cast<uint8_t>(sign | 0x7Fu);
  return static_cast<uint8_t>(sign | round_magnitude<2, -14, 15>(u & 0x7FFFFFFFu, 0x7Bu));
}

// fp32 -> E2M1 code (bit 3 sign), RNE on the grid, saturating to ±6; -0 and negative values
// that round to 0 keep the sign (code 8). Software path, bit-exact with cvt.rn.satfinite.e2m1x2.
// Branch-free and cheap (the cast is ALU-bound on Hopper without it):
//  - |f| >= 1: the normal grid (1 mantissa bit, exponent bias 1) is round_magnitude<1, 0, 1>;
//  - |f| <  1: the grid is 0, 0.5, 1 (codes 0..2); adding 2^22, whose fp32 ulp is 0.5, rounds |f|
//    to it with the FPU's RNE, and the code is the distance in ulps from 2^22.
// NaN gives 7, as round_magnitude would.
JQ_HD uint8_t float_to_e2m1(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 28) & 0x8u, abs_bits = u & 0x7FFFFFFFu;
  const float a = bits_float(abs_bits);
  const uint32_t below_one = float_bits(a + 4194304.0f) - 0x4A800000u;  // bits of 2^22
  const uint32_t rounded = (abs_bits + 0x1FFFFFu + ((abs_bits >> 22) & 1u)) >> 22;
  const uint32_t normal = rounded - 252u > 7u ? 7u : rounded - 252u;  // (127 - 1) << 1
  return static_cast<uint8_t>(sign | (a < 1.0f ? below_one : normal));
}

// The magnitude code of e2m1(x) (docs/numerics.md §2, rule 6) in bits 0-2 of the result, bits 3-21 zero and
// bit 22 one (bits 23-31 hold an exponent the caller masks off), for kernels that put the signs in
// separately. The FPU rounds: after saturating |x| to 6, adding M = 2^e (2^22 + 2^21 - 149) (e =
// max(floor(log2 |x|), 0)), which is 2^(e+22) plus 2^22 - 298 ulps of that binade, leaves one ulp equal to
// the E2M1 step of the binade (0.5 below 2, 1 in [2, 4), 2 in [4, 6]), so the sum is RNE on the grid (the
// offset is even: the parity the ties look at is the code's). The sum s has mantissa 2^22 - 298 + k (k:
// |x| rounded to whole steps of its binade) and exponent field 149 + e, so s + (s >> 22) has
// 2^22 + k + 2e = 2^22 + code in bits 0-22. On the GPU the M product fuses into the add (it is exact): one
// FFMA where an integer M took a shift-add and an add (ALU pipe, the cast's busiest) before the float add.
// Same code as float_to_e2m1 for every fp32 input (tests/test_e2m1_magnitude.py checks all 2^32, on the host
// and on a GPU); NaN gives 7.
JQ_HD uint32_t e2m1_magnitude_bits(float x) {
#if defined(__CUDA_ARCH__)
  const float a = fminf(fabsf(x), 6.0f);  // one min.f32 with an |x| operand; NaN gives 6
#else
  const float a = fmin_ignore_nan(bits_float(float_bits(x) & 0x7FFFFFFFu), 6.0f);
#endif
  const uint32_t ab = float_bits(a);
  const float two_e = bits_float((ab > 0x3F800000u ? ab : 0x3F800000u) & 0x7F800000u);  // 2^e, e >= 0
  constexpr float kMagic = 6291307.0f;  // 2^22 + 2^21 - 149
#if defined(__CUDA_ARCH__)
  const uint32_t sum = float_bits(__fmaf_rn(two_e, kMagic, a));
#else
  const uint32_t sum = float_bits(two_e * kMagic + a);  // the product is exact
#endif
  return (sum >> 22) + sum;
}

// fp32 -> the nearest bf16 value (RNE), as fp32: the compute-dtype rounding (docs/numerics.md §2,
// "Compute dtype"); overflow gives inf, subnormals round like normals, NaN stays NaN (sign kept).
JQ_HD float round_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if (is_nan(f)) return bits_float((u | 0x00400000u) & 0xFFFF0000u);
  return bits_float((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}

JQ_HD float e4m3_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xFu, m = b & 0x7u;
  if ((b & 0x7Fu) == 0x7Fu) return bits_float(sign | 0x7FC00000u);
  if (e == 0) return bits_float(sign | float_bits(static_cast<float>(m) * 0.001953125f));  // m * 2^-9
  return bits_float(sign | ((e + 120u) << 23) | (m << 20));
}

JQ_HD float e2m1_to_float(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x8u) << 28;
  const uint32_t e = (code >> 1) & 0x3u, m = code & 0x1u;
  if (e == 0) return bits_float(sign | (m ? 0x3F000000u : 0u));  // 0 or 0.5
  return bits_float(sign | ((e + 126u) << 23) | (m << 22));
}

// ---------------------------------------------------------------------------------------------
// FP8 per-tensor current scaling (docs/numerics.md §1 steps 2-5)
// ---------------------------------------------------------------------------------------------
struct Fp8Scale {
  float scale;
  float scale_inv;
};

JQ_HD Fp8Scale fp8_scale_from_amax(float amax, float fp8_max, float amax_epsilon, bool force_pow_2) {
  const float a = fmax_ignore_nan(amax, amax_epsilon);
  float scale;
  if (a == 0.0f || !is_finite(a)) {
    scale = 1.0f;
  } else {
    scale = fp8_max / a;
    if (scale > kFltMax) scale = kFltMax;  // +inf -> FLT_MAX
  }
  if (force_pow_2) scale = bits_float(float_bits(scale) & 0xFF800000u);
  return {scale, 1.0f / scale};
}

// ---------------------------------------------------------------------------------------------
// NVFP4 2D block scaling (docs/numerics.md §2 steps 2-5)
// ---------------------------------------------------------------------------------------------
JQ_HD float nvfp4_global_encode_scale(float amax) {
  if (amax == 0.0f || !is_finite(amax)) return 1.0f;
  return fmin_ignore_nan(kNvfp4GlobalRange / fmax_ignore_nan(amax, kFltMin), kFltMax);
}

// E4M3 bits of the tile decode scale.
JQ_HD uint8_t nvfp4_tile_scale_bits(float tile_amax, float s_enc) {
  const float c6 = bits_float(0x3E2AAAABu);  // 1.0f / 6.0f
  return float_to_e4m3(fmin_ignore_nan(tile_amax * (s_enc * c6), kFltMax));
}

// Encode multiplier of a tile from its stored E4M3 scale and the global decode scale.
JQ_HD float nvfp4_tile_encode(uint8_t s8_bits, float s_dec) {
  const float s8 = e4m3_to_float(s8_bits);
  if (s8 == 0.0f) return kFltMax;
  return fmin_ignore_nan(1.0f / (s8 * s_dec), kFltMax);
}

// bf16 bits of value(code) * float(s8), the NVFP4 element decoded without the global factor (§2.8): a 2-bit by
// 4-bit significand product between 2^-10 and 2688, so the fp32 product is exact and so is its bf16 (the upper
// half of its bits; -0 and +0 keep their signs).
JQ_HD uint16_t nvfp4_blockwise_bf16(uint8_t code, float s8) {
  return static_cast<uint16_t>(float_bits(e2m1_to_float(code) * s8) >> 16);
}

// Layout helpers (docs/numerics.md §2.7).
JQ_HD int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }
JQ_HD int64_t nvfp4_scale_rows(int64_t rows) { return round_up(rows, 128); }
JQ_HD int64_t nvfp4_scale_cols(int64_t cols) { return round_up(cols / kTile, 4); }

}  // namespace jaxquant
