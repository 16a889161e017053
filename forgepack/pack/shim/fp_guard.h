// forgepack guarded dispatch: the helpers every generated shim uses.
//
// A generated shim (see forgepack/pack/shimgen.py) defines, before including this header,
//     constexpr bool kCuda;                    // the pack's target: CUDA kernels or CPU kernels
//     constexpr c10::DispatchKey kBackend;     // DispatchKey::CUDA or DispatchKey::CPU
// and then one override per aten overload whose guard calls the matchers below, cheapest first.
// Everything here is header-only against c10/ATen core headers (no CUDA headers, no Python), so the
// shim compiles with g++ in seconds and loads into any process that has this torch build.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/boxing/impl/boxing.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_strided_ops.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/SymIntArrayRef.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "forgepack_abi.h"

namespace fpg {

using KernelFn = int32_t (*)(const fp_call*);

// A kernel that states no needs (forgepack/needs.py) may use up to 16-byte vector loads at the offset
// it was verified at: the guard then requires the data pointer to sit at the same offset modulo 16
// (fresh allocations are >= 64-byte aligned, so that offset is storage_offset * itemsize mod 16).
// A kernel that states its needs gets exactly those: `align` bytes past a multiple of `align_bytes`.
constexpr uintptr_t kAlignBytes = 16;
constexpr int kMaxDevices = 64;

// What one tensor argument must look like for a variant to fire.
struct TensorSpec {
  c10::ScalarType dtype;
  int32_t abi_dtype;  // fp_dtype
  int32_t ndim;
  const int64_t* sizes;
  const int64_t* strides;
  int32_t align;                                          // data pointer offset modulo align_bytes
  int32_t align_bytes = static_cast<int32_t>(kAlignBytes);  // a power of two
};

// A Scalar (or a Python number wrapped into a 0-dim tensor) the card fixed.
struct ScalarSpec {
  int32_t kind;  // fp_scalar_kind
  int64_t i;
  double f;
};

// ---- tensors --------------------------------------------------------------------------------------

inline bool dims_equal(c10::IntArrayRef got, const int64_t* want, int32_t n) {
  for (int32_t d = 0; d < n; ++d) {
    if (got[d] != want[d]) return false;
  }
  return true;
}

// A defined, strided, plain (no wrapped number, neg or conj bit) tensor of this dtype, rank and device:
// what every guard checks first, all of it in the TensorImpl.
inline bool plain(const at::Tensor& t, c10::ScalarType dtype, int32_t ndim, c10::DeviceType device) {
  if (!t.defined()) return false;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->dtype().toScalarType() != dtype) return false;
  if (impl->device_type() != device) return false;
  if (impl->layout() != c10::kStrided) return false;
  if (impl->is_wrapped_number() || t.is_neg() || t.is_conj()) return false;
  return impl->dim() == ndim;
}

// Cheap-first: dtype and device live in the TensorImpl; sizes and strides next; the data pointer last.
inline bool match(const at::Tensor& t, const TensorSpec& s, c10::DeviceType device) {
  if (!plain(t, s.dtype, s.ndim, device)) return false;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (!dims_equal(impl->sizes(), s.sizes, s.ndim) || !dims_equal(impl->strides(), s.strides, s.ndim)) return false;
  if (!impl->has_storage()) return false;
  auto addr = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  return static_cast<int32_t>(addr & static_cast<uintptr_t>(s.align_bytes - 1)) == s.align;
}

template <class List>
inline bool match_list(const List& list, const TensorSpec* specs, size_t n, c10::DeviceType device) {
  if (list.size() != n) return false;
  size_t k = 0;
  for (const at::Tensor& t : list) {
    if (!match(t, specs[k++], device)) return false;
  }
  return true;
}

inline bool match(const std::optional<at::Tensor>& t, const TensorSpec& s, c10::DeviceType device) {
  return t.has_value() && match(*t, s, device);
}

// ---- shape families --------------------------------------------------------------------------------
// A family variant serves every member of a shape family (forgepack/families.py; `families.bind` is
// this code's Python twin). Each dim is bound from its first occurrence among the inputs' axes and
// must lie in its range there, and equal it at every other occurrence; fixed sizes must be equal;
// then every stride must be c * product of dims (a size-1 axis's stride is never read, so never
// checked, nor any of an empty tensor's, whose strides PyTorch sets freely and whose data pointer is
// NULL, aligned to anything). `dv` holds the bound values, -1 while unbound.

