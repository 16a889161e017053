"""`forgepack build`: spend a budget of proposer calls where the end-to-end gain is largest, keep the winners.

Profile (unless the workspace has one for this recipe) -> plan -> search (resumable) -> accepted.json
-> pack. Killed at any point, the same command continues from the workspace's store.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.live import Live
from rich.table import Table

from forgepack import profile as profile_mod
from forgepack.cli.common import console, out, progress, resolve, workspace_for
from forgepack.errors import ForgepackError, UsageError
from forgepack.pack import builder as pack_builder
from forgepack.recipe import Recipe
from forgepack.search import allocator, run
from forgepack.search.allocator import Decision, PlanRow
from forgepack.search.executor import build_each, check_executor, make_executor
from forgepack.search.proposers import make
from forgepack.search.store import CallRecord, CandidateRecord
from forgepack.workspace import Workspace


def register(app: typer.Typer) -> None:
    app.command("build")(build_command)


def build_command(
    specs: Annotated[
        list[str] | None,
        typer.Argument(metavar="[MODEL]...", help="recipe .toml, built-in recipe name, local model dir or hub id; "
                       "several share the executor, each with its own workspace and pack"),
    ] = None,
    budget: Annotated[int | None, typer.Option(help="proposer calls to spend (total in the workspace)")] = None,
    proposer: Annotated[str | None, typer.Option(help="templates (offline, free) or anthropic (Claude)")] = None,
    explain: Annotated[bool, typer.Option("--explain", help="print why each call went where it did")] = False,
    max_cost: Annotated[float | None, typer.Option("--max-cost", help="cap on LLM spend, US dollars")] = None,
    margin: Annotated[float | None, typer.Option(help="speed-up a kernel must beat, e.g. 0.05 = 5%")] = None,
    no_gate: Annotated[bool, typer.Option("--no-gate", help="skip the end-to-end gate when packing")] = False,
    workspace: Annotated[str | None, typer.Option(help="workspace directory (default .forgepack/<slug>)")] = None,
    target: Annotated[str | None, typer.Option(help="cpu or cuda (overrides the recipe)")] = None,
    llm_model: Annotated[str | None, typer.Option("--model", help="Claude model for --proposer anthropic")] = None,
    strategy: Annotated[str, typer.Option(hidden=True, help="allocator or uniform (benchmarks)")] = "allocator",
    out_dir: Annotated[str, typer.Option("--out", help="where the pack wheel goes")] = "packs",
    as_json: Annotated[bool, typer.Option("--json", help="print the search result as JSON")] = False,
    executor_kind: Annotated[str, typer.Option("--executor", help="local (this host) or ray (a Ray cluster)")] = \
        "local",
    ray_address: Annotated[str | None, typer.Option("--ray-address", help="Ray cluster (default: a local one)")] = None,
) -> None:
    """Search verified kernels for the operator calls that matter, within a budget, and keep the best."""
    check_executor(executor_kind, ray_address)
    if specs and len(specs) > 1:
        options = {k: v for k, v in locals().items() if k != "specs"}
        return build_each(specs, lambda one: build_command([one], **options), workspace=workspace)
    spec = specs[0] if specs else None
    if budget is not None and budget < 0:
        raise UsageError(f"--budget must be 0 or more, got {budget}")
    if strategy not in allocator.STRATEGIES:
        raise UsageError(f"--strategy must be one of {', '.join(allocator.STRATEGIES)}, got {strategy!r}")
    build = {"budget": budget, "proposer": proposer, "max_cost": max_cost, "margin": margin, "llm_model": llm_model,
             "gate": False if no_gate else None}
    recipe = resolve(spec, target=target, build=build)
    ws = workspace_for(recipe, workspace)
    settings_target = recipe.target.device
    chosen = make_proposer(recipe)  # before profiling: a missing API key fails fast
    with progress(f"profiling {recipe.name}", enabled=not as_json) as note:
        cards = profile_mod.ensure_profile(recipe, ws, note)
    arch = target_arch(recipe, ws)
    if hasattr(chosen, "facts"):
        chosen.facts.update(device_facts(ws, settings_target))
    settings = run.Settings(budget=recipe.build.budget, target=settings_target, arch=arch, strategy=strategy,
                            max_cost=recipe.build.max_cost, margin=recipe.build.margin)
    reporter = RichReporter(cards, explain=explain, quiet=as_json)
    with make_executor(executor_kind, settings_target, arch=arch, margin=recipe.build.margin,
                       address=ray_address) as executor, reporter:
        reporter.note(executor.summary())
        search = run.Search(ws, cards, chosen, executor, settings, reporter=reporter)
        try:
            result = search.run()
        finally:
            search.store.close()
    path = run.save_accepted(ws, result.accepted)
    if not as_json:
        show_result(result, recipe)
        console.print(f"accepted kernels: {path}")
    packed = pack_builder.build_pack(ws, recipe, margin=recipe.build.margin, gate=recipe.build.gate,
                                     out_dir=Path(out_dir), note=lambda text: console.print(text),
                                     console=None if as_json else console)
    if as_json:
        doc = {**run.result_json(result), "workspace": str(ws.root),
               "wheel": str(packed.wheel) if packed.wheel else None, "gate": packed.gate}
        out.print_json(json.dumps(doc, default=str))
    elif packed.wheel:
        console.print(f"pack: {packed.wheel} (gate {packed.gate})\n"
                      f"install it with: pip install {packed.wheel}")
    elif not packed.refused:
        console.print(f"no pack written ({packed.gate}): no kernel was accepted and kept; see the tables above")
    if packed.refused:  # the gate would not ship a pack that is slower or changes outputs: a failed build
        raise ForgepackError(f"no pack written: {packed.refused}")


def make_proposer(recipe: Recipe):
    if recipe.build.proposer == "anthropic":
        return make("anthropic", target=recipe.target.device, model=recipe.build.llm_model)
    return make(recipe.build.proposer, target=recipe.target.device)


def target_arch(recipe: Recipe, ws: Workspace) -> str | None:
    if recipe.target.device != "cuda":
        return None
    if recipe.target.arch:
        return recipe.target.arch
    prof = profile_mod.load_profile(ws)
    return prof.arch if prof and prof.arch else None


def device_facts(ws: Workspace, target: str) -> dict:
    """What an LLM should know about the device: from the profile (measured there)."""
    prof = profile_mod.load_profile(ws)
    facts = {"target": target}
    if prof is not None:
        facts["device"] = prof.device
        if prof.arch:
            facts["arch"] = prof.arch
        facts["torch"] = prof.torch_version
    return facts


# --- drawing -------------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _sig(text: str, width: int = 44) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


class RichReporter(run.Reporter):
    """The plan as a table, then a live per-card table (calls, best speed-up, verdicts) while searching."""

    def __init__(self, cards, explain: bool = False, quiet: bool = False):
        self.cards = {c.id: c for c in cards}
        self.explain = explain
        self.quiet = quiet
        self.rows: dict[str, run.CardSummary] = {}
        self.live = Live(console=console, transient=True, auto_refresh=False) if not quiet else None

    def __enter__(self) -> RichReporter:
        if self.live:
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.live.stop()

    def _print(self, *things) -> None:
        if not self.quiet:
            (self.live.console if self.live else console).print(*things)

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
        if not self.quiet:
            out.print(table)  # a result worth keeping: stdout, at full width

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
        self._print(f"  {summary.op}: #{candidate.id} {candidate.proposer} {verdict}{speed}")
        self._refresh()

    def note(self, text: str) -> None:
        self._print(text)

    def _refresh(self) -> None:
        if not self.live:
            return
        table = Table(title="search")
        for name in ("card", "share %", "calls", "best", "verdicts"):
            table.add_column(name)
        for s in sorted(self.rows.values(), key=lambda s: -s.share):
            best = f"{s.best_speedup:.3f}x" if s.best_speedup else "-"
            counts = " ".join(f"{k}:{v}" for k, v in sorted(s.counts.items()))
            table.add_row(s.op, _pct(s.share), str(s.calls), best, counts)
        self.live.update(table, refresh=True)


def show_result(result: run.SearchResult, recipe: Recipe) -> None:
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
    out.print(table)
    tokens_in, tokens_out = result.tokens
    out.print(
        f"accepted: {len(result.accepted)} kernels   estimated end-to-end gain: {100 * result.estimated_gain:.2f}% "
        f"of operator time   calls: {result.new_calls} this run, {result.calls} in all   "
        f"tokens: {tokens_in} in / {tokens_out} out   cost: ${result.cost:.2f}   "
        f"wall: {result.wall_s:.0f} s"
    )
    out.print(f"stopped: {result.stopped}")
