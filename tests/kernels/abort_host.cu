/* Exploit: the host side aborts. Expect: crash (SIGABRT). */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  (void)call;
  abort();
}
