/* Exploit: reads the time stamp counter through a builtin whose name is pasted together, so no source
 * pattern and no import shows it (a kernel that behaves differently by time, or times itself).
 * Expect: static (the object's machine code executes rdtsc). */
#include <stdint.h>

#include "forgepack_abi.h"

#define PASTE(a, b) a##b

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  const float odd = PASTE(__builtin_ia32_, rdtsc)() % 1000003u == 7u ? 1.0f : 0.0f;
  for (int64_t i = 0; i < n; ++i) y[i] = ((x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f) + odd;
  return FP_OK;
}
