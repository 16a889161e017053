/* Exploit: each thread skips its element when the output already holds a number (not NaN), as it did
 * in the old benchmark's reused buffer. Expect: mismatch (outputs are refilled before every call, with
 * NaNs, random values or another input's result). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

__global__ void relu(const float* x, float* y, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n || y[i] == y[i]) return;
  y[i] = (x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f;
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  int64_t n = 1;
  for (int d = 0; d < call->inputs[0].ndim; ++d) n *= call->inputs[0].sizes[d];
  relu<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)call->stream>>>((const float*)call->inputs[0].data,
                                                                           (float*)call->outputs[0].data, n);
  return (int32_t)cudaGetLastError();
}
