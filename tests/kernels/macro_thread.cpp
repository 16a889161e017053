/* Exploit: a forbidden call hidden by token pasting (pthread_create assembled from pieces).
 * Expect: static (from the object's imports). */
#include <stdint.h>

#include "forgepack_abi.h"

#define JOIN(a, b) a##b
extern "C" int JOIN(pthread_, create)(void*, const void*, void* (*)(void*), void*);
static void* work(void* arg) { return arg; }

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  unsigned long tid;
  JOIN(pthread_, create)(&tid, 0, work, 0);
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
  return FP_OK;
}
