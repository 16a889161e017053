"""`forgepack bench <model|recipe> --pack <wheel>`: eager, the pack and torch.compile, side by side.

The engine is `forgepack.bench`; this module parses the flags, writes `bench.json` and draws the table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from forgepack import bench
from forgepack.bench import COLUMNS
from forgepack.cli.common import console, out, resolve, workspace_for


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_command)


def bench_command(
    model: Annotated[str | None, typer.Argument(help="recipe .toml, built-in name, model dir or hub id")] = None,
    pack: Annotated[str | None, typer.Option("--pack", help="the pack wheel (.whl) to time")] = None,
    rounds: Annotated[int, typer.Option(help="interleaved rounds")] = 7,
    reps: Annotated[int, typer.Option(help="forwards timed per column per round (median)")] = 5,
    columns: Annotated[str, typer.Option(help=f"comma-separated, from: {', '.join(COLUMNS)}")] = "eager,pack,compile",
    compile_backend: Annotated[str, typer.Option("--compile-backend", help="torch.compile backend")] = "inductor",
    compile_mode: Annotated[str | None, typer.Option("--compile-mode", help="torch.compile mode")] = None,
    target: Annotated[str | None, typer.Option(help="cpu or cuda (overrides the recipe)")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32, float16 or bfloat16")] = None,
    batch: Annotated[int | None, typer.Option(help="batch size")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="sequence length")] = None,
    workspace: Annotated[str | None, typer.Option(help="where bench.json goes (default .forgepack/<slug>)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for machines")] = False,
) -> None:
    """Time the model eagerly, with the pack, with CUDA graphs and under torch.compile, interleaved in one run."""
    names = [c.strip() for c in columns.split(",") if c.strip()]
    recipe = resolve(model, target=target, dtype=dtype, batch=batch, seq_len=seq_len)
    result = bench.run(recipe, names, rounds, reps, Path(pack) if pack else None, compile_backend, compile_mode)
    ws = workspace_for(recipe, workspace)
    ws.root.mkdir(parents=True, exist_ok=True)
    ws.write_json("bench.json", result)  # the report's "eager vs pack vs torch.compile" section
    if as_json:
        out.print_json(json.dumps(result))
        return
    out.print(table(result))


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
    return t
