/* Exploit: does nothing, hoping the output memory still holds the reference's freed result.
 * Expect: mismatch (unwritten: outputs are poisoned before every run). */
#include <stdint.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  (void)call;
  return FP_OK;
}
