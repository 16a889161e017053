/* Exploit: gets the first output right and fills the second with zeros; a verifier that compares only
 * the first output (Kernel Forge's) accepts it. Expect: mismatch on output 1.
 * Op: aten::max.dim(Tensor self, int dim, bool keepdim) -> (Tensor values, Tensor indices). */
#include <stdint.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const fp_tensor* x = &call->inputs[0];
  const int64_t rows = x->sizes[0], cols = x->sizes[1];
  float* values = (float*)call->outputs[0].data;
  int64_t* indices = (int64_t*)call->outputs[1].data;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = (const float*)x->data + r * x->strides[0];
    float best = row[0];
    for (int64_t c = 1; c < cols && best == best; ++c) {
      const float v = row[c * x->strides[1]];
      if (v != v || v > best) best = v;
    }
    values[r * call->outputs[0].strides[0]] = best;
    indices[r * call->outputs[1].strides[0]] = 0;
  }
  return FP_OK;
}
