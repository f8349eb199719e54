// Every fp32 input, on the GPU: e2m1_magnitude_bits as the device compiles it (fused multiply-add, min with
// an |x| operand; csrc/jaxquant/numerics.h) passes e2m1_magnitude_bits_agree. Prints the mismatch count;
// exit status 1 on any.
#include <cstdio>
#include "e2m1_magnitude_check.h"

__global__ void check(unsigned long long* bad, uint32_t* first) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  unsigned long long local = 0;
  for (uint64_t u = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; u <= 0xFFFFFFFFull; u += stride) {
    if (!e2m1_magnitude_bits_agree(jaxquant::bits_float(static_cast<uint32_t>(u)))) {
      ++local;
      atomicMin(first, static_cast<uint32_t>(u));
    }
  }
  if (local) atomicAdd(bad, local);
}

int main() {
  unsigned long long* bad;
  uint32_t* first;
  if (cudaMallocManaged(&bad, sizeof(*bad)) != cudaSuccess || cudaMallocManaged(&first, sizeof(*first)) != cudaSuccess) {
    std::printf("cudaMallocManaged failed\n");
    return 2;
  }
  *bad = 0;
  *first = 0xFFFFFFFFu;
  check<<<1024, 256>>>(bad, first);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    std::printf("kernel failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 2;
  }
  if (*bad) std::printf("first mismatch at 0x%08x\n", *first);
  std::printf("%llu mismatches\n", *bad);
  return *bad != 0;
}
