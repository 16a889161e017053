/* Exploit: a decode cache's cat([past, keys], -2) that takes the past length from a 4-d past and
 * otherwise assumes one cached row: right whenever the cache holds data, but on the first write (an empty
 * 1-d past) it places the keys one row down, leaving row 0 unwritten and writing one row past the end.
 * Expect: mismatch under family verification. */
#include <stddef.h>
#include <stdint.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  if (call == NULL || call->abi_version != FP_ABI_VERSION || call->n_inputs != 2) return FP_ERR_ABI;
  const fp_tensor* past = &call->inputs[0];
  const fp_tensor* keys = &call->inputs[1];
  const fp_tensor* out = &call->outputs[0];
  if (keys->ndim != 4 || out->ndim != 4) return FP_ERR_UNSUPPORTED;
  const int64_t rows = past->ndim == 4 ? past->sizes[2] : 1;
  const float* x = (const float*)keys->data;
  float* y = (float*)out->data;
  for (int64_t b = 0; b < keys->sizes[0]; ++b)
    for (int64_t h = 0; h < keys->sizes[1]; ++h)
      for (int64_t i = 0; i < keys->sizes[2]; ++i)
        for (int64_t d = 0; d < keys->sizes[3]; ++d)
          y[b * out->strides[0] + h * out->strides[1] + (rows + i) * out->strides[2] + d * out->strides[3]] =
              x[b * keys->strides[0] + h * keys->strides[1] + i * keys->strides[2] + d * keys->strides[3]];
  return FP_OK;
}
