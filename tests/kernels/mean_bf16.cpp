/* Exploit: an fp32 row mean whose result goes through bf16 (0.4% relative error). At outputs near 4e-4
 * a fixed fp32 atol of 1e-5 let it pass. Expect: mismatch (the absolute term scales with the output). */
#include <string.h>
#include <stdint.h>

#include "forgepack_abi.h"

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
  const int64_t rows = call->inputs[0].sizes[0], cols = call->inputs[0].sizes[1];
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0.0;
    for (int64_t c = 0; c < cols; ++c) s += x[r * cols + c];
    float m = (float)(s / (double)cols);
    uint32_t bits;
    memcpy(&bits, &m, 4);
    bits = (bits + 0x8000u) & 0xFFFF0000u; /* round to bf16 */
    memcpy(&m, &bits, 4);
    y[r * call->outputs[0].strides[0]] = m;
  }
  return FP_OK;
}
