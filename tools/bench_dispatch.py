"""Dispatch overhead of a pack's C++ guards (run on the H200; `--device cpu` for a local smoke run).

What it measures, per call of `aten::silu` on a small tensor, in C++ loops (no Python in the loop):
- miss: the pack active, a shape no variant serves, minus stock on the same shape (target <= 0.5 us);
- hit: the pack active, the variant's own shape, minus a direct launch of the same kernel (allocate the
  output, build the descriptors, take the current stream, call `forgepack_kernel`; target <= 1 us);
- hit vs stock: the same hit minus stock PyTorch's silu on that shape;
- Python guard miss: a `torch.library` override written in Python (shape check, then the captured
  kernel's `call_boxed`), minus stock (measured about +6 us on this machine class);
- graph capture: the pack's kernel inside a CUDA graph, replayed, matches stock.

Each number is the median over interleaved rounds of the mean time per call of a batch of calls.
Writes `dispatch_overhead.json` and `dispatch_overhead.md` to ${OUT:-benchmarks/out}.

    python tools/bench_dispatch.py                 # cuda, the H200
    python tools/bench_dispatch.py --device cpu    # the same on the CPU target (a smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from forgepack.capture import card_from_call
from forgepack.compile import compile_kernel
from forgepack.pack import shimgen

HIT_SHAPE = (8, 64)
MISS_SHAPE = (8, 128)
NAMESPACE = "forgepack_dispatch_bench"

CUDA_SILU = r"""
#include "forgepack_abi.h"
#include <cuda_runtime.h>
__global__ void silu_kernel(const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { float v = x[i]; y[i] = v / (1.0f + expf(-v)); }
}
FP_EXPORT int32_t forgepack_kernel(const fp_call* c) {
  if (c->abi_version != FP_ABI_VERSION || c->n_inputs != 1 || c->n_outputs != 1) return FP_ERR_ABI;
  int n = 1;
  for (int d = 0; d < c->outputs[0].ndim; ++d) n *= (int)c->outputs[0].sizes[d];
  silu_kernel<<<(n + 255) / 256, 256, 0, (cudaStream_t)c->stream>>>((const float*)c->inputs[0].data,
                                                                    (float*)c->outputs[0].data, n);
  return (int32_t)cudaGetLastError();
}
"""

CPU_SILU = r"""
#include "forgepack_abi.h"
#include <math.h>
FP_EXPORT int32_t forgepack_kernel(const fp_call* c) {
  if (c->abi_version != FP_ABI_VERSION || c->n_inputs != 1 || c->n_outputs != 1) return FP_ERR_ABI;
  int64_t n = 1;
  for (int d = 0; d < c->outputs[0].ndim; ++d) n *= c->outputs[0].sizes[d];
  const float* x = (const float*)c->inputs[0].data;
  float* y = (float*)c->outputs[0].data;
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] / (1.0f + expf(-x[i]));
  return FP_OK;
}
"""

# C++ timing loops: the dispatcher from C++ (what model code reaches), and a direct launch of the same
# kernel (what a hit costs at least: output allocation, descriptors, current stream, the call).
LOOPS = r"""
#include "fp_guard.h"
#include <ATen/ops/silu_ops.h>
#include <chrono>
#include <string>

namespace {
fpg::KernelFn kernel_fn = nullptr;

double loop_op(const at::Tensor& x, int64_t n) {
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) at::_ops::silu::call(x);
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / n;
}

// Straight to the backend key (what the pack overrides): the pack's own cost, without autograd's layer.
double loop_backend(const at::Tensor& x, int64_t n) {
  c10::DispatchKeySet ks(x.is_cuda() ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU);
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) at::_ops::silu::redispatch(ks, x);
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / n;
}

double loop_direct(const at::Tensor& x, int64_t n, const std::string& kernel) {
  if (kernel_fn == nullptr) {
    void* h = dlopen(kernel.c_str(), RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(h != nullptr, dlerror());
    kernel_fn = reinterpret_cast<fpg::KernelFn>(dlsym(h, "forgepack_kernel"));
  }
  c10::DispatchKey key = x.is_cuda() ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU;
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end()), strides(x.strides().begin(), x.strides().end());
  fpg::TensorSpec spec{x.scalar_type(), 0, (int32_t)x.dim(), sizes.data(), strides.data(), 0};
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    c10::OptionalDeviceGuard guard;
    if (x.is_cuda()) guard.reset_device(x.device());
    at::Tensor out = fpg::alloc(key, x.device(), spec);
    fp_tensor in[1], outd[1];
    fpg::describe(in[0], x, 0);
    fpg::describe(outd[0], out, 0);
    const fp_call call{FP_ABI_VERSION, 1, 1, 0, in, outd, nullptr, fpg::current_stream(x.device())};
    TORCH_CHECK(kernel_fn(&call) == FP_OK, "kernel failed");
  }
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / n;
}
}  // namespace

