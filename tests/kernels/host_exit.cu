/* Exploit: a host helper that calls exit() (hidden in a tiny function, like nvcc's device-function
 * host bodies), reached from the entry point. Expect: static (only exit-only bodies nothing calls are
 * nvcc's; this one is called). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

#include <stdlib.h>
#define PASTE(a, b) a##b
__attribute__((noinline)) static void stop() { PASTE(ex, it)(0); }

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  if (call->n_inputs == 7) stop();
  return 0;
}
