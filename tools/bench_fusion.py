"""Module-level fusion end to end: fused kernels vs eager vs torch.compile, side by side (issue 7's table).

For each recipe (the six reference recipes by default), in one run:
1. Build: capture the model with its dataflow and free functions, find the fusion cards
   (`forgepack.fusion`), render the preferred fused template that serves each card (default
   parameters; the next one where it fails; all of them with `--all-templates`), compile in parallel,
   verify each through the real evaluator (`Evaluator("cuda")`, worker subprocess, captured and fresh
   inputs, bench=False), time the verified ones against the chain they replace, keep the fastest;
   then stage all kept kernels of all recipes as one package directory (`forgepack.pack.fusedgen.stage`:
   one compiled `fused` op) and load it with the pack runtime (`runtime/modules.PackModules`),
   exactly as a pack does.
2. Measure, rounds interleaved (rotating order), every call timed alone with device events, the GPU
   idle before it (launch overhead counts, as it does for a caller):
   - `eager`: the forward as it is;
   - `fused`: the module patches active (eager dispatch);
   - `graphs`: forgepack graph mode (`runtime/graphs.GraphedForward`), no patches;
   - `fused+graphs`: graph mode with the patches active: the activated pack;
   - `pack` / `pack+graphs` as well when `--pack RECIPE=WHEEL` gives an operator-level pack (activated
     together with the fused patches);
   - `compile`: `torch.compile(model)` (default mode), skipped when the time budget would be exceeded.
   Reported: median ms, speed-up over eager, geomean over recipes, the largest relative difference from
   eager's output, hits per forward, and the per-card kernel table.

    python tools/bench_fusion.py                         # six reference recipes, ~4 min on an H200
    python tools/bench_fusion.py --recipes llama-1b-prefill,gpt2 --rounds 7
    python tools/bench_fusion.py --recipes tiny-llama --device cpu --no-compile   # smoke test anywhere

Results: `${OUT:-benchmarks/out}/results/bench_fusion.{json,md}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib
from bench_graphs import load_pack, relative_diff, rewinder, run_rounds, timed_call

from forgepack import fusion, models, opcall, recipe, samples, timing
from forgepack.capture import capture
from forgepack.compile import compile_kernel
from forgepack.evaluate import Evaluator
from forgepack.pack import fusedgen
from forgepack.runtime import graphs
from forgepack.runtime import modules as rt
from forgepack.templates import fused
from forgepack.verify import KernelCall, load_kernel

RECIPES = ["llama-1b-prefill", "llama-1b-decode", "qwen2-0.5b-prefill", "gpt2", "vit-base", "resnet-50"]
NAMESPACE = "forgepack_bench_fusion"
COMPILE_GUESS_S = 50.0
RESERVE_S = 15.0  # per recipe still to measure


@dataclasses.dataclass
class Built:
    """One recipe's model and what the build found for it."""

    name: str
    lm: models.LoadedModel
    cards: list = dataclasses.field(default_factory=list)
    samples: dict = dataclasses.field(default_factory=dict)
    dropped: dict = dataclasses.field(default_factory=dict)
    kernels: list = dataclasses.field(default_factory=list)  # rows for the kernel table
    chosen: list = dataclasses.field(default_factory=list)  # (card, binary, source path, needs: None, the default)


# --- build -----------------------------------------------------------------------------------------------


def load(name: str, device: str | None) -> models.LoadedModel:
    r = recipe.resolve(name)
    if device:
        r = dataclasses.replace(r, target=dataclasses.replace(r.target, device=device))
    with models.quiet_transformers():
        return models.load(r)


def find_cards(b: Built) -> None:
    lm = b.lm
    with models.quiet_transformers():
        cap = capture(lm.model, lm.forward, keep_samples=False, functions=fusion.function_sites(lm.model))
        lm.reset()
        candidates, _ = fusion.find(cap)

        def run():
            out = lm.forward()
            lm.reset()
            return out

        checked = fusion.check_and_sample(lm.model, run, fusion.group(cap, candidates))
    b.cards, b.samples, b.dropped = checked.cards, checked.samples, checked.dropped


# Which template to try first for a card several serve: the vectorised ones before index math.
PREFERENCE = ("fused.rows", "fused.pointwise", "fused.indexed")


