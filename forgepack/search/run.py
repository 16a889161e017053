"""The build loop: allocator -> tree -> proposer -> store -> executor -> store, until the budget is spent.

One call at a time is decided, while up to ``lag`` candidates compile and evaluate in the background.
What a decision sees does not depend on timing: results are taken in the order their candidates were
submitted, and a call is decided with exactly the last ``lag - 1`` candidates submitted still unknown
(fewer at the start, and after a decision that found no card worth a call, which waits for one more
result). ``lag`` is the executor's slots when the search starts (not its later, measured pace) plus
one per evaluator beyond the first. A result that arrives early waits for the ones before it. So the
same verdicts give the same calls, the same candidates and the same accepted kernels on any executor
with the same slots and evaluators, however the candidates' evaluations overlap or finish (a build on
two evaluators, with more in flight, is a different, equally deterministic search). Order of writes, for `kill -9`:
source file, then call + pending candidate (one transaction), then the verdict. On start, the trees are
rebuilt from the store and pending candidates are evaluated before anything new is proposed; the budget
counts the calls already in the store (per proposer), and dollars across all calls.

An LLM proposer (`proposers.Exchanger`) has up to ``concurrency`` calls in flight (``--llm-concurrency``),
and a card up to ``samples`` of them (best-of-k, ``--llm-samples``). Calls are decided one at a time as
above, each seeing the ones decided before it as pending (the allocator's virtual loss; the tree's
"best" policy gives the k-th call in flight on a card its k-th best kernel as parent), and sent at once
on a thread pool; a round of sent calls is recorded, in the order it was decided, when it is full, when
no card is worth another call, or before a verdict is taken. So the replies' arrival order changes
nothing: the same replies (and verdicts) give the same calls, candidates and verdicts, which is what
lets a recorded build be replayed (`forgepack.search.cassette`). Each exchange is written to the
workspace's cassette before its call row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forgepack import accepted as accepted_mod
from forgepack import needs as needs_mod
from forgepack import packreport
from forgepack.accepted import AcceptedKernel
from forgepack.cards import Card
from forgepack.errors import ForgepackError
from forgepack.search import allocator, cassette, resources
from forgepack.search.allocator import CallResult, Config, Decision, PlanRow
from forgepack.search.executor import Executor, file_sha256
from forgepack.search.proposers import Context, Example, NothingToPropose, Parent, Proposal, Proposer, exchanges
from forgepack.search.store import CallRecord, CandidateRecord, Store, VerdictRow
from forgepack.search.tree import Node, Tree, TreeConfig
from forgepack.workspace import Workspace

# no kernel launch + run is faster than this (allocator headroom). On the cpu a kernel is a function call
# from the shim: tiny-llama's cat ran in 0.58 us, so a 1 us floor capped its headroom at 3.2x below the
# 5.5x its first kernel reached, and the card was dropped as "at its ceiling" after one call
FLOOR_US = {"cuda": 2.0, "cpu": 0.1}
FEEDBACK_CHARS = 4000  # a verdict's feedback, cut at a line end (a compiler's first errors matter most)
LINE_CHARS = 1000  # one line past this is cut (a template instantiation's error can run to pages)
EXAMPLE_CHARS = 16000  # a kernel source longer than this is not shown as an example
SIMILAR = 2  # accepted kernels of similar cards shown per prompt

# The CLI's LLM options, as the environment of the build process (the recipe has no fields for them).
CONCURRENCY_ENV = "FORGEPACK_LLM_CONCURRENCY"
SAMPLES_ENV = "FORGEPACK_LLM_SAMPLES"
MIN_GAIN_ENV = "FORGEPACK_MIN_GAIN_PER_DOLLAR"
# A paid call must be expected to save at least this fraction of the model's operator time per dollar
# (0.1%/$: a $0.10 call must be expected to save 0.01%); a free proposer is never held to it.
MIN_GAIN_PER_DOLLAR = 1e-3


@dataclass(frozen=True)
class Settings:
    budget: int  # proposer calls (of this proposer) the store may hold when the search ends
    target: str = "cuda"
    arch: str | None = None
    strategy: str = "allocator"  # a key of allocator.STRATEGIES: allocator, breadth or uniform (a baseline)
    max_cost: float | None = None  # US dollars over all calls in the store
    deadline: float | None = None  # `time.monotonic()` past which no new call starts (build.time_limit)
    margin: float = 0.05
    allocator: Config | None = None
    tree: TreeConfig = field(default_factory=TreeConfig)
    concurrency: int | None = None  # LLM calls in flight (None: $FORGEPACK_LLM_CONCURRENCY, else 1)
    samples: int | None = None  # of them on one card, best-of-k (None: $FORGEPACK_LLM_SAMPLES, else concurrency)
    min_gain_per_dollar: float | None = None  # (None: $FORGEPACK_MIN_GAIN_PER_DOLLAR, else MIN_GAIN_PER_DOLLAR)

    def resolved(self) -> Settings:
        """The settings with every None above given its value (from the environment, else the default)."""
        concurrency = self.concurrency or _env_number(CONCURRENCY_ENV, int) or 1
        samples = self.samples or _env_number(SAMPLES_ENV, int) or concurrency
        gain = self.min_gain_per_dollar
        if gain is None:
            gain = _env_number(MIN_GAIN_ENV, float)
        if concurrency < 1 or samples < 1:
            raise ForgepackError(f"--llm-concurrency and --llm-samples must be 1 or more, got {concurrency} and "
                                 f"{samples}")
        return dataclasses.replace(self, concurrency=concurrency, samples=min(samples, concurrency),
                                   min_gain_per_dollar=MIN_GAIN_PER_DOLLAR if gain is None else gain)


def _env_number(name: str, kind: type) -> int | float | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return kind(value)
    except ValueError:
        raise ForgepackError(f"{name}={value!r} is not a number") from None


@dataclass(frozen=True)
class CardSummary:
    card_id: str
    op: str
    signature: str
    share: float
    baseline: str
    calls: int
    counts: dict[str, int]
    best_speedup: float | None
    best_candidate: int | None
    kernel_us: float | None
    roofline_us: float
    eager_us: float
    fused_away: float = 0.0  # fraction of its calls inside accepted fusion kernels (counted there)

    @property
    def roofline_pct(self) -> float | None:
        if not self.kernel_us or self.roofline_us <= 0:
            return None
        return 100.0 * self.roofline_us / self.kernel_us

    @property
    def gain(self) -> float:
        """Estimated end-to-end saving, share x (1 - 1/speedup), less what fusion kernels took over."""
        return allocator.estimated_gain([(self.share * (1 - self.fused_away), self.best_speedup or 1.0)])


@dataclass(frozen=True)
class SearchResult:
    cards: list[CardSummary]
    accepted: list[AcceptedKernel]
    plan: list[PlanRow]
    calls: int  # calls of this proposer in the store
    new_calls: int  # made by this run
    evaluated: int  # candidates evaluated by this run
    tokens: tuple[int, int]
    cost: float
    wall_s: float
    stopped: str

    @property
    def estimated_gain(self) -> float:
        return sum(c.gain for c in self.cards)


class Reporter:
    """Progress callbacks; the CLI draws them, the benchmark and tests ignore them."""

    def plan(self, rows: list[PlanRow], remaining: int) -> None: ...

    def decided(self, call: CallRecord, decision: Decision) -> None: ...

    def evaluated(self, candidate: CandidateRecord, summary: CardSummary) -> None: ...

    def note(self, text: str) -> None: ...


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def source_suffix(target: str) -> str:
    return ".cu" if target == "cuda" else ".cpp"


def verdict_row(verdict: Any, margin: float, binary_path: str | None) -> VerdictRow:
    """The store's columns from an evaluator `Verdict`, with the feedback text a proposer will see."""
    return VerdictRow(
        accepted=bool(verdict.accepted),
        category=verdict.category,
        reason=verdict.reason,
        speedup=verdict.speedup,
        ci_low=verdict.ci_low,
        ci_high=verdict.ci_high,
        eager_us=verdict.eager_us,
        kernel_us=verdict.kernel_us,
        compile_s=verdict.compile_s,
        verify_s=verdict.verify_s,
        bench_s=verdict.bench_s,
        feedback=feedback_text(verdict, margin),
        verdict=verdict.to_json(),
        binary_path=binary_path,
    )


