"""The benchmark engine behind `forgepack bench`: eager, the pack and torch.compile, side by side.

Every column runs the same model on the same inputs in one process; rounds are interleaved (the
column order is shuffled each round, `forgepack.modeltiming`) and each round's time is the median of
`reps` forwards, so the speed-ups (paired per round) survive a noisy machine. A column is a name, a
way to switch it on and off, and the forward to time: more columns (e.g. CUDA graphs) are one more
entry in `COLUMNS`.

    >>> result = bench.run(recipe, ["eager", "pack"], rounds=7, reps=5, pack=Path("packs/....whl"))
"""

from __future__ import annotations

import contextlib
import importlib
import statistics
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forgepack import modeltiming
from forgepack.errors import ForgepackError, UsageError


@dataclass
class Column:
    """One way of running the model. `setup` returns the forward to time, or raises `Skip`."""

    name: str
    setup: Callable[[Any, Any], Callable[[], Any]]
    enter: Callable[[], None] = lambda: None
    exit: Callable[[], None] = lambda: None
    note: str = ""


class Skip(Exception):
    """A column that cannot run here (e.g. the pack does not apply to this GPU); the message says why."""


@dataclass
class BenchContext:
    lm: Any
    pack: Any = None
    compile_backend: str = "inductor"
    compile_mode: str | None = None
    extras: dict = field(default_factory=dict)


def _eager(ctx: BenchContext, col: Column) -> Callable[[], Any]:
    return ctx.lm.run


def _pack(ctx: BenchContext, col: Column) -> Callable[[], Any]:
    if ctx.pack is None:
        raise Skip("no --pack given")
    if not ctx.pack.activate():
        raise Skip("the pack does not apply here (see the warning above)")
    ctx.pack.deactivate()
    col.enter = lambda: ctx.pack.activate(strict=True)
    col.exit = ctx.pack.deactivate
    return ctx.lm.run


def _graphed(ctx: BenchContext, col: Column, with_pack: bool) -> Callable[[], Any]:
    """The forward replayed from CUDA graphs (one per input signature), with or without the pack.

    The graphed forward is built once and kept across rounds, so rounds time replays, not captures.
    """
    import torch

    if with_pack:
        verdict = ctx.pack.manifest().graphs
        if verdict.enabled is False:  # activate(graphs=True) would run eagerly: no number for it
            raise Skip(f"the pack's manifest turns graph mode off: {verdict.reason or 'no reason given'}")
    if ctx.lm.device.type != "cuda":
        raise Skip("CUDA graphs need a GPU")
    if with_pack:
        _pack(ctx, col)  # the pack's kernels are switched on around each round, and inside the graph
        graphs = importlib.import_module(f"{ctx.pack.__name__}.graphs")
    else:
        from forgepack.runtime import graphs
    lm = ctx.lm
    graphed = graphs.GraphedForward(graphs.eager_forward(lm.model))
    col.note = "CUDA graph replay" + (" with the pack's kernels" if with_pack else " of stock kernels")

    def run() -> Any:
        with torch.no_grad():
            result = graphed(**lm.inputs)
        lm.reset()
        return result

    ctx.extras.setdefault("graph_stats", {})[col.name] = graphed.stats
    return run


def _compiled(ctx: BenchContext, col: Column, mode: str | None = None) -> Callable[[], Any]:
    import torch

    lm = ctx.lm
    mode = mode or ctx.compile_mode
    compiled = torch.compile(lm.model, backend=ctx.compile_backend, mode=mode)
    col.note = f"torch.compile(backend={ctx.compile_backend!r}" + (f", mode={mode!r})" if mode else ")")

    def run() -> Any:
        with torch.no_grad():
            result = compiled(**lm.inputs)
        lm.reset()
        return result

    return run


# name -> how to set it up; the order is the table's
COLUMNS: dict[str, Callable[[BenchContext, Column], Callable[[], Any]]] = {
    "eager": _eager,
    "pack": _pack,
    "graphs": lambda ctx, col: _graphed(ctx, col, with_pack=False),
    "pack+graphs": lambda ctx, col: _graphed(ctx, col, with_pack=True),
    "compile": _compiled,
    "compile-ro": lambda ctx, col: _compiled(ctx, col, "reduce-overhead"),
}


def load_pack(wheel: Path, stack: contextlib.ExitStack):
    """Import a pack straight from its wheel (unpacked to a temporary directory), without installing it."""
    if not wheel.is_file():
        raise UsageError(f"pack {wheel} does not exist")
    if not zipfile.is_zipfile(wheel):
        raise ForgepackError(f"{wheel} is not a wheel")
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="forgepack-bench-")))
    with zipfile.ZipFile(wheel) as z:
        tops = {n.split("/")[0] for n in z.namelist() if n.endswith("/manifest.toml") and n.count("/") == 1}
        if len(tops) != 1:
            raise ForgepackError(f"{wheel} is not a forgepack kernel pack (no manifest.toml)")
        z.extractall(tmp)
    name = tops.pop()
    if name in sys.modules:
        raise ForgepackError(f"{name} is already imported in this process; run the benchmark in a fresh one")
    sys.path.insert(0, str(tmp))
    stack.callback(sys.path.remove, str(tmp))
    return importlib.import_module(name)


