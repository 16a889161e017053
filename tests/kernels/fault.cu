/* Exploit: writes through a wild device pointer (illegal address). Expect: crash. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

static int64_t numel(const fp_tensor* t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; ++d) n *= t->sizes[d];
  return n;
}

__global__ void wild(float* y) { *(volatile float*)(y + (1ll << 40)) = 1.0f; }

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  (void)numel(&call->inputs[0]);
  wild<<<1, 1, 0, (cudaStream_t)call->stream>>>((float*)call->outputs[0].data);
  return (int32_t)cudaGetLastError();
}
