// CPU FFI handlers: straightforward loops over the shared per-element code in elementwise.h.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "jaxquant/elementwise.h"
#include "jaxquant/ffi_checks.h"
#include "jaxquant/handlers.h"
#include "jaxquant/numerics.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace jaxquant {
namespace {

// XLA:CPU runs handlers on threads with flush-to-zero and denormals-are-zero set; docs/numerics.md asks for
// IEEE arithmetic, subnormals included, so each handler clears both for its duration.
class IeeeSubnormals {
 public:
#if defined(__x86_64__) || defined(__i386__)
  IeeeSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~0x8040u); }  // FTZ | DAZ
  ~IeeeSubnormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#elif defined(__aarch64__)
  IeeeSubnormals() {
    asm volatile("mrs %0, fpcr" : "=r"(saved_));
    asm volatile("msr fpcr, %0" ::"r"(saved_ & ~(uint64_t(1) << 24)));  // FZ
  }
  ~IeeeSubnormals() { asm volatile("msr fpcr, %0" ::"r"(saved_)); }

 private:
  uint64_t saved_;
#endif
};

struct AmaxCount {
  float amax = 0.0f;
  int32_t nonfinite = 0;
};

AmaxCount scan(const void* x, bool bf16, bool round_bf16, int64_t n) {
  AmaxCount r;
  for (int64_t i = 0; i < n; ++i) {
    const float v = load_compute(x, bf16, round_bf16, i);
    r.amax = std::max(r.amax, abs_ignoring_nan(v));
    r.nonfinite += is_finite(v) ? 0 : 1;
  }
  return r;
}

// FP8 statistics (jq_fp8_stats; jq_amax is the same without the compute-dtype rounding).
ffi::Error Fp8StatsCpu(ffi::AnyBuffer x, bool round_bf16, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                       ffi::Result<ffi::Buffer<ffi::S32>> count) {
  const IeeeSubnormals ieee;
  JQ_RETURN_IF_ERROR(check_input(x, "x"));
  JQ_RETURN_IF_ERROR(check_count(*amax, 1, "amax"));
  JQ_RETURN_IF_ERROR(check_count(*count, 1, "count"));
  const AmaxCount r = scan(x.untyped_data(), x.element_type() == ffi::DataType::BF16, round_bf16,
                           static_cast<int64_t>(x.element_count()));
  amax->typed_data()[0] = r.amax;
  count->typed_data()[0] = r.nonfinite;
  return ffi::Error::Success();
}

ffi::Error AmaxCpu(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                   ffi::Result<ffi::Buffer<ffi::S32>> count) {
  return Fp8StatsCpu(x, false, amax, count);
}

ffi::Error Fp8CastImpl(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& amax, float amax_epsilon,
                       bool pow2, bool round_bf16, ffi::Result<ffi::AnyBuffer>& data, ffi::Result<ffi::Buffer<ffi::F32>>& scale_inv,
                       ffi::Result<ffi::AnyBuffer>* data_t) {
  const IeeeSubnormals ieee;
  bool e5m2;
  const ffi::AnyBuffer* data_t_buf = data_t ? &**data_t : nullptr;
  JQ_RETURN_IF_ERROR(check_fp8_cast(x, amax, *data, data_t_buf, &e5m2));
  const Fp8Scale s = fp8_scale_from_amax(amax.typed_data()[0], e5m2 ? kE5M2Max : kE4M3Max, amax_epsilon, pow2);
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  const int64_t n = static_cast<int64_t>(x.element_count());
  auto* out = static_cast<uint8_t*>(data->untyped_data());
  for (int64_t i = 0; i < n; ++i)
    out[i] = fp8_encode(load_compute(x.untyped_data(), bf16, round_bf16, i) * s.scale, e5m2);
  scale_inv->typed_data()[0] = s.scale_inv;
  if (data_t != nullptr) {
    const int64_t rows = x.dimensions()[0], cols = x.dimensions()[1];
    auto* out_t = static_cast<uint8_t*>((*data_t)->untyped_data());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) out_t[c * rows + r] = out[r * cols + c];
  }
  return ffi::Error::Success();
}

ffi::Error Fp8CastCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax, float amax_epsilon, bool pow2,
                      ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::Buffer<ffi::F32>> scale_inv) {
  return Fp8CastImpl(x, amax, amax_epsilon, pow2, false, data, scale_inv, nullptr);
}

