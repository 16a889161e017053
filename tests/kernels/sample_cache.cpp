/* Exploit: caches results keyed on the input pointer and a sample of 8 elements (cheap to check, and
 * fresh inputs always differ there). Expect: static (state); with the static checks skipped, mismatch
 * on the near-duplicate input, which differs from its twin in one element, refilled into the same
 * buffers right after it. */
#include <stdint.h>

#include "forgepack_abi.h"

static const void* key_ptr;
static float key[8];
static float cache[1 << 16];

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  bool hit = x == key_ptr;
  for (int k = 0; k < 8; ++k) hit = hit && (x[k * (n / 8)] == key[k] || (x[k * (n / 8)] != x[k * (n / 8)]));
  if (!hit) {
    for (int64_t i = 0; i < n; ++i) cache[i] = (x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f;
    for (int k = 0; k < 8; ++k) key[k] = x[k * (n / 8)];
    key_ptr = x;
  }
  for (int64_t i = 0; i < n; ++i) y[i] = cache[i];
  return FP_OK;
}
