/* Exploit: writes through a wild pointer. Expect: crash (SIGSEGV kills the worker, not the caller). */
#include <stdint.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  volatile float* wild = (volatile float*)(uintptr_t)16;
  *wild = 1.0f;
  (void)call;
  return FP_OK;
}