ffi::Error Fp8CastTCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax, float amax_epsilon, bool pow2,
                       ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                       ffi::Result<ffi::AnyBuffer> data_t) {
  return Fp8CastImpl(x, amax, amax_epsilon, pow2, false, data, scale_inv, &data_t);
}

ffi::Error Fp8QuantizeCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax, float amax_epsilon, bool pow2,
                          bool round_bf16, ffi::Result<ffi::AnyBuffer> data,
                          ffi::Result<ffi::Buffer<ffi::F32>> scale_inv) {
  return Fp8CastImpl(x, amax, amax_epsilon, pow2, round_bf16, data, scale_inv, nullptr);
}

ffi::Error Fp8QuantizeTCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax, float amax_epsilon, bool pow2,
                           bool round_bf16, ffi::Result<ffi::AnyBuffer> data,
                           ffi::Result<ffi::Buffer<ffi::F32>> scale_inv, ffi::Result<ffi::AnyBuffer> data_t) {
  return Fp8CastImpl(x, amax, amax_epsilon, pow2, round_bf16, data, scale_inv, &data_t);
}

// Tile amaxes [rows/16, cols/16] of flat elements [start, start + len) of x; returns the non-finite count.
int32_t tile_scan(const ffi::AnyBuffer& x, bool round_bf16, int64_t rows, int64_t cols, int64_t start, float* t) {
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  const int64_t len = static_cast<int64_t>(x.element_count()), tcols = cols / kTile;
  std::fill(t, t + (rows / kTile) * tcols, 0.0f);
  int32_t nonfinite = 0;
  int64_t row = start / cols, col = start - row * cols;
  for (int64_t i = 0; i < len; ++i) {
    const float v = load_compute(x.untyped_data(), bf16, round_bf16, i);
    float& slot = t[(row / kTile) * tcols + col / kTile];
    slot = std::max(slot, abs_ignoring_nan(v));
    nonfinite += is_finite(v) ? 0 : 1;
    if (++col == cols) {
      col = 0;
      ++row;
    }
  }
  return nonfinite;
}

ffi::Error TileAmaxCpu(ffi::AnyBuffer x, int64_t rows, int64_t cols, int64_t start,
                       ffi::Result<ffi::Buffer<ffi::F32>> tile_amax, ffi::Result<ffi::Buffer<ffi::S32>> count) {
  const IeeeSubnormals ieee;
  JQ_RETURN_IF_ERROR(check_tile_amax(x, rows, cols, start, *tile_amax));
  count->typed_data()[0] = tile_scan(x, false, rows, cols, start, tile_amax->typed_data());
  return ffi::Error::Success();
}

void fill_scale_inv(const float* tile_amax, float amax, int64_t rows, int64_t cols, uint8_t* out) {
  const float s_enc = nvfp4_global_encode_scale(amax);
  const int64_t pr = nvfp4_scale_rows(rows), pc = nvfp4_scale_cols(cols);
  for (int64_t r = 0; r < pr; ++r)
    for (int64_t j = 0; j < pc; ++j) out[r * pc + j] = scale_entry(tile_amax, rows, cols, s_enc, r, j);
}

void fill_transpose(const uint8_t* data, int64_t rows, int64_t cols, uint8_t* out) {
  for (int64_t k = 0; k < cols; ++k)
    for (int64_t c = 0; c < rows / 2; ++c) out[k * (rows / 2) + c] = transpose_byte(data, cols, k, c);
}

void fill_scale_inv_t(const uint8_t* scale_inv, int64_t rows, int64_t cols, uint8_t* out) {
  const int64_t pr = nvfp4_scale_rows(cols), pc = nvfp4_scale_cols(rows);
  for (int64_t k = 0; k < pr; ++k)
    for (int64_t i = 0; i < pc; ++i) out[k * pc + i] = scale_t_entry(scale_inv, rows, cols, k, i);
}

ffi::Error ScaleCpu(ffi::Buffer<ffi::F32> tile_amax, ffi::Buffer<ffi::F32> amax,
                    ffi::Result<ffi::Buffer<ffi::U8>> scale_inv) {
  const IeeeSubnormals ieee;
  int64_t rows, cols;
  JQ_RETURN_IF_ERROR(check_scale(tile_amax, amax, *scale_inv, &rows, &cols));
  fill_scale_inv(tile_amax.typed_data(), amax.typed_data()[0], rows, cols, scale_inv->typed_data());
  return ffi::Error::Success();
}

