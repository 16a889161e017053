"""The allocator: which card gets the next proposer call. Pure functions of cards + history.

Objective (as Ansor's task scheduler: the sum over tasks of weight x latency): the model's estimated
end-to-end gain, sum over cards of ``share x (1 - 1/speedup)``. Each call goes to the card with the
highest estimated gain per call:

    forward  = p(success) x share x (1/best - 1/next)          expected gain of one more call
    backward = share x (1/best[t-w] - 1/best[t]) / w            gain actually realised over the last w calls
    score    = alpha x backward + (1 - alpha) x forward         (forward alone until w calls are evaluated)

- ``best`` is the card's best accepted speed-up so far (1.0: eager). ``next`` is what a success is
  expected to reach, as a fraction of the log headroom still open: a first kernel reaches
  ``headroom ** reach.first``, a refinement ``best x (headroom / best) ** reach.refine`` (at least 5%
  past the best, never past the ceiling). Both fractions start from priors (half the way for a first
  kernel, a quarter for a refinement) and are learned online from what successes on all cards really
  reached, so the budget does not chase refinements that only ever give a few percent.
- The achievable headroom is eager time over roofline time, where no kernel can be faster than
  ``floor_us`` (launch latency: a 5 us op with a 0.01 us roofline does not have 500x to give) and the
  whole is capped at ``headroom_cap`` (roofline estimates of odd ops are not to be trusted further). A
  card whose best kernel already went well past its roofline (the estimate was wrong) keeps a refinement
  margin above its best instead of being dropped as at its ceiling.
- ``p(success)``, the chance that one call improves the card's best, is a Beta posterior: the baseline
  class's prior (vendor kernels are rarely beaten, native ones often), updated with the results of the
  other cards of the same class, shrunk into the card's own results (``prior_strength`` pseudo-calls).
  Calls still being evaluated count as failures until their verdict arrives (a virtual loss, so parallel
  slots do not all pile onto one card).
- Fusion cards overlap operator cards: a fusion card's chain is made of calls that operator cards also
  count. Once a fusion card has an accepted kernel, the calls inside its chains no longer run, so an
  operator card's share shrinks by the fraction of its calls those chains cover (`coverage`): the
  budget is not spent on ops already fused away, and the estimated gain (`total_gain`) counts each
  call's time once.
- A card is dropped for good when it is a view (no kernel runs), nothing can write kernels for it, its
  headroom is below the acceptance margin, its best already reached the ceiling, its search space is
  exhausted, or it has gone ``patience`` calls without improving (Ansor drops tasks that stop yielding).

- A paid proposer's call must be expected to save at least ``min_gain_per_dollar`` of the model's
  operator time per dollar: a card whose score over ``cost_per_call`` (what a call is expected to cost,
  the search's running mean) falls below it gets no call now (`--min-gain-per-dollar`).

Every decision carries its reason, and the per-card scores it compared, so `--explain` and the store can
say why each call went where it did (with the gain per dollar where calls cost money).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from forgepack import families
from forgepack.cards import Card, output_key

# Beta(a, b) priors on "one call improves this card", per baseline class.
DEFAULT_PRIORS: dict[str, tuple[float, float]] = {
    "vendor": (0.5, 9.5),  # cuBLAS/cuDNN/flash: 5%; Kernel Forge beat 1 of 9 such ops
    "native": (2.0, 3.0),  # PyTorch's own kernels: 40%; Kernel Forge beat 13 of 24
    "fusion": (2.5, 2.5),  # a chain of launches replaced by one: 50%
}
NEVER_SEARCHED = ("view",)


@dataclass(frozen=True)
class Config:
    priors: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_PRIORS))
    prior_strength: float = 4.0
    headroom_cap: float = 8.0
    floor_us: float = 0.0  # the fastest any kernel can be on this target (launch latency)
    first_reach: float = 0.5  # prior: a first kernel goes half the log way to the ceiling
    refine_reach: float = 0.25  # prior: a refinement a quarter of the log way still open
    reach_strength: float = 3.0  # pseudo-observations behind those priors
    step: float = 0.05
    refine_margin: float = 0.25  # room a card past the headroom cap keeps above its best
    window: int = 3  # Ansor's backward window
    alpha: float = 0.5  # weight of the backward (realised) gain once the window is filled
    patience: int = 6  # calls without improvement before a card is dropped
    margin: float = 0.05  # acceptance margin: a card whose headroom is below it cannot win
    max_pending: int | None = None  # calls in flight per card (1 for an LLM: each call sees the last verdict)
    improvement: float = 0.02  # a better kernel counts as a success only past this (smaller is timing noise)
    min_gain_per_dollar: float = 0.0  # a paid call's expected end-to-end gain per dollar must reach this
    cost_per_call: float = 0.0  # dollars a call is expected to cost (0: free, or not known yet)

    def prior(self, baseline: str) -> tuple[float, float]:
        return self.priors.get(baseline, self.priors["native"])


@dataclass(frozen=True)
class CardState:
    """One card as the allocator sees it: profile facts plus its search history."""

    card_id: str
    op: str
    share: float
    eager_us: float
    roofline_us: float
    baseline: str
    headroom: float = 0.0  # the profile's eager/roofline, used when roofline_us is unknown
    unsupported: str | None = None  # why the proposer cannot write kernels for it, if it cannot
    exhausted: bool = False  # its search tree can grow no further
    best: tuple[float, ...] = ()  # best speed-up after each evaluated call, in call order
    successes: float = 0.0  # evaluated calls that improved the best
    pending: int = 0  # calls made whose candidates are not evaluated yet
    since_improvement: int = 0  # evaluated calls since the last improvement (all of them if none)
    covered: tuple[tuple[str, float], ...] = ()  # (fusion card, fraction of this card's calls in its chains)
    kind: str = "op"  # "op" | "fusion"

    @property
    def evaluated(self) -> int:
        return len(self.best)

    @property
    def calls(self) -> int:
        return len(self.best) + self.pending

    @property
    def best_speedup(self) -> float:
        return self.best[-1] if self.best else 1.0


@dataclass(frozen=True)
class Score:
    card_id: str
    score: float
    forward: float
    backward: float
    p: float
    headroom: float  # achievable
    gain: float  # end-to-end gain if the next call succeeds
    dropped: str | None = None  # why this card gets no more calls (now)
    per_dollar: float | None = None  # score over the expected cost of a call (None: calls are free)

    def short(self) -> str:
        if self.dropped:
            return f"{self.card_id}: dropped ({self.dropped})"
        return f"{self.card_id}: {self.score:.3g}"


@dataclass(frozen=True)
class Decision:
    card_id: str | None  # None: no card is worth a call now
    reason: str
    scores: tuple[Score, ...] = ()

    def to_json(self) -> dict:
        top = [s for s in self.scores if not s.dropped][:5]
        return {"card_id": self.card_id, "reason": self.reason, "top": [dataclasses.asdict(s) for s in top]}


@dataclass(frozen=True)
class CallResult:
    """One proposer call as history: its card, and once evaluated whether it gave an accepted kernel."""

    card_id: str
    pending: bool = False
    accepted: bool = False
    speedup: float | None = None


# --- history -------------------------------------------------------------------------------------


def card_states(
    cards: Iterable[Card],
    history: Iterable[CallResult],
    unsupported: Callable[[Card], str | None] = lambda card: None,
    exhausted: Iterable[str] = (),
    improvement: float = Config.improvement,
    covers: dict[str, tuple[tuple[str, float], ...]] | None = None,
) -> list[CardState]:
    """Allocator states from profiled cards and the calls made so far (in call order).

    The best speed-up follows every accepted kernel; a call is a success (for p and patience) when it
    gives the card its first accepted kernel or beats the best by more than `improvement`. `covers`:
    `coverage(cards)`, when the caller keeps it (the cards of a search never change).
    """
    exhausted = set(exhausted)
    cards = list(cards)
    covers = coverage(cards) if covers is None else covers
    by_card: dict[str, list[CallResult]] = {}
    for result in history:
        by_card.setdefault(result.card_id, []).append(result)
    states = []
    for card in cards:
        prof = card.profile
        if prof is None:
            raise ValueError(f"card {card.id} has no profile: run `forgepack profile` first")
        best, successes, since, pending, current = [], 0, 0, 0, 1.0
        for r in by_card.get(card.id, ()):
            if r.pending:
                pending += 1
                continue
            better = r.accepted and r.speedup is not None and r.speedup > current
            if better and (current == 1.0 or r.speedup > current * (1 + improvement)):
                successes, since = successes + 1, 0
            else:
                since += 1
            if better:
                current = r.speedup
            best.append(current)
        states.append(
            CardState(
                card_id=card.id,
                op=card.op,
                share=prof.share,
                eager_us=prof.eager_us,
                roofline_us=prof.roofline_us,
                baseline=prof.baseline,
                headroom=prof.headroom,
                unsupported=unsupported(card),
                exhausted=card.id in exhausted,
                best=tuple(best),
                successes=float(successes),
                pending=pending,
                since_improvement=since,
                covered=covers.get(card.id, ()),
                kind=card.kind,
            )
        )
    return states


def coverage(cards: Sequence[Card]) -> dict[str, tuple[tuple[str, float], ...]]:
    """For each operator card, the fraction of its calls that each fusion card's chains contain.

    A chain entry is matched to operator cards by op and output layout (the chain records its entries'
    outputs); where several cards share both (inputs laid out differently), the entry's calls are split
    in proportion to their calls. A family card (a fusion's or an operator's) takes part at each point
    capture saw, with that point's calls (`families.calls_at_points`): an envelope build's fused RMSNorm
    family covers the mean and cast families inside it, whose representatives may be other points'.
    """
    by_key = families.calls_by_output(cards)
    covered: dict[str, dict[str, float]] = {}
    for fusion in (c for c in cards if c.kind == "fusion"):
        for member, fused_calls in families.calls_at_points(fusion):
            for entry in member.chain:
                matches = by_key.get(output_key(entry.op, entry.outs), [])
                total = sum(n for _, n in matches)
                for card, n in matches:
                    if card.calls and total:  # it takes fused_calls * n / total of the card's calls
                        mine = covered.setdefault(card.id, {})
                        mine[fusion.id] = mine.get(fusion.id, 0.0) + fused_calls * n / total / card.calls
    return {cid: tuple((fid, min(1.0, f)) for fid, f in sorted(by.items())) for cid, by in covered.items()}


def fused_away(state: CardState, accepted_fusions: set[str] | frozenset[str]) -> float:
    """Fraction of this card's calls that run inside fusion kernels already accepted."""
    return min(1.0, sum(f for fid, f in state.covered if fid in accepted_fusions))


