"""Helpers shared by the commands: recipe resolution with CLI overrides, console, progress."""

from __future__ import annotations

import sys
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from forgepack import recipe as recipe_mod
from forgepack.recipe import Recipe
from forgepack.workspace import Workspace

# Progress goes to stderr so stdout stays clean for --json; tables keep their width when piped.
console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
out = Console(width=None if sys.stdout.isatty() else 160)


def resolve(spec: str | None, target: str | None = None, dtype: str | None = None, batch: int | str | None = None,
            seq_len: int | str | None = None, build: dict | None = None, phase: str | None = None) -> Recipe:
    """The recipe named on the command line, with the flags that override its fields applied (`batch`,
    `seq_len`: a size or a range such as "1-8", parsed by the recipe)."""
    recipe = recipe_mod.resolve(spec)
    workload = {"dtype": dtype, "batch": batch, "seq_len": seq_len, "phase": phase}
    sections = {"target": {"device": target}, "workload": workload, "build": build or {}}
    if any(v is not None for section in sections.values() for v in section.values()):
        recipe = recipe.replace(**sections)
    return recipe


def workspace_for(recipe: Recipe, override: str | None) -> Workspace:
    return Workspace.for_recipe(recipe, override)


@contextmanager
def progress(description: str, enabled: bool = True):
    """A rich progress bar; yields `note(text, done, total)` for the stage to report through."""
    if not enabled:
        yield lambda *_: None
        return
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[detail]}"))
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=None, detail="")

        def note(text: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, detail=text)

        yield note