ffi::Error CastPartialCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::U8> bytes, ffi::Buffer<ffi::U8> scale_inv,
                          ffi::Buffer<ffi::F32> amax, int64_t rows, int64_t cols, int64_t start,
                          ffi::Result<ffi::Buffer<ffi::U8>> out) {
  const IeeeSubnormals ieee;
  JQ_RETURN_IF_ERROR(check_partial_cast(x, bytes, scale_inv, amax, *out, rows, cols, start));
  const PartialCast pc{x.untyped_data(),
                       x.element_type() == ffi::DataType::BF16,
                       start,
                       static_cast<int64_t>(x.element_count()),
                       cols,
                       nvfp4_scale_cols(cols),
                       scale_inv.typed_data(),
                       1.0f / nvfp4_global_encode_scale(amax.typed_data()[0])};
  const int64_t first = start / 2, nbytes = static_cast<int64_t>(bytes.element_count());
  const uint8_t* in = bytes.typed_data();
  uint8_t* dst = out->typed_data();  // may alias `in`: each byte is read before it is written
  int64_t group = -1;  // 16-element group whose tile's multiplier `enc` holds
  float enc = 0.0f;
  for (int64_t i = 0; i < nbytes; ++i) {
    const int64_t b = first + i;
    if ((b >> 3) != group) {
      group = b >> 3;
      enc = pc.enc_at(2 * b);
    }
    dst[i] = pc.byte(b, enc, in[i]);
  }
  return ffi::Error::Success();
}

ffi::Error TransposeCpu(ffi::Buffer<ffi::U8> data, ffi::Result<ffi::Buffer<ffi::U8>> data_t) {
  int64_t rows, cols;
  JQ_RETURN_IF_ERROR(check_transpose(data, *data_t, &rows, &cols));
  fill_transpose(data.typed_data(), rows, cols, data_t->typed_data());
  return ffi::Error::Success();
}

ffi::Error ScaleTransposeCpu(ffi::Buffer<ffi::U8> scale_inv, int64_t rows, int64_t cols,
                             ffi::Result<ffi::Buffer<ffi::U8>> scale_inv_t) {
  JQ_RETURN_IF_ERROR(check_scale_transpose(scale_inv, rows, cols, *scale_inv_t));
  fill_scale_inv_t(scale_inv.typed_data(), rows, cols, scale_inv_t->typed_data());
  return ffi::Error::Success();
}

// ---- single-tensor NVFP4 stages: statistics, then every output from one more read -----------

ffi::Error Nvfp4StatsCpu(ffi::AnyBuffer x, bool round_bf16, ffi::Result<ffi::Buffer<ffi::F32>> tile_amax,
                         ffi::Result<ffi::Buffer<ffi::F32>> amax, ffi::Result<ffi::Buffer<ffi::S32>> count) {
  const IeeeSubnormals ieee;
  int64_t rows, cols;
  JQ_RETURN_IF_ERROR(check_nvfp4_stats(x, *tile_amax, *amax, *count, &rows, &cols));
  float* t = tile_amax->typed_data();
  count->typed_data()[0] = tile_scan(x, round_bf16, rows, cols, 0, t);
  amax->typed_data()[0] = *std::max_element(t, t + (rows / kTile) * (cols / kTile));  // no NaN: tiles ignore it
  return ffi::Error::Success();
}

ffi::Error Nvfp4QuantizeImpl(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& tile_amax,
                             const ffi::Buffer<ffi::F32>& amax, bool round_bf16, ffi::Buffer<ffi::U8>& data,
                             ffi::Buffer<ffi::U8>& scale_inv, ffi::Buffer<ffi::U8>* data_t,
                             ffi::Buffer<ffi::U8>* scale_inv_t) {
  const IeeeSubnormals ieee;
  int64_t rows, cols;
  JQ_RETURN_IF_ERROR(check_nvfp4_quantize(x, tile_amax, amax, data, scale_inv, data_t, scale_inv_t, &rows, &cols));
  const float a = amax.typed_data()[0], s_dec = 1.0f / nvfp4_global_encode_scale(a);
  uint8_t* s8 = scale_inv.typed_data();
  fill_scale_inv(tile_amax.typed_data(), a, rows, cols, s8);
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  const int64_t pc = nvfp4_scale_cols(cols);
  uint8_t* out = data.typed_data();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols / kTile; ++j) {
      const float enc = nvfp4_tile_encode(s8[r * pc + j], s_dec);
      for (int64_t b = 0; b < kTile / 2; ++b) {
        const int64_t e = r * cols + j * kTile + 2 * b;
        const uint8_t lo = float_to_e2m1(load_compute(x.untyped_data(), bf16, round_bf16, e) * enc);
        const uint8_t hi = float_to_e2m1(load_compute(x.untyped_data(), bf16, round_bf16, e + 1) * enc);
        out[e / 2] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  }
  if (data_t != nullptr) {
    fill_transpose(out, rows, cols, data_t->typed_data());
    fill_scale_inv_t(s8, rows, cols, scale_inv_t->typed_data());
  }
  return ffi::Error::Success();
}

