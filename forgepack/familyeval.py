"""Evaluate a candidate for a family card: verified over the range, benchmarked over the envelope.

A family kernel serves every member its guard admits, so one verification at the captured sizes says
little: a kernel that hard-codes a captured size passes there. Here the `Evaluator` runs today's full
checks on a concrete member at every point of `families.check_points` (the captured points, each
dim's min and max, 1, primes, odd and random sizes; fresh inputs at each, the representative member
also its captured samples), and the candidate is accepted only if every one passes. The first
failing member's verdict is the family's, its sizes named in the reason. A check point whose inputs
stock PyTorch itself refuses (a fold that unified a broadcast size-1 axis with a real one) is no member
of the op's domain: it is skipped, and listed in `diagnostics["family"]["skipped"]`.

Timed at the captured points (the envelope's own mix of sizes; past `MAX_TIMED_POINTS`, a spread of
them by bytes, each untimed point's weight given to the nearest timed one), the family's speed-up is the
envelope-weighted figure: with `w_i` the share of the family's eager time at point i
(`Family.point_weights` when profile set them, else calls x eager time), speed-up = 1 / sum(w_i / s_i),
the ratio of eager to kernel time summed over the envelope; the interval's ends are combined the same
way. Each point's figures stay in `diagnostics["family"]["points"]`.

A kernel that wins on part of the envelope and loses on the rest (fast at long sequences, slow at short
ones) is kept for the sub-range where it pays (`sub_range`): the box along the family's free dims that
holds no losing timed point (slower than stock beyond the noise: its interval wholly below 1) and saves
the most eager time over the timed points inside it (a point whose interval holds 1 saves nothing
measurable either way: it breaks no tie against a box that serves it). A point merely short of the margin (1.03x) is no
loser: it still saves time, and a box that gave it to stock would also give away the winners beyond it
(a real envelope build on CPU kept a 3.91x rsqrt family for a sub-range at 3.68x that way, handing
stock the sizes where the kernel ran 1.07x). Its verdict is the narrowed
family's: `diagnostics["family"]["served"]` (per free dim (name, lo, hi); `whole`: the whole range's
figures, `served_share`: the envelope's eager time inside the sub-range), and the envelope figure with
the points outside at stock's 1.0x (the guard sends those calls to stock), which the allocator, the
accept rule and the gate use. Verification covered the whole range, so the sub-range is verified.

Before the guard acts on a loss it is confirmed: a timed point losing by a little (speed-up at least
`RETIMED_ABOVE`) is benchmarked again on fresh inputs placed elsewhere in memory (`_confirmed`). The
same small op, stock and kernel alike, timed in two H200 builds moved by up to a quarter while each
build's interval stayed tight (benchmarks/2026-12-04-h200-envelope-both-models: the KV cache's cat at batch 3,
720 tokens, 1.15x in one and 0.85x in the other). The runs are `pooled`: mean times, and an interval
spanning every run's, so a point loses only where every placement lost; each run's figures stay in
the point's `placements`.

A family kernel's template states that it needs each input at element alignment only (its vector
paths chosen at run time: `needs.natural`), and the guard would admit any such pointer (a
checkpoint's weight at 8 mod 16). The check points are all laid out at their captured offsets, so one
more member has every input moved one element along (`shifted_member`) and is verified too; where it
fails, the guard keeps each input at the offset modulo 16 bytes it was verified at. The answer is
`diagnostics["element_aligned"]`, which the search reads (`element_aligned`).

Exact-shape cards go straight to the `Evaluator`; an accepted exact CPU kernel then gets the same
moved check (a CPU render states element alignment: `Template.needs`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path

from forgepack import families, staticcheck
from forgepack.cards import Card, Family, TensorMeta
from forgepack.compile import CompileResult, compile_kernel
from forgepack.errors import ForgepackError
from forgepack.evaluate import Evaluator, Progress, Verdict, accept_rule
from forgepack.outcomes import STOCK_DIFFERS, STOCK_FAILED

TIMED_OK = (None, "slower")  # a timed point that is merely slow still verified


def evaluate(evaluator: Evaluator, card: Card, source: str, samples_path: Path | None = None,
             margin: float = 0.05, bench: bool = True, arch: str | None = None, *,
             progress: Progress | None = None) -> Verdict:
    """`Evaluator.evaluate` for any card: static checks, compile (cached), then `evaluate_compiled`."""
    if staticcheck.check_source(source, evaluator.target):  # the evaluator's verdict on them
        return evaluator.evaluate(card, source, samples_path, margin, bench, arch, progress=progress)
    (progress or (lambda _stage: None))("compiling")
    compiled = compile_kernel(source, evaluator.target, arch=arch)
    return evaluate_compiled(evaluator, card, compiled, source, samples_path, margin, bench, progress=progress)


def evaluate_compiled(evaluator: Evaluator, card: Card, compiled: CompileResult, source: str,
                      samples_path: Path | None = None, margin: float = 0.05, bench: bool = True, *,
                      progress: Progress | None = None) -> Verdict:
    """`Evaluator.evaluate_compiled` for any card; a family card over its check points (module doc)."""
    if card.family is None:
        verdict = evaluator.evaluate_compiled(card, compiled, source, samples_path, margin, bench, progress=progress)
        return _exact_element_aligned(evaluator, card, compiled, source, margin, verdict)
    say = progress or (lambda _stage: None)
    rep = families.bind(card, card.tensor_inputs())
    captured = [dict(p) for p in card.family.points]
    timed_at = timed_points(card)
    points = families.check_points(card)
    verdicts: list[tuple[dict, Verdict]] = []
    skipped: list[dict] = []
    for k, values in enumerate(points):
        member = families.member(card, values)
        samples = None
        if values == rep and samples_path is not None and card.samples:
            member, samples = dataclasses.replace(member, samples=card.samples), samples_path
        timed = bench and values in timed_at
        say(f"member {k + 1}/{len(points)}: {_sizes(values)}")
        try:
            if not verdicts:  # the static checks of source and object, once
                verdict = evaluator.evaluate_compiled(member, compiled, source, samples, margin, timed)
            else:
                verdict = evaluator.run_worker(member, compiled, source, samples, margin, timed)
        except ForgepackError as err:
            if values in captured:
                raise
            if str(err).startswith(STOCK_FAILED):
                skipped.append(values)  # sizes the op itself refuses (operands that do not broadcast): no member
                continue
            if str(err).startswith(STOCK_DIFFERS):  # the family is wrong here, not the model: this card only
                return _failed(Verdict(False, "mismatch", f"the family does not describe the op here: {err}"),
                               values, member, k, len(points))
            raise
        if verdict.category not in (TIMED_OK if timed else (None,)):
            return _failed(verdict, values, member, k, len(points))
        verdicts.append((values, verdict))
    shifted = _element_aligned(evaluator, compiled, source, families.member(card, rep or captured[0]), margin)
    if bench:
        confirmed = _confirmed(evaluator, card, compiled, source, verdicts, timed_at, margin)
        if isinstance(confirmed, Verdict):
            return confirmed
        verdicts = confirmed
    return _folded(card, verdicts, timed_at, margin, bench, skipped, shifted)


def shifted_member(member: Card) -> Card | None:
    """`member` with every tensor input one element further into its storage, so that no data pointer
    sits at a multiple of 16 bytes (None where no input can be moved so: none is narrower than 16)."""
    def moved(m: TensorMeta | None) -> TensorMeta | None:
        if m is None or not m.numel or m.itemsize >= 16:
            return m
        return dataclasses.replace(m, storage_offset=m.storage_offset + 1)

    args = tuple(dataclasses.replace(a, tensor=moved(a.tensor)) if a.kind == "tensor"
                 else dataclasses.replace(a, tensors=tuple(moved(t) for t in a.tensors)) if a.kind == "tensors"
                 else a for a in member.args)
    out = dataclasses.replace(member, args=args)
    return None if out.tensor_inputs() == member.tensor_inputs() else out


def _element_aligned(evaluator: Evaluator, compiled: CompileResult, source: str, member: Card,
                     margin: float) -> dict:
    """Whether the kernel is right with its inputs at element alignment only (`shifted_member`): a
    template states that it needs no more (`needs.natural`), and the guard admits such pointers
    (a checkpoint's weight at 8 mod 16) only where this check passed; where it failed, the guard keeps
    each input at the offset modulo 16 bytes it was verified at (`needs.default`)."""
    moved = shifted_member(member)
    if moved is None:
        return {"ok": False, "reason": "no input narrower than 16 bytes to move"}
    try:
        verdict = evaluator.run_worker(moved, compiled, source, None, margin, False)
    except ForgepackError as err:
        return {"ok": False, "reason": str(err)}
    return {"ok": verdict.accepted, "reason": verdict.reason, "member": moved.signature()}


def _exact_element_aligned(evaluator: Evaluator, card: Card, compiled: CompileResult, source: str,
                            margin: float, verdict: Verdict) -> Verdict:
    """An accepted exact kernel for the CPU, also checked moved one element along: a CPU render states
    element alignment (`Template.needs`: plain loops), so that a checkpoint's weight at 8 mod 16 hits the
    kernel captured from it. A CUDA render's vectors are laid out for the captured offsets: not checked."""
    if not verdict.accepted or evaluator.target != "cpu":
        return verdict
    shifted = _element_aligned(evaluator, compiled, source, card, margin)
    return dataclasses.replace(verdict, diagnostics={**verdict.diagnostics, "element_aligned": shifted})


def element_aligned(verdict: dict | None) -> bool:
    """Whether an accepted verdict (as stored: JSON), family or exact, passed `_element_aligned`."""
    shifted = ((verdict or {}).get("diagnostics") or {}).get("element_aligned") or {}
    return bool(shifted.get("ok"))


RETIMED_ABOVE = 0.7  # a loss by less than this is timed again elsewhere in memory; a deeper one is no noise
RETIMES = 1  # other placements a losing point is timed at


def _slower(ci_high: float | None) -> bool:
    """Slower than stock beyond the noise: the interval wholly below 1."""
    return ci_high is not None and ci_high < 1.0


def _confirmed(evaluator: Evaluator, card: Card, compiled: CompileResult, source: str,
               verdicts: list[tuple[dict, Verdict]], timed_at: list[dict], margin: float
               ) -> list[tuple[dict, Verdict]] | Verdict:
    """`verdicts`, each timed point that loses by less than RETIMED_ABOVE timed again at RETIMES other
    placements (fresh inputs, buffers elsewhere: `Evaluator.bench_again`) and `pooled`; a check that
    fails there is the family's verdict."""
    out = []
    for k, (values, verdict) in enumerate(verdicts):
        if values in timed_at and _slower(verdict.ci_high) and verdict.speedup >= RETIMED_ABOVE:
            member = families.member(card, values)
            runs = [verdict]
            for placement in range(1, RETIMES + 1):
                again = evaluator.bench_again(member, compiled, source, margin, placement)
                if again.category not in TIMED_OK:
                    return _failed(again, values, member, k, len(verdicts))
                runs.append(again)
            verdict = pooled(runs)
        out.append((values, verdict))
    return out


def pooled(runs: list[Verdict]) -> Verdict:
    """One point's benchmarks at several placements as one: the mean eager and kernel times, their ratio,
    and the interval spanning every run's, so that a loss counts only where every placement lost."""
    eager = sum(r.eager_us for r in runs) / len(runs)
    kernel = sum(r.kernel_us for r in runs) / len(runs)
    placements = [{k: getattr(r, k) for k in ("speedup", "ci_low", "ci_high", "eager_us", "kernel_us")} for r in runs]
    first = runs[0]
    return dataclasses.replace(first, eager_us=eager, kernel_us=kernel, speedup=eager / kernel,
                               ci_low=min(r.ci_low for r in runs), ci_high=max(r.ci_high for r in runs),
                               bench_s=sum(r.bench_s for r in runs),
                               diagnostics={**first.diagnostics, "placements": placements})


MAX_TIMED_POINTS = 6  # a decode family has a captured point per (batch, cache length): time a spread


def _bytes(card: Card, values: dict[str, int]) -> int:
    m = families.member(card, values)
    return sum(t.numel * t.itemsize for t in [*m.tensor_inputs(), *m.outputs] if t is not None)


def timed_points(card: Card) -> list[dict[str, int]]:
    """The captured points a family kernel is timed at: all of them, or past `MAX_TIMED_POINTS` a spread
    from the smallest to the largest by bytes moved (each untimed point's weight goes to the timed point
    nearest it in bytes, `_weights`). Every captured point is still verified."""
    captured = [dict(p) for p in card.family.points]
    if len(captured) <= MAX_TIMED_POINTS:
        return captured
    by_size = sorted(captured, key=lambda v: _bytes(card, v))
    last = len(by_size) - 1
    return [by_size[round(k * last / (MAX_TIMED_POINTS - 1))] for k in range(MAX_TIMED_POINTS)]


def _sizes(values: dict[str, int]) -> str:
    return ", ".join(f"{n}={v}" for n, v in values.items())


def _failed(verdict: Verdict, values: dict, member: Card, index: int, total: int) -> Verdict:
    where = f"at {_sizes(values)} [{member.signature()}], member {index + 1} of {total} checked"
    diagnostics = {**verdict.diagnostics, "family": {"failed_at": values, "checked": index}}
    return dataclasses.replace(verdict, accepted=False, reason=f"{where}: {verdict.reason}", diagnostics=diagnostics)


def _folded(card: Card, verdicts: list[tuple[dict, Verdict]], captured: list[dict], margin: float,
            bench: bool, skipped: list[dict], shifted: dict | None = None) -> Verdict:
    """One verdict for the family from its points' verdicts. `shifted` is `_element_aligned`'s answer; None
    (not checked) reads as not element-aligned, so the guard keeps the verified offsets."""
    first = verdicts[0][1]
    base = dict(source_hash=first.source_hash, binary=first.binary, compile_s=first.compile_s,
                verify_s=sum(v.verify_s for _, v in verdicts), bench_s=sum(v.bench_s for _, v in verdicts))
    family = {"checked": [values for values, _ in verdicts], "skipped": skipped}
    diagnostics = {"verification": first.diagnostics.get("verification", {}), "family": family,
                   "element_aligned": shifted}
    n = len(verdicts)
    if not bench:
        return Verdict(True, None, f"verified at {n} sizes of the family (not benchmarked)", diagnostics, **base)
    timed = [(values, v) for values, v in verdicts if values in captured]
    weights = _weights(card, timed)
    family["points"] = [_point(card, values, w, v) for (values, v), w in zip(timed, weights, strict=True)]
    speedup = _harmonic(weights, [v.speedup for _, v in timed])
    low = _harmonic(weights, [v.ci_low for _, v in timed])
    high = _harmonic(weights, [v.ci_high for _, v in timed])
    calls = [max(_calls(card, values), 1) for values, _ in timed]
    eager = sum(c * v.eager_us for c, (_, v) in zip(calls, timed, strict=True)) / sum(calls)
    kernel = sum(c * v.kernel_us for c, (_, v) in zip(calls, timed, strict=True)) / sum(calls)
    per_point = ", ".join(f"{_sizes(values)}: {v.speedup:.2f}x" for values, v in timed)
    summary = (f"envelope {speedup:.3f}x (95% interval {low:.3f}-{high:.3f}) over {len(timed)} timed sizes "
               f"({per_point}); verified at {n} sizes")
    timing = dict(eager_us=eager, kernel_us=kernel, speedup=speedup, ci_low=low, ci_high=high)
    figures = [PointFigure(values, w, v.speedup, v.ci_low, v.ci_high)
               for (values, v), w in zip(timed, weights, strict=True)]
    # pays on part of the envelope only, or loses somewhere: the sub-range where it pays (module doc)
    box = sub_range(card.family, figures, margin)
    if any(f.loses() for f in figures) or (box is not None and not all(in_box(box, f.values) for f in figures)):
        return _narrowed(card, box, timed, weights, figures, margin, diagnostics, base, summary, timing)
    if accept_rule(speedup, low, margin):
        return Verdict(True, None, f"verified; {summary}", diagnostics, **timing, **base)
    return Verdict(False, "slower", f"verified but not fast enough: {summary}; needs >= {1 + margin:.3f}x",
                   diagnostics, **timing, **base)


def _point(card: Card, values: dict, weight: float, v: Verdict) -> dict:
    point = {"values": values, "weight": weight, "calls": _calls(card, values), "speedup": v.speedup,
             "ci_low": v.ci_low, "ci_high": v.ci_high, "eager_us": v.eager_us, "kernel_us": v.kernel_us}
    if "placements" in v.diagnostics:
        point["placements"] = v.diagnostics["placements"]
    return point


def _calls(card: Card, values: dict) -> int:
    fam = card.family
    for point, calls in zip(fam.points, fam.point_calls, strict=False):
        if dict(point) == values:
            return calls
    return 0


def _weights(card: Card, timed: list[tuple[dict, Verdict]]) -> list[float]:
    """Each timed point's share of the family's eager time over the envelope: its own, plus that of the
    untimed captured points nearest it in bytes (their eager time scaled from it by bytes)."""
    raw = [0.0] * len(timed)
    for _, j, w in _shares(card, timed):
        raw[j] += w
    total = sum(raw)
    return [w / total for w in raw] if total > 0 else [1.0 / len(timed)] * len(timed)


def _shares(card: Card, timed: list[tuple[dict, Verdict]]) -> list[tuple[dict, int, float]]:
    """Per captured point: its dim values, the timed point that stands for it (itself, else the nearest in
    bytes) and its eager time there (profile's weight, else calls x eager time scaled by bytes)."""
    fam = card.family
    points = [dict(p) for p in fam.points]
    size = {i: _bytes(card, values) for i, values in enumerate(points)}
    timed_size = [_bytes(card, values) for values, _ in timed]
    out = []
    for i, values in enumerate(points):
        j = next((k for k, (v, _) in enumerate(timed) if v == values), None)
        if j is None:
            j = min(range(len(timed)), key=lambda k: abs(timed_size[k] - size[i]))
        if fam.point_weights and len(fam.point_weights) == len(points):
            out.append((values, j, fam.point_weights[i]))
        else:
            calls = fam.point_calls[i] if i < len(fam.point_calls) else 0
            out.append((values, j, max(calls, 1) * timed[j][1].eager_us * size[i] / max(timed_size[j], 1)))
    return out


def _harmonic(weights: list[float], speedups: list[float]) -> float:
    """Eager over kernel time summed over the envelope, given each point's share of the eager time."""
    return 1.0 / sum(w / max(s, 1e-12) for w, s in zip(weights, speedups, strict=True))


# --- the sub-range where a kernel pays ----------------------------------------------------------------------


@dataclass(frozen=True)
class PointFigure:
    """One timed point of a family: its dim values, its share of the envelope's eager time, its figures."""

    values: dict[str, int]
    weight: float
    speedup: float
    ci_low: float
    ci_high: float

    def wins(self, margin: float) -> bool:
        """Pays here by the accept rule: speed-up at least 1 + margin, its interval above 1."""
        return accept_rule(self.speedup, self.ci_low, margin)

    def loses(self) -> bool:
        """Slower than stock here beyond the noise: the guard must send these sizes to stock."""
        return _slower(self.ci_high)

    def gain(self) -> float:
        """The share of the envelope's eager time the kernel saves here (negative where it loses); none
        where its interval holds 1: a median a little either side of 1 there is noise, and counting it
        cut parity kernels' boxes short (the residual add's, served for batch 1-3 only in an H200 build
        because batch 4's single token timed 0.968x [0.961, 1.000])."""
        if self.ci_low <= 1.0 <= self.ci_high:
            return 0.0
        return self.weight * (1.0 - 1.0 / max(self.speedup, 1e-12))


Box = tuple[tuple[str, int, int], ...]  # per free dim (name, lo, hi)


def in_box(box: Box, values: dict[str, int]) -> bool:
    return all(lo <= values[name] <= hi for name, lo, hi in box)


def sub_range(family: Family, figures: list[PointFigure], margin: float) -> Box | None:
    """The box along the family's free dims, inside its range, that holds no losing timed point
    (`PointFigure.loses`) and saves the most eager time over the timed points inside it (`PointFigure.gain`:
    none at a point whose interval holds 1); None where no such box holds a winner (no point wins, or each
    winner's point is a loser's too) and some of the envelope's eager time.

    Candidate boxes have their ends at timed points' values (per dim every [lo, hi] of them, at most
    MAX_TIMED_POINTS^2 / 2 per dim). The chosen box is then widened, one side at a time, to the range's
    end wherever that admits no timed point it left out: sizes beyond the last winner are served as the
    envelope's corner was measured. Between a winner and a point left out it ends at the winner (the sizes
    in between were not measured, so stock keeps them)."""
    free = families.free_dims(family)
    losers = [f.values for f in figures if f.loses()]
    winners = [f for f in figures if f.wins(margin)]
    if not winners:
        return None
    sides = []
    for d in free:
        ends = sorted({f.values[d.name] for f in figures})
        sides.append([(d.name, lo, hi) for lo, hi in itertools.combinations_with_replacement(ends, 2)])
    best, best_key = None, (0.0, 0)
    for box in itertools.product(*sides):
        if any(in_box(box, v) for v in losers) or not any(in_box(box, f.values) for f in winners):
            continue
        inside = [f for f in figures if in_box(box, f.values)]
        # the most time saved; between equal savings the box holding more timed points (a point of no
        # weight still tells that the kernel serves its sizes correctly and no slower)
        key = (round(sum(f.gain() for f in inside), 12), len(inside))
        if key > best_key and sum(f.weight for f in inside) > 0:  # it serves some of the envelope's time
            best, best_key = box, key
    if best is None:
        return None
    return _widened(best, free, [f.values for f in figures if not in_box(best, f.values)])


def _widened(box: Box, free: list, left_out: list[dict[str, int]]) -> Box:
    out = list(box)
    for k, d in enumerate(free):
        for end in ("lo", "hi"):
            name, lo, hi = out[k]
            trial = (name, d.min, hi) if end == "lo" else (name, lo, d.max)
            if not any(in_box((*out[:k], trial, *out[k + 1:]), v) for v in left_out):
                out[k] = trial
    return tuple(out)


def _narrowed(card: Card, box: Box | None, timed: list[tuple[dict, Verdict]], weights: list[float],
              figures: list[PointFigure], margin: float, diagnostics: dict, base: dict, summary: str,
              whole: dict) -> Verdict:
    """The verdict of the family narrowed to `box` (`sub_range`): the points outside served by stock
    (1.0x). `whole`: the whole range's timing, the verdict's where no sub-range pays."""
    diagnostics["family"]["whole"] = whole
    if box is None:
        return Verdict(False, "slower", f"verified but no sub-range pays without a losing point: {summary}",
                       diagnostics, **whole, **base)
    # The box lies inside the verified range (its ends are timed points' values or the range's ends);
    # `families.narrow` holds every later stage to that.
    served = families.narrow(card, box).family.served
    inside = [in_box(box, f.values) for f in figures]  # the timed points
    # Each captured point where the guard puts it: inside the box, timed as the timed point standing for it
    # (an untimed neighbour by bytes); outside, stock's 1.0x.
    raw = _shares(card, timed)
    total = sum(w for _, _, w in raw)
    shares = [(w / total if total > 0 else 1.0 / len(raw), timed[j][1] if in_box(box, values) else None)
              for values, j, w in raw]
    speedup = _harmonic([w for w, _ in shares], [v.speedup if v else 1.0 for _, v in shares])
    low = _harmonic([w for w, _ in shares], [v.ci_low if v else 1.0 for _, v in shares])
    high = _harmonic([w for w, _ in shares], [v.ci_high if v else 1.0 for _, v in shares])
    calls = [max(_calls(card, values), 1) for values, _ in timed]
    eager = sum(c * v.eager_us for c, (_, v) in zip(calls, timed, strict=True)) / sum(calls)
    kernel = sum(c * (v.kernel_us if i else v.eager_us)
                 for c, (_, v), i in zip(calls, timed, inside, strict=True)) / sum(calls)
    share = sum(w for w, v in shares if v is not None)
    where = ", ".join(f"{n} in {lo}..{hi}" for n, lo, hi in served) or "its whole range"
    diagnostics["family"].update(served=[list(x) for x in served], served_share=share)
    text = (f"kept for {where} ({share:.0%} of the envelope's eager time; stock serves the rest): envelope "
            f"{speedup:.3f}x (95% interval {low:.3f}-{high:.3f}); over the whole range {summary}")
    timing = dict(eager_us=eager, kernel_us=kernel, speedup=speedup, ci_low=low, ci_high=high)
    if accept_rule(speedup, low, margin):
        return Verdict(True, None, f"verified; {text}", diagnostics, **timing, **base)
    return Verdict(False, "slower", f"verified but not fast enough even {text}; needs >= {1 + margin:.3f}x",
                   diagnostics, **timing, **base)