def build_kernels(built: list[Built], target: str, folder: Path, workers: int, every: bool, note) -> None:
    """Render, compile (in parallel), verify (the real evaluator), time and pick one kernel per card.
    Templates are tried in `PREFERENCE` order, the next only for cards whose last one failed (all of
    them with `every`)."""
    cards = []
    for b in built:
        for card in b.cards:
            path = folder / f"{card.id}.safetensors"
            card = dataclasses.replace(card, samples=samples.save_samples(path, b.samples[card.id]))
            served = sorted((t for t in fused.TEMPLATES if t.supports(card, target) is None),
                            key=lambda t: PREFERENCE.index(t.name) if t.name in PREFERENCE else len(PREFERENCE))
            cards.append((b, card, path, served))
    verified: dict[str, list] = {}
    with Evaluator(target, timeout_s=120) as ev:  # its worker starts now, while the kernels compile
        for rank in range(len(PREFERENCE)):
            jobs = [(b, card, path, served[rank], served[rank].render(card, target, served[rank].default(card, target)))
                    for b, card, path, served in cards if rank < len(served) and (every or card.id not in verified)]
            if not jobs:
                break
            note(f"compiling {len(jobs)} fused kernels (template choice {rank + 1})")
            with ThreadPoolExecutor(workers) as pool:
                compiled = list(pool.map(lambda j: compile_kernel(j[4], target), jobs))
            note("verifying")
            for (b, card, path, t, source), result in zip(jobs, compiled, strict=True):
                v = ev.evaluate_compiled(card, result, source, samples_path=path, bench=False)
                row = {"recipe": b.name, "card": card.id, "pattern": card.fusion.pattern, "calls": card.calls,
                       "launches": card.fusion.launches, "template": t.name,
                       "verdict": v.category or "verified", "reason": "" if v.accepted else v.reason[:160]}
                b.kernels.append(row)
                if v.accepted:
                    src = folder / f"{card.id}.{t.name}{'.cu' if target == 'cuda' else '.cpp'}"
                    src.write_text(source)
                    verified.setdefault(card.id, []).append((b, card, path, Path(result.binary), src, row))
    note("timing verified kernels against their chains")
    for options in verified.values():
        b, card = options[0][0], options[0][1]
        device = b.lm.device
        sets = samples.load_samples(card, options[0][2], device)
        inputs = sets[0][0] if sets else samples.fresh_inputs(card, 0, device)
        chain = opcall.stock_call(card, inputs, device)
        chain_us = timing.median(timing.time_us(chain, device, reps=20))
        best = None
        for _, _, _, binary, src, row in options:
            outs = [torch.empty_strided(m.shape, m.stride, dtype=getattr(torch, m.dtype), device=device)
                    for m in card.outputs]
            stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
            call = KernelCall(load_kernel(binary), inputs, outs, [], stream)
            us = timing.median(timing.time_us(call, device, reps=20))
            row.update(chain_us=round(chain_us, 2), kernel_us=round(us, 2), speedup=round(chain_us / us, 3))
            if best is None or us < best[0]:
                best = (us, binary, src, row)
        best[3]["chosen"] = True
        b.chosen.append((card, best[1], best[2], None))


def stage_all(built: list[Built], target: str, folder: Path) -> rt.PackModules | None:
    items = [item for b in built for item in sorted(b.chosen, key=lambda c: -c[0].calls)]
    if not items:
        return None
    pkg = folder / "pkg"
    fusedgen.stage(pkg, items, NAMESPACE, target, title="bench_fusion")
    pm = rt.PackModules.read(pkg)
    pm.root = pkg
    return pm


# --- measure ---------------------------------------------------------------------------------------------


class Column:
    def __init__(self, name: str, call, enter=None, leave=None, graphed=None):
        self.name, self.call, self.graphed = name, call, graphed
        self.enter, self.leave = enter or (lambda: None), leave or (lambda: None)
        self.times: list[float] = []
        self.compile_s: float | None = None
        self.diff: float | None = None
        self.hits: int | None = None
        self.note = ""


def columns(b: Built, pm: rt.PackModules | None, pack: Any, with_compile: bool) -> list[Column]:
    lm = b.lm
    model, inputs = lm.model, lm.inputs
    device = lm.device
    state = {"fused": False}

    def on():
        if pack is not None and not pack.activate():
            raise RuntimeError("the operator pack did not activate here")
        if pm is not None:
            pm.activate(pm.root, [device.index or 0] if device.type == "cuda" else [])
        state["fused"] = True

    def off():
        if pm is not None:
            pm.deactivate()
        if pack is not None:
            pack.deactivate()
        state["fused"] = False

    label = "pack" if pack is not None else "fused"
    cols = [Column("eager", lambda: model(**inputs))]
    if pm is not None or pack is not None:
        cols.append(Column(label, lambda: model(**inputs), on, off))
    if device.type == "cuda":
        plain = graphs.GraphedForward(model, context_key=lambda: state["fused"])
        cols.append(Column("graphs", lambda: plain(**inputs), graphed=plain))
        if pm is not None or pack is not None:
            gf = graphs.GraphedForward(model, context_key=lambda: state["fused"])
            cols.append(Column(f"{label}+graphs", lambda: gf(**inputs), on, off, graphed=gf))
    if with_compile:
        compiled = torch.compile(model)
        cols.append(Column("compile", lambda: compiled(**inputs)))
    return cols


