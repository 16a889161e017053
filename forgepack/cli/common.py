"""Helpers shared by the commands: recipe resolution with CLI overrides, console, progress."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from forgepack import recipe as recipe_mod
from forgepack.recipe import Recipe
from forgepack.workspace import Workspace

# Progress goes to stderr so stdout stays clean for --json; tables keep their width when piped.
console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
out = Console(width=None if sys.stdout.isatty() else 160)


def resolve(spec: str | None, target: str | None = None, dtype: str | None = None, batch: int | str | None = None,
            seq_len: int | str | None = None, build: dict | None = None, task: str | None = None,
            phase: str | None = None) -> Recipe:
    """The recipe named on the command line, with the flags that override its fields applied (`batch`,
    `seq_len`: a size or a range such as "1-8", parsed by the recipe)."""
    recipe = recipe_mod.resolve(spec)
    workload = {"task": task, "dtype": dtype, "batch": batch, "seq_len": seq_len, "phase": phase}
    sections = {"target": {"device": target}, "workload": workload, "build": build or {}}
    if any(v is not None for section in sections.values() for v in section.values()):
        recipe = recipe.replace(**sections)
    return recipe


def workspace_for(recipe: Recipe, override: str | None) -> Workspace:
    return Workspace.for_recipe(recipe, override)


def _log(text: str) -> None:
    """A plain timestamped line, for logs that are not a terminal (no bar is drawn there)."""
    console.print(f"{time.strftime('%H:%M:%S')} {text}", markup=False, highlight=False)


@contextmanager
def progress(description: str, enabled: bool = True):
    """A rich progress bar; yields `note(text, done, total)` for the stage to report through.

    Where stderr is not a terminal, the bar is replaced by a line as each step starts (a step is the
    note's first word: "loading", "timing", ...) and at each quarter of a long step."""
    if not enabled:
        yield lambda *_: None
        return
    if not console.is_terminal:
        seen: dict[str, int] = {}

        def log(text: str, done: int, total: int) -> None:
            step = text.split(" ", 1)[0]
            quarter = 4 * done // total if total else 0
            if seen.get(step, -1) < quarter:
                seen[step] = quarter
                where = f" ({done}/{total})" if total > 1 else ""
                _log(f"{description}: {text}{where}")

        started = time.monotonic()
        yield log
        _log(f"{description}: done in {time.monotonic() - started:.1f} s")
        return
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[detail]}"))
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=None, detail="")

        def note(text: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, detail=text)

        yield note


@contextmanager
def steps(description: str, live: bool = True):
    """Steps of a stage that report no fraction done (compiling the shim, the gate's subprocess):
    yields `note(text)`, called as each step starts. On a terminal a spinner with the step's elapsed
    time runs until the next; elsewhere, and for every step once it ends, one line with its duration."""
    current: dict[str, float | str] = {}
    bar = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), TimeElapsedColumn(), console=console,
                   transient=True) if live and console.is_terminal else None
    task = None

    def finish() -> None:
        if current:
            took = time.monotonic() - float(current["at"])
            _log(f"{description}: {current['text']}: done in {took:.1f} s")

    def note(text: str) -> None:
        nonlocal task
        finish()
        current.update(text=text, at=time.monotonic())
        if bar is None:
            _log(f"{description}: {text}")
            return
        if task is not None:
            bar.remove_task(task)
        task = bar.add_task(text)

    if bar is None:
        yield note
        finish()
        return
    with bar:
        yield note
    finish()
