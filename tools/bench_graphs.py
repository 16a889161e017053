"""Graph mode against eager and torch.compile, side by side, rounds interleaved (H200).

Columns, per recipe, all on the same model object and the same inputs:
- `eager`: the forward as it is;
- `pack`: a kernel pack active (only with `--pack RECIPE=WHEEL_OR_MODULE`);
- `pack+graphs` (or `graphs` without a pack): forgepack graph mode (`GraphedForward`), pack active;
- `compile`: `torch.compile(model)` (default mode);
- `compile-ro`: `torch.compile(model, mode="reduce-overhead")` (Inductor + CUDA graphs).

Each call is timed alone (device events around it, the GPU idle before: launch overhead counts, as
it does for a caller); decode steps rewind the static cache after each call, outside the timed span.
After warm-up (compile time recorded) every column runs `--iters` calls per round, for `--rounds`
rounds, in a rotating order. Reported: median, p10/p90, speed-up over eager, time relative to
reduce-overhead, the largest difference from eager's output, and graph-mode counters. torch.compile
columns are skipped (and say so) when the time budget would be exceeded.

    python tools/bench_graphs.py                                    # the four reference recipes
    python tools/bench_graphs.py --recipes gpt2 --pack gpt2=packs/forgepack_pack_gpt2-0.1-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

from forgepack import models, recipe
from forgepack.runtime import graphs

RECIPES = ["llama-1b-prefill", "llama-1b-decode", "gpt2", "resnet-50"]
COMPILE_GUESS_S = 60.0  # a torch.compile warm-up before any has been measured
RESERVE_S = 30.0  # per recipe still to come: loading, eager and graph columns


class Column:
    """One way of running the forward: `call()` runs it once; `enter`/`leave` bracket its rounds."""

    def __init__(self, name: str, call, enter=None, leave=None, graphed: graphs.GraphedForward | None = None):
        self.name, self.call, self.graphed = name, call, graphed
        self.enter, self.leave = enter or (lambda: None), leave or (lambda: None)
        self.times: list[float] = []
        self.compile_s: float | None = None
        self.diff: float | None = None
        self.note = ""


def load_pack(spec: str) -> Any:
    """A pack module from a wheel (unpacked into a temporary directory) or an importable name."""
    path = Path(spec)
    if path.suffix == ".whl":
        target = Path(tempfile.mkdtemp(prefix="forgepack-pack-"))
        with zipfile.ZipFile(path) as whl:
            whl.extractall(target)
        names = [p.name for p in target.iterdir()
                 if p.is_dir() and p.name.startswith("forgepack_pack_") and p.name.isidentifier()]  # not its .dist-info
        if not names:
            raise SystemExit(f"{spec}: no forgepack_pack_* package inside")
        sys.path.insert(0, str(target))
        return importlib.import_module(names[0])
    return importlib.import_module(spec)


def rewinder(lm: models.LoadedModel):
    """Puts a static cache's device-side length back where it was at load, in place (graph-safe).

    `lm.reset()` does this through `cache.crop(-n)`, which transformers 5.17's StaticLayer lacks; an
    absolute restore works on every version and is idempotent after a working `crop`.
    """
    cache = lm.extra.get("cache")
    layers = getattr(cache, "layers", None) or []
    saved = [(layer.cumulative_length, layer.cumulative_length.clone()) for layer in layers
             if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]

    def rewind() -> None:
        lm.reset()
        for live, value in saved:
            live.copy_(value)

    return rewind


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_rounds(live: list, lm, rewind, rounds: int, iters: int) -> None:
    """`iters` timed calls per column per round, the columns' order rotating each round."""
    for rnd in range(rounds):
        for col in live[rnd % len(live):] + live[:rnd % len(live)]:
            col.enter()
            try:
                for _ in range(iters):
                    col.times.append(timed_call(col, lm, rewind)[0])
            finally:
                col.leave()


def timed_call(col: Column, lm: models.LoadedModel, rewind) -> tuple[float, Any]:
    """One call in milliseconds, the GPU idle before it; the decode cache is rewound afterwards."""
    sync(lm.device)
    if lm.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = col.call()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
    else:
        t0 = time.perf_counter()
        out = col.call()
        ms = (time.perf_counter() - t0) * 1e3
    rewind()
    return ms, out


def relative_diff(lm: models.LoadedModel, out: Any, ref: torch.Tensor) -> float:
    got = lm.output_tensor(out).float()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def pack_switch(pack: Any):
    def enter() -> None:
        if not pack.activate():
            raise RuntimeError("the pack did not activate here (see its warning)")

    return enter, pack.deactivate


def columns_for(lm: models.LoadedModel, pack: Any, compile_modes: list[str]) -> list[Column]:
    """Warm-up order: the cheap columns first, then reduce-overhead (the target) before default."""
    model, inputs = lm.model, lm.inputs
    cols = [Column("eager", lambda: model(**inputs))]
    if pack is not None:
        enter, leave = pack_switch(pack)
        cols.append(Column("pack", lambda: model(**inputs), enter, leave))
        gf = graphs.GraphedForward(model, context_key=pack.is_active)
        cols.append(Column("pack+graphs", lambda: gf(**inputs), enter, leave, graphed=gf))
    else:
        gf = graphs.GraphedForward(model)
        cols.append(Column("graphs", lambda: gf(**inputs), graphed=gf))
    for mode in compile_modes:
        compiled = torch.compile(model, mode=None if mode == "default" else mode)
        cols.append(Column("compile" if mode == "default" else "compile-ro", lambda c=compiled: c(**inputs)))
    return cols


