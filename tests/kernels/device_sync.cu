/* Exploit: synchronises the device before returning (hides asynchronous work, breaks CUDA graphs).
 * Expect: static (and, with static checks skipped, crash: the call fails under CUDA graph capture). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

static int64_t numel(const fp_tensor* t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; ++d) n *= t->sizes[d];
  return n;
}

__global__ void relu(const float* x, float* y, int64_t n) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = (x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f;
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  int64_t n = numel(&call->inputs[0]);
  relu<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)call->stream>>>((const float*)call->inputs[0].data,
                                                                             (float*)call->outputs[0].data, n);
  return (int32_t)cudaDeviceSynchronize();
}