struct DimRange {
  int64_t min;
  int64_t max;
};

// One axis's size: the family dim `dim`, or the fixed `size` when dim < 0.
struct AxisSize {
  int32_t dim;
  int64_t size;
};

// stride = c * dv[dims[0]] * ... * dv[dims[n - 1]]; c < 0: any non-negative stride (an input's free
// stride, cards.FREE_STRIDE: the kernel reads it).
struct StrideRule {
  int64_t c;
  int32_t n;
  int32_t dims[3];  // forgepack.families.MAX_STRIDE_DIMS
};

struct FamilySpec {
  c10::ScalarType dtype;
  int32_t abi_dtype;  // fp_dtype
  int32_t ndim;
  const AxisSize* sizes;
  const StrideRule* strides;
  int32_t align;        // data pointer offset modulo align_bytes (the kernel's stated need)
  int32_t align_bytes;  // a power of two; 1: any address
};

inline int64_t stride_of(const StrideRule& r, const int64_t* dv) {
  int64_t s = r.c;
  for (int32_t k = 0; k < r.n; ++k) s *= dv[r.dims[k]];
  return s;
}

// Everything about one input but its strides: dtype, device, rank, sizes (binding dims), pointer.
inline bool bind(const at::Tensor& t, const FamilySpec& s, c10::DeviceType device, const DimRange* ranges,
                 int64_t* dv) {
  if (!plain(t, s.dtype, s.ndim, device)) return false;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  c10::IntArrayRef sizes = impl->sizes();
  for (int32_t a = 0; a < s.ndim; ++a) {
    const AxisSize& ax = s.sizes[a];
    const int64_t n = sizes[a];
    if (ax.dim < 0) {
      if (n != ax.size) return false;
    } else if (dv[ax.dim] < 0) {
      if (n < ranges[ax.dim].min || n > ranges[ax.dim].max) return false;
      dv[ax.dim] = n;
    } else if (dv[ax.dim] != n) {
      return false;
    }
  }
  if (!impl->has_storage()) return false;
  auto addr = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  return static_cast<int32_t>(addr & static_cast<uintptr_t>(s.align_bytes - 1)) == s.align;
}

// After every input is bound: each stride as its rule says.
inline bool strides_ok(const at::Tensor& t, const FamilySpec& s, const int64_t* dv) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->numel() == 0) return true;  // no element to address: any strides (PyTorch's vary)
  c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
  for (int32_t a = 0; a < s.ndim; ++a) {
    if (s.strides[a].c < 0) {
      if (strides[a] < 0) return false;
    } else if (sizes[a] != 1 && strides[a] != stride_of(s.strides[a], dv)) {
      return false;
    }
  }
  return true;
}

// A derived dim (no input holds it: a cat's output length) from its bound base dims, in its range.
inline bool derive(int64_t& d, int64_t value, const DimRange& r) {
  d = value;
  return value >= r.min && value <= r.max;
}

template <class List>
inline bool bind_list(const List& list, const FamilySpec* specs, size_t n, c10::DeviceType device,
                      const DimRange* ranges, int64_t* dv) {
  if (list.size() != n) return false;
  size_t k = 0;
  for (const at::Tensor& t : list) {
    if (!bind(t, specs[k++], device, ranges, dv)) return false;
  }
  return true;
}

template <class List>
inline bool strides_ok_list(const List& list, const FamilySpec* specs, const int64_t* dv) {
  size_t k = 0;
  for (const at::Tensor& t : list) {
    if (!strides_ok(t, specs[k++], dv)) return false;
  }
  return true;
}

// Every tensor input of a hit must live on one device: the kernel gets raw pointers.
struct SameDevice {
  c10::Device device{c10::DeviceType::CPU};
  bool first = true;
  bool add(const at::Tensor& t) {
    if (first) {
      device = t.device();
      first = false;
      return true;
    }
    return t.device() == device;
  }
  bool add(const std::optional<at::Tensor>& t) { return !t.has_value() || !t->defined() || add(*t); }
  template <class List>
  bool add_list(const List& list) {
    for (const at::Tensor& t : list) {
      if (!add(t)) return false;
    }
    return true;
  }
  // A Device argument naming the inputs' own device (`.to(device=...)` that moves nothing): without an
  // index it names the current device of its type.
  bool device_is(const c10::Device& d) const {
    if (first || d.type() != device.type()) return false;
    if (device.is_cpu()) return true;
    const c10::DeviceIndex index = d.has_index() ? d.index() : c10::impl::getDeviceGuardImpl(d.type())->getDevice().index();
    return index == device.index();
  }
};

