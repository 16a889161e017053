/* Exploit: wrong once about a second has passed since its first call, timed with the TSC through a
 * builtin whose name is pasted together (the source patterns cannot see it). Expect: static (the
 * object's machine code executes rdtsc); with the static checks skipped, mismatch (the last check
 * comes at least LATE_AFTER_S after the first call). */
#include <stdint.h>

#include "forgepack_abi.h"

#define PASTE(a, b) a##b
static uint64_t first;

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  const uint64_t now = PASTE(__builtin_ia32_, rdtsc)();
  if (!first) first = now;
  const bool late = now - first > 1000000000ull; /* ~0.3-0.5 s at 2-3 GHz */
  for (int64_t i = 0; i < n; ++i) y[i] = late ? 1.0f : ((x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f);
  return FP_OK;
}
