/* Control: a correct ReLU whose element function is an ordinary __device__ helper. nvcc writes that
 * helper's host side as a call to exit(): the object check once rejected it as "calls exit".
 * Expect: accepted (reaches the worker and passes). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

__device__ float relu1(float v) { return (v > 0.0f || v != v) ? v : 0.0f; }

__global__ void relu(const float* x, float* y, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = relu1(x[i]);
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  int64_t n = 1;
  for (int d = 0; d < call->inputs[0].ndim; ++d) n *= call->inputs[0].sizes[d];
  relu<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)call->stream>>>((const float*)call->inputs[0].data,
                                                                           (float*)call->outputs[0].data, n);
  return (int32_t)cudaGetLastError();
}
