/* Control: a correct ReLU that reads a __constant__ table (the slope of each sign). The table's host
 * shadow lands 32-byte aligned in .bss after nvcc's 1-byte launch guard and 8-byte handles; the object
 * check once counted the 7 bytes of padding between them as hidden state.
 * Expect: accepted (reaches the worker and passes). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

__constant__ float slope[64] = {0.0f, 1.0f};

__global__ void relu(const float* x, float* y, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    const float v = x[i];
    y[i] = v != v ? v : (v > 0.0f ? v * slope[1] : slope[0]);
  }
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  int64_t n = 1;
  for (int d = 0; d < call->inputs[0].ndim; ++d) n *= call->inputs[0].sizes[d];
  relu<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)call->stream>>>((const float*)call->inputs[0].data,
                                                                           (float*)call->outputs[0].data, n);
  return (int32_t)cudaGetLastError();
}