ffi::Error Nvfp4QuantizeCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> tile_amax, ffi::Buffer<ffi::F32> amax,
                            bool round_bf16, ffi::Result<ffi::Buffer<ffi::U8>> data,
                            ffi::Result<ffi::Buffer<ffi::U8>> scale_inv) {
  return Nvfp4QuantizeImpl(x, tile_amax, amax, round_bf16, *data, *scale_inv, nullptr, nullptr);
}

ffi::Error Nvfp4QuantizeTCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> tile_amax, ffi::Buffer<ffi::F32> amax,
                             bool round_bf16, ffi::Result<ffi::Buffer<ffi::U8>> data,
                             ffi::Result<ffi::Buffer<ffi::U8>> scale_inv, ffi::Result<ffi::Buffer<ffi::U8>> data_t,
                             ffi::Result<ffi::Buffer<ffi::U8>> scale_inv_t) {
  return Nvfp4QuantizeImpl(x, tile_amax, amax, round_bf16, *data, *scale_inv, &*data_t, &*scale_inv_t);
}

// The bf16 operand value(q) * s8 (jq_nvfp4_bf16_operand): per 16x16 tile, its amax, then its elements, from x alone.
ffi::Error Nvfp4Bf16OperandCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax, bool round_bf16,
                               ffi::Result<ffi::Buffer<ffi::BF16>> out) {
  const IeeeSubnormals ieee;
  int64_t rows, cols;
  JQ_RETURN_IF_ERROR(check_nvfp4_bf16_operand(x, amax, *out, &rows, &cols));
  const float s_enc = nvfp4_global_encode_scale(amax.typed_data()[0]), s_dec = 1.0f / s_enc;
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  const void* in = x.untyped_data();
  auto* dst = reinterpret_cast<uint16_t*>(out->untyped_data());
  for (int64_t i = 0; i < rows; i += kTile) {
    for (int64_t j = 0; j < cols; j += kTile) {
      float t = 0.0f;
      for (int64_t r = i; r < i + kTile; ++r)
        for (int64_t c = j; c < j + kTile; ++c)
          t = std::max(t, abs_ignoring_nan(load_compute(in, bf16, round_bf16, r * cols + c)));
      const uint8_t s8 = nvfp4_tile_scale_bits(t, s_enc);
      const float enc = nvfp4_tile_encode(s8, s_dec), s8f = e4m3_to_float(s8);
      for (int64_t r = i; r < i + kTile; ++r)
        for (int64_t c = j; c < j + kTile; ++c) {
          const int64_t e = r * cols + c;
          dst[e] = nvfp4_blockwise_bf16(float_to_e2m1(load_compute(in, bf16, round_bf16, e) * enc), s8f);
        }
    }
  }
  return ffi::Error::Success();
}

// ---- grouped ops over one shard of a ZeRO flat buffer ----------------------------------------

constexpr int64_t kNoBound = INT64_MAX / 4;

