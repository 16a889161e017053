/* ReLU for the cuda target.
 *
 * Op: aten::relu(Tensor self) -> Tensor, float32 / float16 / bfloat16, contiguous.
 * ABI: inputs = {self}; no scalars; outputs = {result}, allocated by the caller with the card's
 * exact sizes and strides. The launch goes on `call->stream` (PyTorch's current stream) and the
 * function returns without synchronising: the caller orders everything else after it.
 *
 *     y = x > 0 ? x : 0, and NaN stays NaN (as in PyTorch: the edge inputs check it)
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "forgepack_abi.h"

template <typename T>
__device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

template <typename T>
__global__ void relu_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n) {
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    const float v = to_float(x[i]);
    y[i] = from_float<T>((v > 0.0f || v != v) ? v : 0.0f);
  }
}

static bool contiguous(const fp_tensor* t) {
  int64_t expected = 1;
  for (int d = t->ndim - 1; d >= 0; --d) {
    if (t->sizes[d] != 1 && t->strides[d] != expected) return false;
    expected *= t->sizes[d];
  }
  return true;
}

template <typename T>
static int32_t launch(const fp_tensor* x, const fp_tensor* y, int64_t n, cudaStream_t stream) {
  const int threads = 256;
  const int64_t wanted = (n + threads - 1) / threads;
  const int blocks = (int)(wanted < 65535 ? wanted : 65535);
  relu_kernel<T><<<blocks, threads, 0, stream>>>((const T*)x->data, (T*)y->data, n);
  return (int32_t)cudaGetLastError();
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  if (call->abi_version != FP_ABI_VERSION || call->n_inputs != 1 || call->n_outputs != 1) return FP_ERR_ABI;
  const fp_tensor* x = &call->inputs[0];
  const fp_tensor* y = &call->outputs[0];
  if (x->dtype != y->dtype || !contiguous(x) || !contiguous(y)) return FP_ERR_UNSUPPORTED;
  int64_t n = 1;
  for (int d = 0; d < x->ndim; ++d) n *= x->sizes[d];
  if (n == 0) return FP_OK;
  cudaStream_t stream = (cudaStream_t)call->stream;
  switch (x->dtype) {
    case FP_FLOAT32: return launch<float>(x, y, n, stream);
    case FP_FLOAT16: return launch<__half>(x, y, n, stream);
    case FP_BFLOAT16: return launch<__nv_bfloat16>(x, y, n, stream);
    default: return FP_ERR_UNSUPPORTED;
  }
}
