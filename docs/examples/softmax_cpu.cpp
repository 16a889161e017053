/* Softmax for the cpu target.
 *
 * Op: aten::_softmax(Tensor self, int dim, bool half_to_float) -> Tensor, float32 in and out.
 * ABI: inputs = {self}; scalars = {dim, half_to_float}; outputs = {result}, allocated by the caller
 * with the card's exact sizes and strides. Any layout is handled: the rows along `dim` are walked
 * with each tensor's own strides.
 *
 *     y_i = exp(x_i - max_j x_j) / sum_k exp(x_k - max_j x_j)
 *
 * NaN and inf follow PyTorch: a row holding a NaN or +inf comes out all NaN.
 */
#include <math.h>
#include <stdint.h>

#include "forgepack_abi.h"

static void softmax_row(const float* x, int64_t xs, float* y, int64_t ys, int64_t n) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i * xs];
    m = (v > m || v != v) ? v : m; /* keep a NaN: it must poison the whole row */
  }
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    float e = expf(x[i * xs] - m);
    y[i * ys] = e;
    sum += e;
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < n; ++i) y[i * ys] *= inv;
}

FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  if (call->abi_version != FP_ABI_VERSION || call->n_inputs != 1 || call->n_outputs != 1 || call->n_scalars != 2)
    return FP_ERR_ABI;
  const fp_tensor* x = &call->inputs[0];
  const fp_tensor* y = &call->outputs[0];
  if (x->dtype != FP_FLOAT32 || y->dtype != FP_FLOAT32 || call->scalars[1].i != 0) return FP_ERR_UNSUPPORTED;

  const int ndim = x->ndim;
  if (ndim == 0) { /* a 0-d tensor: one row of one element */
    softmax_row((const float*)x->data, 1, (float*)y->data, 1, 1);
    return FP_OK;
  }
  int64_t dim = call->scalars[0].i;
  if (dim < 0) dim += ndim;
  if (dim < 0 || dim >= ndim) return FP_ERR_UNSUPPORTED;

  int64_t rows = 1;
  for (int d = 0; d < ndim; ++d)
    if (d != dim) rows *= x->sizes[d];
  if (rows == 0 || x->sizes[dim] == 0) return FP_OK;

  int64_t index[FP_MAX_DIMS] = {0}; /* odometer over every dimension but `dim` */
  for (int64_t r = 0; r < rows; ++r) {
    int64_t xo = 0, yo = 0;
    for (int d = 0; d < ndim; ++d) {
      xo += index[d] * x->strides[d];
      yo += index[d] * y->strides[d];
    }
    softmax_row((const float*)x->data + xo, x->strides[dim], (float*)y->data + yo, y->strides[dim], x->sizes[dim]);
    for (int d = ndim - 1; d >= 0; --d) {
      if (d == dim) continue;
      if (++index[d] < x->sizes[d]) break;
      index[d] = 0;
    }
  }
  return FP_OK;
}