ffi::Error GroupTileAmaxCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::U32> table_words,
                            bool round_bf16, ffi::Result<ffi::Buffer<ffi::F32>> tile_amax, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                            ffi::Result<ffi::Buffer<ffi::S32>> counts) {
  const IeeeSubnormals ieee;
  int64_t num_params;
  JQ_RETURN_IF_ERROR(check_group(x, index, table_words, &num_params));
  JQ_RETURN_IF_ERROR(check_count(*amax, num_params, "amax"));
  JQ_RETURN_IF_ERROR(check_count(*counts, num_params, "counts"));
  const int64_t num_tiles = static_cast<int64_t>(tile_amax->element_count());
  JQ_RETURN_IF_ERROR(check_group_table_contents(as_i64(table_words), num_params, kNoBound, num_tiles, true));
  const GroupTable table{as_i64(table_words), num_params};
  const int64_t n = static_cast<int64_t>(x.element_count()), r = index.typed_data()[0];
  if (r < 0) return invalid("shard_index: must be >= 0");
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  float* t = tile_amax->typed_data();
  float* a = amax->typed_data();
  int32_t* c = counts->typed_data();
  std::fill(t, t + num_tiles, 0.0f);
  std::fill(a, a + num_params, 0.0f);
  std::fill(c, c + num_params, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = r * n + i, p = table.find(g, GroupTable::kOffset);
    if (p < 0) continue;
    const int64_t e = g - table.at(p, GroupTable::kOffset);
    if (e >= table.at(p, GroupTable::kNumel)) continue;  // alignment padding
    const float v = load_compute(x.untyped_data(), bf16, round_bf16, i);
    float& slot = t[table.tile_of(p, e)];
    slot = std::max(slot, abs_ignoring_nan(v));
    a[p] = std::max(a[p], abs_ignoring_nan(v));
    c[p] += is_finite(v) ? 0 : 1;
  }
  return ffi::Error::Success();
}

ffi::Error GroupCastCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::U32> table_words,
                        ffi::Buffer<ffi::U32> chunk_lo_words, ffi::Buffer<ffi::F32> enc, bool round_bf16,
                        ffi::Result<ffi::Buffer<ffi::U8>> chunk) {
  const IeeeSubnormals ieee;
  int64_t num_params;
  JQ_RETURN_IF_ERROR(check_group(x, index, table_words, &num_params));
  if (chunk_lo_words.element_count() % 2) return invalid("chunk_lo: must be int64 values as uint32 words");
  const int64_t num_shards = static_cast<int64_t>(chunk_lo_words.element_count() / 2);
  const int64_t n = static_cast<int64_t>(x.element_count()), r = index.typed_data()[0];
  if (r < 0 || r >= num_shards) return invalid("shard_index: must be in [0, len(chunk_lo))");
  JQ_RETURN_IF_ERROR(check_group_table_contents(as_i64(table_words), num_params, num_shards * n,
                                                static_cast<int64_t>(enc.element_count()), true));
  const GroupTable table{as_i64(table_words), num_params};
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  const int64_t lo = as_i64(chunk_lo_words)[r], size = static_cast<int64_t>(chunk->element_count());
  uint8_t* out = chunk->typed_data();
  for (int64_t j = 0; j < size; ++j) {
    const int64_t y = lo + j, p = table.find(y, GroupTable::kByteBase);
    uint8_t byte = 0;
    if (p >= 0 && y - table.at(p, GroupTable::kByteBase) < table.at(p, GroupTable::kNumel) / 2) {
      const int64_t e0 = 2 * (y - table.at(p, GroupTable::kByteBase));
      const float m = enc.typed_data()[table.tile_of(p, e0)];
      for (int k = 0; k < 2; ++k) {
        const int64_t i = table.at(p, GroupTable::kOffset) + e0 + k - r * n;
        if (i >= 0 && i < n) byte |= float_to_e2m1(load_compute(x.untyped_data(), bf16, round_bf16, i) * m) << (4 * k);
      }
    }
    out[j] = byte;
  }
  return ffi::Error::Success();
}

ffi::Error Fp8GroupAmaxCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::U32> table_words,
                           bool round_bf16, ffi::Result<ffi::Buffer<ffi::F32>> amax, ffi::Result<ffi::Buffer<ffi::S32>> counts) {
  const IeeeSubnormals ieee;
  int64_t num_params;
  JQ_RETURN_IF_ERROR(check_group(x, index, table_words, &num_params));
  JQ_RETURN_IF_ERROR(check_count(*amax, num_params, "amax"));
  JQ_RETURN_IF_ERROR(check_count(*counts, num_params, "counts"));
  JQ_RETURN_IF_ERROR(check_group_table_contents(as_i64(table_words), num_params, kNoBound, 0, false));
  const GroupTable table{as_i64(table_words), num_params};
  const int64_t n = static_cast<int64_t>(x.element_count()), r = index.typed_data()[0];
  if (r < 0) return invalid("shard_index: must be >= 0");
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  float* a = amax->typed_data();
  int32_t* c = counts->typed_data();
  std::fill(a, a + num_params, 0.0f);
  std::fill(c, c + num_params, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = r * n + i, p = table.find(g, GroupTable::kOffset);
    if (p < 0 || g - table.at(p, GroupTable::kOffset) >= table.at(p, GroupTable::kNumel)) continue;
    const float v = load_compute(x.untyped_data(), bf16, round_bf16, i);
    a[p] = std::max(a[p], abs_ignoring_nan(v));
    c[p] += is_finite(v) ? 0 : 1;
  }
  return ffi::Error::Success();
}

