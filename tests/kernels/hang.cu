/* Exploit: a kernel that never finishes. Expect: timeout (the worker is killed). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

static int64_t numel(const fp_tensor* t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; ++d) n *= t->sizes[d];
  return n;
}

__global__ void spin(float* y) {
  __shared__ volatile int keep_going;
  keep_going = 1;
  while (keep_going) {
  }
  y[0] = 0.0f;
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  (void)numel(&call->inputs[0]);
  spin<<<1, 1, 0, (cudaStream_t)call->stream>>>((float*)call->outputs[0].data);
  return (int32_t)cudaGetLastError();
}
