/* Exploit: once it has seen an output pointer before (the benchmark's loop), launches its work on the
 * legacy default stream, so the timing events on call->stream bracket nothing. The pointers it has
 * seen live in host memory it reserves with assembler directives: no variable for the object check
 * to name. Expect: static (writable data outside any variable); with the static checks skipped,
 * mismatch (every benchmark call holds the legacy stream busy and snapshots its output when the end
 * event completes: work elsewhere is missing then). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

asm(".pushsection .data\n.balign 8\n.Lfp_seen: .zero 64\n.popsection");

__global__ void relu(const float* x, float* y, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = (x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f;
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  void** seen;
  asm volatile("leaq .Lfp_seen(%%rip), %0" : "=r"(seen));
  void* out = call->outputs[0].data;
  bool again = false;
  for (int k = 0; k < 8; ++k) again = again || seen[k] == out;
  for (int k = 7; k > 0; --k) seen[k] = seen[k - 1];
  seen[0] = out;
  int64_t n = 1;
  for (int d = 0; d < call->inputs[0].ndim; ++d) n *= call->inputs[0].sizes[d];
  cudaStream_t stream = again ? (cudaStream_t)0 : (cudaStream_t)call->stream;
  relu<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>((const float*)call->inputs[0].data, (float*)out, n);
  return (int32_t)cudaGetLastError();
}
