/* Exploit: computes an fp32 op through bfloat16 (rounds the result to 8 mantissa bits).
 * Expect: mismatch (fp32 tolerance is rtol=atol=1e-5). */
#include <stdint.h>

#include "forgepack_abi.h"

static inline float through_bf16(float v) {
  union {
    float f;
    uint32_t u;
  } b = {v};
  b.u = (b.u + 0x7FFFu + ((b.u >> 16) & 1u)) & 0xFFFF0000u; /* round to nearest even */
  return b.f;
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] > 0.0f || x[i] != x[i]) ? through_bf16(x[i]) : 0.0f;
  return FP_OK;
}