def warm(col: Column, lm: models.LoadedModel, rewind, ref: torch.Tensor, calls: int) -> None:
    col.enter()
    try:
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            _, out = timed_call(col, lm, rewind)
        if col.name.startswith("compile"):
            col.compile_s = time.perf_counter() - t0
        col.diff = relative_diff(lm, out, ref)
    finally:
        col.leave()


def bench_recipe(name: str, args, pack: Any, deadline: float, left: int, compile_cost: list[float]) -> dict:
    """`left`: recipes after this one, each of which needs time for its own eager columns."""
    r = recipe.resolve(name)
    with models.quiet_transformers():
        lm = models.load(r)
    rewind = rewinder(lm)
    with torch.no_grad():
        ref = lm.output_tensor(lm.forward()).float().clone()
        rewind()
        cols = columns_for(lm, pack, [] if args.no_compile else ["reduce-overhead", "default"])
        for col in cols:
            guess = statistics.median(compile_cost) if compile_cost else COMPILE_GUESS_S
            if col.name.startswith("compile") and deadline - time.perf_counter() - RESERVE_S * left < guess:
                col.note = "skipped: time budget"
                continue
            try:
                warm(col, lm, rewind, ref, args.warmup)
            except Exception as err:  # one broken column must not sink the run
                col.note = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
                traceback.print_exc()
            if col.compile_s is not None:
                compile_cost.append(col.compile_s)
        live = [c for c in cols if not c.note]
        run_rounds(live, lm, rewind, args.rounds, args.iters)
    result = summarise(cols)
    del lm, cols
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def summarise(cols: list[Column]) -> dict:
    out: dict[str, Any] = {"columns": {}}
    medians = {c.name: statistics.median(c.times) for c in cols if c.times}
    eager, ro = medians.get("eager"), medians.get("compile-ro")
    for c in cols:
        entry: dict[str, Any] = {"note": c.note, "compile_s": c.compile_s, "max_rel_diff_vs_eager": c.diff}
        if c.times:
            qs = statistics.quantiles(c.times, n=10)
            med = medians[c.name]
            entry.update(median_ms=med, p10_ms=qs[0], p90_ms=qs[-1], n=len(c.times),
                         speedup_vs_eager=eager / med if eager else None,
                         time_vs_reduce_overhead=med / ro if ro else None)
        if c.graphed is not None:
            entry["graph_stats"] = {k: v for k, v in c.graphed.stats().items() if k != "failures"}
            entry["graph_failures"] = c.graphed.stats()["failures"]
        out["columns"][c.name] = entry
    return out


def markdown(info: dict, results: dict, args) -> str:
    text = benchlib.header_md("Graph mode vs eager and torch.compile", info)
    text += (f"Median of {args.rounds} interleaved rounds x {args.iters} calls per column, each call timed alone "
             "with device events. Speed-up = eager median / column median; `vs RO` = column median / "
             "reduce-overhead median (at most 1.00 means at least as fast).\n\n")
    rows = []
    for name, res in results.items():
        if "error" in res:
            rows.append([name, "error", "", "", "", "", "", res["error"][:80]])
            continue
        for col, e in res["columns"].items():
            if "median_ms" not in e:
                rows.append([name, col, "", "", "", "", "", e["note"]])
                continue
            vs_ro = f"{e['time_vs_reduce_overhead']:.2f}" if e.get("time_vs_reduce_overhead") else ""
            note = e["note"]
            if e.get("compile_s") is not None:
                note = f"warm-up incl. compile {e['compile_s']:.0f} s " + note
            if "graph_stats" in e:
                s = e["graph_stats"]
                note = f"captures {s['captures']}, replays {s['replays']}, fallbacks {s['fallbacks']} " + note
            diff = e.get("max_rel_diff_vs_eager")
            rows.append([name, col, f"{e['median_ms']:.3f}", f"{e['p10_ms']:.3f}-{e['p90_ms']:.3f}",
                         f"{e['speedup_vs_eager']:.2f}x", vs_ro, f"{diff:.1e}" if diff is not None else "", note])
    text += tabulate(rows, ["recipe", "column", "median ms", "p10-p90 ms", "speed-up", "vs RO", "rel diff", "notes"],
                     tablefmt="github")
    return text + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--pack", action="append", default=[], metavar="RECIPE=WHEEL_OR_MODULE")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4, help="calls per column before timing (>= 3 for graphs)")
    parser.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget; compile columns yield")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    deadline = start + args.budget_s
    packs = dict(spec.split("=", 1) for spec in args.pack)
    info = benchlib.meta()
    import transformers

    info["transformers"] = transformers.__version__
    results: dict[str, Any] = {}
    compile_cost: list[float] = []
    names = args.recipes.split(",")
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        try:
            pack = load_pack(packs[name]) if name in packs else None
            results[name] = bench_recipe(name, args, pack, deadline, len(names) - 1 - i, compile_cost)
        except Exception as err:
            traceback.print_exc()
            results[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    info["wall_s"] = round(time.perf_counter() - start, 1)
    data = {"meta": info, "settings": vars(args), "results": results}
    benchlib.write("bench_graphs", data, markdown(info, results, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