def accepted_fusions(states: Sequence[CardState]) -> frozenset[str]:
    return frozenset(s.card_id for s in states if s.kind == "fusion" and s.best_speedup > 1.0)


def effective_share(state: CardState, accepted: set[str] | frozenset[str]) -> float:
    """The share still worth searching: what accepted fusion kernels have not already taken over."""
    return state.share * (1.0 - fused_away(state, accepted))


# --- scoring -------------------------------------------------------------------------------------


def achievable_headroom(state: CardState, cfg: Config) -> float:
    """Eager time over the fastest a kernel could be (roofline, but no faster than launch latency).

    The cap tempers expectations, it is not a ceiling: a card whose best already passed it (a fused
    chain at 19x) keeps a refinement margin above its best, up to its measured headroom. Treating the
    cap as reached dropped such a card after one call on the H200 (search-ff77da0.md)."""
    if state.roofline_us > 0 and state.eager_us > 0:
        headroom = state.eager_us / max(state.roofline_us, cfg.floor_us)
    else:
        headroom = state.headroom
    capped = min(headroom, cfg.headroom_cap)
    if state.best_speedup >= capped:
        room = state.best_speedup * (1 + cfg.refine_margin)
        # a kernel well past the measured roofline proves the estimate wrong (on the cpu a small op's data
        # stays in cache, which a DRAM roofline does not count): it keeps its refinement margin
        beaten = state.best_speedup > max(1.0, headroom) * (1 + cfg.refine_margin)
        capped = room if beaten else min(headroom, room)
    return max(1.0, capped)


