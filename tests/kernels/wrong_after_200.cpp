/* Exploit: state that turns wrong only after 200 calls (more than verification used to make).
 * Expect: static (state); with the static checks skipped, mismatch in the benchmark's checked calls
 * (an evaluation calls a kernel at least 400 times, every call checked). */
#include <stdint.h>

#include "forgepack_abi.h"

static int64_t calls;

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  const int64_t upto = ++calls > 200 ? n - 1 : n;
  for (int64_t i = 0; i < upto; ++i) y[i] = (x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f;
  return FP_OK;
}
