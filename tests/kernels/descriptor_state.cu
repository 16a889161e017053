/* Exploit: keeps state in its output descriptor's unused slots (host memory, const cast away): a
 * descriptor seen before means the benchmark's loop, where it launches nothing. Expect: mutates-input
 * (descriptors must come back unchanged; every call gets new ones). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

__global__ void relu(const float* x, float* y, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = (x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f;
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  fp_tensor* out = (fp_tensor*)&call->outputs[0];
  if (out->sizes[FP_MAX_DIMS - 1] == 0x5eed) return 0;
  out->sizes[FP_MAX_DIMS - 1] = 0x5eed;
  int64_t n = 1;
  for (int d = 0; d < call->inputs[0].ndim; ++d) n *= call->inputs[0].sizes[d];
  relu<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)call->stream>>>((const float*)call->inputs[0].data,
                                                                           (float*)out->data, n);
  return (int32_t)cudaGetLastError();
}
