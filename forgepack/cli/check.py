"""`forgepack check CARD.json KERNEL_SOURCE`: one kernel through the full evaluation.

Exit status: 0 accepted, 1 rejected (category, reason and diagnostics printed), 2 usage error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from forgepack.errors import UsageError


def register(app: typer.Typer) -> None:
    app.command("check")(check)


def check(
    card_path: Path = typer.Argument(..., metavar="CARD.json", help="A card, exact or family (a workspace's cards/)."),
    source_path: Path = typer.Argument(..., metavar="KERNEL_SOURCE", help="A kernel source (.cu cuda, .cpp cpu)."),
    target: str = typer.Option(None, "--target", help="cuda or cpu (default: the card's device)."),
    samples: Path = typer.Option(None, "--samples", help="Captured inputs (default: ../samples/<id>.safetensors)."),
    margin: float = typer.Option(0.05, "--margin", help="Required speed-up over eager, e.g. 0.05 = 5% faster."),
    no_bench: bool = typer.Option(False, "--no-bench", help="Verify only; do not benchmark."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdict as JSON."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds allowed for verification or benchmark."),
) -> None:
    """Check a kernel against a card: static checks, compile, verify, benchmark (a family card at every
    check point of its range, as a build does)."""
    card, source, target, samples = _inputs(card_path, source_path, target, samples)
    from forgepack.evaluate import Evaluator

    verdict = _run(Evaluator, card, source, target, samples, margin, not no_bench, timeout, quiet=as_json)
    if as_json:
        typer.echo(json.dumps(_report(verdict, card.id, target, samples), indent=1, default=str))
    else:
        _print(verdict)
    raise typer.Exit(0 if verdict.accepted else 1)


def _inputs(card_path: Path, source_path: Path, target: str | None, samples: Path | None):
    from forgepack import cards

    for path, what in ((card_path, "card"), (source_path, "kernel source")):
        if not path.is_file():
            raise UsageError(f"{what} not found: {path}")
    try:
        card = cards.load(card_path)
    except (ValueError, KeyError, TypeError) as err:
        raise UsageError(f"{card_path} is not a forgepack card: {err}") from err
    source = source_path.read_text()
    target = target or _card_device(card)
    if target not in ("cuda", "cpu"):
        raise UsageError(f"--target must be cuda or cpu, not {target!r}")
    if target == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--target cuda needs a CUDA GPU and none is visible (use --target cpu for cpu kernels)")
    if samples is None:
        default = card_path.resolve().parent.parent / "samples" / f"{card.id}.safetensors"
        samples = default if default.is_file() else None
    elif not samples.is_file():
        raise UsageError(f"samples not found: {samples}")
    return card, source, target, samples


def _card_device(card) -> str:
    for meta in [*card.tensor_inputs(), *card.outputs]:
        if meta is not None:
            return "cuda" if meta.device == "cuda" else "cpu"
    return "cpu"


def _run(evaluator_cls, card, source, target, samples, margin, bench, timeout, quiet: bool):
    from rich.console import Console

    from forgepack import familyeval

    console = Console(stderr=True, quiet=quiet or not sys.stderr.isatty())
    with console.status(f"checking a {target} kernel for {card.op} {card.signature()}") as status, \
            evaluator_cls(target, timeout_s=timeout) as evaluator:
        # as the search evaluates: a family card over its range, an exact CPU kernel also moved one element
        return familyeval.evaluate(evaluator, card, source, samples_path=samples, margin=margin, bench=bench,
                                   progress=lambda stage: status.update(f"{stage} ({card.id})"))


def _report(verdict, card_id: str, target: str, samples: Path | None) -> dict:
    return {
        "verdict": "accepted" if verdict.accepted else "rejected",
        "accepted": verdict.accepted,
        "category": verdict.category,
        "reason": verdict.reason,
        "diagnostics": verdict.diagnostics,
        "timings": {"compile_s": verdict.compile_s, "verify_s": verdict.verify_s, "bench_s": verdict.bench_s},
        "speedup": verdict.speedup,
        "ci_low": verdict.ci_low,
        "ci_high": verdict.ci_high,
        "eager_us": verdict.eager_us,
        "kernel_us": verdict.kernel_us,
        "card": card_id,
        "target": target,
        "samples": str(samples) if samples else None,
        "source_hash": verdict.source_hash,
        "binary": verdict.binary,
    }


def _print(verdict) -> None:
    if verdict.accepted:
        typer.secho(f"accepted: {verdict.reason}", fg=typer.colors.GREEN)
    else:
        typer.secho(f"rejected [{verdict.category}]: {verdict.reason}", fg=typer.colors.RED)
        for key, value in verdict.diagnostics.items():
            if key == "compile_log":
                typer.echo("compiler output:\n" + "\n".join("  " + line for line in str(value).splitlines()[:40]))
            elif key not in ("verification",):
                typer.echo(f"  {key}: {_short(value)}")
    typer.echo(f"  timings: compile {verdict.compile_s:.2f} s, verify {verdict.verify_s:.2f} s, "
               f"benchmark {verdict.bench_s:.2f} s")


def _short(value) -> str:
    text = json.dumps(value, default=str) if isinstance(value, dict | list) else str(value)
    return text if len(text) <= 300 else text[:300] + "..."
