"""The `forgepack` command. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import importlib
import sys

import typer

from forgepack.errors import ForgepackError

app = typer.Typer(
    name="forgepack",
    help="Profile a model's operator calls, search verified kernels where they pay, ship them as a kernel pack.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

@app.callback()
def _root() -> None:
    """Profile a model's operator calls, search verified kernels where they pay, ship them as a kernel pack."""


# One module per command; each defines `register(app)`.
COMMANDS = ("recipes", "profile", "check", "build", "inspect", "bench", "report")

for _name in COMMANDS:
    try:
        _module = importlib.import_module(f"forgepack.cli.{_name}")
    except ModuleNotFoundError as err:  # a command whose module is not written yet
        if err.name != f"forgepack.cli.{_name}":
            raise
        continue
    _module.register(app)


def main() -> None:
    try:
        app()
    except ForgepackError as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        typer.secho("interrupted; the workspace keeps what was done, run the same command to resume", err=True)
        sys.exit(130)
