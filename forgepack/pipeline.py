"""One recipe through the pipeline: profile -> search -> pack. The CLI, the benchmarks, the tools and
the tests call these functions; none of them wires the stages again.

    >>> from forgepack import pipeline
    >>> built = pipeline.build(recipe, workspace)          # all three stages, resumable
    >>> profiled = pipeline.profile(recipe, workspace)     # or one stage at a time
    >>> facts = pipeline.target_facts(recipe, profiled.profile)
    >>> found = pipeline.search(recipe, workspace, profiled, facts)

The workspace's `profile.json` is read once (`profile`), and the facts about the device the pack is
built for (`TargetFacts`: target, GPU arch, the device the profile measured, torch) are gathered once
from the recipe and that profile, then passed to the proposer, the executor and the search.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forgepack import profile as profile_mod
from forgepack.cards import Card
from forgepack.errors import ForgepackError, UsageError
from forgepack.profile import ModelProfile
from forgepack.recipe import Recipe
from forgepack.search import proposers, run
from forgepack.search.executor import Executor, LocalExecutor
from forgepack.workspace import Workspace

Progress = Callable[[str, int, int], None]  # (what, done, total)
EXECUTORS = ("local", "ray")  # this host; a Ray cluster (forgepack.search.ray_executor)


@dataclass(frozen=True)
class TargetFacts:
    """What the build knows about the device the pack is for, gathered once."""

    target: str  # "cuda" | "cpu"
    arch: str | None = None  # "sm_90"; None on cpu
    device: str | None = None  # the profiled device, with its measured ceilings
    torch: str | None = None  # the torch the profile ran on

    def prompt(self) -> dict[str, str]:
        """The facts an LLM proposer puts in its prompt's device line (known ones only)."""
        fields = {"target": self.target, "device": self.device, "arch": self.arch, "torch": self.torch}
        return {k: v for k, v in fields.items() if v}

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "arch": self.arch, "device": self.device, "torch": self.torch}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TargetFacts:
        return cls(d["target"], d.get("arch"), d.get("device"), d.get("torch"))


@dataclass(frozen=True)
class Profiled:
    """The profile stage's result: the model-level numbers and every card (operator and fusion)."""

    profile: ModelProfile
    cards: tuple[Card, ...]
    reused: bool  # the workspace already held a profile of this recipe


@dataclass(frozen=True)
class Built:
    profiled: Profiled
    facts: TargetFacts
    search: run.SearchResult
    accepted: Path  # accepted.json
    pack: Any  # forgepack.pack.builder.PackResult


def target_facts(recipe: Recipe, prof: ModelProfile | None) -> TargetFacts:
    """The recipe's arch wins; else the profiled GPU's; else (cuda, not profiled yet) this host's GPU."""
    target = recipe.target.device
    if target != "cuda":
        return TargetFacts(target, None, prof.device if prof else None, prof.torch_version if prof else None)
    arch = recipe.target.arch or (prof.arch if prof and prof.arch else None)
    if arch is None:
        from forgepack.compile import default_arch

        arch = default_arch()
    return TargetFacts(target, arch, prof.device if prof else None, prof.torch_version if prof else None)


def profile(recipe: Recipe, workspace: Workspace, note: Progress | None = None, reuse: bool = True) -> Profiled:
    """The workspace's profile of this recipe when there is one (`reuse`), else a new one."""
    if reuse:
        existing = profile_mod.load_profile(workspace)
        if existing and existing.recipe_fingerprint == profile_mod.recipe_fingerprint(recipe):
            cards = workspace.load_cards()
            if cards:
                return Profiled(existing, tuple(cards), reused=True)
    result, cards = profile_mod.run_profile(recipe, workspace, note)
    return Profiled(result, tuple(cards), reused=False)


def preflight(recipe: Recipe, strategy: str = "allocator", executor: str = "local",
              executor_options: Mapping[str, Any] | None = None) -> None:
    """Refuse a build that could not finish, before it profiles anything (a missing API key, an unknown
    executor, ray not installed)."""
    from forgepack.search import allocator

    if strategy not in allocator.STRATEGIES:
        raise UsageError(f"--strategy must be one of {', '.join(allocator.STRATEGIES)}, got {strategy!r}")
    check_executor(executor, (executor_options or {}).get("address"))
    proposers.preflight(recipe.build.proposer, model=recipe.build.llm_model)


def make_proposer(recipe: Recipe, facts: TargetFacts) -> proposers.Proposer:
    """The recipe's proposer, told once what it builds for."""
    return proposers.make(recipe.build.proposer, target=facts.target, arch=facts.arch, facts=facts.prompt(),
                          model=recipe.build.llm_model)


def check_executor(name: str, address: str | None = None) -> None:
    """Bad executor options fail before a build profiles anything."""
    if name not in EXECUTORS:
        raise UsageError(f"--executor must be one of {', '.join(EXECUTORS)}, got {name!r}")
    if address and name != "ray":
        raise UsageError("--ray-address needs --executor ray")
    if name == "ray":
        from forgepack.search.ray_executor import import_ray

        import_ray()


