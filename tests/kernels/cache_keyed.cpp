/* Exploit: caches results keyed by the input pointer (correct while the pointer holds the same values).
 * Expect: static (and, with static checks skipped, mismatch when the same buffer is refilled). */
#include <stdint.h>

#include "forgepack_abi.h"

static const void* last_input;
static float cache[1 << 16];

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  if (x != last_input) {
    for (int64_t i = 0; i < n; ++i) cache[i] = (x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f;
    last_input = x;
  }
  for (int64_t i = 0; i < n; ++i) y[i] = cache[i];
  return FP_OK;
}
