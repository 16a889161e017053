"""Where a column's time goes: the GPU kernels behind one forward, per bench column, side by side.

For each recipe and column (the columns of `forgepack bench`: graphs, pack+graphs, compile-ro, ...):
- wall ms per forward, timed as `forgepack bench` times it (synchronised before and after);
- host ms: the time until the call returns, before synchronising (how long the CPU keeps the GPU waiting
  when the GPU has nothing queued);
- kernel ms: the sum of the GPU kernels' durations in one forward (torch.profiler; CUDA graph replays
  included), and how many kernels and memcpy/memset operations one forward runs;
- the kernels that take the most time, per column, so a gap between two columns has names.

    python tools/probe_kernels.py llama-1b-decode gpt2 --columns graphs,pack+graphs,compile-ro \
        [--packs-root DIR]      # DIR/<recipe>/packs/*.whl: the pack of each recipe (tools/bench_packs.py)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

from forgepack import models
from forgepack.cli.bench import COLUMNS, WARMUP_CALLS, BenchContext, Column, Skip, load_pack
from forgepack.recipe import resolve

TOP = 15


def wall_and_host(col: Column, fn, reps: int = 20) -> tuple[float, float]:
    walls, hosts = [], []
    col.enter()
    try:
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
            hosts.append((t1 - t0) * 1e3)
    finally:
        col.exit()
    return statistics.median(walls), statistics.median(hosts)


def kernels(col: Column, fn, calls: int = 5) -> tuple[collections.Counter, collections.Counter, int]:
    """µs and count per kernel name over `calls` forwards, and the number of memcpy/memset ops."""
    from torch.profiler import ProfilerActivity, profile

    col.enter()
    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
    finally:
        col.exit()
    us, count, copies = collections.Counter(), collections.Counter(), 0
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.name
        if name.startswith(("Memcpy", "Memset")):
            copies += 1
        us[name] += ev.device_time / calls if hasattr(ev, "device_time") else ev.cuda_time / calls
        count[name] += 1
    return us, count, copies // calls


def short(name: str, width: int = 100) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def probe(recipe_name: str, columns: list[str], packs_root: Path | None) -> dict:
    recipe = resolve(recipe_name)
    result: dict = {"recipe": recipe_name, "columns": {}}
    with contextlib.ExitStack() as stack, models.quiet_transformers():
        wheels = sorted((packs_root / recipe_name / "packs").glob("*.whl")) if packs_root else []
        pack = load_pack(wheels[-1], stack) if wheels else None
        lm = models.load(recipe)
        ctx = BenchContext(lm, pack)
        for name in columns:
            col = Column(name, COLUMNS[name])
            try:
                fn = col.setup(ctx, col)
                for _ in range(WARMUP_CALLS):
                    col.enter()
                    try:
                        fn()
                    finally:
                        col.exit()
            except Skip as why:
                result["columns"][name] = {"skipped": str(why)}
                continue
            wall, host = wall_and_host(col, fn)
            us, count, copies = kernels(col, fn)
            calls = 5
            result["columns"][name] = {
                "wall_ms": wall, "host_ms": host, "kernel_ms": sum(us.values()) / 1e3,
                "kernels": sum(count.values()) // calls, "copies": copies,
                "top": [{"kernel": short(k), "us": v, "per_call": count[k] / calls} for k, v in us.most_common(TOP)],
            }
            torch.cuda.synchronize()
    return result


def render(info: dict, results: list[dict]) -> str:
    md = benchlib.header_md("Kernels behind one forward, per column", info)
    md += ("wall = synchronised ms per forward; host = ms until the call returns; kernel = sum of kernel "
           "durations in one forward (profiler); kernels = kernels per forward; copies = memcpy/memset "
           "per forward.\n\n")
    for res in results:
        rows = []
        for name, c in res["columns"].items():
            if "skipped" in c:
                rows.append({"column": name, "skipped": c["skipped"]})
                continue
            rows.append({"column": name, "wall ms": c["wall_ms"], "host ms": c["host_ms"],
                         "kernel ms": c["kernel_ms"], "kernels": c["kernels"], "copies": c["copies"]})
        md += f"## {res['recipe']}\n\n{tabulate(rows, headers='keys', floatfmt='.3f', tablefmt='github')}\n\n"
        for name, c in res["columns"].items():
            if "top" in c:
                md += f"### {res['recipe']}: {name}, top kernels (µs per forward)\n\n"
                md += tabulate(c["top"], headers="keys", floatfmt=".1f", tablefmt="github") + "\n\n"
    return md


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="+")
    parser.add_argument("--columns", default="graphs,pack+graphs,compile-ro")
    parser.add_argument("--packs-root", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("probe_kernels needs a CUDA GPU")
        return 1
    columns = [c for c in args.columns.split(",") if c]
    info = benchlib.meta()
    results = []
    for name in args.recipes:
        try:
            results.append(probe(name, columns, args.packs_root))
        except Exception as exc:  # one recipe's failure must not cost the others their rows
            results.append({"recipe": name, "columns": {"(all)": {"skipped": f"{type(exc).__name__}: {exc}"[:300]}}})
        torch.cuda.empty_cache()
    md = render(info, results)
    benchlib.write("probe_kernels", {"meta": info, "results": results}, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