// Autograd would need to see the call: leave it to stock when grad mode is on and an input requires it.
inline bool needs_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
inline bool needs_grad(const std::optional<at::Tensor>& t) { return t.has_value() && needs_grad(*t); }
template <class List>
inline bool list_needs_grad(const List& list) {
  for (const at::Tensor& t : list) {
    if (needs_grad(t)) return true;
  }
  return false;
}

// ---- non-tensor arguments -------------------------------------------------------------------------

inline bool is_type(const c10::Device& d, c10::DeviceType type) { return d.type() == type; }
inline bool eq(int64_t v, int64_t want) { return v == want; }
inline bool eq(const c10::SymInt& v, int64_t want) {
  auto i = v.maybe_as_int();
  return i.has_value() && *i == want;
}
inline bool eq(double v, double want) { return v == want || (std::isnan(v) && std::isnan(want)); }
inline bool eq(bool v, bool want) { return v == want; }
inline bool eq(c10::ScalarType v, c10::ScalarType want) { return v == want; }
inline bool eq(c10::Layout v, c10::Layout want) { return v == want; }
inline bool eq(c10::MemoryFormat v, c10::MemoryFormat want) { return v == want; }

inline bool eq(const at::Scalar& v, const ScalarSpec& want) {
  if (v.isSymbolic()) return false;
  switch (want.kind) {
    case FP_SCALAR_BOOL:
      return v.isBoolean() && v.toBool() == (want.i != 0);
    case FP_SCALAR_INT:
      return v.isIntegral(/*includeBool=*/false) && v.toLong() == want.i;
    default:
      return v.isFloatingPoint() && eq(v.toDouble(), want.f);
  }
}

// A Python number in a Tensor slot arrives as a wrapped 0-dim CPU tensor (double, long or bool).
inline bool eq_wrapped(const at::Tensor& t, const ScalarSpec& want) {
  if (!t.defined() || !t.unsafeGetTensorImpl()->is_wrapped_number() || t.dim() != 0) return false;
  if (t.device().type() != c10::DeviceType::CPU) return false;
  switch (want.kind) {
    case FP_SCALAR_BOOL:
      return t.scalar_type() == c10::kBool && *t.const_data_ptr<bool>() == (want.i != 0);
    case FP_SCALAR_INT:
      return t.scalar_type() == c10::kLong && *t.const_data_ptr<int64_t>() == want.i;
    default:
      return t.scalar_type() == c10::kDouble && eq(*t.const_data_ptr<double>(), want.f);
  }
}

template <class Ints>
inline bool eq_ints(const Ints& v, const int64_t* want, size_t n) {
  if (v.size() != n) return false;
  for (size_t k = 0; k < n; ++k) {
    if (!eq(v[k], want[k])) return false;
  }
  return true;
}
template <class Ints>
inline bool eq_opt_ints(const Ints& v, const int64_t* want, size_t n) {
  return v.has_value() && eq_ints(*v, want, n);
}

template <class Str>
inline bool eq_str(const Str& v, const char* want) {
  size_t n = std::strlen(want);
  return v.size() == n && std::memcmp(v.data(), want, n) == 0;
}
template <class Str>
inline bool eq_opt_str(const std::optional<Str>& v, const char* want) {
  return v.has_value() && eq_str(*v, want);
}

template <class T, class W>
inline bool eq_opt(const std::optional<T>& v, const W& want) {
  return v.has_value() && eq(*v, want);
}

template <class T>
inline bool is_none(const std::optional<T>& v) {
  return !v.has_value();
}
inline bool is_none(const std::optional<at::Tensor>& v) { return !v.has_value() || !v->defined(); }
inline bool is_none(const at::OptionalIntArrayRef& v) { return !v.has_value(); }
inline bool is_none(const at::OptionalSymIntArrayRef& v) { return !v.has_value(); }

// ---- the hit path ---------------------------------------------------------------------------------

