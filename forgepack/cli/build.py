"""`forgepack build`: spend a budget of proposer calls where the end-to-end gain is largest, keep the winners.

Profile (unless the workspace has one for this recipe) -> plan -> search (resumable) -> accepted.json
-> pack, as `forgepack.pipeline.build` runs them; this module parses the flags and draws the stages.
Killed at any point, the same command continues from the workspace's store.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from forgepack import pipeline
from forgepack.cli.common import console, out, progress, resolve, steps, workspace_for
from forgepack.errors import ForgepackError, UsageError
from forgepack.recipe import DEFAULT_RECIPE, TASKS, BuildSettings, Recipe
from forgepack.search import prices, run
from forgepack.search.allocator import Decision, PlanRow
from forgepack.search.store import CallRecord, CandidateRecord


def register(app: typer.Typer) -> None:
    app.command("build")(build_command)


DEFAULTS = BuildSettings()
BASE_URL_ENVS = {"openai": "OPENAI_BASE_URL", "anthropic": "ANTHROPIC_BASE_URL"}


def build_command(
    specs: Annotated[
        list[str] | None,
        typer.Argument(metavar="[MODEL]...", help="recipe .toml, built-in recipe name, local model dir or hub id; "
                       "several share the executor, each with its own workspace and pack",
                       show_default=DEFAULT_RECIPE),
    ] = None,
    budget: Annotated[int | None, typer.Option(
        help="proposer calls to spend (total in the workspace)",
        show_default=f"the recipe's build.budget, else {DEFAULTS.budget}")] = None,
    proposer: Annotated[str | None, typer.Option(
        help="templates (offline, free), anthropic (Claude) or openai (any chat-completions server)",
        show_default=f"the recipe's build.proposer, else {DEFAULTS.proposer}")] = None,
    llm_model: Annotated[str | None, typer.Option(
        "--llm-model", help="the model an LLM proposer asks for (openai: default gpt-5)",
        show_default=f"the recipe's build.llm_model, else {DEFAULTS.llm_model}")] = None,
    llm_base_url: Annotated[str | None, typer.Option(
        "--llm-base-url", help="the LLM server's API root, e.g. http://127.0.0.1:8000/v1 for a local one "
                               "(default: OPENAI_BASE_URL / ANTHROPIC_BASE_URL, else the provider's)")] = None,
    llm_price: Annotated[str | None, typer.Option(
        "--llm-price", help="IN,OUT dollars per million tokens for a model the price table does not know; "
                            "0,0 for a local server (free: not counted against --max-cost)")] = None,
    llm_concurrency: Annotated[int | None, typer.Option(
        "--llm-concurrency", help="LLM calls in flight at once (replies are recorded in the order the calls "
                                  "were decided, so the build stays reproducible)", show_default="1")] = None,
    llm_samples: Annotated[int | None, typer.Option(
        "--llm-samples", help="of those, calls in flight on one card: best-of-k samples, each refining one of "
                              "the card's best kernels", show_default="--llm-concurrency")] = None,
    min_gain_per_dollar: Annotated[float | None, typer.Option(
        "--min-gain-per-dollar", help="a paid LLM call must be expected to save at least this fraction of the "
                                      "model's operator time per dollar (--explain shows each call's)",
        show_default=f"{run.MIN_GAIN_PER_DOLLAR:g}")] = None,
    old_llm_model: Annotated[str | None, typer.Option("--model", hidden=True, help="deprecated: --llm-model")] = None,
    explain: Annotated[bool, typer.Option("--explain", help="print why each call went where it did")] = False,
    max_cost: Annotated[float | None, typer.Option("--max-cost", help="cap on LLM spend, US dollars")] = None,
    time_limit: Annotated[float | None, typer.Option(
        "--time-limit", help="seconds for profile + search: no call starts that would end past it; the accepted "
                             "kernels are packed, and a later build continues (recipe: build.time_limit)")] = None,
    margin: Annotated[float | None, typer.Option(
        help="speed-up a kernel must beat, e.g. 0.05 = 5%",
        show_default=f"the recipe's build.margin, else {DEFAULTS.margin}")] = None,
    no_gate: Annotated[bool, typer.Option("--no-gate", help="skip the end-to-end gate when packing")] = False,
    target: Annotated[str | None, typer.Option(help="cpu or cuda (overrides the recipe)")] = None,
    task: Annotated[str | None, typer.Option(help=f"{', '.join(TASKS)} (overrides the recipe)")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32, float16 or bfloat16 (overrides the recipe)")] = None,
    batch: Annotated[str | None, typer.Option(help="batch size, or a range such as 1-8 (overrides the recipe)")] = None,
    seq_len: Annotated[str | None, typer.Option(
        "--seq-len", help="sequence length, or a range such as 16-2048 (overrides the recipe)")] = None,
    phase: Annotated[str | None, typer.Option(help="prefill, decode or generate (overrides the recipe)")] = None,
    workspace: Annotated[str | None, typer.Option(help="workspace directory (default .forgepack/<slug>)")] = None,
    strategy: Annotated[str, typer.Option(
        help="allocator (calls where the estimated gain is largest), breadth (every card worth a call gets "
             "one before any gets a second: a wide envelope under a time limit) or uniform (a benchmark's "
             "baseline)")] = "allocator",
    out_dir: Annotated[str, typer.Option("--out", help="where the pack wheel goes")] = "packs",
    as_json: Annotated[bool, typer.Option(
        "--json", help="print the search result as JSON on stdout (progress stays on stderr)")] = False,
    executor_kind: Annotated[str, typer.Option(
        "--executor", help=f"where candidates compile and run: {' or '.join(pipeline.EXECUTORS)} "
                           "(this host, a Ray cluster)",
    )] = "local",
    ray_address: Annotated[str | None, typer.Option("--ray-address", help="Ray cluster (default: a local one)")] = None,
) -> None:
    """Search verified kernels for the operator calls that matter, within a budget, and keep the best."""
    pipeline.check_executor(executor_kind, ray_address)  # once, before any recipe profiles
    if specs and len(specs) > 1:
        options = {k: v for k, v in locals().items() if k != "specs"}
        return pipeline.build_each(specs, lambda one: build_command([one], **options), workspace=workspace)
    spec = specs[0] if specs else None
    if budget is not None and budget < 0:
        raise UsageError(f"--budget must be 0 or more, got {budget}")
    if old_llm_model is not None:
        console.print("[yellow]--model is deprecated (it names the Claude model): use --llm-model[/yellow]")
        llm_model = llm_model or old_llm_model
    build = {"budget": budget, "proposer": proposer, "max_cost": max_cost, "margin": margin, "llm_model": llm_model,
             "gate": False if no_gate else None, "time_limit": time_limit}
    recipe = resolve(spec, target=target, task=task, dtype=dtype, batch=batch, seq_len=seq_len, build=build,
                     phase=phase)
    llm_environment(recipe.build.proposer, llm_base_url, llm_price, llm_concurrency, llm_samples, min_gain_per_dollar)
    ws = workspace_for(recipe, workspace)
    # --json: stdout holds the JSON alone; the progress and the tables go to stderr, so a long build's
    # log still says how far it got
    view = BuildView(recipe, explain=explain, tables=console if as_json else out)
    built = pipeline.build(recipe, ws, listener=view, strategy=strategy, executor=executor_kind,
                           executor_options={"address": ray_address} if ray_address else None,
                           out_dir=Path(out_dir), console=console)
    packed = built.pack
    if as_json:
        doc = {**run.result_json(built.search), "workspace": str(ws.root),
               "wheel": str(packed.wheel) if packed.wheel else None, "gate": packed.gate,
               "package": packed.manifest.name if packed.wheel else None}
        out.print_json(json.dumps(doc, default=str))
    elif packed.wheel:
        console.print(last_lines(packed.wheel, packed.manifest.name, packed.gate))
    elif not packed.refused:
        console.print(f"no pack written ({packed.gate}): no kernel was accepted and kept; see the tables above")
    if packed.refused:  # the gate would not ship a pack that is slower or changes outputs: a failed build
        raise ForgepackError(f"no pack written: {packed.refused}")


def llm_environment(proposer: str | None, base_url: str | None, price: str | None, concurrency: int | None = None,
                    samples: int | None = None, min_gain: float | None = None) -> None:
    """The LLM flags as the environment the proposers and the search read (the recipe has no fields for
    them), set for this process only: the build and the workers it starts."""
    for flag, value in (("--llm-concurrency", concurrency), ("--llm-samples", samples)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be 1 or more, got {value}")
        if value is not None and value > 1 and proposer not in BASE_URL_ENVS:
            raise UsageError(f"{flag} needs --proposer {' or '.join(BASE_URL_ENVS)} (templates calls need no waiting)")
    if min_gain is not None and min_gain < 0:
        raise UsageError(f"--min-gain-per-dollar cannot be negative, got {min_gain}")
    for name, value in ((run.CONCURRENCY_ENV, concurrency), (run.SAMPLES_ENV, samples),
                        (run.MIN_GAIN_ENV, min_gain)):
        if value is not None:
            os.environ[name] = str(value)
    if price is not None:
        os.environ[prices.PRICE_ENV] = ",".join(str(p) for p in prices.parse_price(price))
    if base_url is not None:
        if proposer not in BASE_URL_ENVS:
            raise UsageError(f"--llm-base-url needs --proposer {' or '.join(BASE_URL_ENVS)}")
        os.environ[BASE_URL_ENVS[proposer]] = base_url


def last_lines(wheel: Path, package: str, gate: str) -> str:
    """What to do with the pack: install it, import it by this name, activate it with one line."""
    return (f"pack: {wheel} (gate {gate})\n"
            f"install:  pip install {wheel}\n"
            f"import:   {package}\n"
            f"activate: import {package} as pack; pack.activate()")


class BuildView(pipeline.Listener):
    """The build as the CLI draws it: a profile bar, the search's live table, the pack's steps."""

    def __init__(self, recipe: Recipe, explain: bool, tables: Console):
        self.recipe, self.explain, self.tables = recipe, explain, tables

    def profiling(self):
        return progress(f"profiling {self.recipe.name}")

    @contextmanager
    def searching(self, cards):
        with RichReporter(cards, explain=self.explain, tables=self.tables) as reporter:
            yield reporter

    def searched(self, result: run.SearchResult, accepted: Path) -> None:
        show_result(result, self.recipe, self.tables)
        console.print(f"accepted kernels: {accepted}")

    def packing(self):
        return steps("pack")


# --- drawing -------------------------------------------------------------------------------------


def _seconds(candidate: CandidateRecord) -> str:
    """Where a candidate's time went: a long build's log says which stage to look at."""
    parts = [(name, s) for name, s in (("compile", candidate.compile_s), ("verify", candidate.verify_s),
                                       ("bench", candidate.bench_s)) if s]
    if not parts:
        return ""
    return f" [dim]({sum(s for _, s in parts):.1f} s: {', '.join(f'{n} {s:.1f}' for n, s in parts)})[/dim]"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _sig(text: str, width: int = 44) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


class RichReporter(run.Reporter):
    """The plan as a table, then a live per-card table (calls, best speed-up, verdicts) while searching."""

    def __init__(self, cards, explain: bool = False, tables: Console = out):
        self.cards = {c.id: c for c in cards}
        self.explain = explain
        self.tables = tables  # the plan: stdout, a result worth keeping (stderr under --json)
        self.rows: dict[str, run.CardSummary] = {}
        self.live = Live(console=console, transient=True, auto_refresh=False)

    def __enter__(self) -> RichReporter:
        self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.stop()

    def _print(self, *things) -> None:
        self.live.console.print(*things)

    def plan(self, rows: list[PlanRow], remaining: int) -> None:
        table = Table(title=f"plan: {remaining} calls to spend")
        for name, justify in (("card", "left"), ("signature", "left"), ("share %", "right"), ("headroom", "right"),
                              ("class", "left"), ("p(success)", "right"), ("spent", "right"), ("planned", "right"),
                              ("note", "left")):
            table.add_column(name, justify=justify)
        shown = [r for r in rows if r.planned or r.spent] or rows[:10]
        for r in shown:
            card = self.cards[r.card_id]
            table.add_row(card.op_name, _sig(card.signature()), _pct(r.share), f"{r.headroom:.2f}x", r.baseline,
                          f"{r.p:.2f}", str(r.spent), str(r.planned), r.dropped or "")
        skipped = len(rows) - len(shown)
        if skipped:
            table.caption = f"{skipped} more cards get no calls (views, no template, no share, or low gain)"
        self.tables.print(table)

    def decided(self, call: CallRecord, decision: Decision) -> None:
        if self.explain:
            self._print(f"[dim]call {call.id} ->[/dim] {decision.reason}")
        if call.outcome != "new":
            self._print(f"  {self.cards[call.card_id].op_name}: call {call.id} {call.outcome}: {call.feedback or ''}")
        self._refresh()

    def evaluated(self, candidate: CandidateRecord, summary: run.CardSummary) -> None:
        self.rows[candidate.card_id] = summary
        verdict = "accepted" if candidate.accepted else candidate.category
        speed = f" {candidate.speedup:.3f}x" if candidate.speedup else ""
        self._print(f"  {summary.op}: #{candidate.id} {candidate.proposer} {verdict}{speed}{_seconds(candidate)}")
        self._refresh()

    def note(self, text: str) -> None:
        self._print(text)

    def _refresh(self) -> None:
        table = Table(title="search")
        for name in ("card", "share %", "calls", "best", "verdicts"):
            table.add_column(name)
        for s in sorted(self.rows.values(), key=lambda s: -s.share):
            best = f"{s.best_speedup:.3f}x" if s.best_speedup else "-"
            counts = " ".join(f"{k}:{v}" for k, v in sorted(s.counts.items()))
            table.add_row(s.op, _pct(s.share), str(s.calls), best, counts)
        self.live.update(table, refresh=True)


def show_result(result: run.SearchResult, recipe: Recipe, tables: Console = out) -> None:
    searched = [c for c in result.cards if c.calls]
    table = Table(title=f"{recipe.name}: search results ({result.calls} {recipe.build.proposer} calls)")
    for name, justify in (("card", "left"), ("signature", "left"), ("share %", "right"), ("calls", "right"),
                          ("verdicts", "left"), ("speed-up", "right"), ("% roofline", "right"),
                          ("est. e2e gain %", "right")):
        table.add_column(name, justify=justify)
    for c in sorted(searched, key=lambda c: -c.gain):
        counts = " ".join(f"{k}:{v}" for k, v in sorted(c.counts.items()))
        speed = f"{c.best_speedup:.3f}x" if c.best_speedup else "-"
        roof = f"{c.roofline_pct:.0f}" if c.roofline_pct else "-"
        table.add_row(c.op, _sig(c.signature), _pct(c.share), str(c.calls), counts, speed, roof,
                      f"{100 * c.gain:.2f}" if c.best_speedup else "-")
    tables.print(table)
    tokens_in, tokens_out = result.tokens
    tables.print(
        f"accepted: {len(result.accepted)} kernels   estimated end-to-end gain: {100 * result.estimated_gain:.2f}% "
        f"of operator time   calls: {result.new_calls} this run, {result.calls} in all   "
        f"tokens: {tokens_in} in / {tokens_out} out   cost: ${result.cost:.2f}   "
        f"wall: {result.wall_s:.0f} s"
    )
    tables.print(f"stopped: {result.stopped}")