def success_probability(state: CardState, states: Sequence[CardState], cfg: Config) -> float:
    """Posterior mean of "one more call improves this card": class prior + peers, shrunk into its own."""
    a0, b0 = cfg.prior(state.baseline)
    peers = [s for s in states if s.baseline == state.baseline and s.card_id != state.card_id]
    wins = sum(s.successes for s in peers)
    tries = sum(s.evaluated for s in peers)
    p_class = (a0 + wins) / (a0 + b0 + tries)
    tries_here = state.evaluated + state.pending  # pending calls count as failures until they report
    return (cfg.prior_strength * p_class + state.successes) / (cfg.prior_strength + tries_here)


@dataclass(frozen=True)
class Reach:
    """How far successes go, as fractions of the log headroom still open (learned across cards)."""

    first: float  # a card's first accepted kernel: log(speedup) / log(headroom)
    refine: float  # a later improvement: log(new / old) / log(headroom / old)


def learned_reach(states: Sequence[CardState], cfg: Config) -> Reach:
    """Priors updated with every success seen so far (all cards: one model of what the proposer achieves)."""
    firsts, refines = [], []
    for state in states:
        headroom = achievable_headroom(state, cfg)
        previous = 1.0
        for best in state.best:
            if best <= previous:
                continue
            if previous > 1.0 and best <= previous * (1 + cfg.improvement):
                previous = best  # noise-sized: not a success, so not a measure of what one reaches
                continue
            if previous == 1.0:
                firsts.append(min(1.0, math.log(best) / math.log(headroom)) if headroom > 1 else 1.0)
            elif headroom > previous:
                refines.append(min(1.0, math.log(best / previous) / math.log(headroom / previous)))
            previous = best
    k = cfg.reach_strength
    return Reach(
        first=(k * cfg.first_reach + sum(firsts)) / (k + len(firsts)),
        refine=(k * cfg.refine_reach + sum(refines)) / (k + len(refines)),
    )