def hits_per_forward(pm: rt.PackModules | None, col: Column, lm, rewind) -> int | None:
    if pm is None or col.name not in ("fused", "pack"):
        return None
    col.enter()
    try:
        before = sum(v["hits"] for v in pm.stats().values())
        timed_call(col, lm, rewind)
        return sum(v["hits"] for v in pm.stats().values()) - before
    finally:
        col.leave()


def measure(b: Built, pm, pack, args, deadline: float, left: int, compile_cost: list[float]) -> dict:
    lm = b.lm
    rewind = rewinder(lm)
    guess = statistics.median(compile_cost) if compile_cost else COMPILE_GUESS_S
    forced = b.name in args.compile_always.split(",")
    with_compile = not args.no_compile and (forced or deadline - time.perf_counter() - RESERVE_S * left > guess)
    with torch.no_grad():
        ref = lm.output_tensor(lm.forward()).float().clone()
        rewind()
        cols = columns(b, pm, pack, with_compile)
        for col in cols:
            col.enter()
            try:
                t0 = time.perf_counter()
                out = None
                for _ in range(args.warmup):
                    _, out = timed_call(col, lm, rewind)
                if col.name == "compile":
                    col.compile_s = time.perf_counter() - t0
                    compile_cost.append(col.compile_s)
                col.diff = relative_diff(lm, out, ref)
            except Exception as err:  # one broken column must not sink the run
                col.note = f"failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:120]}"
                traceback.print_exc()
            finally:
                col.leave()
            col.hits = hits_per_forward(pm, col, lm, rewind) if not col.note else None
        live = [c for c in cols if not c.note]
        run_rounds(live, lm, rewind, args.rounds, args.iters)
    if not with_compile and not args.no_compile:
        cols.append(Column("compile", None))
        cols[-1].note = "skipped: time budget"
    return summarise(cols)


def summarise(cols: list[Column]) -> dict:
    medians = {c.name: statistics.median(c.times) for c in cols if c.times}
    eager, comp = medians.get("eager"), medians.get("compile")
    out: dict[str, Any] = {}
    for c in cols:
        e: dict[str, Any] = {"note": c.note, "compile_s": c.compile_s, "max_rel_diff_vs_eager": c.diff,
                             "fused_hits_per_forward": c.hits}
        if c.times:
            qs = statistics.quantiles(c.times, n=10) if len(c.times) > 1 else [c.times[0]] * 9
            med = medians[c.name]
            e.update(median_ms=med, p10_ms=qs[0], p90_ms=qs[-1], n=len(c.times),
                     speedup_vs_eager=eager / med if eager else None, time_vs_compile=med / comp if comp else None)
        if c.graphed is not None:
            stats = c.graphed.stats()
            e["graph_stats"] = {k: v for k, v in stats.items() if k != "failures"}
            e["graph_failures"] = stats.get("failures")
        out[c.name] = e
    return out


def geomeans(results: dict) -> dict[str, float]:
    by_col: dict[str, list[float]] = {}
    for res in results.values():
        for name, e in res.get("columns", {}).items():
            if e.get("speedup_vs_eager"):
                by_col.setdefault(name, []).append(e["speedup_vs_eager"])
    return {k: math.exp(statistics.fmean(math.log(x) for x in v)) for k, v in by_col.items() if v}


