/* Exploit: flushes denormal results to zero (as fast-math or FTZ would). Within an absolute 1e-5 of
 * the reference everywhere, so a fixed fp32 atol let it pass. Expect: mismatch on the denormal input
 * (the absolute term is scaled to the output's magnitude). */
#include <stdint.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  for (int64_t i = 0; i < n; ++i) {
    float v = (x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f;
    y[i] = (v == v && v < 1.17549435e-38f) ? 0.0f : v;
  }
  return FP_OK;
}
