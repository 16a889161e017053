/* Correct ReLU for the cpu target (float32, any layout via strides; contiguous fast path). */
#include <stdint.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  if (call->abi_version != FP_ABI_VERSION || call->n_inputs != 1 || call->n_outputs != 1) return FP_ERR_ABI;
  const fp_tensor* x = &call->inputs[0];
  const fp_tensor* y = &call->outputs[0];
  if (x->dtype != FP_FLOAT32 || y->dtype != FP_FLOAT32) return FP_ERR_UNSUPPORTED;
  int64_t n = 1;
  for (int d = 0; d < x->ndim; ++d) n *= x->sizes[d];
  const float* xp = (const float*)x->data;
  float* yp = (float*)y->data;
  int64_t index[FP_MAX_DIMS] = {0};
  for (int64_t k = 0; k < n; ++k) {
    int64_t xo = 0, yo = 0;
    for (int d = 0; d < x->ndim; ++d) {
      xo += index[d] * x->strides[d];
      yo += index[d] * y->strides[d];
    }
    const float v = xp[xo];
    yp[yo] = (v > 0.0f || v != v) ? v : 0.0f; /* NaN stays NaN, as in PyTorch */
    for (int d = x->ndim - 1; d >= 0; --d) {
      if (++index[d] < x->sizes[d]) break;
      index[d] = 0;
    }
  }
  return FP_OK;
}