def markdown(info: dict, results: dict, kernels: list[dict], args) -> str:
    text = benchlib.header_md("Module-level fusion vs eager and torch.compile", info)
    text += (f"Median of {args.rounds} interleaved rounds x {args.iters} calls per column, each call timed alone "
             "(device events, GPU idle before: launch overhead counts). `fused`: fused kernels behind guarded "
             "module patches; `+graphs`: forgepack graph mode; speed-up = eager median / column median; "
             "`vs compile` = column median / torch.compile median (at most 1.00: at least as fast).\n\n")
    rows = []
    for name, res in results.items():
        if "error" in res:
            rows.append([name, "error", "", "", "", "", "", "", res["error"][:80]])
            continue
        for col, e in res["columns"].items():
            if "median_ms" not in e:
                rows.append([name, col, "", "", "", "", "", "", e["note"]])
                continue
            note = e["note"]
            if e.get("compile_s") is not None:
                note = f"warm-up incl. compile {e['compile_s']:.0f} s " + note
            if e.get("graph_stats"):
                s = e["graph_stats"]
                note = f"replays {s.get('replays')}, fallbacks {s.get('fallbacks')} " + note
            vs = f"{e['time_vs_compile']:.2f}" if e.get("time_vs_compile") else ""
            diff = e.get("max_rel_diff_vs_eager")
            hits = e.get("fused_hits_per_forward")
            rows.append([name, col, f"{e['median_ms']:.3f}", f"{e['p10_ms']:.3f}-{e['p90_ms']:.3f}",
                         f"{e['speedup_vs_eager']:.2f}x", vs, f"{diff:.1e}" if diff is not None else "",
                         "" if hits is None else hits, note])
    text += tabulate(rows, ["recipe", "column", "median ms", "p10-p90 ms", "speed-up", "vs compile", "rel diff",
                            "fused hits", "notes"], tablefmt="github")
    g = geomeans(results)
    text += "\n\nGeomean speed-up over eager: " + ", ".join(f"{k} {v:.2f}x" for k, v in g.items()) + "\n"
    krows = [[k["recipe"], k["pattern"], k["calls"], k["launches"], k["template"], k["verdict"],
              k.get("chain_us", ""), k.get("kernel_us", ""), k.get("speedup", ""), "yes" if k.get("chosen") else "",
              k["reason"]] for k in kernels]
    text += "\n## Fused kernels\n\n" + tabulate(
        krows, ["recipe", "pattern", "calls", "launches", "template", "verdict", "chain us", "kernel us", "speed-up",
                "chosen", "why not"], tablefmt="github") + "\n"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--device", default=None, help="override the recipes' target (e.g. cpu for a smoke test)")
    parser.add_argument("--pack", action="append", default=[], metavar="RECIPE=WHEEL_OR_MODULE",
                        help="an operator-level pack to activate together with the fused patches")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=4, help="calls per column before timing (>= 3 for graphs)")
    parser.add_argument("--budget-s", type=float, default=230.0, help="wall-clock budget; compile columns yield")
    parser.add_argument("--workers", type=int, default=16, help="parallel kernel compiles")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--all-templates", action="store_true", help="try every template per card, keep the fastest")
    parser.add_argument("--compile-always", default="llama-1b-prefill,llama-1b-decode",
                        help="recipes whose torch.compile column runs whatever the budget (the issue's target)")
    args = parser.parse_args()
    start = time.perf_counter()
    deadline = start + args.budget_s
    info = benchlib.meta()
    import transformers

    info["transformers"] = transformers.__version__

    def note(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {text}", flush=True)

    names = args.recipes.split(",")
    results: dict[str, Any] = {}
    built: list[Built] = []
    for name in names:
        try:
            b = Built(name, load(name, args.device))
            find_cards(b)
            built.append(b)
            note(f"{name}: {len(b.cards)} fusion cards ({sum(c.calls for c in b.cards)} calls), "
                 f"{len(b.dropped)} dropped")
        except Exception as err:
            traceback.print_exc()
            results[name] = {"error": f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"}
    target = "cuda" if any(b.lm.device.type == "cuda" for b in built) else "cpu"
    folder = Path(tempfile.mkdtemp(prefix="bench-fusion-"))
    pm = None
    try:
        build_kernels(built, target, folder, args.workers, args.all_templates, note)
        note("staging the fused op")
        pm = stage_all(built, target, folder)
    except Exception:
        traceback.print_exc()
    info["build_s"] = round(time.perf_counter() - start, 1)
    packs = dict(spec.split("=", 1) for spec in args.pack)
    compile_cost: list[float] = []
    for i, b in enumerate(built):
        try:
            pack = load_pack(packs[b.name]) if b.name in packs else None
            results[b.name] = {"cards": len(b.cards), "kept": len(b.chosen),
                               "columns": measure(b, pm, pack, args, deadline, len(built) - 1 - i, compile_cost)}
        except Exception as err:
            traceback.print_exc()
            results[b.name] = {"error": f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"}
        note(f"{b.name}: measured")
        b.lm = None
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    info["wall_s"] = round(time.perf_counter() - start, 1)
    kernels = [k for b in built for k in b.kernels]
    data = {"meta": info, "settings": vars(args), "results": results, "geomean_vs_eager": geomeans(results),
            "kernels": kernels, "site_stats": pm.site_stats() if pm is not None else {}}
    benchlib.write("bench_fusion", data, markdown(info, results, kernels, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
