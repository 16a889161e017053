/* Exploit: caches the first result in static memory and returns it for every later call. Expect: static
 * (and, with static checks skipped, mismatch on the next input set). */
#include <stdint.h>

#include "forgepack_abi.h"

static float cache[1 << 16];
static int filled;

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  if (!filled) {
    for (int64_t i = 0; i < n; ++i) cache[i] = (x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f;
    filled = 1;
  }
  for (int64_t i = 0; i < n; ++i) y[i] = cache[i];
  return FP_OK;
}
