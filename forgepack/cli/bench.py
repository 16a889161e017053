"""`forgepack bench <model|recipe> --pack <wheel>`: eager, the pack and torch.compile, side by side.
`forgepack bench <model|recipe> --serve`: the serving benchmark, real `generate()` over a mixed trace.

The engines are `forgepack.bench` and `forgepack.servebench`; this module parses the flags, writes
`bench.json` (or `serve_bench.json`) and draws the table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from forgepack import bench, servebench
from forgepack.bench import COLUMNS
from forgepack.cli.common import console, out, progress, resolve, workspace_for
from forgepack.errors import UsageError

SERVE = "serving benchmark (--serve)"
DEFAULT_COLUMNS = "eager,pack,compile"


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_command)


def bench_command(
    model: Annotated[str | None, typer.Argument(help="recipe .toml, built-in name, model dir or hub id")] = None,
    pack: Annotated[str | None, typer.Option("--pack", help="the pack wheel (.whl) to time (--serve: or its "
                                                           "import name)")] = None,
    rounds: Annotated[int | None, typer.Option(help="interleaved rounds (default 7; --serve: 2)")] = None,
    reps: Annotated[int | None, typer.Option(help="forwards timed per column per round (median; default 5)")] = None,
    columns: Annotated[str | None, typer.Option(help=f"comma-separated, from: {', '.join(COLUMNS)} "
                                                     f"(default {DEFAULT_COLUMNS})")] = None,
    compile_backend: Annotated[str | None, typer.Option("--compile-backend",
                                                        help="torch.compile backend (default inductor)")] = None,
    compile_mode: Annotated[str | None, typer.Option("--compile-mode", help="torch.compile mode")] = None,
    target: Annotated[str | None, typer.Option(help="cpu or cuda (overrides the recipe)")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32, float16 or bfloat16")] = None,
    batch: Annotated[int | None, typer.Option(help="batch size")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="sequence length")] = None,
    serve: Annotated[bool, typer.Option("--serve", help="the serving benchmark: generate() over a mixed trace, "
                                                        "columns eager, pack, pack+graphs, static+compile, "
                                                        "reduce-overhead (CPU: eager, pack, graphs emulated)")] = False,
    requests: Annotated[int | None, typer.Option(help=f"{SERVE}: requests in the trace (default 16)")] = None,
    batches: Annotated[str | None, typer.Option(help=f"{SERVE}: batch sizes drawn from (default 1,2,4,8)")] = None,
    prompt: Annotated[str | None, typer.Option(help=f"{SERVE}: prompt lengths low,high, log-uniform "
                                                    "(default 16,2048)")] = None,
    new: Annotated[str | None, typer.Option(help=f"{SERVE}: new tokens low,high (default 64,256)")] = None,
    seed: Annotated[int | None, typer.Option(help=f"{SERVE}: the trace's seed (default 0)")] = None,
    agree: Annotated[int | None, typer.Option(help=f"{SERVE}: requests checked teacher-forced against eager "
                                                   "(default 2)")] = None,
    no_compile: Annotated[bool, typer.Option("--no-compile", help=f"{SERVE}: leave out the torch.compile "
                                                                  "columns")] = False,
    no_cold: Annotated[bool, typer.Option("--no-cold", help=f"{SERVE}: leave out the first request from a cold "
                                                            "process")] = False,
    peers: Annotated[bool, typer.Option("--peers", help=f"{SERVE}: the fair peers, each column in a fresh "
                                                        "process (eager, static-pinned, compiled-loop, graphs, "
                                                        "pack+graphs), >= 5 rounds advised")] = False,
    budget_s: Annotated[float | None, typer.Option("--budget-s", help=f"{SERVE}: compiled columns' turns are "
                                                                      "skipped after this many seconds "
                                                                      "(default 480)")] = None,
    workspace: Annotated[str | None, typer.Option(help="where bench.json goes (default .forgepack/<slug>)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for machines")] = False,
) -> None:
    """Time the model eagerly, with the pack, with CUDA graphs and under torch.compile, interleaved in one run;
    with --serve, time real generate() calls over a mixed trace of requests instead."""
    serve_flags = {"--requests": requests, "--batches": batches, "--prompt": prompt, "--new": new, "--seed": seed,
                   "--agree": agree, "--budget-s": budget_s, "--no-compile": no_compile or None,
                   "--no-cold": no_cold or None, "--peers": peers or None}
    bench_flags = {"--reps": reps, "--columns": columns, "--compile-backend": compile_backend,
                   "--compile-mode": compile_mode, "--batch": batch, "--seq-len": seq_len}
    wrong = [flag for flag, value in (bench_flags if serve else serve_flags).items() if value is not None]
    if wrong:
        raise UsageError(f"{wrong[0]} is {'not ' if serve else ''}for the serving benchmark "
                         f"({'leave it out with' if serve else 'add'} --serve)")
    if serve:
        given = {"requests": requests, "seed": seed, "rounds": rounds, "agree": agree, "budget_s": budget_s}
        settings = servebench.ServeSettings.parse(
            batches or "1,2,4,8", prompt or "16,2048", new or "64,256", no_compile=no_compile, cold=not no_cold,
            **{k: v for k, v in given.items() if v is not None})
        serve_command(resolve(model, target=target, dtype=dtype), settings, pack, workspace, as_json, peers)
        return
    names = [c.strip() for c in (columns or DEFAULT_COLUMNS).split(",") if c.strip()]
    recipe = resolve(model, target=target, dtype=dtype, batch=batch, seq_len=seq_len)
    result = bench.run(recipe, names, 7 if rounds is None else rounds, 5 if reps is None else reps,
                       Path(pack) if pack else None, compile_backend or "inductor", compile_mode)
    ws = workspace_for(recipe, workspace)
    ws.root.mkdir(parents=True, exist_ok=True)
    ws.write_json("bench.json", result)  # the report's "eager vs pack vs torch.compile" section
    if as_json:
        out.print_json(json.dumps(result))
        return
    out.print(table(result))


def serve_command(recipe, settings: servebench.ServeSettings, pack: str | None, workspace: str | None,
                  as_json: bool, peers: bool = False) -> None:
    """The serving benchmark on one recipe: `serve_bench.json` in the workspace, a table or JSON.
    `peers`: every column in a fresh process of its own (servebench.bench_peers)."""
    from forgepack import models

    with contextlib.ExitStack() as stack, models.quiet_transformers(), progress("serving benchmark") as note:
        if peers:
            result = servebench.bench_peers(recipe, settings, pack, note)
        else:
            module = servebench.load_pack(pack, stack)
            result = servebench.bench_model(recipe, settings, module, note, pack_spec=pack)
    doc = {"recipe": recipe.name, "device": str(models.target_device(recipe)), "dtype": recipe.workload.dtype,
           "pack": pack, "settings": dataclasses.asdict(settings), **result}
    ws = workspace_for(recipe, workspace)
    ws.root.mkdir(parents=True, exist_ok=True)
    ws.write_json("serve_bench.json", doc)
    if as_json:
        out.print_json(json.dumps(doc, default=str))
        return
    out.print(serve_table(doc, settings))


def serve_table(doc: dict[str, Any], settings: servebench.ServeSettings) -> Table:
    t = Table(title=f"{doc['recipe']} on {doc['device']} ({doc['dtype']}): {servebench.describe_trace(settings)}")
    for name in servebench.PEER_HEADERS if doc.get("peers") else servebench.HEADERS:
        t.add_column(name, justify="left" if name in ("column", "note") else "right")
    for row in servebench.rows_of(doc):
        t.add_row(*("" if v is None or v is False else str(v) for v in row))
    if doc.get("peers"):
        t.caption = servebench.coverage_line(doc)
    if not doc["device"].startswith("cuda"):
        console.print(servebench.NO_CUDA)
    if settings.cold and not doc.get("peers"):
        console.print(servebench.COLD)
    return t


def table(result: dict[str, Any]) -> Table:
    t = Table(title=f"{result['recipe']} on {result['device']} ({result['dtype']}): median of {result['rounds']} "
                    f"interleaved rounds x {result['reps']} forwards")
    for name, justify in (("", "left"), ("ms", "right"), ("vs eager", "right"), ("range", "right"),
                          ("note", "left")):
        t.add_column(name, justify=justify)
    for name, c in result["columns"].items():
        if "skipped" in c:
            t.add_row(name, "-", "-", "-", f"skipped: {c['skipped']}")
            continue
        speed = f"{c['speedup']:.3f}x" if "speedup" in c else ""
        span = f"{c['speedup_range'][0]:.2f}-{c['speedup_range'][1]:.2f}" if "speedup_range" in c else ""
        t.add_row(name, f"{c['ms']:.3f}", speed, span, c.get("note", ""))
    if "pack_hits" in result:
        used = sum(1 for h in result["pack_hits"].values() if h)
        console.print(f"pack kernels used: {used} of {len(result['pack_hits'])}")
    for name, p in result.get("decode_launches", {}).items():
        console.print(f"{name}: a served decode step launches {p['launches']} kernels stock, {p['with_blocks']} "
                      f"with the pack ({p['blocks']} blocks)")
    return t
