"""`forgepack profile`: what a model spends its time on, on this device."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from forgepack import pipeline
from forgepack import profile as profile_mod
from forgepack.cli.common import console, out, progress, resolve, workspace_for
from forgepack.recipe import TASKS


def register(app: typer.Typer) -> None:
    app.command("profile")(profile_command)


def profile_command(
    model: Annotated[
        str | None, typer.Argument(help="recipe .toml, built-in recipe name, local model dir or hub id")
    ] = None,
    target: Annotated[str | None, typer.Option(help="cpu or cuda (overrides the recipe)")] = None,
    task: Annotated[str | None, typer.Option(help=f"{', '.join(TASKS)} (overrides the recipe)")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32, float16 or bfloat16 (overrides the recipe)")] = None,
    batch: Annotated[str | None, typer.Option(help="batch size, or a range such as 1-8")] = None,
    seq_len: Annotated[str | None, typer.Option("--seq-len", help="sequence length, or a range: 16-2048")] = None,
    phase: Annotated[str | None, typer.Option(help="prefill, decode or generate (prefill + decode steps)")] = None,
    workspace: Annotated[str | None, typer.Option(help="workspace directory (default .forgepack/<slug>)")] = None,
    top: Annotated[int, typer.Option(help="rows to show (0 = all)")] = 25,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for machines")] = False,
) -> None:
    """Capture every aten call the model makes, time each variant, and show where the time goes."""
    recipe = resolve(model, target=target, task=task, dtype=dtype, batch=batch, seq_len=seq_len, phase=phase)
    ws = workspace_for(recipe, workspace)
    with progress(f"profiling {recipe.name}", enabled=not as_json) as note:
        profiled = pipeline.profile(recipe, ws, note, reuse=False)
    result, cards = profiled.profile, list(profiled.cards)
    if as_json:
        doc = {**result.to_json(), "workspace": str(ws.root),
               "cards": [{"id": c.id, "op": c.op, "kind": c.kind, "signature": c.signature(), "calls": c.calls,
                          **c.profile.__dict__} for c in cards]}
        out.print_json(json.dumps(doc, default=list))
        return
    show(result, cards, top)
    console.print(f"workspace: {ws.root}")


def show(result: profile_mod.ModelProfile, cards, top: int) -> None:
    """The operator table (shares add up to 100%), then the fusion chains apart: a chain's share
    overlaps the operator calls it replaces."""
    ops, chains = profile_mod.operators_and_chains(cards)
    out.print(resolved_line(result))
    out.print(operator_table(result, ops, top))
    if chains:
        out.print(chain_table(chains, top))
    busy = "n/a (cpu)" if result.gpu_busy is None else f"{result.gpu_busy:.0%}"
    out.print(f"end to end: {result.e2e_ms:.2f} ms   aten calls: {result.aten_calls}   variants: {result.variants}   "
              f"summed op time: {result.op_time_ms:.2f} ms   GPU busy: {busy}")
    out.print(f"diagnosis: {result.diagnosis}")


def resolved_line(result: profile_mod.ModelProfile) -> str:
    """What the model argument resolved to: a directory or hub id's task and class are guesses to check."""
    return (f"resolved: task {result.task}   class {result.model_class}   dtype {result.dtype}   "
            f"device {result.device}   shapes {result.shapes}")


def operator_table(result: profile_mod.ModelProfile, ops, top: int) -> Table:
    table = Table(title=f"{result.recipe}: {result.device}", show_lines=False)
    for name, justify in (("op", "left"), ("signature", "left"), ("calls", "right"), ("µs/call", "right"),
                          ("share %", "right"), ("roofline µs", "right"), ("headroom", "right"), ("class", "left")):
        table.add_column(name, justify=justify, overflow="fold" if name == "signature" else "ellipsis")
    ranked = ops[: top or len(ops)]
    for c in ranked:
        p = c.profile
        sig = _short(c.signature(), 60 if c.family is None else 160)  # a family's ranges come last: keep them
        table.add_row(c.op_name, sig, str(c.calls), f"{p.eager_us:.1f}", f"{100 * p.share:.1f}",
                      f"{p.roofline_us:.2f}", profile_mod.headroom_text(c), p.baseline)
    if len(ops) > len(ranked):
        rest = sum(c.profile.share for c in ops[len(ranked):])
        table.add_row(f"… {len(ops) - len(ranked)} more", "", "", "", f"{100 * rest:.1f}", "", "", "")
    return table


def chain_table(chains, top: int) -> Table:
    table = Table(title="fusion chains: one kernel for a module's chain of the operator calls above",
                  caption="a chain's share is of the same operator time, spent in the calls it replaces: "
                          "it overlaps the table above and is not added to it")
    for name, justify in (("chain", "left"), ("module", "left"), ("calls", "right"), ("replaces", "left"),
                          ("µs/call", "right"), ("share %", "right"), ("headroom", "right")):
        table.add_column(name, justify=justify, overflow="fold" if name == "replaces" else "ellipsis")
    for c in chains[: top or len(chains)]:
        p = c.profile
        replaced = " ".join(e.op.removeprefix("aten.").removesuffix(".default") for e in c.chain)
        module = (c.fusion.module_class if c.fusion else "").rsplit(":", 1)[-1]
        table.add_row(c.op_name.removeprefix("fusion."), module, str(c.calls), _short(replaced), f"{p.eager_us:.1f}",
                      f"{100 * p.share:.1f}", profile_mod.headroom_text(c))
    return table


def _short(signature: str, width: int = 60) -> str:
    return signature if len(signature) <= width else signature[: width - 1] + "…"
