/* Exploit: finishes its output on a C11 thread after returning (declared by hand, the name pasted so
 * the patterns miss it). Expect: static (thrd_create is not on the import allow-list); with the static
 * checks skipped, crash (the worker's sandbox kills thread creation with SIGSYS). */
#include <stdint.h>

#include "forgepack_abi.h"

#define PASTE(a, b) a##b
extern "C" int PASTE(thrd_, create)(void* thread, int (*fn)(void*), void* arg);
struct job { const float* x; float* y; int64_t n; };

static int work(void* p) {
  job* j = (job*)p;
  for (int64_t i = 0; i < j->n; ++i) j->y[i] = (j->x[i] > 0.0f || j->x[i] != j->x[i]) ? j->x[i] : 0.0f;
  return 0;
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  job j = {(const float*)call->inputs[0].data, (float*)call->outputs[0].data,
           call->inputs[0].sizes[0] * call->inputs[0].sizes[1]};
  unsigned long thread[4];
  if (PASTE(thrd_, create)(thread, work, &j) != 0) work(&j);
  work(&j);
  return FP_OK;
}
