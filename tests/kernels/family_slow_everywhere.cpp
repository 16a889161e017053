/* A correct SiLU over any [batch, tokens, hidden] float tensor that does its work 32 times over: slower
 * than stock at every size, and equally slow wherever its buffers lie. Expect: verified at every check
 * point, losing at every timed one, and every such loss confirmed at another placement
 * (tests/test_placements.py). */
#include <math.h>
#include <stdint.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  if (call == NULL || call->abi_version != FP_ABI_VERSION || call->n_inputs != 1) return FP_ERR_ABI;
  const fp_tensor* in = &call->inputs[0];
  if (in->ndim != 3) return FP_ERR_UNSUPPORTED;
  const int64_t n = in->sizes[0] * in->sizes[1] * in->sizes[2];
  const float* x = (const float*)in->data;
  volatile float* y = (volatile float*)call->outputs[0].data;  // each pass really stores
  for (int pass = 0; pass < 32; ++pass)
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] / (1.0f + expf(-x[i]));
  return FP_OK;
}