# Diagnostics a proposer gains nothing from (seeds, hashes, per-point figures) or sees elsewhere.
QUIET = frozenset({"seed", "binary_sha256", "verification", "bench", "margin", "placements", "element_aligned",
                   "suspicious", "family", "resources"})


def feedback_text(verdict: Any, margin: float) -> str:
    """What a proposer is told of a verdict: one line, then the diagnostics raw (a compiler's log as it
    printed it, not JSON-escaped), cut at a line end, and (CUDA) the kernels' registers and spills."""
    diagnostics = verdict.diagnostics or {}
    usage = resources.summary(diagnostics.get("resources") or [])
    if verdict.accepted:
        head = f"accepted: {verdict.speedup:.3f}x ({verdict.kernel_us:.2f} us vs eager {verdict.eager_us:.2f} us)"
        return head + (f"\n{usage}" if usage else "")
    lines = [f"{verdict.category}: {verdict.reason}"]
    if verdict.category == "slower" and verdict.speedup is not None:
        lines[0] += (f" (measured {verdict.speedup:.3f}x, interval {verdict.ci_low:.3f}-{verdict.ci_high:.3f}; "
                     f"needs at least {1 + margin:.2f}x with the interval above 1)")
    if usage:
        lines.append(usage)
    if isinstance(diagnostics, str):
        lines.extend(diagnostics.splitlines())
        diagnostics = {}
    for key, value in diagnostics.items():
        if key in QUIET:
            continue
        if isinstance(value, str) and "\n" in value.strip():
            lines.append(f"{key}:")
            lines.extend(value.rstrip().splitlines())
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            lines.append(f"{key}: {text}")
    return whole_lines(lines, FEEDBACK_CHARS)