TORCH_LIBRARY(forgepack_dispatch_loops, m) {
  m.def("loop_op(Tensor x, int n) -> float", &loop_op);
  m.def("loop_backend(Tensor x, int n) -> float", &loop_backend);
  m.def("loop_direct(Tensor x, int n, str kernel) -> float", &loop_direct);
}
"""


def build(work: Path, device: torch.device) -> tuple[Path, Path, Path]:
    """(pack directory with shim + kernel, loops library, kernel object)."""
    target = device.type
    x = torch.randn(*HIT_SHAPE, device=device)
    card, _, _ = card_from_call(torch.ops.aten.silu.default, (x,))
    compiled = compile_kernel(CUDA_SILU if target == "cuda" else CPU_SILU, target)
    if not compiled.ok:
        raise SystemExit(f"kernel did not compile:\n{compiled.log}")
    pack = work / "pack"
    (pack / "kernels").mkdir(parents=True)
    shutil.copyfile(compiled.binary, pack / "kernels" / "silu.so")
    src = pack / "shim.cpp"
    src.write_text(shimgen.generate([shimgen.ShimVariant(card, "kernels/silu.so")], NAMESPACE, target))
    includes = [shimgen.SHIM_DIR, shimgen.ABI_DIR]
    shimgen.compile_shim(src, pack / "shim.so", includes)
    loops = work / "loops.cpp"
    loops.write_text(LOOPS)
    shimgen.compile_shim(loops, work / "loops.so", includes)
    return pack, work / "loops.so", pack / "kernels" / "silu.so"


def python_guard(device: torch.device):
    """A Python-level guarded override of silu at the backend key (the pattern a C++ guard replaces)."""
    key = "CUDA" if device.type == "cuda" else "CPU"
    original = torch.library.get_kernel("aten::silu", key)
    lib = torch.library.Library("aten", "IMPL")

    def guarded(keyset, x):
        if tuple(x.shape) == HIT_SHAPE and x.dtype == torch.float32 and x.is_contiguous():
            return original.call_boxed(keyset, x)  # a real pack would launch its kernel here
        return original.call_boxed(keyset, x)

    lib.impl("silu", guarded, key, with_keyset=True)
    return lib


def measure(device: torch.device, kernel: Path, calls: int, rounds: int) -> dict[str, float]:
    loops = torch.ops.forgepack_dispatch_loops
    pack = getattr(torch.ops, NAMESPACE)
    x_hit = torch.randn(*HIT_SHAPE, device=device)
    x_miss = torch.randn(*MISS_SHAPE, device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def op(x, loop=loops.loop_op):
        def run():
            sync()
            t = loop(x, calls)
            sync()
            return t
        return run

    def direct():
        sync()
        t = loops.loop_direct(x_hit, calls, str(kernel))
        sync()
        return t

    def with_pack(fn):
        def run():
            pack.activate(str(kernel.parent.parent), [device.index or 0])
            try:
                return fn()
            finally:
                pack.deactivate()
        return run

    def with_python_guard(fn):
        def run():
            lib = python_guard(device)
            try:
                return fn()
            finally:
                lib._destroy()
        return run

    cases = {
        "stock_hit_shape": op(x_hit),
        "stock_miss_shape": op(x_miss),
        "pack_hit": with_pack(op(x_hit)),
        "pack_miss": with_pack(op(x_miss)),
        "direct_launch": direct,
        "backend_stock_hit_shape": op(x_hit, loops.loop_backend),
        "backend_stock_miss_shape": op(x_miss, loops.loop_backend),
        "backend_pack_hit": with_pack(op(x_hit, loops.loop_backend)),
        "backend_pack_miss": with_pack(op(x_miss, loops.loop_backend)),
        "python_guard_miss": with_python_guard(op(x_miss)),
    }
    for fn in cases.values():  # warm-up: allocator pools, lazy init, first launches
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    rng = random.Random(0)
    names = list(cases)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            times[name].append(cases[name]() / 1e3)  # us per call
    return {name: statistics.median(v) for name, v in times.items()}


def graph_check(device: torch.device, kernel: Path) -> str:
    """The pack's kernel captured in a CUDA graph, replayed on new values: matches stock silu."""
    if device.type != "cuda":
        return "n/a (cpu)"
    pack = getattr(torch.ops, NAMESPACE)
    x = torch.randn(*HIT_SHAPE, device=device)
    pack.activate(str(kernel.parent.parent), [device.index or 0])
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.nn.functional.silu(x)  # warm-up off the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        before = pack.stats()[0]
        with torch.cuda.graph(graph):
            y = torch.nn.functional.silu(x)
        captured = pack.stats()[0] - before
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        replay_hits = pack.stats()[0] - before - captured
    finally:
        pack.deactivate()
    stock = torch.nn.functional.silu(x)
    ok = captured == 1 and replay_hits == 0 and torch.allclose(y, stock, rtol=1e-5, atol=1e-6)
    return f"{'ok' if ok else 'FAILED'} (kernel captured: {captured == 1}; replay matches stock silu on new values)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed batch")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here; use --device cpu for a smoke run", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    out = Path(os.environ.get("OUT", "benchmarks/out")) / "results"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pack_dir, loops_lib, kernel = build(Path(tmp), device)
        torch.ops.load_library(str(pack_dir / "shim.so"))
        torch.ops.load_library(str(loops_lib))
        t = measure(device, kernel, args.calls, args.rounds)
        graph = graph_check(device, kernel)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "op": f"aten::silu f32{list(HIT_SHAPE)} (hit) / f32{list(MISS_SHAPE)} (miss)",
        "calls_per_batch": args.calls,
        "rounds": args.rounds,
        "us_per_call": t,
        # the pack's own cost, called at the backend key (the targets)
        "miss_overhead_us": t["backend_pack_miss"] - t["backend_stock_miss_shape"],
        "hit_overhead_over_direct_us": t["backend_pack_hit"] - t["direct_launch"],
        # what model code sees, through the whole dispatcher (autograd layer included)
        "miss_overhead_full_dispatch_us": t["pack_miss"] - t["stock_miss_shape"],
        "hit_overhead_over_direct_full_dispatch_us": t["pack_hit"] - t["direct_launch"],
        "hit_vs_stock_us": t["pack_hit"] - t["stock_hit_shape"],
        "python_guard_miss_overhead_us": t["python_guard_miss"] - t["stock_miss_shape"],
        "targets": {"miss_overhead_us": 0.5, "hit_overhead_over_direct_us": 1.0},
        "graph_capture": graph,
    }
    result["meets_targets"] = (result["miss_overhead_us"] <= 0.5 and result["hit_overhead_over_direct_us"] <= 1.0)
    (out / "dispatch_overhead.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "dispatch_overhead.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(r: dict) -> str:
    t = r["us_per_call"]
    rows = [
        ("guard miss over stock (at the backend key)", r["miss_overhead_us"], "<= 0.5"),
        ("hit over a direct kernel launch (at the backend key)", r["hit_overhead_over_direct_us"], "<= 1.0"),
        ("guard miss over stock (full dispatch from C++)", r["miss_overhead_full_dispatch_us"], ""),
        ("hit over a direct kernel launch (full dispatch)", r["hit_overhead_over_direct_full_dispatch_us"], ""),
        ("hit vs stock silu (full dispatch)", r["hit_vs_stock_us"], ""),
        ("Python torch.library guard, miss over stock", r["python_guard_miss_overhead_us"], "(~6 measured)"),
    ]
    lines = [
        f"# Pack dispatch overhead: {r['device']}, torch {r['torch']}",
        "",
        f"{r['op']}; median of {r['rounds']} interleaved rounds of {r['calls_per_batch']} calls, timed in C++.",
        "",
        "| | us per call | target |",
        "|---|---:|---:|",
        *[f"| {name} | {value:+.3f} | {target} |" for name, value, target in rows],
        "",
        "| raw | us per call |",
        "|---|---:|",
        *[f"| {k} | {v:.3f} |" for k, v in t.items()],
        "",
        f"CUDA graph capture with the pack active: {r['graph_capture']}",
        f"Meets both targets: {'yes' if r['meets_targets'] else 'NO'}",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