def next_speedup(state: CardState, headroom: float, reach: Reach, cfg: Config) -> float:
    """What the next success is expected to reach: part of the log way from the best to the ceiling.

    >>> next_speedup(CardState("c", "op", 0.1, 8.0, 2.0, "native"), 4.0, Reach(0.5, 0.25), Config())
    2.0
    """
    best = state.best_speedup
    if best <= 1.0:
        target = headroom**reach.first
    else:
        target = best * (headroom / best) ** reach.refine if headroom > best else best
    return min(headroom, max(target, best * (1 + cfg.step)))


def drop_reason(state: CardState, headroom: float, cfg: Config, share: float | None = None) -> str | None:
    """Why a card gets no more calls, or None. The last one is temporary (results still coming).
    `share`: the card's effective share (after accepted fusion kernels), default its profiled one."""
    if state.baseline in NEVER_SEARCHED:
        return f"{state.baseline}: no kernel runs, nothing to beat"
    if state.unsupported:
        return state.unsupported
    if state.share <= 0:
        return "no measured time"
    if share is not None and share <= 1e-6 * state.share:
        return "fused away: all its calls run inside accepted fusion kernels"
    if headroom < 1 + cfg.margin:
        return f"at roofline: headroom {headroom:.2f}x is below the {cfg.margin:.0%} margin"
    if state.best_speedup >= headroom:
        return f"best {state.best_speedup:.2f}x reached its achievable {headroom:.2f}x"
    if state.exhausted:
        return "search space exhausted"
    if state.since_improvement >= cfg.patience:
        return f"stopped improving: {state.since_improvement} calls without a better kernel"
    if state.since_improvement + state.pending >= cfg.patience:
        return "waiting: its last chances are still being evaluated"
    if cfg.max_pending is not None and state.pending >= cfg.max_pending:
        return "waiting: the verdict of its last call is not in yet"
    return None


def score(state: CardState, states: Sequence[CardState], cfg: Config, reach: Reach | None = None,
          fusions: frozenset[str] | None = None) -> Score:
    headroom = achievable_headroom(state, cfg)
    p = success_probability(state, states, cfg)
    best = state.best_speedup
    reach = reach or learned_reach(states, cfg)
    share = effective_share(state, accepted_fusions(states) if fusions is None else fusions)
    gain = max(0.0, share * (1 / best - 1 / next_speedup(state, headroom, reach, cfg)))
    forward = p * gain
    backward = 0.0
    if state.evaluated >= cfg.window:
        before = state.best[-cfg.window - 1] if state.evaluated > cfg.window else 1.0
        backward = share * (1 / before - 1 / best) / cfg.window
        value = cfg.alpha * backward + (1 - cfg.alpha) * forward
    else:
        value = forward
    dropped = drop_reason(state, headroom, cfg, share)
    per_dollar = value / cfg.cost_per_call if cfg.cost_per_call > 0 else None
    if dropped is None and per_dollar is not None and per_dollar < cfg.min_gain_per_dollar:
        dropped = (f"est. gain/$ {per_dollar:.2e} is below the minimum {cfg.min_gain_per_dollar:.2e} "
                   f"(a call is expected to cost ${cfg.cost_per_call:.4f})")
    return Score(state.card_id, 0.0 if dropped else value, forward, backward, p, headroom, gain, dropped, per_dollar)


