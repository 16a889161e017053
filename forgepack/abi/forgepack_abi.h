/* forgepack kernel ABI, version 1.
 *
 * A kernel is one shared object exporting
 *
 *     FP_EXPORT int32_t forgepack_kernel(const fp_call* call);
 *
 * It includes this header and, for the cuda target, the CUDA runtime (cuda_runtime.h, cuda_fp16.h,
 * cuda_bf16.h); never PyTorch. The caller (verifier, benchmark, or a pack's guarded dispatch)
 * allocates every output from the card's verified output metadata, and passes the stream to launch
 * on (PyTorch's current stream; NULL for the cpu target). A kernel must:
 *   - launch all its work on `call->stream`, and return without synchronising the device;
 *   - write every element of every output, and nothing else (inputs are read-only);
 *   - keep no state between calls, allocate no memory, create no streams, events or threads.
 * Return 0 on success; a nonzero value (e.g. a cudaError_t) makes the caller fall back to PyTorch.
 *
 * Tensor descriptors: `data` points at element 0 (storage offset already applied); `sizes` and
 * `strides` are in elements, `ndim` of them are valid. An exact card fixes the dtypes, sizes, strides
 * and non-tensor arguments a kernel will ever see (the pack's guard enforces them), so a kernel may
 * specialise on them as compile-time constants. A shape-family card fixes dtypes, ranks, fixed sizes
 * and non-tensor arguments; its varying sizes (each in its range) and the strides that follow from
 * them (c * product of sizes) arrive in the descriptors, and the outputs are allocated at those sizes.
 * Data pointers are guaranteed only as aligned as the kernel states it needs (forgepack/needs.py;
 * a kernel that states nothing gets each input at the offset modulo 16 bytes it was verified at).
 * An empty tensor (a size 0: the first write of a growing cache, `cat([torch.tensor([]), x])`) has
 * data == NULL (PyTorch's data pointer of every empty tensor, as the verifier and the guard pass it):
 * a kernel must not dereference it; its strides are whatever PyTorch gave it.
 *
 * Inputs: the operator's tensor arguments in schema order, Tensor[] arguments flattened; an optional
 * tensor passed as None is a descriptor with data == NULL and dtype == FP_NONE.
 * Scalars: the numeric and bool non-tensor arguments in schema order, int lists flattened.
 * Outputs: the operator's returned tensors in order.
 */
#ifndef FORGEPACK_ABI_H
#define FORGEPACK_ABI_H

#include <stdint.h>

#define FP_ABI_VERSION 1
#define FP_MAX_DIMS 8

#if defined(_WIN32)
#define FP_EXPORT_ATTR __declspec(dllexport)
#else
#define FP_EXPORT_ATTR __attribute__((visibility("default")))
#endif
#ifdef __cplusplus
#define FP_EXPORT extern "C" FP_EXPORT_ATTR
#else
#define FP_EXPORT FP_EXPORT_ATTR
#endif

typedef enum {
  FP_NONE = -1,
  FP_FLOAT32 = 0,
  FP_FLOAT16 = 1,
  FP_BFLOAT16 = 2,
  FP_FLOAT64 = 3,
  FP_INT64 = 4,
  FP_INT32 = 5,
  FP_INT16 = 6,
  FP_INT8 = 7,
  FP_UINT8 = 8,
  FP_BOOL = 9
} fp_dtype;

typedef struct {
  void* data;
  int32_t dtype; /* fp_dtype */
  int32_t ndim;
  int64_t sizes[FP_MAX_DIMS];
  int64_t strides[FP_MAX_DIMS];
} fp_tensor;

typedef enum { FP_SCALAR_INT = 0, FP_SCALAR_FLOAT = 1, FP_SCALAR_BOOL = 2 } fp_scalar_kind;

typedef struct {
  int32_t kind; /* fp_scalar_kind */
  int32_t reserved;
  int64_t i; /* valid for INT and BOOL */
  double f;  /* valid for FLOAT (and set to the int value for INT and BOOL) */
} fp_scalar;

typedef struct {
  int32_t abi_version; /* FP_ABI_VERSION */
  int32_t n_inputs;
  int32_t n_outputs;
  int32_t n_scalars;
  const fp_tensor* inputs;
  fp_tensor* outputs;
  const fp_scalar* scalars;
  void* stream; /* cudaStream_t for cuda; NULL for cpu */
} fp_call;

#define FP_OK 0
#define FP_ERR_ABI (-1)         /* abi_version or argument count not what the kernel was built for */
#define FP_ERR_UNSUPPORTED (-2) /* a descriptor the kernel cannot handle */

#endif /* FORGEPACK_ABI_H */