inline void describe(fp_tensor& d, const at::Tensor& t, int32_t abi_dtype) {
  d.data = const_cast<void*>(t.const_data_ptr());
  d.dtype = abi_dtype;
  d.ndim = static_cast<int32_t>(t.dim());
  for (int32_t k = 0; k < d.ndim; ++k) {
    d.sizes[k] = t.sizes()[k];
    d.strides[k] = t.strides()[k];
  }
}
inline void describe(fp_tensor& d, const std::optional<at::Tensor>& t, int32_t abi_dtype) {
  describe(d, *t, abi_dtype);
}
inline void describe_none(fp_tensor& d) {
  std::memset(&d, 0, sizeof(d));
  d.dtype = FP_NONE;
}

// Outputs come from the op's own backend kernel for empty_strided (its allocator, its memory pools,
// graph-capture aware), reached by redispatch so no key computation is paid.
inline at::Tensor alloc(c10::DispatchKey key, c10::Device device, const TensorSpec& s) {
  c10::IntArrayRef sizes(s.sizes, s.ndim), strides(s.strides, s.ndim);
  return at::_ops::empty_strided::redispatch(c10::DispatchKeySet(key), c10::fromIntArrayRefUnchecked(sizes),
                                             c10::fromIntArrayRefUnchecked(strides), s.dtype, c10::kStrided,
                                             device, std::nullopt);
}

// A family output at the bound dim values (fresh: its pointer is the allocator's, >= 64-byte aligned).
inline at::Tensor alloc(c10::DispatchKey key, c10::Device device, const FamilySpec& s, const int64_t* dv) {
  int64_t sizes[FP_MAX_DIMS], strides[FP_MAX_DIMS];
  for (int32_t a = 0; a < s.ndim; ++a) {
    sizes[a] = s.sizes[a].dim < 0 ? s.sizes[a].size : dv[s.sizes[a].dim];
    strides[a] = stride_of(s.strides[a], dv);
  }
  c10::IntArrayRef sz(sizes, s.ndim), st(strides, s.ndim);
  return at::_ops::empty_strided::redispatch(c10::DispatchKeySet(key), c10::fromIntArrayRefUnchecked(sz),
                                             c10::fromIntArrayRefUnchecked(st), s.dtype, c10::kStrided,
                                             device, std::nullopt);
}

// PyTorch's current stream on `device` (what the caller, a CUDA graph capture included, launches on).
inline void* current_stream(c10::Device device) {
  if (device.type() == c10::DeviceType::CPU) return nullptr;
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
}

// The captured stock kernel, called boxed with the dispatch key set this call arrived with.
template <class R, class... Args>
inline R call_original(const c10::SafeKernelFunction& kernel, const c10::OperatorHandle& op,
                       c10::DispatchKeySet ks, Args... args) {
  torch::jit::Stack stack = c10::impl::boxArgs<Args...>(std::forward<Args>(args)...);
  kernel.callBoxed(op, ks, &stack);
  return c10::impl::PopResult<R>::call(stack);
}

// Overriding an aten kernel warns once per process; this pack does it on purpose.
struct QuietWarnings : c10::WarningHandler {
  void process(const c10::Warning& /*warning*/) override {}
};

// One op overload the pack overrides: where to find it and the stock kernel captured at activate.
struct OpSlot {
  const char* name;      // "aten::add"
  const char* overload;  // "Tensor" or ""
  std::optional<c10::OperatorHandle> handle;
  // Never freed: a call still running on another thread while the pack is deactivated and
  // re-activated keeps a valid kernel (a few bytes per activation).
  std::atomic<const c10::SafeKernelFunction*> original{nullptr};
  std::atomic<int64_t> calls{0};
};

struct VariantSlot {
  const char* id;
  const char* kernel_file;  // relative to the package directory
  std::atomic<KernelFn> fn{nullptr};
  std::atomic<bool> enabled{true};
  std::atomic<int64_t> hits{0};
  std::atomic<int64_t> errors{0};
  std::atomic<int64_t> outside{0};  // misses inside the verified range but outside the served sub-range
};

inline void count(std::atomic<int64_t>& c) { c.fetch_add(1, std::memory_order_relaxed); }