def scores(states: Sequence[CardState], cfg: Config, reach: Reach | None = None) -> list[Score]:
    """Every card's score, best first (ties: larger share, then card id, so decisions are stable)."""
    share = {s.card_id: s.share for s in states}
    reach = reach or learned_reach(states, cfg)
    fusions = accepted_fusions(states)
    out = [score(s, states, cfg, reach, fusions) for s in states]
    return sorted(out, key=lambda s: (s.dropped is not None, -s.score, -share[s.card_id], s.card_id))


# --- decisions -----------------------------------------------------------------------------------


def decide(states: Sequence[CardState], cfg: Config, reach: Reach | None = None) -> Decision:
    """The card for the next call, with the reason: highest estimated end-to-end gain per call."""
    reach = reach or learned_reach(states, cfg)
    ranked = scores(states, cfg, reach)
    live = [s for s in ranked if not s.dropped and s.score > 0]
    if not live:
        waiting = [s for s in ranked if s.dropped and s.dropped.startswith("waiting")]
        why = "cards still being evaluated" if waiting else "every card is dropped or has nothing left to gain"
        return Decision(None, f"no card is worth a call: {why}", tuple(ranked))
    top = live[0]
    state = next(s for s in states if s.card_id == top.card_id)
    reason = (
        f"{top.card_id}: est. gain/call {top.score:.2e} (share {state.share:.1%}, {state.baseline}, "
        f"p {top.p:.2f}, headroom {top.headroom:.2f}x, best {state.best_speedup:.2f}x, "
        f"forward {top.forward:.2e}, recent {top.backward:.2e}, reach {reach.first:.2f}/{reach.refine:.2f})"
    )
    if top.per_dollar is not None:
        reason += f"; est. gain/$ {top.per_dollar:.2e} at ${cfg.cost_per_call:.4f} a call"
    if len(live) > 1:
        reason += f"; next best {live[1].card_id} {live[1].score:.2e}"
    return Decision(top.card_id, reason, tuple(ranked))


def decide_uniform(states: Sequence[CardState], cfg: Config, reach: Reach | None = None) -> Decision:
    """The baseline the allocator must beat: the budget split evenly over every searchable card."""
    usable = [
        s for s in states
        if s.baseline not in NEVER_SEARCHED and not s.unsupported and not s.exhausted and s.share > 0
    ]
    if not usable:
        return Decision(None, "uniform: no searchable card left")
    # ties by card id (a hash of the signature): arbitrary with respect to share, as a split that ignores
    # the profile is; ordering by share would make it a greedy allocator
    pick = min(usable, key=lambda s: (s.calls, s.card_id))
    return Decision(pick.card_id, f"uniform: fewest calls so far ({pick.calls}) among {len(usable)} cards")


def decide_breadth(states: Sequence[CardState], cfg: Config, reach: Reach | None = None) -> Decision:
    """Every card worth a call gets one before any gets a second: among the cards the allocator would
    not drop, the fewest calls so far, then the highest estimated gain per call. For a build that must
    reach many cards within a time limit rather than refine a few: a shape envelope whose kernels must
    serve every family of an op (issue 20's served share), where the first call of a template family
    brings most of what a card will get."""
    reach = reach or learned_reach(states, cfg)
    live = [s for s in scores(states, cfg, reach) if not s.dropped and s.score > 0]
    if not live:
        return Decision(None, "breadth: every card is dropped or has nothing left to gain")
    calls = {s.card_id: s.calls for s in states}
    waiting = awaiting_fusion(states)
    # `live` is best first: ties keep the better card
    pick = min(live, key=lambda sc: (calls[sc.card_id], sc.card_id in waiting))
    return Decision(pick.card_id, f"breadth: fewest calls so far ({calls[pick.card_id]}) among {len(live)} live "
                                  f"cards, then est. gain/call {pick.score:.2e}")


