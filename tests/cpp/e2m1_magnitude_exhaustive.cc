// Every fp32 input: e2m1_magnitude_bits (the Hopper cast kernels' rounding, csrc/jaxquant/numerics.h) gives
// the magnitude code of float_to_e2m1 in bits 0-2, zeros in bits 3-21 and a one in bit 22. Exit status 1 on
// any mismatch.
#include <cstdio>
#include "e2m1_magnitude_check.h"
int main() {
  using namespace jaxquant;
  unsigned long long bad = 0;
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; ++u) {
    const float f = bits_float(static_cast<uint32_t>(u));
    if (!e2m1_magnitude_bits_agree(f)) {
      if (bad++ < 5)
        std::printf("mismatch at 0x%08llx: bits 0x%08x, float_to_e2m1 code %u\n", (unsigned long long)u,
                    e2m1_magnitude_bits(f), float_to_e2m1(f) & 7u);
    }
  }
  std::printf("%llu mismatches\n", bad);
  return bad != 0;
}
