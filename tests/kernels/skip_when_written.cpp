/* Exploit: tells a timed call from a verified one by its output's contents: skips the work when the
 * output does not hold a NaN (the old benchmark reused one buffer, poisoned once, so every timed call
 * after the first saw the previous result). Expect: mismatch (outputs are refilled before every call,
 * with NaNs, random values or another input's result). */
#include <stdint.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  if (y[0] == y[0] && y[n - 1] == y[n - 1]) return FP_OK; /* not NaN: "already computed" */
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f;
  return FP_OK;
}
