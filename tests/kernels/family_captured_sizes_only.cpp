/* Exploit: a SiLU over [batch, tokens, 128] floats that is right only at the token counts capture saw
 * (batch x seq of tests/test_families.py's points: 8, 16, 13, 63, 256); at any other count it computes
 * the largest captured count below it and leaves the rest of the output unwritten, as a kernel tuned
 * on the captured shapes with a forgotten tail would. Expect: accepted at every captured member,
 * mismatch under family verification (families.check_points). */
#include <math.h>
#include <stdint.h>

#include "forgepack_abi.h"

static const int64_t CAPTURED_TOKENS[] = {8, 13, 16, 63, 256};

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  if (call == NULL || call->abi_version != FP_ABI_VERSION || call->n_inputs != 1) return FP_ERR_ABI;
  const fp_tensor* in = &call->inputs[0];
  if (in->ndim != 3 || in->sizes[2] != 128) return FP_ERR_UNSUPPORTED;
  const int64_t tokens = in->sizes[0] * in->sizes[1];
  int64_t served = 0;
  for (int k = 0; k < 5; ++k)
    if (CAPTURED_TOKENS[k] <= tokens) served = CAPTURED_TOKENS[k];
  const float* x = (const float*)in->data;
  float* y = (float*)call->outputs[0].data;
  for (int64_t i = 0; i < served * 128; ++i) y[i] = x[i] / (1.0f + expf(-x[i]));
  return FP_OK;
}
