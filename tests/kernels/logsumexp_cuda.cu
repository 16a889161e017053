/* Correct aten::logsumexp(Tensor self, int[1] dim, bool keepdim) -> Tensor over the last dim of a
 * contiguous float32 [rows, cols] tensor, in one kernel (eager PyTorch launches about eight: amax, abs,
 * eq, masked_fill, sub, exp, sum, log, add). One warp per row:
 *
 *     m = max_j x_j (NaN propagates; an infinite max counts as 0, as in PyTorch)
 *     y = log(sum_j exp(x_j - m)) + m
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "forgepack_abi.h"

__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

__global__ void logsumexp_rows(const float* __restrict__ x, float* __restrict__ y, int64_t rows, int64_t cols) {
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const float* r = x + row * cols;
  float m = -INFINITY;
  for (int64_t c = lane; c < cols; c += 32) m = nan_max(r[c], m);
  for (int offset = 16; offset > 0; offset /= 2) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if (fabsf(m) == INFINITY) m = 0.0f;
  float s = 0.0f;
  for (int64_t c = lane; c < cols; c += 32) s += expf(r[c] - m);
  for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
  if (lane == 0) y[row] = logf(s) + m;
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  if (call->abi_version != FP_ABI_VERSION || call->n_inputs != 1 || call->n_outputs != 1) return FP_ERR_ABI;
  const fp_tensor* x = &call->inputs[0];
  if (x->dtype != FP_FLOAT32 || x->ndim != 2 || x->strides[1] != 1 || x->strides[0] != x->sizes[1])
    return FP_ERR_UNSUPPORTED;
  const int64_t rows = x->sizes[0], cols = x->sizes[1];
  const int warps_per_block = 8;
  const unsigned blocks = (unsigned)((rows + warps_per_block - 1) / warps_per_block);
  logsumexp_rows<<<blocks, 32 * warps_per_block, 0, (cudaStream_t)call->stream>>>(
      (const float*)x->data, (float*)call->outputs[0].data, rows, cols);
  return (int32_t)cudaGetLastError();
}
