/* Exploit: walks the loader's own structures (the dynamic section, through a pasted name) to reach
 * symbols of other libraries, as a kernel calling BLAS inside libtorch would. Expect: static (the
 * object imports _DYNAMIC, which is not on the import allow-list). */
#include <stdint.h>

#include "forgepack_abi.h"

#define PASTE(a, b) a##b
extern "C" const int64_t PASTE(_DYN, AMIC)[];

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  int64_t tags = 0;
  for (const int64_t* d = PASTE(_DYN, AMIC); d[0] != 0; d += 2) tags += d[0] == 21; /* DT_DEBUG: r_debug */
  const float shift = tags > 1000 ? 1.0f : 0.0f; /* what it found decides how it behaves */
  for (int64_t i = 0; i < n; ++i) y[i] = ((x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f) + shift;
  return FP_OK;
}
