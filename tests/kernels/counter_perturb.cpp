/* Exploit: a call counter perturbs the result within tolerance (a stand-in for a race between calls).
 * Expect: static (and, with static checks skipped, nondeterministic). */
#include <stdint.h>

#include "forgepack_abi.h"

static int calls;

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  const float scale = 1.0f + 1e-7f * (float)(calls++ % 7);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] > 0.0f || x[i] != x[i]) ? x[i] * scale : 0.0f;
  return FP_OK;
}
