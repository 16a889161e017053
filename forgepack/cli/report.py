"""`forgepack report [WORKSPACE] [--out report.html] [--open]`: the build as one self-contained HTML page."""

from __future__ import annotations

import webbrowser
from pathlib import Path
from typing import Annotated

import typer

from forgepack.cli.common import console, out, resolve, workspace_for
from forgepack.errors import UsageError


def register(app: typer.Typer) -> None:
    app.command("report")(report_command)


def report_command(
    workspace: Annotated[
        str | None,
        typer.Argument(metavar="[WORKSPACE]",
                       help="workspace directory, or a recipe (.toml or built-in name) whose default workspace to use"),
    ] = None,
    out_path: Annotated[
        str | None, typer.Option("--out", help="HTML file to write (default WORKSPACE/report.html)")
    ] = None,
    open_it: Annotated[bool, typer.Option("--open", help="open the report in a web browser")] = False,
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="draw plots (needs matplotlib)")] = True,
) -> None:
    """Write an HTML report of a build: profile, budget, results, search trees and the pack; works mid-build."""
    from forgepack import report

    root = workspace_root(workspace)
    path = report.write_report(root, out_path, plots=plots)
    out.print(str(path))
    if open_it and not webbrowser.open(path.resolve().as_uri()):
        console.print("no web browser found to open it with")


def workspace_root(spec: str | None) -> Path:
    """A directory is the workspace itself; otherwise the spec names a recipe and its default workspace."""
    if spec is not None and Path(spec).is_dir():
        return Path(spec)
    if spec is not None and not spec.endswith(".toml") and spec.startswith((".", "/", "~")):
        raise UsageError(f"workspace {spec} does not exist")
    root = workspace_for(resolve(spec), None).root
    if not root.is_dir():
        raise UsageError(f"no workspace at {root}: run `forgepack build` first, or name the workspace directory")
    return root
