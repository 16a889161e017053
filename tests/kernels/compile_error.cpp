/* A compiler error: the log must reach the verdict. Expect: compile. */
#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  return undeclared_identifier + call->n_inputs;
}
