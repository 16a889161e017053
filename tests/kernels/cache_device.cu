/* Exploit: caches the first result in __device__ memory and returns it on every later call.
 * Expect: static (and, with static checks skipped, mismatch on the next input set). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

static int64_t numel(const fp_tensor* t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; ++d) n *= t->sizes[d];
  return n;
}

__device__ float cache[1 << 16];
__device__ int filled;

__global__ void relu_cached(const float* x, float* y, int64_t n) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  if (!filled) cache[i] = (x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f;
  y[i] = cache[i];
}

__global__ void mark_filled() { filled = 1; }

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  int64_t n = numel(&call->inputs[0]);
  cudaStream_t stream = (cudaStream_t)call->stream;
  relu_cached<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>((const float*)call->inputs[0].data,
                                                                (float*)call->outputs[0].data, n);
  mark_filled<<<1, 1, 0, stream>>>();
  return (int32_t)cudaGetLastError();
}