// The pack's control ops: activate (capture stock kernels, register overrides), deactivate (destroy
// the registrations: the dispatcher falls back to the kernels that were there before), counters.
struct Control {
  OpSlot* ops;
  size_t n_ops;
  VariantSlot* variants;
  size_t n_variants;
  c10::DispatchKey key;
  bool cuda;
  void (*register_overrides)(torch::Library&);

  std::mutex mu{};
  std::unique_ptr<torch::Library> library{};
  std::atomic<bool> device_ok_[kMaxDevices]{};

  bool device_ok(c10::Device d) const {
    if (!cuda) return true;
    auto i = d.index();
    return i >= 0 && i < kMaxDevices && device_ok_[i].load(std::memory_order_relaxed);
  }

  // root: the package directory; devices: the CUDA device indices whose compute capability is the
  // pack's (the loader decides; guards read the cached flags).
  int64_t activate(const std::string& root, const std::vector<int64_t>& devices) {
    std::lock_guard<std::mutex> lock(mu);
    if (library) return static_cast<int64_t>(n_variants);
    for (auto& flag : device_ok_) flag.store(false);
    for (int64_t d : devices) {
      if (d >= 0 && d < kMaxDevices) device_ok_[d].store(true);
    }
    for (size_t v = 0; v < n_variants; ++v) {
      if (variants[v].fn.load() != nullptr) continue;
      std::string path = root + "/" + variants[v].kernel_file;
      // RTLD_LOCAL: kernels never see each other's symbols. Handles stay open for the process's life,
      // so a call in flight on another thread never runs unmapped code.
      void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      TORCH_CHECK(handle != nullptr, "forgepack: cannot load kernel ", path, ": ", dlerror());
      void* sym = dlsym(handle, "forgepack_kernel");
      TORCH_CHECK(sym != nullptr, "forgepack: ", path, " has no forgepack_kernel symbol");
      variants[v].fn.store(reinterpret_cast<KernelFn>(sym));
    }
    auto& dispatcher = c10::Dispatcher::singleton();
    for (size_t k = 0; k < n_ops; ++k) {
      ops[k].handle = dispatcher.findSchemaOrThrow(ops[k].name, ops[k].overload);
      // Captured now, not at load: whatever kernel is there (stock or another override) is the fallback.
      ops[k].original.store(new c10::SafeKernelFunction(ops[k].handle->getComputedKernelForDispatchKey(key)),
                            std::memory_order_release);
    }
    QuietWarnings quiet;
    c10::WarningUtils::WarningHandlerGuard quiet_guard(&quiet);
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
    register_overrides(*lib);  // throws (and the partial registrations die with `lib`) on a mismatch
    library = std::move(lib);
    return static_cast<int64_t>(n_variants);
  }

  int64_t deactivate() {
    std::lock_guard<std::mutex> lock(mu);
    bool was = library != nullptr;
    library.reset();
    return was ? 1 : 0;
  }

  bool active() {
    std::lock_guard<std::mutex> lock(mu);
    return library != nullptr;
  }

  // [hits per variant..., errors per variant..., outside per variant..., calls per op...]
  std::vector<int64_t> stats() const {
    std::vector<int64_t> out;
    out.reserve(3 * n_variants + n_ops);
    for (size_t v = 0; v < n_variants; ++v) out.push_back(variants[v].hits.load());
    for (size_t v = 0; v < n_variants; ++v) out.push_back(variants[v].errors.load());
    for (size_t v = 0; v < n_variants; ++v) out.push_back(variants[v].outside.load());
    for (size_t k = 0; k < n_ops; ++k) out.push_back(ops[k].calls.load());
    return out;
  }

  // One flag per variant (the gate's ablation); a variant whose kernel is not loaded stays off.
  int64_t set_enabled(const std::vector<int64_t>& flags) {
    TORCH_CHECK(flags.size() == n_variants, "forgepack: set_enabled needs ", n_variants, " flags, got ",
                flags.size());
    int64_t on = 0;
    for (size_t v = 0; v < n_variants; ++v) {
      bool want = flags[v] != 0;
      variants[v].enabled.store(want, std::memory_order_relaxed);
      on += want;
    }
    return on;
  }

  std::vector<std::string> variant_ids() const {
    std::vector<std::string> out;
    for (size_t v = 0; v < n_variants; ++v) out.emplace_back(variants[v].id);
    return out;
  }
};

}  // namespace fpg