def whole_lines(lines: list[str], limit: int) -> str:
    """`lines` joined, as many as fit in `limit` characters (the first always), each at most LINE_CHARS;
    what is left out is counted, never cut mid-line.

    >>> whole_lines(["error: a", "  at b", "  at c"], 16)
    'error: a\\n  at b\\n[1 more line]'
    """
    kept, used = [], 0
    for k, line in enumerate(lines):
        if len(line) > LINE_CHARS:
            line = line[:LINE_CHARS] + " [...]"
        if kept and used + len(line) + 1 > limit:
            left = len(lines) - k
            kept.append(f"[{left} more line{'s' if left != 1 else ''}]")
            break
        kept.append(line)
        used += len(line) + 1
    return "\n".join(kept)


@dataclass
class Sent:
    """A call decided and sent to an LLM, its reply not yet recorded (one of the open round's)."""

    key: int  # its provisional key in `Search.history` (negative)
    card: Card
    tree: Tree
    parent_id: int | None
    parent_hash: str
    occurrence: int
    decision: Decision
    request: dict
    worst: float
    future: Future  # (reply, attempts, seconds)


class Search:
    """One build's search over `cards` (mutable state; `run()` once)."""

    def __init__(
        self,
        workspace: Workspace,
        cards: Sequence[Card],
        proposer: Proposer,
        executor: Executor,
        settings: Settings,
        store: Store | None = None,
        reporter: Reporter | None = None,
    ):
        self.ws = workspace
        self.cards = {c.id: c for c in cards}
        self.proposer = proposer
        self.executor = executor
        self.settings = settings = settings.resolved()
        self.exchanger = exchanges(proposer)
        adaptive = bool(getattr(proposer, "adaptive", False))
        # A paid proposer (an LLM) gets up to `samples` calls in flight per card, so each call sees the
        # verdicts before it; a free deterministic one (templates) proposes untried points in parallel.
        self.concurrency = settings.concurrency if self.exchanger else 1
        self.cfg = settings.allocator or Config(
            floor_us=FLOOR_US.get(settings.target, 1.0), margin=settings.margin,
            max_pending=settings.samples if adaptive else None,
        )
        self.paid = bool(getattr(proposer, "paid", False))
        if self.paid and settings.allocator is None:
            self.cfg = dataclasses.replace(self.cfg, min_gain_per_dollar=settings.min_gain_per_dollar)
        # an LLM refines the best kernels (and samples several first attempts); templates walk by UCT
        self.tree_config = dataclasses.replace(settings.tree, policy="best") if adaptive else settings.tree
        self.store = store or Store(workspace.store_path)
        self.reporter = reporter or Reporter()
        self.decide = allocator.STRATEGIES[settings.strategy]
        self._unsupported = unsearchable(workspace, cards, proposer, settings.target)
        self.exhausted: set[str] = set()
        self.history: dict[int, CallResult] = {}  # call id -> result, in call order (open round: negative ids)
        self.call_candidate: dict[int, int] = {}  # call id -> the new candidate it made
        self.trees: dict[str, Tree] = {}
        self.inflight: dict[Future, CandidateRecord] = {}  # in submission order, the order results are taken in
        self.round: list[Sent] = []  # LLM calls sent, not yet recorded, in the order they were decided
        self.asked: Counter = Counter()  # calls so far per (card, parent source hash): the cassette's key
        self.cassette = cassette.Cassette.of_workspace(workspace.root) if self.exchanger else None
        where = cassette.replay_dir() if self.exchanger else None
        self.replay = cassette.Replay(where) if where is not None else None
        self._pool: ThreadPoolExecutor | None = None
        # CUDA: registers and spills of each LLM candidate, for its feedback (ptxas, beside the evaluation)
        self._ptxas: ThreadPoolExecutor | None = None
        self._usage: dict[int, Future] = {}
        self._provisional = 0
        self._nominal_cost: float | None = None
        self.lag = 1  # candidates in flight when a call is decided; fixed in `run`
        self.new_calls = 0
        self.evaluated = 0
        self.clock = time.monotonic  # the deadline's clock (tests advance their own)
        self.started = self.clock()
        self._covers = allocator.coverage(list(self.cards.values()))  # the cards never change

    # --- state -----------------------------------------------------------------------------------

    def states(self) -> list[allocator.CardState]:
        return allocator.card_states(
            self.cards.values(), self.history.values(), lambda c: self._unsupported[c.id], self.exhausted,
            self.cfg.improvement, self._covers,
        )

    def _rebuild(self) -> list[CandidateRecord]:
        """Trees and history from the store; returns the candidates still to evaluate."""
        states = {s.card_id: s for s in self.states()}
        for card_id, state in states.items():
            ceiling = allocator.achievable_headroom(state, self.cfg)
            self.trees[card_id] = Tree(card_id, ceiling, self.tree_config)
        candidates = {c.id: c for c in self.store.candidates() if c.card_id in self.cards}
        for cand in candidates.values():
            tree = self.trees[cand.card_id]
            tree.add(cand.id, cand.parent_id, cand.proposer, cand.params)
            if cand.state == "evaluated":
                self._record_in_tree(tree, cand)
        for call in self.store.calls():
            if call.card_id not in self.cards:
                continue
            if call.proposer == self.proposer.name:
                parent = candidates.get(call.parent_id) if call.parent_id else None
                self.asked[(call.card_id, parent.source_hash if parent else "")] += 1
            cand = candidates.get(call.candidate_id) if call.candidate_id else None
            if call.outcome == "new" and cand is not None:
                self.history[call.id] = call_result(cand)
                self.call_candidate[call.id] = cand.id
            else:
                self.history[call.id] = CallResult(call.card_id)
                if call.feedback:
                    self.trees[call.card_id].note(call.parent_id, call.feedback)
        return [c for c in candidates.values() if c.state == "pending"]

    @staticmethod
    def _record_in_tree(tree: Tree, cand: CandidateRecord) -> None:
        usage = ((cand.verdict or {}).get("diagnostics") or {}).get("resources") or []
        tree.record(
            cand.id, accepted=bool(cand.accepted), category=cand.category, speedup=cand.speedup,
            kernel_us=cand.kernel_us, eager_us=cand.eager_us, feedback=cand.feedback, ci_low=cand.ci_low,
            ci_high=cand.ci_high, resources=resources.summary(usage),
        )

    def summary(self, card_id: str, states: list[allocator.CardState] | None = None) -> CardSummary:
        card, tree = self.cards[card_id], self.trees[card_id]
        best = tree.best()
        states = states if states is not None else self.states()
        state = next(s for s in states if s.card_id == card_id)
        return CardSummary(
            card_id=card_id,
            op=card.op_name,
            signature=card.signature(),
            share=card.profile.share,
            baseline=card.profile.baseline,
            calls=sum(1 for r in self.history.values() if r.card_id == card_id),
            counts=tree.counts(),
            best_speedup=best.speedup if best else None,
            best_candidate=best.id if best else None,
            kernel_us=best.kernel_us if best else None,
            roofline_us=card.profile.roofline_us,
            eager_us=card.profile.eager_us,
            fused_away=allocator.fused_away(state, allocator.accepted_fusions(states)),
        )

    # --- budget ----------------------------------------------------------------------------------

    def _stop_reason(self) -> str | None:
        spent = self.store.calls_spent(self.proposer.name) + len(self.round)
        if spent >= self.settings.budget:
            return f"budget spent: {spent} of {self.settings.budget} {self.proposer.name} calls"
        if self.settings.deadline is not None:
            now = self.clock()
            # the next call is expected to take this run's average so far: it must end before the deadline
            per_call = (now - self.started) / self.new_calls if self.new_calls else 0.0
            if now + per_call > self.settings.deadline:
                return (f"time limit: {spent} of {self.settings.budget} {self.proposer.name} calls spent when the "
                        f"next call would end past it (a later build with more time continues)")
        if self.settings.max_cost is not None and self.proposer.paid:
            dollars = self._committed()  # each call's worst case is checked as it is made (`_over_cap`)
            if dollars >= self.settings.max_cost:
                return f"cost cap: ${dollars:.4f} spent of ${self.settings.max_cost:.4f}"
        return None

    def _committed(self) -> float:
        """Dollars spent, with the worst case of each call still in flight."""
        return self.store.spend()[2] + sum(sent.worst for sent in self.round)

    def _config(self) -> Config:
        """The allocator's config, with what a paid call is expected to cost (for the minimum gain per
        dollar and `--explain`): the mean of this proposer's calls so far, before any the worst case of a
        first prompt."""
        if not self.paid:
            return self.cfg
        mean = self.store.mean_cost(self.proposer.name)
        cost = mean if mean is not None else self._nominal_cost
        return dataclasses.replace(self.cfg, cost_per_call=cost or 0.0)

    # --- the loop --------------------------------------------------------------------------------

    def run(self) -> SearchResult:
        started = time.monotonic()
        self.started = self.clock()
        # one more in flight per extra evaluator: when results finish out of order, the evaluator that
        # finished early still has a candidate to take while the search waits for the oldest; and room
        # for a round of LLM calls beside them
        self.lag = (max(1, int(self.executor.slots)) + max(0, int(getattr(self.executor, "evaluators", 1)) - 1)
                    + self.concurrency - 1)
        for cand in self._rebuild():
            self._submit(cand)
        if self.inflight:
            self.reporter.note(f"resuming: {len(self.inflight)} proposed candidates still to evaluate")
        gated = sorted(cid for cid, why in self._unsupported.items() if why and why.startswith(GATE_DROPPED))
        if gated:
            self.reporter.note(f"{len(gated)} cards get no calls, the end-to-end gate dropped their kernels: "
                               + ", ".join(gated))
        if self.replay is not None:
            self.reporter.note(f"replaying the LLM's replies from {self.replay.root} ({cassette.REPLAY_ENV})")
        self._nominal_cost = self._first_prompt_cost()
        remaining = max(0, self.settings.budget - self.store.calls_spent(self.proposer.name))
        plan = allocator.plan(self.states(), remaining, self._config(), self.settings.strategy)
        self.reporter.plan(plan, remaining)
        if self.exchanger and self.replay is None:
            self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="llm")
        try:
            stopped = self._loop()
            self._flush()
            while self.inflight:
                self._take_oldest()
        finally:
            for pool in (self._pool, self._ptxas):
                if pool is not None:
                    pool.shutdown(wait=False, cancel_futures=True)
        tokens_in, tokens_out, cost = self.store.spend()
        states = self.states()
        return SearchResult(
            cards=[self.summary(cid, states) for cid in self.cards],
            accepted=self.accepted(),
            plan=plan,
            calls=self.store.calls_spent(self.proposer.name),
            new_calls=self.new_calls,
            evaluated=self.evaluated,
            tokens=(tokens_in, tokens_out),
            cost=cost,
            wall_s=time.monotonic() - started,
            stopped=stopped,
        )

    def _loop(self) -> str:
        while True:
            stop = self._stop_reason()
            if stop:
                return stop
            if len(self.inflight) + len(self.round) >= self.lag:
                if self.round:
                    self._flush()
                else:
                    self._take_oldest()
                continue
            decision = self.decide(self.states(), self._config())
            if decision.card_id is None:
                if self.round:
                    self._flush()
                    continue
                if self.inflight:
                    self._take_oldest()
                    continue
                return decision.reason
            stop = self._call(decision)
            if stop:
                return stop
            if len(self.round) >= self.concurrency:
                self._flush()

    def _call(self, decision: Decision) -> str | None:
        """Make the decided call; returns why the search stops instead (the call could pass the cost cap)."""
        card, tree = self.cards[decision.card_id], self.trees[decision.card_id]
        in_flight = sum(1 for r in self.history.values() if r.pending and r.card_id == card.id)
        while True:
            node = tree.select(in_flight)
            if node is None:
                self.exhausted.add(card.id)
                return None
            parent = self._parent(node)
            lineage, feedback = tree.lineage(node), tree.feedback(node)
            if self.exchanger:
                parent_hash = self.store.candidate(node.id).source_hash if node.id is not None else ""
                occurrence = self.asked[(card.id, parent_hash)]
                context = self._context(card, tree, node, occurrence)
                request = self.proposer.request(card, parent, lineage, feedback, context)
                worst = float(self.proposer.worst_case_cost(request))
                over = self._over_cap(card, worst)
                if over:
                    return over
                self._send(card, tree, node.id, parent_hash, occurrence, decision, request, worst)
                return None
            over = self._over_cap(card, self._worst_case(card, parent, lineage, feedback))
            if over:
                return over
            tried = frozenset(n.params_key() for n in tree.nodes.values())
            try:
                started = time.monotonic()
                proposal = self.proposer.propose(card, parent, lineage, feedback, tried)
                seconds = time.monotonic() - started
            except NothingToPropose:
                tree.mark_exhausted(node)
                continue
            self._record(card, tree, node.id, proposal, decision, seconds)
            return None

    def _parent(self, node: Node) -> Parent | None:
        if node.id is None:
            return None
        rec = self.store.candidate(node.id)
        return Parent(candidate_id=node.id, source=(self.ws.root / rec.source_path).read_text(), params=node.params,
                      proposer=node.proposer, speedup=node.speedup, kernel_us=node.kernel_us)

    def _worst_case(self, card: Card, parent: Parent | None, lineage: Sequence[Any],
                    feedback: Sequence[str]) -> float | None:
        """A proposer's bound on the dollars of this very call (None: it states none)."""
        if self.settings.max_cost is None or not self.proposer.paid:
            return 0.0
        bound = getattr(self.proposer, "worst_case_cost", None)
        return None if bound is None else float(bound(card, parent, lineage, feedback))

    def _over_cap(self, card: Card, worst: float | None) -> str | None:
        """Why this call may not be made under `max_cost`: its worst case (the proposer's bound for this
        very prompt, at the most output it allows), added to what is spent and to the worst case of the
        calls still in flight, could pass the cap. Checked before every call, the first included: an
        average of the calls so far says nothing before the first and too little after."""
        cap = self.settings.max_cost
        if cap is None or not self.proposer.paid:
            return None
        if worst is None:
            return (f"cost cap: the {self.proposer.name} proposer states no worst-case cost of a call, so no call "
                    f"can be shown to stay under ${cap:.2f}")
        spent = self._committed()
        if spent + worst > cap:
            return (f"cost cap: ${spent:.4f} spent; the next call ({card.id}) could cost up to ${worst:.4f}, "
                    f"past the ${cap:.4f} cap")
        return None

    def _first_prompt_cost(self) -> float | None:
        """The worst case of a from-scratch call to the card with the largest share that may get calls:
        what the allocator takes a call to cost until the first one is recorded."""
        if not (self.exchanger and self.paid):
            return None
        open_cards = [c for c in self.cards.values() if not self._unsupported[c.id] and c.profile is not None]
        if not open_cards:
            return None
        card = max(open_cards, key=lambda c: (c.profile.share, c.id))
        return float(self.proposer.worst_case_cost(self.proposer.request(card, None, [], [], Context())))

    # --- LLM calls: sent in parallel, recorded in order --------------------------------------------

    def _send(self, card: Card, tree: Tree, parent_id: int | None, parent_hash: str, occurrence: int,
              decision: Decision, request: dict, worst: float) -> None:
        self.asked[(card.id, parent_hash)] += 1
        if self.replay is not None:
            recorded = self.replay.reply(card.id, parent_hash, occurrence, self.proposer.name)
            future: Future = Future()
            future.set_result((recorded.reply, recorded.attempts, recorded.seconds))
        else:
            future = self._pool.submit(self._timed_send, request)
        self._provisional -= 1
        self.history[self._provisional] = CallResult(card.id, pending=True)
        self.round.append(Sent(self._provisional, card, tree, parent_id, parent_hash, occurrence, decision, request,
                               worst, future))

    def _timed_send(self, request: dict) -> tuple[dict, int, float]:
        started = time.monotonic()
        reply, attempts = self.proposer.send(request)
        return reply, attempts, time.monotonic() - started

    def _flush(self) -> None:
        """Record the open round's calls in the order they were decided (each exchange to the cassette
        first), whatever order their replies came in. A call whose API gave up is not recorded; the
        others are, then its error stops the build (the same command resumes)."""
        sent, self.round = self.round, []
        error: BaseException | None = None
        for item in sent:
            del self.history[item.key]
            try:
                reply, attempts, seconds = item.future.result()
            except BaseException as err:  # re-raised below, once the others are recorded
                error = error or err
                continue
            proposal = self.proposer.parse(item.request, reply, attempts, seconds)
            self.cassette.record(cassette.Exchange(
                card_id=item.card.id, parent_hash=item.parent_hash, occurrence=item.occurrence,
                proposer=self.proposer.name, model=proposal.model, request=item.request, reply=reply,
                attempts=attempts, seconds=round(seconds, 3)))
            self._record(item.card, item.tree, item.parent_id, proposal, item.decision, seconds)
        if error is not None:
            raise error

    def _context(self, card: Card, tree: Tree, node: Node, attempt: int = 0) -> Context:
        """What else the prompt shows: the card's other evaluated kernels (the node's siblings among them),
        its best kernel (when the node is not it), the best accepted kernels of similar cards, and how
        many calls from the node came before."""
        best = tree.best() or next(iter(tree.ranked()), None)
        shown = self._example(card.id, best) if best is not None and best.id != node.id else None
        similar = []
        for other, other_tree in self.trees.items():
            kept = other_tree.best()
            if other == card.id or kept is None or not similar_cards(card, self.cards[other]):
                continue
            example = self._example(other, kept)
            if example is not None:
                similar.append(example)
        similar.sort(key=lambda e: (-(e.speedup or 0.0), e.candidate_id))
        return Context(evaluated=tuple(tree.evaluated(node)), best=shown, similar=tuple(similar[:SIMILAR]),
                       attempt=attempt)

    def _example(self, card_id: str, node: Node) -> Example | None:
        source = (self.ws.root / self.store.candidate(node.id).source_path).read_text()
        if len(source) > EXAMPLE_CHARS:
            return None
        verdict = "accepted" if node.accepted else (node.category or "slower")
        return Example(node.id, card_id, self.cards[card_id].signature(), source, node.speedup, verdict)

    def _record(
        self, card: Card, tree: Tree, parent_id: int | None, proposal: Proposal, decision: Decision, seconds: float
    ) -> None:
        digest = rel_path = None
        if proposal.source is not None:
            digest = source_hash(proposal.source)
            rel_path = f"kernels/{card.id}/{digest[:16]}{source_suffix(self.settings.target)}"
            path = self.ws.root / rel_path
            if not path.exists():  # written before the call row: a pending candidate always has its source
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(path.suffix + ".tmp")
                tmp.write_text(proposal.source)
                tmp.replace(path)
        call, cand = self.store.record_call(
            card_id=card.id,
            parent_id=parent_id,
            proposer=self.proposer.name,
            reason=decision.reason,
            decision=decision.to_json(),
            model=proposal.model,
            tokens_in=proposal.tokens[0],
            tokens_out=proposal.tokens[1],
            cost=proposal.cost,
            seconds=seconds,
            source_hash=digest,
            source_path=rel_path,
            params=proposal.params,
            candidate_proposer=proposal.label or self.proposer.name,
            feedback=proposal.feedback,
        )
        self.new_calls += 1
        if call.outcome == "new":
            tree.add(cand.id, parent_id, cand.proposer, cand.params)
            self.history[call.id] = CallResult(card.id, pending=True)
            self.call_candidate[call.id] = cand.id
            self._submit(cand)
        else:
            self.history[call.id] = CallResult(card.id)
            tree.note(parent_id, call.feedback or call.outcome)
        self.reporter.decided(call, decision)

    def _submit(self, cand: CandidateRecord) -> None:
        path = self.ws.root / cand.source_path
        if not path.is_file():
            raise ForgepackError(f"candidate #{cand.id}'s source {cand.source_path} is missing from the workspace "
                                 f"{self.ws.root}; restore it, or delete {self.ws.store_path.name} to start over")
        source = path.read_text()
        samples = self.ws.sample_path(cand.card_id)
        future = self.executor.submit(self.cards[cand.card_id], source, samples if samples.exists() else None)
        self.inflight[future] = cand
        if self.settings.target == "cuda" and getattr(self.proposer, "adaptive", False):
            if self._ptxas is None:
                self._ptxas = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ptxas")
            self._usage[cand.id] = self._ptxas.submit(resources.usage, source, self.settings.arch)

    def _take_oldest(self) -> None:
        """Wait for the earliest submitted candidate still in flight and record its verdict (later
        ones that are done already wait their turn: see the module docstring)."""
        future = next(iter(self.inflight))
        cand = self.inflight.pop(future)
        verdict = future.result()  # an executor failure (not a kernel's) stops the build, resumable
        usage = self._usage.pop(cand.id, None)
        if usage is not None and verdict.category not in ("static", "compile"):
            kernels = usage.result()  # started with the evaluation, done long before it
            if kernels:
                diagnostics = {**verdict.diagnostics, "resources": [dataclasses.asdict(k) for k in kernels]}
                verdict = dataclasses.replace(verdict, diagnostics=diagnostics)
        binary = self._keep_binary(cand, verdict) if verdict.accepted else None
        cand = self.store.record_verdict(cand.id, verdict_row(verdict, self.settings.margin, binary))
        self.evaluated += 1
        tree = self.trees[cand.card_id]
        self._record_in_tree(tree, cand)
        self.exhausted.discard(cand.card_id)  # a new working node may open the tree again
        for call_id, candidate_id in self.call_candidate.items():
            if candidate_id == cand.id:
                self.history[call_id] = call_result(cand)
        self.reporter.evaluated(cand, self.summary(cand.card_id))

    def _keep_binary(self, cand: CandidateRecord, verdict: Any) -> str | None:
        """Copy the verified, timed object into the workspace: that exact file is what ships."""
        if not verdict.binary:
            return None
        rel = f"kernels/{cand.card_id}/{cand.source_hash[:16]}{Path(verdict.binary).suffix or '.so'}"
        dest = self.ws.root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(verdict.binary, dest)
        verified = verdict.diagnostics.get("binary_sha256")
        if verified and file_sha256(dest) != verified:
            dest.unlink()
            raise ForgepackError(f"candidate #{cand.id}: {verdict.binary} is not the object that was verified and "
                                 f"timed (its sha256 differs from {verified[:16]}); run the build again")
        return rel

    # --- results ---------------------------------------------------------------------------------

    def accepted(self) -> list[AcceptedKernel]:
        """The best accepted candidate per card: the earliest unless a later one is clearly faster
        (`tree.clearly_faster`: beyond both timings' noise)."""
        from forgepack.templates import needs_of  # lazy, as the templates proposer imports them

        out = []
        for card_id, tree in self.trees.items():
            best = tree.best()
            if best is None:
                continue
            rec = self.store.candidate(best.id)
            card = self.cards[card_id]
            out.append(
                AcceptedKernel(
                    card_id=card_id,
                    target=self.settings.target,
                    arch=self.settings.arch,
                    source=rec.source_path,
                    binary=rec.binary_path or "",
                    source_hash=rec.source_hash,
                    speedup=rec.speedup,
                    ci_low=rec.ci_low,
                    ci_high=rec.ci_high,
                    eager_us=rec.eager_us,
                    kernel_us=rec.kernel_us,
                    proposer=rec.proposer,
                    candidate_id=rec.id,
                    kind=card.kind,
                    needs=self._needs(card, rec, needs_of),
                    binary_sha256=(rec.verdict or {}).get("diagnostics", {}).get("binary_sha256", ""),
                    served=accepted_mod.served_of(rec.verdict),
                )
            )
        return sorted(out, key=lambda k: -self.cards[k.card_id].profile.share)

    def _needs(self, card: Card, rec, needs_of) -> Any:
        """What the guard checks of an accepted kernel's pointers: the template's statement where it was
        verified, that is where it states today's rule (each input at the offset modulo 16 bytes it was
        verified at) or the kernel was also verified with every input one element along (a family
        kernel, an exact CPU kernel: `familyeval.element_aligned`); else None, today's rule."""
        from forgepack import familyeval

        stated = needs_of(card, self.settings.target, rec.params)
        if stated is None or stated == needs_mod.default(card) or familyeval.element_aligned(rec.verdict):
            return stated
        return None