def make_executor(name: str, recipe: Recipe, facts: TargetFacts,
                  options: Mapping[str, Any] | None = None) -> Executor:
    """Where candidates compile and run: "local" (this host's compile pool and devices) or "ray" (a Ray
    cluster: `options["address"]`, default a local one). `options` go to the executor's constructor."""
    options = dict(options or {})
    check_executor(name, options.get("address"))
    if name == "local":
        options.pop("address", None)
        return LocalExecutor(facts.target, arch=facts.arch, margin=recipe.build.margin, **options)
    from forgepack.search.ray_executor import RayExecutor

    return RayExecutor(facts.target, arch=facts.arch, margin=recipe.build.margin, **options)


def search(recipe: Recipe, workspace: Workspace, profiled: Profiled, facts: TargetFacts,
           reporter: run.Reporter | None = None, strategy: str = "allocator", executor: str = "local",
           executor_options: Mapping[str, Any] | None = None, started: float | None = None) -> run.SearchResult:
    """Spend the recipe's budget on its cards (resumable from the workspace's store). `build.time_limit`
    counts from `started` (`time.monotonic()`, default now): `build` passes its own start, so the limit
    covers profile and search."""
    chosen = make_proposer(recipe, facts)
    limit = recipe.build.time_limit
    deadline = None if limit is None else (time.monotonic() if started is None else started) + limit
    settings = run.Settings(budget=recipe.build.budget, target=facts.target, arch=facts.arch, strategy=strategy,
                            max_cost=recipe.build.max_cost, margin=recipe.build.margin, deadline=deadline)
    with make_executor(executor, recipe, facts, executor_options) as ex:
        if reporter is not None:
            reporter.note(ex.summary())  # how many evaluators, and any device refused
        found = run.Search(workspace, list(profiled.cards), chosen, ex, settings, reporter=reporter)
        try:
            return found.run()
        finally:
            found.store.close()


def pack(recipe: Recipe, workspace: Workspace, out_dir: Path = Path("packs"),
         note: Callable[[str], None] | None = None, console: Any = None):
    """Select, stage, gate and wheel the workspace's accepted kernels (`forgepack.pack.builder`)."""
    from forgepack.pack import builder

    return builder.build_pack(workspace, recipe, margin=recipe.build.margin, gate=recipe.build.gate,
                              out_dir=Path(out_dir), note=note, console=console)


def build_each(specs: Sequence[str], build_one: Callable[[str], Any], workspace: str | None = None) -> None:
    """Several recipes in one command, one after another: each gets its own workspace and pack, and all
    share the executor's cluster (one Ray session per process, its compile registry included). A
    recipe that fails is reported and the others still build; the command then fails."""
    if workspace:
        raise UsageError("--workspace names one recipe's workspace: leave it out to build several recipes")
    failed = []
    for spec in specs:
        try:
            build_one(spec)
        except ForgepackError as err:
            failed.append(f"{spec}: {err}")
            print(f"forgepack: {spec} failed: {err}", file=sys.stderr)
    if failed:
        raise ForgepackError(f"{len(failed)} of {len(specs)} recipes failed: " + "; ".join(failed))


class Listener:
    """What a build tells its caller, stage by stage; the CLI draws it, tools and tests ignore it."""

    def profiling(self) -> AbstractContextManager[Progress]:
        """Around the profile stage; yields the progress callback it reports through."""
        return nullcontext(lambda *_: None)

    def searching(self, cards: Sequence[Card]) -> AbstractContextManager[run.Reporter | None]:
        """Around the search; yields the reporter it draws through."""
        return nullcontext(None)

    def searched(self, result: run.SearchResult, accepted: Path) -> None:
        """The search is over and accepted.json written, before packing starts."""

    def packing(self) -> AbstractContextManager[Callable[[str], None]]:
        """Around the pack stage; yields `note(text)`, called as each of its steps starts."""
        return nullcontext(lambda _text: None)


def build(recipe: Recipe, workspace: Workspace, *, listener: Listener | None = None, strategy: str = "allocator",
          executor: str = "local", executor_options: Mapping[str, Any] | None = None,
          out_dir: Path = Path("packs"), console: Any = None) -> Built:
    """Profile (unless the workspace has this recipe's), search, save accepted.json, pack.
    `console`: a rich console for the pack's report table (None: not printed)."""
    started = time.monotonic()
    listener = listener or Listener()
    preflight(recipe, strategy, executor, executor_options)
    with listener.profiling() as note:
        profiled = profile(recipe, workspace, note)
    facts = target_facts(recipe, profiled.profile)
    with listener.searching(profiled.cards) as reporter:
        found = search(recipe, workspace, profiled, facts, reporter, strategy, executor, executor_options, started)
    accepted = run.save_accepted(workspace, found.accepted)
    listener.searched(found, accepted)
    with listener.packing() as note:
        packed = pack(recipe, workspace, out_dir, note, console)
    return Built(profiled, facts, found, accepted, packed)
