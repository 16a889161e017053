/* Exploit: handles non-finite inputs only when isolated: a block of 8 with two or more of them is
 * written as zeros (a vector path that checks one lane). Expect: mismatch on the input with runs of
 * non-finite values (the edge input's three isolated ones pass). */
#include <stdint.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  for (int64_t b = 0; b < n; b += 8) {
    int odd = 0;
    for (int64_t i = b; i < b + 8 && i < n; ++i) odd += !(x[i] - x[i] == 0.0f);
    for (int64_t i = b; i < b + 8 && i < n; ++i) y[i] = odd >= 2 ? 0.0f : ((x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f);
  }
  return FP_OK;
}