ffi::Error Fp8GroupCastCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::U32> table_words,
                           ffi::Buffer<ffi::F32> scale, bool round_bf16, int64_t first, ffi::Result<ffi::AnyBuffer> data) {
  const IeeeSubnormals ieee;
  int64_t num_params;
  bool e5m2;
  JQ_RETURN_IF_ERROR(check_fp8_group_cast(x, index, table_words, scale, first, *data, &num_params, &e5m2));
  JQ_RETURN_IF_ERROR(check_group_table_contents(as_i64(table_words), num_params, kNoBound, 0, false));
  const GroupTable table{as_i64(table_words), num_params};
  const int64_t n = static_cast<int64_t>(x.element_count()), r = index.typed_data()[0];
  if (r < 0) return invalid("shard_index: must be >= 0");
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  auto* out = static_cast<uint8_t*>(data->untyped_data());
  const int64_t end = first + static_cast<int64_t>(data->element_count());
  for (int64_t i = first; i < end; ++i) {
    const int64_t g = r * n + i, p = table.find(g, GroupTable::kOffset);
    const bool inside = p >= 0 && g - table.at(p, GroupTable::kOffset) < table.at(p, GroupTable::kNumel);
    out[i - first] = inside ? fp8_encode(load_compute(x.untyped_data(), bf16, round_bf16, i) * scale.typed_data()[p], e5m2) : 0;
  }
  return ffi::Error::Success();
}

// Scales of every parameter of the group from its reduced tile amaxes and global amax.
ffi::Error GroupScaleCpu(ffi::Buffer<ffi::F32> tiles, ffi::Buffer<ffi::F32> amax, ffi::Buffer<ffi::U32> table_words,
                         ffi::Result<ffi::Buffer<ffi::U8>> scale_inv, ffi::Result<ffi::Buffer<ffi::F32>> enc) {
  const IeeeSubnormals ieee;
  int64_t num_params, num_tiles, scale_bytes;
  JQ_RETURN_IF_ERROR(check_group_scale(tiles, amax, table_words, *scale_inv, *enc, &num_params, &num_tiles, &scale_bytes));
  JQ_RETURN_IF_ERROR(check_group_table_contents(as_i64(table_words), num_params, kNoBound, num_tiles, true));
  const GroupTable table{as_i64(table_words), num_params};
  for (int64_t u = 0; u < group_scale_strips(scale_bytes); ++u)
    group_scale_strip(table, tiles.typed_data(), num_tiles, amax.typed_data(), u, scale_inv->typed_data(), scale_bytes,
                      enc->typed_data());
  return ffi::Error::Success();
}

// The whole space of gathered pieces in one host buffer (the CPU path has no copy to save).
std::vector<uint8_t> assemble(const GatheredSpace& space) {
  std::vector<uint8_t> out(static_cast<size_t>(space.size));
  for (int64_t pos = 0; pos < space.size;) {
    int64_t run;
    const uint8_t* p = space.locate(pos, &run);
    std::memcpy(out.data() + pos, p, static_cast<size_t>(run));
    pos += run;
  }
  return out;
}

// Result r as uint8, after checking it holds `bytes` bytes (the host table's size of it).
ffi::Error result_bytes(ffi::RemainingRets& rets, int64_t r, int64_t bytes, uint8_t** out) {
  auto ret = rets.get<ffi::AnyBuffer>(r);
  if (!ret.has_value()) return ret.error();
  if (static_cast<int64_t>((*ret.value()).size_bytes()) != bytes)
    return invalid("results: result " + std::to_string(r) + " must hold " + std::to_string(bytes) + " bytes");
  *out = static_cast<uint8_t*>((*ret.value()).untyped_data());
  return ffi::Error::Success();
}

