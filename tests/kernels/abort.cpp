/* Exploit: aborts (e.g. a failed assert). Expect: crash (SIGABRT). */
#include <stdint.h>
#include <stdlib.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  (void)call;
  abort();
}
