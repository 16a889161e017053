"""Where a column's time goes: the GPU kernels behind one forward, per bench column, side by side.

For each recipe and column (the columns of `forgepack bench`: graphs, pack+graphs, compile-ro, ...):
- wall ms per forward, timed as `forgepack bench` times it (synchronised before and after);
- host ms: the time until the call returns, before synchronising (how long the CPU keeps the GPU waiting
  when the GPU has nothing queued);
- kernel ms: the sum of the GPU kernels' durations in one forward (torch.profiler; CUDA graph replays
  included), and how many kernels and memcpy/memset operations one forward runs;
- the kernels that take the most time, per column, so a gap between two columns has names;
- for eager columns (`eager`, `pack`), the aten ops that launched each of those kernels, innermost
  first, so a kernel's name leads back to the model code.

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
from forgepack.bench import BenchContext, Column, Skip, load_pack, ready_column
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


def kernels(col: Column, fn, calls: int = 5) -> dict:
    """Kernel µs and counts per name over `calls` forwards, and where the time between them goes.

    Per forward (median over the calls): `pre_us`, from the call's start on the host to the launch that
    starts its first kernel (cudaGraphLaunch for a graph); `span_us`, from the first kernel's start to
    the last one's end on the GPU; `idle_us`, the part of the span with no kernel running; and the host
    ops that took the most time of their own.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    col.enter()
    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                with record_function("probe.call"):
                    fn()
                torch.cuda.synchronize()
    finally:
        col.exit()
    events = list(prof.events())
    # The call's own range is mirrored on the GPU timeline: it is not a kernel.
    gpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "probe.call"),
                 key=lambda e: e.time_range.start)
    us, count = collections.Counter(), collections.Counter()
    for ev in gpu:
        us[ev.name] += ev.device_time / calls
        count[ev.name] += 1
    windows = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.name == "probe.call" and e.device_type == torch.autograd.DeviceType.CPU)
    pre, span, idle = [], [], []
    for i, (start, _) in enumerate(windows):
        stop = windows[i + 1][0] if i + 1 < len(windows) else float("inf")
        mine = [e for e in gpu if start <= e.time_range.start < stop]
        if not mine:
            continue
        launches = [e.time_range.start for e in events if e.device_type == torch.autograd.DeviceType.CPU
                    and e.name.startswith(("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel"))
                    and start <= e.time_range.start < mine[0].time_range.start]
        pre.append((min(launches) if launches else mine[0].time_range.start) - start)
        first, last = mine[0].time_range.start, max(e.time_range.end for e in mine)
        span.append(last - first)
        idle.append(last - first - _busy(mine))
    host = collections.Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and e.name != "probe.call":
            host[e.name] += e.self_cpu_time_total / calls
    copies = sum(n for name, n in count.items() if name.startswith(("Memcpy", "Memset"))) // calls
    return {"us": us, "count": count, "calls": calls, "copies": copies, "ops": _launching_ops(events),
            "pre_us": statistics.median(pre) if pre else None, "span_us": statistics.median(span) if span else None,
            "idle_us": statistics.median(idle) if idle else None,
            "host_top": [{"host op": short(k, 60), "self µs": v} for k, v in host.most_common(8)]}


def _launching_ops(events: list) -> dict[str, collections.Counter]:
    """Kernel name -> how often each chain of aten ops (innermost first, three deep) launched it."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or not getattr(e, "kernels", None):
            continue
        chain, node = [], e
        while node is not None and len(chain) < 3:
            if node.name.startswith("aten::"):
                chain.append(node.name[len("aten::"):])
            node = node.cpu_parent
        for k in e.kernels:
            out[k.name][" < ".join(chain) or e.name] += 1
    return out


def _chains(chains: collections.Counter | None, calls: int) -> str:
    return "; ".join(f"{chain} x{n // calls}" for chain, n in (chains or collections.Counter()).most_common(3))


def _busy(kernels: list) -> float:
    """µs during which at least one of these kernels runs (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for e in kernels:
        s, t = e.time_range.start, e.time_range.end
        if t > end:
            total += t - max(s, end)
            end = t
    return total


def _ms(us: float | None) -> float | None:
    return None if us is None else us / 1e3


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
            try:
                col, fn = ready_column(ctx, name)
            except Skip as why:
                result["columns"][name] = {"skipped": str(why)}
                continue
            wall, host = wall_and_host(col, fn)
            prof = kernels(col, fn)
            us, count, calls = prof["us"], prof["count"], prof["calls"]
            result["columns"][name] = {
                "wall_ms": wall, "host_ms": host, "kernel_ms": sum(us.values()) / 1e3,
                "kernels": sum(count.values()) // calls, "copies": prof["copies"],
                "pre_ms": _ms(prof["pre_us"]), "span_ms": _ms(prof["span_us"]), "idle_ms": _ms(prof["idle_us"]),
                "top": [{"kernel": short(k), "us": v, "per_call": count[k] / calls} for k, v in us.most_common(TOP)],
                "host_top": prof["host_top"],
            }
            if name in ("eager", "pack"):
                result["columns"][name]["ops"] = [
                    {"kernel": short(k, 70), "us": v, "launched by": _chains(prof["ops"].get(k), calls)}
                    for k, v in us.most_common(2 * TOP)]
            torch.cuda.synchronize()
    return result


def render(info: dict, results: list[dict]) -> str:
    md = benchlib.header_md("Kernels behind one forward, per column", info)
    md += ("wall = synchronised ms per forward; host = ms until the call returns; pre = from the call's start "
           "to the launch of its first GPU work (host work the GPU waits for); span = first kernel start to "
           "last kernel end; idle = the part of the span with no kernel running; kernel = sum of kernel "
           "durations; kernels = kernels per forward; copies = memcpy/memset per forward (profiler: "
           "medians over 5 forwards; host op times are inflated by the profiler itself).\n\n")
    for res in results:
        rows = []
        for name, c in res["columns"].items():
            if "skipped" in c:
                rows.append({"column": name, "skipped": c["skipped"]})
                continue
            rows.append({"column": name, "wall ms": c["wall_ms"], "host ms": c["host_ms"],
                         "pre ms": c["pre_ms"], "span ms": c["span_ms"], "idle ms": c["idle_ms"],
                         "kernel ms": c["kernel_ms"], "kernels": c["kernels"], "copies": c["copies"]})
        md += f"## {res['recipe']}\n\n{tabulate(rows, headers='keys', floatfmt='.3f', tablefmt='github')}\n\n"
        for name, c in res["columns"].items():
            if "top" in c:
                md += f"### {res['recipe']}: {name}, top kernels (µs per forward)\n\n"
                md += tabulate(c["top"], headers="keys", floatfmt=".1f", tablefmt="github") + "\n\n"
                if "ops" in c:
                    md += f"{name}: the aten ops that launched its kernels (innermost first):\n\n"
                    md += tabulate(c["ops"], headers="keys", floatfmt=".1f", tablefmt="github") + "\n\n"
                md += f"host ops of {name}, self time per forward:\n\n"
                md += tabulate(c["host_top"], headers="keys", floatfmt=".1f", tablefmt="github") + "\n\n"
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
