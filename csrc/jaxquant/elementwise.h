// Per-element and per-byte pieces of the primitives, shared by the CPU loops and the CUDA kernels,
// so that both compute every output unit through the same code.
#pragma once

#include <climits>
#include <cstdint>

#include "jaxquant/numerics.h"

namespace jaxquant {

// Input element i as fp32; inputs are fp32 or bf16 (bit patterns).
JQ_HD float load_as_float(const void* x, bool is_bf16, int64_t i) {
  return is_bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(x)[i])
                 : static_cast<const float*>(x)[i];
}

// Input element i in the compute dtype, as fp32: with round_bf16 (fp32 input, bf16 compute dtype)
// the value is rounded to bf16 where it is loaded, so no separate convert pass runs.
JQ_HD float load_compute(const void* x, bool is_bf16, bool round_bf16, int64_t i) {
  const float v = load_as_float(x, is_bf16, i);
  return round_bf16 ? round_to_bf16(v) : v;
}

JQ_HD uint8_t fp8_encode(float v, bool e5m2) { return e5m2 ? float_to_e5m2(v) : float_to_e4m3(v); }

// NVFP4 partial cast, one byte. `byte` is the global byte index into the packed [rows, cols/2]
// data; elements outside [start, start+len) keep their nibble of `old_byte`.
struct PartialCast {
  const void* x;  // the shard: x[e - start] is element e
  bool is_bf16;
  int64_t start, len, cols, scale_cols;
  const uint8_t* scale_inv;
  float s_dec;

  // Encode multiplier of the tile holding element e (the same for 16 aligned elements).
  JQ_HD float enc_at(int64_t e) const {
    const int64_t row = e / cols, col = e - row * cols;
    return nvfp4_tile_encode(scale_inv[row * scale_cols + col / kTile], s_dec);
  }

  JQ_HD bool owns(int64_t e) const { return e >= start && e < start + len; }

  JQ_HD uint8_t code(int64_t e, float enc) const { return float_to_e2m1(load_as_float(x, is_bf16, e - start) * enc); }

  // Byte b given the encode multiplier of its tile.
  JQ_HD uint8_t byte(int64_t b, float enc, uint8_t old_byte) const {
    const int64_t e0 = 2 * b, e1 = e0 + 1;
    const uint8_t lo = owns(e0) ? code(e0, enc) : (old_byte & 0x0F);
    const uint8_t hi = owns(e1) ? code(e1, enc) : (old_byte >> 4);
    return static_cast<uint8_t>(lo | (hi << 4));
  }
};

// Packed transpose [rows, cols/2] -> [cols, rows/2], one output byte (k, c).
JQ_HD uint8_t transpose_byte(const uint8_t* data, int64_t cols, int64_t k, int64_t c) {
  const int64_t half = cols / 2, m0 = 2 * c;
  const uint8_t shift = static_cast<uint8_t>((k & 1) * 4);
  const uint8_t lo = (data[m0 * half + k / 2] >> shift) & 0x0F;
  const uint8_t hi = (data[(m0 + 1) * half + k / 2] >> shift) & 0x0F;
  return static_cast<uint8_t>(lo | (hi << 4));
}

// Padded rowwise scale_inv [ru(rows,128), ru(cols/16,4)], one entry (r, j); 0 in the padding.
JQ_HD uint8_t scale_entry(const float* tile_amax, int64_t rows, int64_t cols, float s_enc, int64_t r,
                          int64_t j) {
  if (r >= rows || j >= cols / kTile) return 0;
  return nvfp4_tile_scale_bits(tile_amax[(r / kTile) * (cols / kTile) + j], s_enc);
}

// Columnwise scale_inv_t [ru(cols,128), ru(rows/16,4)], one entry (k, i) = s8[i, k/16].
JQ_HD uint8_t scale_t_entry(const uint8_t* scale_inv, int64_t rows, int64_t cols, int64_t k, int64_t i) {
  if (k >= cols || i >= rows / kTile) return 0;
  return scale_inv[(i * kTile) * nvfp4_scale_cols(cols) + k / kTile];
}

}  // namespace jaxquant