GATE_DROPPED = "the end-to-end gate dropped its kernel"


def similar_cards(card: Card, other: Card) -> bool:
    """Whether a kernel of `other` is worth showing as an example for `card`: the same operator overload
    (another shape or layout of it); for a fusion card, the same chain of ops.

    >>> from forgepack.cards import Card
    >>> similar_cards(Card("aten.mul.Tensor", "", (), ()), Card("aten.mul.Tensor", "", (), (), calls=3))
    True
    """
    if card.op != other.op or card.kind != other.kind:
        return False
    return card.kind != "fusion" or [e.op for e in card.chain] == [e.op for e in other.chain]


def unsearchable(workspace: Workspace, cards: Sequence[Card], proposer: Proposer, target: str) -> dict[str, str | None]:
    """Per card, why no call may go to it (None: calls may): the proposer cannot write its kernels, the
    pack could never dispatch one (a factory op such as `arange` has no tensor to guard on), it is one
    op of integer bookkeeping (`bookkeeping_reason`), or the
    workspace's last pack dropped its kernel at the end-to-end gate (a faster kernel alone would not pay
    in the model either). Each reason is the allocator's drop reason, so the plan and `--explain` show it."""
    from forgepack.pack import shimgen

    includes = shimgen.torch_include_dirs()
    gated = gate_drops(workspace)
    return {c.id: proposer.unsupported(c) or dispatch_reason(c, target, includes) or bookkeeping_reason(c)
            or gated.get(c.id) for c in cards}


