"""Benchmark of candidate evaluation: compile time per candidate, and candidates evaluated per minute.

    python tools/bench_evaluate.py                 # cuda (the H200), 24 distinct candidates
    python tools/bench_evaluate.py --target cpu    # the same pipeline on cpu (a smoke test)

1. Compile: every candidate compiled once into an empty cache (median and p90 seconds), then once more
   (cache hits).
2. End to end, serial: an `Evaluator` runs static checks, compile, verification and benchmark for every
   candidate, from an empty cache: candidates per minute, and the median time of each stage.
3. End to end, pipelined as the search's executor does it: compiles in a pool of threads (nvcc/g++
   run as subprocesses), evaluation of each finished object on the one worker.

The candidates are distinct parametrised kernels (relu and logsumexp over a few launch shapes), as the
templates proposer produces them. Results go to ${OUT:-benchmarks/out}/bench_evaluate.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from tabulate import tabulate

from forgepack.capture import card_from_call
from forgepack.compile import compile_kernel, compiler_version, default_arch
from forgepack.evaluate import Evaluator

RELU_CUDA = """#include <cuda_runtime.h>
#include <stdint.h>
#include "forgepack_abi.h"
#define THREADS {threads}
#define VEC {vec}
__global__ void __launch_bounds__(THREADS) relu_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n) {{
  const int64_t step = (int64_t)gridDim.x * THREADS * VEC;
  for (int64_t base = ((int64_t)blockIdx.x * THREADS + threadIdx.x) * VEC; base < n; base += step) {{
#pragma unroll
    for (int k = 0; k < VEC; ++k) {{
      const int64_t i = base + k;
      if (i < n) {{
        const float v = x[i];
        y[i] = (v > 0.0f || v != v) ? v : 0.0f;
      }}
    }}
  }}
}}
FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {{
  int64_t n = 1;
  for (int d = 0; d < call->inputs[0].ndim; ++d) n *= call->inputs[0].sizes[d];
  int64_t blocks = (n + THREADS * VEC - 1) / (THREADS * VEC);
  if (blocks > {max_blocks}) blocks = {max_blocks};
  relu_kernel<<<(unsigned)blocks, THREADS, 0, (cudaStream_t)call->stream>>>(
      (const float*)call->inputs[0].data, (float*)call->outputs[0].data, n);
  return (int32_t)cudaGetLastError();
}}
"""

LOGSUMEXP_CUDA = """#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include "forgepack_abi.h"
#define WARPS {warps}
__device__ __forceinline__ float nan_max(float a, float b) {{ return (a != a || a > b) ? a : b; }}
__global__ void __launch_bounds__(32 * WARPS) lse(const float* __restrict__ x, float* __restrict__ y,
                                                  int64_t rows, int64_t cols) {{
  const int64_t row = (int64_t)blockIdx.x * WARPS + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const float* r = x + row * cols;
  float m = -INFINITY;
  for (int64_t c = lane; c < cols; c += 32) m = nan_max(r[c], m);
  for (int o = 16; o > 0; o /= 2) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (fabsf(m) == INFINITY) m = 0.0f;
  float s = 0.0f;
  for (int64_t c = lane; c < cols; c += 32) s += expf(r[c] - m);
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) y[row] = logf(s) + m;
}}
FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {{
  const int64_t rows = call->inputs[0].sizes[0], cols = call->inputs[0].sizes[1];
  lse<<<(unsigned)((rows + WARPS - 1) / WARPS), 32 * WARPS, 0, (cudaStream_t)call->stream>>>(
      (const float*)call->inputs[0].data, (float*)call->outputs[0].data, rows, cols);
  return (int32_t)cudaGetLastError();
}}
"""

RELU_CPU = """#include <stdint.h>
#include "forgepack_abi.h"
FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {{
  int64_t n = 1;
  for (int d = 0; d < call->inputs[0].ndim; ++d) n *= call->inputs[0].sizes[d];
  const float* x = (const float*)call->inputs[0].data;
  float* y = (float*)call->outputs[0].data;
#pragma GCC unroll {unroll}
  for (int64_t i = 0; i < n; ++i) {{
    const float v = x[i];
    y[i] = (v > 0.0f || v != v) ? v {op} 0.0f : 0.0f;
  }}
  return FP_OK;
}}
"""


def candidates(target: str, count: int) -> list[tuple[str, str, object]]:
    """(name, source, card) for `count` distinct candidates."""
    torch.manual_seed(0)
    if target == "cpu":
        relu = card_from_call(torch.ops.aten.relu.default, (torch.randn(8, 64),))[0]
        out = []
        for unroll in range(1, count + 1):
            for op in ("+", "-"):
                out.append((f"relu_cpu unroll={unroll} {op}0", RELU_CPU.format(unroll=unroll, op=op), relu))
        return out[:count]
    relu = card_from_call(torch.ops.aten.relu.default, (torch.randn(4096, 1024),))[0]
    lse = card_from_call(torch.ops.aten.logsumexp.default, (torch.randn(4096, 1024), [-1], False))[0]
    out = [(f"logsumexp warps={w}", LOGSUMEXP_CUDA.format(warps=w), lse) for w in (1, 2, 4, 8, 16, 32)]
    for threads in (64, 128, 256, 512, 1024):
        for vec in (1, 2, 4, 8):
            for max_blocks in (1024, 65535):
                name = f"relu threads={threads} vec={vec} max_blocks={max_blocks}"
                out.append((name, RELU_CUDA.format(threads=threads, vec=vec, max_blocks=max_blocks), relu))
    return out[:count]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def fresh_cache() -> tempfile.TemporaryDirectory:
    tmp = tempfile.TemporaryDirectory(prefix="forgepack-bench-cache-")
    os.environ["FORGEPACK_CACHE"] = tmp.name
    return tmp


def bench_compile(cands: list, target: str, arch: str | None) -> dict:
    with fresh_cache():
        cold = []
        for name, source, _ in cands:
            result = compile_kernel(source, target, arch=arch)
            if not result.ok:
                raise SystemExit(f"candidate {name} does not compile:\n{result.log}")
            cold.append(result.seconds)
        hits = [compile_kernel(source, target, arch=arch).seconds for _, source, _ in cands]
    return {"candidates": len(cands), "median_s": statistics.median(cold), "p90_s": quantile(cold, 0.9),
            "max_s": max(cold), "cache_hit_median_s": statistics.median(hits), "each_s": cold}


def bench_serial(cands: list, target: str, arch: str | None) -> dict:
    with fresh_cache(), Evaluator(target, timeout_s=120.0) as ev:
        ev.start()  # worker start-up (torch import, CUDA context) is not per-candidate work
        verdicts, start = [], time.perf_counter()
        for _, source, card in cands:
            verdicts.append(ev.evaluate(card, source, arch=arch))
        wall = time.perf_counter() - start
    return _summary(verdicts, wall)


def bench_pipelined(cands: list, target: str, arch: str | None, workers: int) -> dict:
    with fresh_cache(), Evaluator(target, timeout_s=120.0) as ev, ThreadPoolExecutor(workers) as pool:
        ev.start()
        start = time.perf_counter()
        futures = {pool.submit(compile_kernel, source, target, arch): (source, card) for _, source, card in cands}
        verdicts = []
        for future in as_completed(futures):
            source, card = futures[future]
            verdicts.append(ev.evaluate_compiled(card, future.result(), source))
        wall = time.perf_counter() - start
    return {**_summary(verdicts, wall), "compile_workers": workers}


def _summary(verdicts: list, wall: float) -> dict:
    categories: dict[str, int] = {}
    for v in verdicts:
        key = "accepted" if v.accepted else v.category
        categories[key] = categories.get(key, 0) + 1
    return {
        "candidates": len(verdicts),
        "wall_s": wall,
        "candidates_per_minute": 60.0 * len(verdicts) / wall,
        "median_compile_s": statistics.median(v.compile_s for v in verdicts),
        "median_verify_s": statistics.median(v.verify_s for v in verdicts),
        "median_bench_s": statistics.median(v.bench_s for v in verdicts),
        "median_total_s": statistics.median(v.compile_s + v.verify_s + v.bench_s for v in verdicts),
        "verdicts": categories,
        "best_speedup": max((v.speedup or 0.0) for v in verdicts),
    }


def _compiler_line(target: str) -> str:
    lines = compiler_version(target).splitlines()
    release = [line for line in lines if "release" in line]
    return (release or lines or ["unknown compiler"])[0].strip()


def _commit() -> str:
    import subprocess

    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
                         cwd=Path(__file__).resolve().parent.parent)
    return out.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--count", type=int, default=24, help="distinct candidates (at least 20 for the record)")
    parser.add_argument("--compile-workers", type=int, default=min(8, os.cpu_count() or 1))
    args = parser.parse_args()
    if args.target == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible: run on the GPU machine, or pass --target cpu")
    arch = default_arch() if args.target == "cuda" else None
    cands = candidates(args.target, args.count)

    compile_stats = bench_compile(cands, args.target, arch)
    serial = bench_serial(cands, args.target, arch)
    pipelined = bench_pipelined(cands, args.target, arch, args.compile_workers)

    machine = torch.cuda.get_device_name(0) if args.target == "cuda" else platform.processor() or platform.machine()
    result = {
        "target": args.target, "arch": arch, "machine": machine, "cpus": os.cpu_count(),
        "torch": torch.__version__, "compiler": _compiler_line(args.target),
        "compile": compile_stats, "serial": serial, "pipelined": pipelined,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(["python", *sys.argv]),
        "commit": _commit(),
    }
    rows = [
        ["compile, cold cache: median s", f"{compile_stats['median_s']:.2f}"],
        ["compile, cold cache: p90 s", f"{compile_stats['p90_s']:.2f}"],
        ["compile, cache hit: median s", f"{compile_stats['cache_hit_median_s']:.4f}"],
        ["end to end, serial: candidates/min", f"{serial['candidates_per_minute']:.1f}"],
        ["  median compile / verify / bench s",
         f"{serial['median_compile_s']:.2f} / {serial['median_verify_s']:.2f} / {serial['median_bench_s']:.2f}"],
        ["  median evaluation s per candidate (compile + verify + bench)", f"{serial['median_total_s']:.2f}"],
        [f"end to end, {args.compile_workers} compile workers: candidates/min",
         f"{pipelined['candidates_per_minute']:.1f}"],
        ["verdicts (serial)", ", ".join(f"{k}: {n}" for k, n in sorted(serial["verdicts"].items()))],
    ]
    table = tabulate(rows, headers=[f"{len(cands)} candidates, {args.target} on {machine}", "value"],
                     tablefmt="github")
    print(table)
    out = Path(os.environ.get("OUT") or "benchmarks/out") / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_evaluate.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "bench_evaluate.md").write_text(
        f"# Candidate evaluation benchmark ({result['date']})\n\n{machine}, {result['cpus']} CPUs, torch "
        f"{result['torch']}, {result['compiler']}\n\ncommit {result['commit']}, command `{result['command']}`"
        f"\n\n{table}\n"
    )
    print(f"wrote {out / 'bench_evaluate.json'} and {out / 'bench_evaluate.md'}")


if __name__ == "__main__":
    main()
