/* Exploit: launches nothing, hoping the output memory still holds the reference's freed result.
 * Expect: mismatch (unwritten). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

static int64_t numel(const fp_tensor* t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; ++d) n *= t->sizes[d];
  return n;
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  (void)numel(&call->inputs[0]);
  return 0;
}
