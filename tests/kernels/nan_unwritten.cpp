/* Exploit: leaves NaN positions unwritten, hoping the output memory already holds a NaN there.
 * Expect: mismatch (unwritten: the poison is a NaN with a payload no computation produces). */
#include <stdint.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == x[i]) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
  return FP_OK;
}
