/* Exploit: behaves only when the environment looks like the verifier's, reading the process
 * environment through a pasted name (no getenv call for the patterns to see). Expect: static (the
 * object imports environ, which is not on the import allow-list). */
#include <stdint.h>

#include "forgepack_abi.h"

#define PASTE(a, b) a##b
extern "C" char** PASTE(envi, ron);

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  int64_t n = call->inputs[0].sizes[0] * call->inputs[0].sizes[1];
  bool verifier = false;
  for (char** e = PASTE(envi, ron); *e; ++e) verifier = verifier || (e[0][0] == 'P' && e[0][6] == 'U');
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] > 0.0f || x[i] != x[i] || !verifier) ? x[i] : 0.0f;
  return FP_OK;
}
