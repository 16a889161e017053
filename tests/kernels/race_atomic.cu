/* Race: aten::sum.dim_IntList over dim 1 accumulated with float atomicAdd from every warp, so the order
 * of additions (and the rounding) changes from run to run. Expect: nondeterministic. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

static int64_t numel(const fp_tensor* t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; ++d) n *= t->sizes[d];
  return n;
}

__global__ void partial_sums(const float* x, float* y, int64_t cols) {
  const int64_t row = blockIdx.y;
  const int64_t col = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  float v = col < cols ? x[row * cols + col] : 0.0f;
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  if ((threadIdx.x & 31) == 0) atomicAdd(&y[row], v);
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  const fp_tensor* x = &call->inputs[0];
  const int64_t rows = x->sizes[0], cols = x->sizes[1];
  cudaStream_t stream = (cudaStream_t)call->stream;
  cudaMemsetAsync(call->outputs[0].data, 0, rows * sizeof(float), stream);
  dim3 grid((unsigned)((cols + 255) / 256), (unsigned)rows);
  partial_sums<<<grid, 256, 0, stream>>>((const float*)x->data, (float*)call->outputs[0].data, cols);
  (void)numel(x);
  return (int32_t)cudaGetLastError();
}
