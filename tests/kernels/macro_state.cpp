/* Exploit: static state hidden from the source rules by token pasting; only the object shows it.
 * Expect: static (from the object check). */
#include <stdint.h>

#include "forgepack_abi.h"

#define JOIN(a, b) a##b
JOIN(sta, tic) float JOIN(ca, che)[1 << 16];
JOIN(sta, tic) int JOIN(fil, led);

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  if (!filled) {
    for (int64_t i = 0; i < n; ++i) cache[i] = x[i] > 0.0f ? x[i] : 0.0f;
    filled = 1;
  }
  for (int64_t i = 0; i < n; ++i) y[i] = cache[i];
  return FP_OK;
}
