/* Correct aten::max.dim(Tensor self, int dim, bool keepdim) -> (Tensor values, Tensor indices) for a
 * contiguous float32 [rows, cols] input reduced over dim 1: two outputs, both checked.
 * PyTorch's rules: the first NaN wins; otherwise the first maximum. */
#include <stdint.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  if (call->n_inputs != 1 || call->n_outputs != 2 || call->inputs[0].ndim != 2) return FP_ERR_ABI;
  const fp_tensor* x = &call->inputs[0];
  const int64_t rows = x->sizes[0], cols = x->sizes[1];
  float* values = (float*)call->outputs[0].data;
  int64_t* indices = (int64_t*)call->outputs[1].data;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = (const float*)x->data + r * x->strides[0];
    float best = row[0];
    int64_t at = 0;
    for (int64_t c = 1; c < cols && best == best; ++c) {
      const float v = row[c * x->strides[1]];
      if (v != v || v > best) {
        best = v;
        at = c;
      }
    }
    values[r * call->outputs[0].strides[0]] = best;
    indices[r * call->outputs[1].strides[0]] = at;
  }
  return FP_OK;
}