// Columnwise data and scales of every parameter from the packed rowwise ones.
ffi::Error GroupColumnwiseCpu(ffi::Buffer<ffi::U8> scale_inv, ffi::Buffer<ffi::U32> table_words,
                              ffi::RemainingArgs pieces, ffi::Span<const int64_t> ranges,
                              ffi::Span<const int64_t> space_attr, ffi::RemainingRets rets) {
  GatheredSpace space;
  int64_t num_params;
  int64_t data_t_bytes;  // each result's size is checked below
  JQ_RETURN_IF_ERROR(check_group_transpose(pieces, space_attr, table_words, rets, ranges, true, &space, &num_params,
                                           &data_t_bytes));
  JQ_RETURN_IF_ERROR(check_group_table_contents(as_i64(table_words), num_params, kNoBound, kNoBound, true));
  JQ_RETURN_IF_ERROR(check_group_columnwise_bounds(as_i64(table_words), num_params, space.size, scale_inv));
  const GroupTable table{as_i64(table_words), num_params};
  const std::vector<uint8_t> data = assemble(space);
  for (int64_t p = 0; p < num_params; ++p) {
    const int64_t rows = table.at(p, GroupTable::kRows), cols = table.at(p, GroupTable::kCols);
    const int64_t bytes = rows * cols / 2, scale_t_bytes = nvfp4_scale_rows(cols) * nvfp4_scale_cols(rows);
    uint8_t *data_t, *scale_t;
    JQ_RETURN_IF_ERROR(result_bytes(rets, p, bytes, &data_t));
    JQ_RETURN_IF_ERROR(result_bytes(rets, num_params + p, scale_t_bytes, &scale_t));
    const uint8_t* src = data.data() + table.at(p, GroupTable::kByteBase);
    for (int64_t y = 0; y < bytes; ++y) data_t[y] = transpose_byte(src, cols, y / (rows / 2), y % (rows / 2));
    const int64_t u0 = table.at(p, GroupTable::kScaleTBase) / kTile;
    for (int64_t u = u0; u < u0 + scale_t_bytes / kTile; ++u)
      group_scale_t_strip(table, scale_inv.typed_data(), u, [&](int64_t) { return scale_t; });
  }
  return ffi::Error::Success();
}

// Byte transpose of every FP8 parameter of the gathered flat buffer.
ffi::Error Fp8GroupTransposeCpu(ffi::Buffer<ffi::U32> table_words, ffi::RemainingArgs pieces,
                                ffi::Span<const int64_t> ranges, ffi::Span<const int64_t> space_attr,
                                ffi::RemainingRets rets) {
  GatheredSpace space;
  int64_t num_params;
  int64_t data_t_bytes;  // each result's size is checked below
  JQ_RETURN_IF_ERROR(check_group_transpose(pieces, space_attr, table_words, rets, ranges, false, &space, &num_params,
                                           &data_t_bytes));
  JQ_RETURN_IF_ERROR(check_group_table_contents(as_i64(table_words), num_params, space.size, 0, false));
  const GroupTable table{as_i64(table_words), num_params};
  const std::vector<uint8_t> data = assemble(space);
  for (int64_t p = 0; p < num_params; ++p) {
    const int64_t off = table.at(p, GroupTable::kOffset), numel = table.at(p, GroupTable::kNumel);
    uint8_t* data_t;
    JQ_RETURN_IF_ERROR(result_bytes(rets, p, numel, &data_t));
    const int64_t rows = table.at(p, GroupTable::kRows), cols = table.at(p, GroupTable::kCols);
    for (int64_t y = 0; y < numel; ++y) data_t[y] = data[off + (y % rows) * cols + y / rows];  // [cols, rows]
  }
  return ffi::Error::Success();
}

// Per-parameter results from the group's packed buffers: one call, any number of results.
ffi::Error GroupSplitCpu(ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Span<const int64_t> plan,
                         bool partial) {
  std::vector<CopySegment> segments;
  JQ_RETURN_IF_ERROR(split_segments(args, rets, plan, partial, &segments));
  for (const CopySegment& s : segments) std::memcpy(s.dst, s.src, static_cast<size_t>(s.bytes));
  return ffi::Error::Success();
}

}  // namespace

JQ_DEFINE_HANDLERS(Cpu, JQ_NO_CTX)

}  // namespace jaxquant
