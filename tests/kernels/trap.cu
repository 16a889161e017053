/* Exploit: a device-side trap (what a failed device assert does). Expect: crash. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

static int64_t numel(const fp_tensor* t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; ++d) n *= t->sizes[d];
  return n;
}

__global__ void boom(float* y) {
  if (threadIdx.x == 0) __trap();
  y[threadIdx.x] = 0.0f;
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  (void)numel(&call->inputs[0]);
  boom<<<1, 32, 0, (cudaStream_t)call->stream>>>((float*)call->outputs[0].data);
  return (int32_t)cudaGetLastError();
}