BOOKKEEPING = "integer bookkeeping (generate()'s positions and counters): one stock launch for one kernel launch"


def bookkeeping_reason(card: Card) -> str | None:
    """Why a single op on integers only (cache positions, counters, index arithmetic: `generate()`'s own
    and the decode loop's) gets no call: its kernel would replace one launch of a few elements with
    another, a gain no budget should buy. A fusion of such calls still saves launches and may get calls."""
    if card.kind == "fusion":
        return None
    metas = [m for m in card.tensor_inputs() if m is not None] + list(card.outputs)
    if metas and all(m.dtype.startswith(("int", "uint")) or m.dtype == "bool" for m in metas):
        return BOOKKEEPING
    return None


def dispatch_reason(card: Card, target: str, includes: list[Path] | None = None) -> str | None:
    """Why the pack's guarded dispatch could never serve a kernel for `card`, or None."""
    from forgepack.pack import fusedgen, shimgen

    if card.kind == "fusion":
        why = fusedgen.unsupported_reason(card, target)
    else:
        why = shimgen.unsupported_reason(card, target, includes)
    return f"the pack cannot dispatch it: {why}" if why else None


def gate_drops(workspace: Workspace) -> dict[str, str]:
    """Cards whose kernel the workspace's last pack dropped at the end-to-end gate, with the gate's reason.
    A pack refused as a whole (it would not pay) drops no card for good: each of its kernels paid alone."""
    if not (workspace.root / packreport.FILE).is_file():
        return {}
    try:
        report = packreport.PackReport.from_json(workspace.read_json(packreport.FILE))
    except (ValueError, KeyError, TypeError):
        return {}  # an unreadable report holds no verdicts; the next pack writes a new one
    return {d.card_id: f"{GATE_DROPPED} in the last pack: {d.reason}" for d in report.dropped
            if d.stage == "gate" and not (report.refused and d.reason == report.refused)}


def call_result(cand: CandidateRecord) -> CallResult:
    """What a candidate did for its call, as the allocator counts it (pending until evaluated)."""
    if cand.state == "pending":
        return CallResult(cand.card_id, pending=True)
    return CallResult(cand.card_id, accepted=bool(cand.accepted), speedup=cand.speedup)


def save_accepted(workspace: Workspace, kernels: list[AcceptedKernel]) -> Path:
    return accepted_mod.save_all(workspace.root, kernels)


def result_json(result: SearchResult) -> dict[str, Any]:
    """Plain data for benchmarks and `--json`."""
    return {
        "calls": result.calls,
        "new_calls": result.new_calls,
        "evaluated": result.evaluated,
        "tokens": list(result.tokens),
        "cost": result.cost,
        "wall_s": result.wall_s,
        "stopped": result.stopped,
        "estimated_gain": result.estimated_gain,
        "cards": [{**dataclasses.asdict(c), "gain": c.gain, "roofline_pct": c.roofline_pct} for c in result.cards],
        "accepted": [dataclasses.asdict(k) for k in result.accepted],
        "plan": [dataclasses.asdict(r) for r in result.plan],
    }
