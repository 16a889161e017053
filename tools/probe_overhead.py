"""Host-time probe: where a pack's eager forward spends host time that stock's does not, op by op.

An eager LLM forward on the H200 host is launch-bound (about 9 us of host time per aten call against
under 1 us of GPU time for most of them), so a pack that serves kernels faster alone can still lose
end to end on what its guards, fallbacks and module patches cost the host. Per shape of
`bench_shapes`' grid this runs `--forwards` forwards under `torch.profiler` (CPU activity), stock then
each pack, and reports per aten op its calls per forward and its host time per call (the op's own
CPU total: the dispatcher, a pack's guard, the kernel's host side and launch), and the difference
times the calls: the milliseconds per forward each op adds or saves. The Python module patches
(fused sites) show as the rest: the forward's wall time less its ops' totals. The profiler inflates
every call alike; the differences are what to read, not the absolute microseconds.

    python tools/probe_overhead.py --base llama-1b-decode --pack packs/forgepack_pack_llama_1b_decode_envelope-*.whl \\
        --exact packs/forgepack_pack_llama_1b_decode-*.whl --shapes "prefill b8 s16,decode b1 c2048"
Output: `<out>/results/probe_overhead-<name>.json` and `.md` (date, device, commit, command).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib
from bench_shapes import add_grid_args, grid_of

from forgepack import bench, models, modeltiming, recipe
from forgepack.errors import ForgepackError

TOP = 12  # ops per table, by the host time they add or save


def host_profile(lm: models.LoadedModel, forwards: int) -> dict[str, Any]:
    """Per aten op: calls and CPU total (us) per forward, and the wall ms per forward, over `forwards`."""
    from torch.profiler import ProfilerActivity, profile

    sync = modeltiming.device_sync(lm.device)
    for _ in range(3):
        lm.run()
    sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(forwards):
            lm.run()
        sync()
        wall = time.perf_counter() - start
    ops = {}
    for e in prof.key_averages():
        if e.key.startswith("aten::") and e.count:
            ops[e.key] = {"calls": e.count / forwards, "us": e.cpu_time_total / forwards}
    return {"wall_ms": wall * 1e3 / forwards, "ops": ops}


def compare(stock: dict[str, Any], pack: dict[str, Any]) -> list[dict[str, Any]]:
    """Per op: calls per forward, host us per call for both, and the ms per forward the pack adds."""
    rows = []
    for op in set(stock["ops"]) | set(pack["ops"]):
        s, p = stock["ops"].get(op, {"calls": 0, "us": 0.0}), pack["ops"].get(op, {"calls": 0, "us": 0.0})
        rows.append({"op": op, "calls": p["calls"], "stock_calls": s["calls"],
                     "stock_us_per_call": s["us"] / s["calls"] if s["calls"] else None,
                     "pack_us_per_call": p["us"] / p["calls"] if p["calls"] else None,
                     "added_ms": (p["us"] - s["us"]) / 1e3})
    return sorted(rows, key=lambda r: -abs(r["added_ms"]))


def markdown(info: dict, base: recipe.Recipe, wheels: dict[str, str], results: list[dict]) -> str:
    md = benchlib.header_md(f"Host time per forward, stock against each pack, op by op: {base.name}", info)
    md += "".join(f"- {name} pack: {wheel}\n" for name, wheel in wheels.items())
    md += ("- per op: calls per forward, host us per call under the profiler (the op's CPU total), and the ms per "
           "forward the pack adds (negative: saves); wall ms per forward under the profiler\n\n")
    for r in results:
        md += f"## {r['shape']}\n\n- wall ms per forward: stock {r['stock']['wall_ms']:.2f}"
        md += "".join(f", {n} {r[n]['wall_ms']:.2f}" for n in wheels) + "\n\n"
        for n in wheels:
            rows = [[x["op"], f"{x['calls']:.0f}", f"{x['stock_calls']:.0f}",
                     "-" if x["stock_us_per_call"] is None else f"{x['stock_us_per_call']:.2f}",
                     "-" if x["pack_us_per_call"] is None else f"{x['pack_us_per_call']:.2f}",
                     f"{x['added_ms']:+.3f}"] for x in r[f"{n}_ops"][:TOP]]
            total = sum(x["added_ms"] for x in r[f"{n}_ops"])
            md += (f"{n}: the ops' host time adds {total:+.3f} ms per forward; the wall time "
                   f"{r[n]['wall_ms'] - r['stock']['wall_ms']:+.3f} ms (the difference is Python: module patches)\n\n")
            md += tabulate(rows, headers=["op", "calls", "stock calls", "stock us/call", f"{n} us/call",
                                          "added ms/fwd"], tablefmt="github") + "\n\n"
    return md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_grid_args(p, "1,8", "16", "2048")
    p.add_argument("--pack", required=True, help="a pack's wheel (the envelope pack)")
    p.add_argument("--exact", default=None, help="a second pack's wheel (the exact-shape pack)")
    p.add_argument("--shapes", default=None, help="comma-separated labels of the grid to probe (default: all)")
    p.add_argument("--forwards", type=int, default=20)
    args = p.parse_args(argv)

    base, grid = grid_of(args)
    if args.shapes:
        wanted = [s.strip() for s in args.shapes.split(",")]
        grid = [s for s in grid if s.label in wanted]
    wheels = {"envelope": args.pack, **({"exact": args.exact} if args.exact else {})}
    info = benchlib.meta()
    results = []
    with contextlib.ExitStack() as stack, models.quiet_transformers():
        packs = {name: bench.load_pack(Path(w), stack) for name, w in wheels.items()}
        model = models.load(base).model
        for shape in grid:
            lm = models.with_inputs(shape.recipe, model)
            row: dict[str, Any] = {"shape": shape.label, "stock": host_profile(lm, args.forwards)}
            for name, pack in packs.items():
                pack.activate(strict=True)
                try:
                    row[name] = host_profile(lm, args.forwards)
                finally:
                    pack.deactivate()
                row[f"{name}_ops"] = compare(row["stock"], row[name])
            results.append(row)
            print(f"{shape.label}: wall ms stock {row['stock']['wall_ms']:.2f} "
                  + " ".join(f"{n} {row[n]['wall_ms']:.2f}" for n in packs), file=sys.stderr)
            # after every shape: a run cut by a device call's limit keeps the shapes it finished
            data = {**info, "base": recipe.to_dict(base), "wheels": wheels, "forwards": args.forwards,
                    "shapes": results}
            benchlib.write(f"probe_overhead-{recipe.slugify(base.name)}", data,
                           markdown(info, base, wheels, results), quiet=True)
    print(markdown(info, base, wheels, results))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ForgepackError as err:
        sys.exit(f"probe_overhead: {err}")
