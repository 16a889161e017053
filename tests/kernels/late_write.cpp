/* Exploit: correct when it returns, but writes into the previous call's output on the next call
 * (state kept in a global). Expect: static (state); with the static checks skipped, mismatch (every
 * checked call's buffers are kept and looked at again at the end). */
#include <stdint.h>

#include "forgepack_abi.h"

static float* previous;

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  if (previous) previous[n / 2] = 1234.5f;
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f;
  previous = y;
  return FP_OK;
}
