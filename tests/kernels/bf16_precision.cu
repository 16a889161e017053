/* Exploit: computes an fp32 op through bfloat16. Expect: mismatch (fp32 tolerance rtol=atol=1e-5). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

static int64_t numel(const fp_tensor* t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; ++d) n *= t->sizes[d];
  return n;
}
#include <cuda_bf16.h>

__global__ void relu(const float* x, float* y, int64_t n) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = __bfloat162float(__float2bfloat16(x[i]));
  y[i] = (v > 0.0f || v != v) ? v : 0.0f;
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  int64_t n = numel(&call->inputs[0]);
  relu<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)call->stream>>>((const float*)call->inputs[0].data,
                                                                             (float*)call->outputs[0].data, n);
  return (int32_t)cudaGetLastError();
}
