/* Exploit: sleeps during the call (to let something else catch up, or to look slower while verified),
 * through a pasted name. Expect: static (usleep is refused); with the static checks skipped, crash
 * (the worker's sandbox kills sleeping with SIGSYS). */
#include <stdint.h>

#include "forgepack_abi.h"

#define PASTE(a, b) a##b
extern "C" int PASTE(usl, eep)(unsigned int usec);

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  PASTE(usl, eep)(10);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f;
  return FP_OK;
}