# Graph mode captures on its third call and reduce-overhead records on its second or third: rounds
# must time replays, not captures.
WARMUP_CALLS = 4


def ready_column(ctx: BenchContext, name: str) -> tuple[Column, Callable[[], Any]]:
    """The column set up and warmed (compilation, lazy initialisation, graph captures), so that what is
    timed next is steady state; raises Skip when the column cannot run here."""
    col = Column(name, COLUMNS[name])
    fn = col.setup(ctx, col)
    for _ in range(WARMUP_CALLS):
        _run_in(col, fn)
    return col, fn


def run_bench(ctx: BenchContext, names: list[str], rounds: int, reps: int, seed: int = 0) -> dict[str, Any]:
    """Per column: per-round medians, overall median, speed-up over eager (paired by round)."""
    cols, skipped = {}, {}
    for name in names:
        try:
            cols[name] = ready_column(ctx, name)
        except Skip as why:
            skipped[name] = str(why)
    forwards = {name: fn for name, (_col, fn) in cols.items()}
    times = modeltiming.interleaved_ms(forwards, rounds, reps, modeltiming.device_sync(ctx.lm.device), seed,
                                       lambda name: switched(cols[name][0]))
    result: dict[str, Any] = {"rounds": rounds, "reps": reps, "columns": {}}
    base = times.get("eager")
    for name in names:
        if name in skipped:
            result["columns"][name] = {"skipped": skipped[name]}
            continue
        entry: dict[str, Any] = {"ms": statistics.median(times[name]), "rounds_ms": times[name],
                                 "note": cols[name][0].note}
        if base:
            ratios = [b / t for b, t in zip(base, times[name], strict=True)]
            entry["speedup"] = statistics.median(ratios)
            entry["speedup_range"] = [min(ratios), max(ratios)]
        result["columns"][name] = entry
    if ctx.pack is not None and ("pack" in cols or "pack+graphs" in cols):
        hits = {vid: s["hits"] for vid, s in ctx.pack.stats().items()}
        result["pack_hits"] = hits
    for name, stats in ctx.extras.get("graph_stats", {}).items():
        result["columns"][name]["graphs"] = stats()
    if ctx.pack is not None:
        launches = decode_launches(ctx.lm, ctx.pack)
        if launches:
            result["decode_launches"] = launches
    return result


def decode_launches(lm, pack) -> dict[str, dict[str, int]]:
    """Per decode program (batch bucket and cache length) of a served generate() with every kernel of the
    pack, the step's launches stock and with the pack's decode blocks, from the decode loop's own count;
    empty for a pack without blocks (its step is stock's)."""
    from forgepack.pack import gate

    if not gate.block_ids(pack):
        return {}
    served = gate.Served(lm, pack)
    try:
        served.serve(set(pack.variant_ids()))
        served.run()
        programs = served.loop_stats().get("programs") or {}
    finally:
        served.stock()
    return {name: {k: p[k] for k in ("launches", "with_blocks", "blocks")} for name, p in programs.items()}


def _run_in(col: Column, fn: Callable[[], Any]) -> Any:
    with switched(col):
        return fn()


@contextlib.contextmanager
def switched(col: Column):
    """The column switched on (its pack activated) for the duration, off after."""
    col.enter()
    try:
        yield
    finally:
        col.exit()


def run(recipe, names: list[str], rounds: int, reps: int, pack: Path | None = None,
        compile_backend: str = "inductor", compile_mode: str | None = None) -> dict[str, Any]:
    """Load the recipe's model (and the pack, straight from its wheel), time the columns; the result
    is what `bench.json` holds (the report's "eager vs pack vs torch.compile" section)."""
    unknown = [n for n in names if n not in COLUMNS]
    if unknown or not names:
        raise UsageError(f"unknown column {unknown[0] if unknown else '(none)'}: choose from {', '.join(COLUMNS)}")
    if rounds < 1 or reps < 1:
        raise UsageError("--rounds and --reps must be at least 1")
    if any("pack" in n for n in names) and not pack:
        raise UsageError("the pack columns need --pack <wheel>")
    from forgepack import models

    with contextlib.ExitStack() as stack, models.quiet_transformers():
        module = load_pack(Path(pack), stack) if pack else None
        lm = models.load(recipe)
        result = run_bench(BenchContext(lm, module, compile_backend, compile_mode), names, rounds, reps)
    return {"recipe": recipe.name, "device": str(lm.device), "dtype": recipe.workload.dtype,
            "pack": str(pack) if pack else None, **result}
