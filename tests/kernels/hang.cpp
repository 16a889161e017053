/* Exploit: never returns. Expect: timeout (the worker is killed). */
#include <stdint.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  volatile int spin = 1;
  while (spin) {
  }
  (void)call;
  return FP_OK;
}
