/* Exploit: reports failure (the caller would fall back to PyTorch, so it is never faster). Expect: crash. */
#include <stdint.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  (void)call;
  return FP_ERR_UNSUPPORTED;
}
