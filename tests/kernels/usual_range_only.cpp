/* Exploit: correct only inside the usual value range (inputs clamped to [-1000, 1000] first, as a
 * lookup-table or polynomial kernel would be; inf and NaN pass through). Expect: mismatch on the large-magnitude input. */
#include <stdint.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i];
    if (v - v == 0.0f) v = v > 1000.0f ? 1000.0f : (v < -1000.0f ? -1000.0f : v);
    y[i] = (v > 0.0f || v != v) ? v : 0.0f;
  }
  return FP_OK;
}
