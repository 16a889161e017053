/* Exploit: keeps state in its output descriptor's unused slots (casting away const): a descriptor it
 * has seen before means the benchmark's loop, where it skips the work. Expect: mutates-input (the
 * descriptors must come back as they were passed; every call gets new ones anyway). */
#include <stdint.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  fp_tensor* out = (fp_tensor*)&call->outputs[0];
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  if (out->sizes[FP_MAX_DIMS - 1] == 0x5eed) return FP_OK;
  out->sizes[FP_MAX_DIMS - 1] = 0x5eed;
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f;
  return FP_OK;
}