def awaiting_fusion(states: Sequence[CardState]) -> frozenset[str]:
    """Operator cards whose calls all run inside fusion cards not judged yet (untried, or a call still
    being evaluated): a breadth round takes them last, since an accepted fusion kernel fuses them away
    (an envelope build's first round had spent its calls on RMSNorm's mean and casts while the fused
    RMSNorm was still being evaluated)."""
    hopeful = {s.card_id for s in states if s.kind == "fusion" and s.best_speedup <= 1.0
               and (s.pending or not s.best)}
    return frozenset(s.card_id for s in states if s.kind != "fusion"
                     and sum(f for fid, f in s.covered if fid in hopeful) >= 1.0 - 1e-6)


STRATEGIES: dict[str, Callable[[Sequence[CardState], Config], Decision]] = {
    "allocator": decide,
    "uniform": decide_uniform,
    "breadth": decide_breadth,
}


# --- the plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanRow:
    card_id: str
    op: str
    share: float
    headroom: float
    baseline: str
    p: float
    spent: int
    planned: int
    dropped: str | None


def expected_call(state: CardState, sc: Score, reach: Reach, cfg: Config) -> CardState:
    """A card's state after one call with the expected outcome (the best moves p of the way to next)."""
    best = state.best_speedup
    target = next_speedup(state, sc.headroom, reach, cfg)
    inv = 1 / best - sc.p * (1 / best - 1 / target)
    return dataclasses.replace(state, best=(*state.best, 1 / inv), successes=state.successes + sc.p)


def expected_life(p: float, patience: int) -> float:
    """Expected calls until `patience` failures in a row (when the card would be dropped).

    >>> round(expected_life(0.05, 6), 1), round(expected_life(0.4, 6), 1)
    (7.2, 51.1)
    """
    q = 1 - p
    if p <= 0:
        return float(patience)
    return (1 - q**patience) / (p * q**patience)


def plan(states: Sequence[CardState], budget: int, cfg: Config, strategy: str = "allocator") -> list[PlanRow]:
    """Where the remaining `budget` calls are expected to go, by replaying the strategy on expected outcomes.

    Each simulated call moves the card's best by its expected improvement; a card stops receiving
    calls after its expected life under `patience`. Only a forecast: the real decisions are taken one
    call at a time on real results.
    """
    decide_fn = STRATEGIES[strategy]
    sim = {s.card_id: s for s in states}
    planned = dict.fromkeys(sim, 0)
    reach = learned_reach(states, cfg)  # from real results only: simulated ones would teach nothing new
    first = {s.card_id: s for s in scores(states, cfg, reach)}
    life = {cid: expected_life(sc.p, cfg.patience) for cid, sc in first.items()}
    for _ in range(budget):
        current = list(sim.values())
        decision = decide_fn(current, cfg, reach)
        if decision.card_id is None:
            break
        chosen = sim[decision.card_id]
        planned[chosen.card_id] += 1
        if strategy == "uniform":
            chosen = dataclasses.replace(chosen, pending=chosen.pending + 1)
        else:
            chosen = expected_call(chosen, score(chosen, current, cfg, reach), reach, cfg)
            if planned[chosen.card_id] >= life[chosen.card_id]:
                chosen = dataclasses.replace(chosen, exhausted=True)
        sim[chosen.card_id] = chosen
    rows = [
        PlanRow(
            card_id=s.card_id,
            op=s.op,
            share=s.share,
            headroom=first[s.card_id].headroom,
            baseline=s.baseline,
            p=first[s.card_id].p,
            spent=s.calls,
            planned=planned[s.card_id],
            dropped=first[s.card_id].dropped,
        )
        for s in states
    ]
    return sorted(rows, key=lambda r: (-r.planned, -r.share, r.card_id))


def total_gain(states: Sequence[CardState]) -> float:
    """The model's estimated saving, each call's time counted once: fusion cards with their share, operator
    cards with what accepted fusion kernels left of theirs."""
    fusions = accepted_fusions(states)
    return estimated_gain((effective_share(s, fusions), s.best_speedup) for s in states)


def estimated_gain(shares_and_speedups: Iterable[tuple[float, float]]) -> float:
    """End-to-end fraction of operator time saved: sum of share x (1 - 1/speedup).

    >>> round(estimated_gain([(0.5, 2.0), (0.1, 1.0)]), 3)
    0.25
    """
    return sum(share * (1 - 1 / speedup) for share, speedup in shares_and_speedups if speedup > 0)
