// The property both exhaustive checks test for one fp32 input (host: e2m1_magnitude_exhaustive.cc, GPU:
// e2m1_magnitude_exhaustive.cu): e2m1_magnitude_bits gives float_to_e2m1's magnitude code in bits 0-2,
// zeros in bits 3-21 and a one in bit 22 (csrc/jaxquant/numerics.h).
#pragma once
#include "jaxquant/numerics.h"

JQ_HD bool e2m1_magnitude_bits_agree(float f) {
  const uint32_t m = jaxquant::e2m1_magnitude_bits(f);
  return (m & 0x7FFFF8u) == 0x400000u && (m & 7u) == (jaxquant::float_to_e2m1(f) & 7u);
}
