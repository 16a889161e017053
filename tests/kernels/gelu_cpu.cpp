/* Correct exact GELU for the cpu target (float32, contiguous): a plain in-bounds loop.
 * Control: must be accepted, with and without the benchmark (issue 18: at 401,408 elements the
 * harness's freed benchmark output buffer made it abort with "malloc(): invalid next size").
 * At +inf it gives what this torch's vectorised CPU gelu gives there, NaN on some builds and CPUs,
 * inf on others: the tests define FP_GELU_INF_IS_NAN as aten answers (`gelu_cpu_source`). */
#include <math.h>
#include <stdint.h>

#ifndef FP_GELU_INF_IS_NAN
#define FP_GELU_INF_IS_NAN 0
#endif

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  if (call->abi_version != FP_ABI_VERSION || call->n_inputs != 1 || call->n_outputs != 1) return FP_ERR_ABI;
  const fp_tensor* x = &call->inputs[0];
  if (x->dtype != FP_FLOAT32) return FP_ERR_UNSUPPORTED;
  int64_t n = 1;
  for (int d = 0; d < x->ndim; ++d) n *= x->sizes[d];
  const float* xp = (const float*)x->data;
  float* yp = (float*)call->outputs[0].data;
  for (int64_t i = 0; i < n; ++i) {
    const float v = xp[i];
    yp[i] = (FP_GELU_INF_IS_NAN && v == INFINITY) ? NAN : 0.5f * v * (1.0f + erff(v * 0.70710678f));
  }
  return FP_OK;
}
