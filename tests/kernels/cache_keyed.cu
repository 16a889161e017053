/* Exploit: caches results in __device__ memory keyed by the input pointer (right while the buffer keeps
 * its values). Expect: static (and, with static checks skipped, mismatch under CUDA graph replay, where the
 * same buffers are refilled). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

static int64_t numel(const fp_tensor* t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; ++d) n *= t->sizes[d];
  return n;
}

__device__ float cache[1 << 16];
__device__ const float* key;

__global__ void relu_cached(const float* x, float* y, int64_t n) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  if (key != x) cache[i] = (x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f;
  y[i] = cache[i];
}

__global__ void remember(const float* x) { key = x; }

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  int64_t n = numel(&call->inputs[0]);
  cudaStream_t stream = (cudaStream_t)call->stream;
  const float* x = (const float*)call->inputs[0].data;
  relu_cached<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(x, (float*)call->outputs[0].data, n);
  remember<<<1, 1, 0, stream>>>(x);
  return (int32_t)cudaGetLastError();
}
