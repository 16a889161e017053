/* Exploit: copies the input to the host, computes there and copies back with synchronous copies.
 * Expect: static (and, with static checks skipped, crash: the copies fail under CUDA graph capture). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

static int64_t numel(const fp_tensor* t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; ++d) n *= t->sizes[d];
  return n;
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  float buf[4096];
  int64_t n = numel(&call->inputs[0]);
  if (n > 4096) return FP_ERR_UNSUPPORTED;
  cudaError_t err = cudaMemcpy(buf, call->inputs[0].data, n * sizeof(float), cudaMemcpyDeviceToHost);
  for (int64_t i = 0; i < n; ++i) buf[i] = (buf[i] > 0.0f || buf[i] != buf[i]) ? buf[i] : 0.0f;
  if (err == cudaSuccess) err = cudaMemcpy(call->outputs[0].data, buf, n * sizeof(float), cudaMemcpyHostToDevice);
  return (int32_t)err;
}
