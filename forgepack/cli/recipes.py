"""`forgepack recipes`: the built-in recipes, one row each (name, model, task, phase, shapes)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from forgepack import recipe as recipe_mod
from forgepack.cli.common import out
from forgepack.recipe import Recipe


def register(app: typer.Typer) -> None:
    app.command("recipes")(recipes_command)


def recipes_command(
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for machines")] = False,
) -> None:
    """List the built-in recipes: `forgepack profile NAME` or `forgepack build NAME` takes any of them."""
    recipes = [recipe_mod.load(recipe_mod.BUILTIN_DIR / f"{name}.toml") for name in recipe_mod.builtin_names()]
    rows = [row(r) for r in recipes]
    if as_json:
        out.print_json(json.dumps(rows))
        return
    table = Table(title="built-in recipes", caption="your own model: forgepack build <hub id | model dir> "
                                                    "--task ... --batch ... --seq-len ..., or a recipe .toml "
                                                    "(see README.md)")
    for name in ("name", "model", "task", "phase", "shapes", "dtype", "target", "budget"):
        table.add_column(name, justify="right" if name == "budget" else "left")
    for r in rows:
        table.add_row(*(str(r[k]) for k in ("name", "model", "task", "phase", "shapes", "dtype", "target",
                                            "budget")))
    out.print(table)


def row(r: Recipe) -> dict[str, str | int]:
    phase = r.workload.phase if r.workload.task == "causal-lm" else "-"
    return {"name": r.name, "model": model_text(r), "task": r.workload.task, "phase": phase,
            "shapes": shapes(r), "dtype": r.workload.dtype, "target": r.target.device, "budget": r.build.budget}


def model_text(r: Recipe) -> str:
    m = r.model
    if m.hub:
        return m.hub + (f"@{m.revision}" if m.revision else "")
    if m.path:
        return m.path
    return f"{m.arch or m.config.get('model_type', '?')}, random weights"


def shapes(r: Recipe) -> str:
    w = r.workload
    if w.task == "image-classification":
        return f"batch {w.batch} x {w.image_size}x{w.image_size}" + (", channels-last" if w.memory_format ==
                                                                     "channels_last" else "")
    text = f"batch {w.batch} x {w.seq_len} tokens"
    if w.phase == "decode":
        text += f", cache {w.cache_len}" + (" (static)" if w.static_cache else "")
    return text
