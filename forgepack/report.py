"""The build report: one self-contained HTML file made from a workspace, readable while a build runs.

`gather(root)` reads whatever the workspace holds (recipe, profile, cards, the search store opened
read-only, accepted kernels, the pack's `pack_report.json`, and `bench.json`: the JSON that
`forgepack bench --json` prints) into a `ReportData`; a missing or unreadable part is `None` plus a
line in `problems`, never an exception. `render(data)` turns it into HTML with five sections:

1. ``profile``: share of operator time per card by baseline class, roofline headroom, model facts.
2. ``budget``: proposer calls and dollars per card over time, with the allocator's reason for each call.
3. ``results``: best speed-up per searched card (eager kept where no kernel won), percent of roofline.
4. ``trees``: each card's search tree (verdict, time, proposer), the path to its best kernel marked,
   every candidate's source and feedback viewable.
5. ``pack``: kernels kept and dropped with the reasons, the end-to-end gate's numbers, and eager vs
   pack vs torch.compile from `bench.json`.

Plots are PNGs drawn with matplotlib (the optional extra `forgepack[report]`, imported lazily) and
inlined as data: URIs; without matplotlib the report has the tables and says so. Everything taken
from the workspace is HTML-escaped; the page runs no script and its Content-Security-Policy forbids
loading anything, so it opens the same offline, from a mail attachment or a CI artefact.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import functools
import html
import io
import json
import re
import sqlite3
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

from forgepack import __version__, packreport
from forgepack import accepted as accepted_mod
from forgepack import cards as cards_mod
from forgepack import recipe as recipe_mod
from forgepack.accepted import AcceptedKernel
from forgepack.cards import Card
from forgepack.errors import ForgepackError
from forgepack.packreport import PackReport
from forgepack.profile import ModelProfile
from forgepack.recipe import Recipe
from forgepack.search.store import CallRecord, CandidateRecord, read_snapshot
from forgepack.workspace import Workspace

TEMPLATE = Path(__file__).parent / "report_assets" / "report.html"
PACK_REPORT = packreport.FILE  # written by forgepack.pack.builder
BENCH = "bench.json"  # `forgepack bench --json` output, kept in the workspace
REPORT = "report.html"
SECTIONS = (("profile", "Profile"), ("budget", "Budget"), ("results", "Results"), ("trees", "Search trees"),
            ("pack", "Pack"))
CLASS_COLORS = {"vendor": "#4c72b0", "native": "#dd8452", "view": "#9ca3af", "fusion": "#55a868"}
TOP_CARDS = 20  # cards drawn in the profile plot; the tables list them all
TOP_RESULTS = 40  # searched cards drawn in the results plot (largest share first)
SOURCE_LIMIT = 200_000  # characters of one kernel source shown
OPEN_TREES = 3  # card trees shown expanded


# --- data -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreData:
    """One consistent snapshot of the search store."""

    calls: tuple[CallRecord, ...]
    candidates: tuple[CandidateRecord, ...]


@dataclass(frozen=True)
class ReportData:
    root: Path
    recipe: Recipe | None
    profile: ModelProfile | None
    cards: tuple[Card, ...]  # largest share first
    store: StoreData | None
    accepted: tuple[AcceptedKernel, ...]
    pack: PackReport | None
    bench: dict[str, Any] | None
    problems: tuple[str, ...] = ()  # parts that exist but could not be read (and why)

    def card(self, card_id: str) -> Card | None:
        return self._by_id.get(card_id)

    @functools.cached_property
    def _by_id(self) -> dict[str, Card]:
        return {c.id: c for c in self.cards}


def is_workspace(root: Path) -> bool:
    ws = Workspace(Path(root))
    return root.is_dir() and any(p.exists() for p in (ws.recipe_path, ws.profile_path, ws.cards_dir, ws.store_path))


def gather(root: str | Path) -> ReportData:
    """Everything the report shows, read from the workspace; never raises for a missing or torn part."""
    ws = Workspace(Path(root))
    problems: list[str] = []

    def attempt(what: str, path: Path, read: Callable[[], Any]) -> Any:
        if not path.exists():
            return None
        try:
            return read()
        except (OSError, ValueError, TypeError, KeyError, sqlite3.Error) as err:
            problems.append(f"{what} ({path.name}) could not be read: {type(err).__name__}: {err}")
            return None

    recipe = attempt("the recipe", ws.recipe_path, lambda: recipe_mod.load(ws.recipe_path))
    profile = attempt("the profile", ws.profile_path, lambda: _dataclass(ModelProfile, ws.read_json("profile.json")))
    cards = _load_cards(ws, problems)
    store = attempt("the search store", ws.store_path, lambda: read_store(ws.store_path))
    accepted = attempt("accepted kernels", ws.root / accepted_mod.FILE, lambda: accepted_mod.load_all(ws.root))
    pack = attempt("the pack report", ws.root / PACK_REPORT,
                   lambda: PackReport.from_json(_json_object(ws.root / PACK_REPORT)))
    bench = attempt("the benchmark", ws.root / BENCH, lambda: _json_object(ws.root / BENCH))
    return ReportData(ws.root, recipe, profile, tuple(cards), store, tuple(accepted or ()), pack, bench,
                      tuple(problems))


def _load_cards(ws: Workspace, problems: list[str]) -> list[Card]:
    found = []
    for path in sorted(ws.cards_dir.glob("*.json")) if ws.cards_dir.is_dir() else ():
        try:
            found.append(cards_mod.load(path))
        except (OSError, ValueError, TypeError, KeyError) as err:  # a card half written by a running profile
            problems.append(f"card {path.name} could not be read: {type(err).__name__}: {err}")
    return sorted(found, key=lambda c: (-(c.profile.share if c.profile else 0.0), c.id))


def _json_object(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def _dataclass(cls: type, data: dict[str, Any]) -> Any:
    """`cls(**data)` keeping only its fields, so a file written by a newer forgepack still reads."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def read_store(path: Path) -> StoreData:
    """The store's calls and candidates, as one consistent snapshot (`store.read_snapshot`)."""
    return StoreData(*read_snapshot(path))


# --- per-card search results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CardSearch:
    """One searched card as the report shows it."""

    card_id: str
    card: Card | None
    calls: tuple[CallRecord, ...]
    candidates: tuple[CandidateRecord, ...]
    best: CandidateRecord | None  # best accepted candidate (as the search picks it)
    best_measured: CandidateRecord | None  # fastest correct candidate, accepted or not
    pack_status: str | None  # "kept" / "dropped" in the pack report, None if not there
    pack_reason: str | None

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(verdict_of(c) for c in self.candidates))

    @property
    def cost(self) -> float:
        return sum(c.cost for c in self.calls)

    @property
    def eager_kept(self) -> bool:
        """No verified kernel won: the guard keeps stock PyTorch for this card."""
        return self.best is None or self.pack_status == "dropped"

    def roofline_pct(self, cand: CandidateRecord | None, eager: bool = False) -> float | None:
        """Percent of the roofline reached by the candidate's kernel (or by eager, timed alongside it)."""
        if self.card is None or self.card.profile is None or self.card.profile.roofline_us <= 0:
            return None
        us = (cand.eager_us if cand and cand.eager_us else self.card.profile.eager_us) if eager else (
            cand.kernel_us if cand else None)
        return 100.0 * self.card.profile.roofline_us / us if us else None


def verdict_of(c: CandidateRecord) -> str:
    if c.state != "evaluated":
        return "pending"
    return "accepted" if c.accepted else (c.category or "failed")


def _working(c: CandidateRecord) -> bool:
    return c.state == "evaluated" and (bool(c.accepted) or c.category == "slower") and bool(c.speedup)


def searches(data: ReportData) -> list[CardSearch]:
    """Every card the search touched, largest share first."""
    if data.store is None:
        return []
    pack = _pack_decisions(data.pack)
    calls: dict[str, list[CallRecord]] = {}
    for call in data.store.calls:
        calls.setdefault(call.card_id, []).append(call)
    cands: dict[str, list[CandidateRecord]] = {}
    for cand in data.store.candidates:
        cands.setdefault(cand.card_id, []).append(cand)
    out = []
    for card_id in dict.fromkeys([*calls, *cands]):
        mine = cands.get(card_id, [])
        accepted = [c for c in mine if c.accepted and c.speedup is not None]
        working = [c for c in mine if _working(c)]
        status, reason = pack.get(card_id, (None, None))
        out.append(CardSearch(
            card_id=card_id, card=data.card(card_id), calls=tuple(calls.get(card_id, ())), candidates=tuple(mine),
            best=max(accepted, key=lambda c: (c.speedup, -c.id), default=None),
            best_measured=max(working, key=lambda c: (c.speedup, -c.id), default=None),
            pack_status=status, pack_reason=reason,
        ))
    return sorted(out, key=lambda s: (-_share(s.card), s.card_id))


def _pack_decisions(pack: PackReport | None) -> dict[str, tuple[str, str]]:
    if pack is None:
        return {}
    return {d.card_id: ("kept" if d.kept else "dropped", d.reason) for d in (*pack.dropped, *pack.kept)}


def _share(card: Card | None) -> float:
    return card.profile.share if card is not None and card.profile is not None else 0.0


# --- HTML building blocks ---------------------------------------------------------------------------------


class Html(str):
    """Markup that is already safe; anything else is escaped on the way in."""


def esc(value: Any) -> Html:
    return value if isinstance(value, Html) else Html(html.escape("" if value is None else str(value), quote=True))


def join(parts: Iterable[Any]) -> Html:
    return Html("".join(esc(p) for p in parts))


def tag(name: str, *body: Any, **attrs: Any) -> Html:
    """`<name attrs>body</name>`; `cls=` gives the class attribute; a True attribute is written bare."""
    text = "".join(
        f" {k.rstrip('_').replace('_', '-') if k != 'cls' else 'class'}" + ("" if v is True else f'="{esc(v)}"')
        for k, v in attrs.items() if v is not None and v is not False
    )
    return Html(f"<{name}{text}>{join(body)}</{name}>")


class Num(Html):
    """A table cell drawn right-aligned."""


def num(text: str) -> Num:
    return Num(esc(text))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], cls: str | None = None) -> Html:
    head = tag("tr", *(tag("th", h) for h in headers))
    body = []
    for row in rows:
        cells = []
        for h, v in zip(headers, row, strict=True):
            kind = "num" if isinstance(v, Num) else ("reason" if h in ("why", "reason", "feedback") else
                                                     "sig" if h == "signature" else None)
            cells.append(tag("td", v, cls=kind))
        body.append(tag("tr", *cells))
    return tag("table", tag("thead", head), tag("tbody", *body), cls=cls)


def missing(text: str) -> Html:
    return tag("p", text, cls="missing")


def fact(key: str, value: Any) -> Html:
    return tag("div", tag("div", key, cls="k"), tag("div", value, cls="v"), cls="fact")


def badge(text: str, kind: str) -> Html:
    return tag("span", text, cls=f"badge {kind}")


def verdict_badge(verdict: str) -> Html:
    group = verdict if verdict in ("accepted", "slower", "pending") else "failed"
    return badge(verdict, f"v-{group}")


def _x(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f}x" if s < 100 else f"{s:,.0f}x"


def _us(us: float | None) -> str:
    if us is None:
        return "-"
    return f"{us:,.0f}" if us >= 1000 else f"{us:.2f}" if us >= 1 else f"{us:.3g}"


def _ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.3f}" if ms < 100 else f"{ms:,.1f}"


def _pct(fraction: float | None) -> str:
    """A fraction as percent: one decimal, or two significant digits below 1% (0.0 would hide small cards)."""
    if fraction is None:
        return "-"
    p = 100 * fraction
    return f"{p:.1f}" if p >= 0.95 or p == 0 else f"{p:.2g}"


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def label(card: Card | None, card_id: str, width: int = 40) -> str:
    """A card as plots and tables name it: op and a short signature."""
    if card is None:
        return card_id
    return _short(f"{card.op_name} {card.signature()}", width)


# --- plots ------------------------------------------------------------------------------------------------


def _figure_class() -> type | None:
    """matplotlib's Figure, or None when the optional extra is not installed.

    The object-oriented API without pyplot: no global backend switch, no figure registry to leak.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure


def png(fig: Any, alt: str, caption: str | None = None) -> Html:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    img = Html(f'<img alt="{esc(alt)}" src="data:image/png;base64,{data}">')
    return tag("figure", img, tag("figcaption", caption) if caption else "")


def class_totals(ops: Sequence[Card]) -> dict[str, float]:
    """Share of operator time per baseline class, over operator cards only: they add up to the whole
    (a fusion chain's share overlaps the operator calls it replaces)."""
    by_class: dict[str, float] = {}
    for c in ops:
        if c.profile is not None and c.kind != "fusion":
            by_class[c.profile.baseline] = by_class.get(c.profile.baseline, 0.0) + c.profile.share
    return by_class


def plot_profile(figure: type, cards: Sequence[Card]) -> Html:
    """Class totals as one stacked bar; per operator card, share (coloured by class) and roofline
    headroom. Fusion chains are left to their own table: their shares overlap the operators'."""
    cards = [c for c in cards if c.kind != "fusion"]
    ranked = [c for c in cards if c.profile is not None][:TOP_CARDS][::-1]  # largest at the top
    by_class = class_totals(cards)
    fig = figure(figsize=(12, 1.6 + 0.32 * len(ranked)))
    grid = fig.add_gridspec(2, 2, height_ratios=[0.9, max(2.0, 0.32 * len(ranked))], width_ratios=[3, 2],
                            hspace=0.35, wspace=0.05)
    top = fig.add_subplot(grid[0, :])
    left = 0.0
    for name, share in sorted(by_class.items(), key=lambda kv: -kv[1]):
        top.barh([0], [100 * share], left=[left], color=CLASS_COLORS.get(name, "#999"), label=name)
        if share > 0.06:
            top.text(left + 50 * share, 0, f"{name} {100 * share:.0f}%", ha="center", va="center", color="white",
                     fontsize=9, fontweight="bold")
        left += 100 * share
    top.set_xlim(0, max(100.0, left))
    top.set_yticks([])
    top.set_xlabel("% of summed operator time, by baseline class")
    top.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=4, frameon=False, fontsize=8)
    ax = fig.add_subplot(grid[1, 0])
    ys = range(len(ranked))
    ax.barh(ys, [100 * c.profile.share for c in ranked], color=[CLASS_COLORS.get(c.profile.baseline, "#999")
                                                                 for c in ranked])
    ax.set_yticks(list(ys), [label(c, c.id, 44) for c in ranked], fontsize=8)
    ax.set_xlabel("share of operator time (%)")
    ax.set_title(f"top {len(ranked)} of {len(cards)} variants", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    hr = fig.add_subplot(grid[1, 1], sharey=ax)
    heads = [c.profile.headroom if c.profile.baseline != "view" and c.profile.headroom > 0 else 0.0 for c in ranked]
    hr.barh(ys, [h if h > 0 else float("nan") for h in heads], left=0, color="#6b7280")
    if any(h > 0 for h in heads):
        hr.set_xscale("log")
    for y, h in zip(ys, heads, strict=True):
        if h > 0:
            hr.text(h, y, f" {_x(h)}", va="center", fontsize=7)
    hr.tick_params(axis="y", labelleft=False)
    hr.set_xlabel("roofline headroom: eager / roofline time (log)")
    hr.grid(axis="x", alpha=0.3)
    return png(fig, "share of operator time per variant by baseline class, with roofline headroom")


def plot_budget(figure: type, calls: Sequence[CallRecord], names: dict[str, str], end: float) -> Html:
    """Cumulative calls (and dollars, if any were spent) per card over the build's wall time, up to `end`."""
    start = calls[0].created
    xs = [(c.created - start) / 60 for c in calls]
    xs.append(max(xs[-1], (end - start) / 60) or 1 / 60)  # the last step gets a width
    per_card = Counter(c.card_id for c in calls)
    shown = [cid for cid, _ in per_card.most_common(8)]
    groups = [*shown, "other"] if len(per_card) > len(shown) else shown
    key = [c.card_id if c.card_id in shown else "other" for c in calls]
    paid = any(c.cost > 0 for c in calls)
    fig = figure(figsize=(12, 3.8))
    axes = fig.subplots(1, 2 if paid else 1, squeeze=False)[0]
    for ax, what, value in ((axes[0], "proposer calls", lambda c: 1.0), *(
            ((axes[1], "dollars", lambda c: c.cost),) if paid else ())):
        series = []
        for g in groups:
            total, ys = 0.0, []
            for call, k in zip(calls, key, strict=True):
                total += value(call) if k == g else 0.0
                ys.append(total)
            series.append([*ys, total])
        ax.stackplot(xs, series, step="post", labels=[names.get(g, g) for g in groups], alpha=0.85)
        ax.set_xlabel("minutes since the first call")
        ax.set_ylabel(f"cumulative {what}")
        ax.grid(alpha=0.3)
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return png(fig, "cumulative proposer calls and dollars per card over time")


def plot_results(figure: type, rows: Sequence[CardSearch], margin: float, caption: str | None = None) -> Html:
    """Speed-up per card (eager kept where no kernel won, as the guard falls back) and % of roofline."""
    rows = list(rows)[:TOP_RESULTS][::-1]
    ys = list(range(len(rows)))
    fig = figure(figsize=(12, 1.2 + 0.34 * len(rows)))
    ax, roof = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 2], "wspace": 0.05})
    for y, r in zip(ys, rows, strict=True):
        if r.best is not None and not r.eager_kept:
            ax.barh(y, r.best.speedup, color="#2e7d32")
            ax.text(r.best.speedup, y, f" {r.best.speedup:.2f}x", va="center", fontsize=8)
            continue
        if r.best is not None:  # faster alone, dropped by the end-to-end gate: the pack keeps eager
            ax.barh(y, r.best.speedup, color="#e5efe5", hatch="//", edgecolor="#7aa77c")
            ax.barh(y, 1.0, color="#9ca3af")
            ax.text(r.best.speedup, y, f" {r.best.speedup:.2f}x alone; gate dropped it", va="center", fontsize=8,
                    color="#374151")
            continue
        measured = r.best_measured.speedup if r.best_measured else None
        ax.barh(y, 1.0, color="#9ca3af")
        if measured is not None:
            ax.plot([measured], [y], marker="o", color="#b7791f", markersize=5)
        text = "eager kept" + (f" (best kernel {measured:.2f}x)" if measured is not None else " (no working kernel)")
        ax.text(max(1.0, measured or 0), y, f" {text}", va="center", fontsize=8, color="#374151")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="#2e7d32", label="kernel (in the pack, or accepted)"),
                       Patch(color="#9ca3af", label="eager kept: the guard falls back"),
                       Patch(facecolor="#e5efe5", edgecolor="#7aa77c", hatch="//",
                             label="faster alone, gate dropped it")],
              fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2, frameon=False)
    ax.axvline(1.0, color="#111827", linewidth=1)
    ax.axvline(1.0 + margin, color="#6b7280", linewidth=1, linestyle="--")
    ax.set_yticks(ys, [label(r.card, r.card_id, 44) for r in rows], fontsize=8)
    ax.set_xlabel(f"speed-up over eager (in isolation); dashed: acceptance margin {1 + margin:.2f}x")
    ax.grid(axis="x", alpha=0.3)
    # room for the labels right of the bars: the long ones follow the gate-dropped and eager-kept bars
    ends = [r.best.speedup * (1.25 if not r.eager_kept else 1.7) for r in rows if r.best]
    ax.set_xlim(0, max([2.2 if any(r.best is None for r in rows) else 1.6, *ends]))
    eager = [r.roofline_pct(r.best or r.best_measured, eager=True) or 0.0 for r in rows]
    kernel = [r.roofline_pct(r.best) or 0.0 for r in rows]
    h = 0.38
    roof.barh([y + h / 2 for y in ys], eager, height=h, color="#9ca3af", label="eager")
    roof.barh([y - h / 2 for y in ys], kernel, height=h, color="#2e7d32", label="best kernel")
    for y, e, k in zip(ys, eager, kernel, strict=True):
        roof.text(k, y - h / 2, f" {k:.3g}%" if k else "", va="center", fontsize=7)
        roof.text(e, y + h / 2, f" {e:.3g}%" if e else "", va="center", fontsize=7, color="#4b5563")
    roof.set_xlabel("% of roofline (roofline time / measured time)")
    roof.legend(fontsize=8, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=2, frameon=False)
    roof.grid(axis="x", alpha=0.3)
    return png(fig, "speed-up per card with eager kept where no kernel won, and percent of roofline", caption)


def plot_e2e(figure: type, bars: Sequence[tuple[str, float, str]]) -> Html:
    """Model time per configuration (gate and benchmark), with the speed-up over stock as a label."""
    fig = figure(figsize=(9, 0.8 + 0.45 * len(bars)))
    ax = fig.add_subplot()
    ys = list(range(len(bars)))[::-1]
    colors = {"eager": "#9ca3af", "stock": "#9ca3af", "pack": "#2e7d32", "compile": "#4c72b0"}
    for y, (name, ms, note) in zip(ys, bars, strict=True):
        ax.barh(y, ms, color=colors.get(name.split(": ")[-1], "#dd8452"))
        ax.text(ms, y, f" {ms:.3f} ms {note}", va="center", fontsize=8)
    ax.set_yticks(ys, [b[0] for b in bars], fontsize=9)
    ax.set_xlabel("model forward time (ms, median)")
    ax.set_xlim(0, max(b[1] for b in bars) * 1.45)
    ax.grid(axis="x", alpha=0.3)
    return png(fig, "end-to-end model time: stock, with the pack, under torch.compile")


# --- sections ---------------------------------------------------------------------------------------------


def _class_span(baseline: str) -> Html:
    return tag("span", baseline, cls=f"c-{re.sub(r'[^a-z]', '', baseline)}")


def section_profile(data: ReportData, figure: type | None) -> Html:
    p = data.profile
    parts: list[Any] = []
    if p is None and not data.cards:
        return Html(missing("no profile yet: run `forgepack profile` or `forgepack build`"))
    if p is None:
        parts.append(missing("profile.json is not written yet (a profile may be running); cards so far below"))
    else:
        busy = "n/a (cpu)" if p.gpu_busy is None else f"{p.gpu_busy:.0%}"
        parts.append(tag("div", fact("device", p.device), fact("end to end", f"{_ms(p.e2e_ms)} ms"),
                         fact("GPU busy", busy), fact("summed op time (isolated)", f"{_ms(p.op_time_ms)} ms"),
                         fact("aten calls / variants", f"{p.aten_calls} / {p.variants}"),
                         fact("torch", p.torch_version), fact("profiled", p.date), cls="facts"))
        parts.append(tag("p", tag("b", "Diagnosis: "), p.diagnosis, cls="diagnosis"))
    profiled = [c for c in data.cards if c.profile is not None]
    if not profiled:
        parts.append(missing(f"{len(data.cards)} cards captured, none timed yet"))
        return join(parts)
    ops = [c for c in profiled if c.kind != "fusion"]
    chains = [c for c in profiled if c.kind == "fusion"]
    if figure is not None and ops:
        parts.append(plot_profile(figure, ops))
    rows = [(c.op_name, c.signature(), num(str(c.calls)), num(_us(c.profile.eager_us)),
             num(_pct(c.profile.share)), num(_us(c.profile.roofline_us)),
             num("-" if c.profile.baseline == "view" else _x(c.profile.headroom)), _class_span(c.profile.baseline),
             c.id) for c in ops]
    headers = ("op", "signature", "calls", "µs/call", "share %", "roofline µs", "headroom", "class", "card")
    parts.append(table(headers, rows[:TOP_CARDS]))
    if len(rows) > TOP_CARDS:
        parts.append(tag("details", tag("summary", f"all {len(rows)} variants"),
                         tag("div", table(headers, rows), cls="scroll")))
    if chains:
        parts.append(tag("h3", "Fusion chains"))
        parts.append(tag("p", "One kernel for a module's chain of the operator calls above. A chain's share is "
                              "of the same operator time, spent in the calls it replaces: it overlaps the "
                              "operators' shares and is not added to them.", cls="note"))
        chain_rows = [(c.op_name, c.fusion.module_class if c.fusion else "", num(str(c.calls)),
                       " ".join(e.op.removeprefix("aten.") for e in c.chain),
                       num(_us(c.profile.eager_us)), num(_pct(c.profile.share)), c.id) for c in chains]
        parts.append(table(("chain", "module", "calls", "replaces", "µs/call", "share %", "card"), chain_rows))
    return join(parts)


def section_budget(data: ReportData, figure: type | None) -> Html:
    if data.store is None or not data.store.calls:
        return Html(missing("no search run yet: `forgepack build` spends the budget and records every call here"))
    calls = data.store.calls
    names = {c.card_id: label(data.card(c.card_id), c.card_id, 36) for c in calls}
    tokens_in, tokens_out = sum(c.tokens_in for c in calls), sum(c.tokens_out for c in calls)
    cost = sum(c.cost for c in calls)
    proposers = Counter(c.proposer for c in calls)
    parts: list[Any] = []
    b = data.recipe.build if data.recipe else None
    parts.append(tag("div", fact("proposer calls", f"{len(calls)}" + (f" (recipe budget {b.budget})" if b else "")),
                     fact("proposers", ", ".join(f"{k}: {v}" for k, v in proposers.items())),
                     fact("tokens in / out", f"{tokens_in:,} / {tokens_out:,}"),
                     fact("dollars", f"${cost:.2f}" + (f" of ${b.max_cost:.2f}" if b and b.max_cost else "")),
                     fact("cards searched", str(len(set(names)))), cls="facts"))
    if figure is not None:
        end = max([c.created for c in calls] + [c.evaluated or 0.0 for c in data.store.candidates])
        parts.append(plot_budget(figure, calls, names, end))
    by_card: dict[str, list[CallRecord]] = {}
    for c in calls:
        by_card.setdefault(c.card_id, []).append(c)
    rows = []
    for card_id, mine in sorted(by_card.items(), key=lambda kv: -len(kv[1])):
        outcomes = Counter(c.outcome for c in mine)
        rows.append((names[card_id], num(str(len(mine))), num(str(outcomes.get("new", 0))),
                     num(str(outcomes.get("duplicate", 0))), num(str(outcomes.get("malformed", 0))),
                     num(f"{sum(c.tokens_in for c in mine):,}/{sum(c.tokens_out for c in mine):,}"),
                     num(f"${sum(c.cost for c in mine):.2f}"), mine[-1].reason))
    parts.append(tag("h3", "Per card"))
    parts.append(table(("card", "calls", "new", "duplicate", "malformed", "tokens in/out", "dollars",
                        "reason (last call)"), rows))
    start = calls[0].created
    log = [(num(str(c.id)), num(f"{c.created - start:.1f}"), names[c.card_id],
            c.proposer + (f" ({c.model})" if c.model else ""), num("-" if c.parent_id is None else f"#{c.parent_id}"),
            c.outcome + (f" #{c.candidate_id}" if c.candidate_id else ""), num(f"${c.cost:.3f}"), c.reason)
           for c in calls]
    parts.append(tag("details", tag("summary", f"every call and the allocator's reason ({len(calls)})"),
                     tag("div", table(("call", "t (s)", "card", "proposer", "parent", "outcome", "dollars", "reason"),
                                      log), cls="scroll"), open=True))
    return join(parts)


def section_results(data: ReportData, rows: list[CardSearch], figure: type | None) -> Html:
    if not rows:
        return Html(missing("no search results yet"))
    margin = data.pack.margin if data.pack else (data.recipe.build.margin if data.recipe
                                                                       else 0.05)
    pending = sum(1 for r in rows for c in r.candidates if c.state != "evaluated")
    won = [r for r in rows if not r.eager_kept]
    parts: list[Any] = [tag("p", f"{len(won)} of {len(rows)} searched cards have a verified kernel that beats eager"
                               + (" and is kept in the pack" if data.pack else "")
                               + f"; the guard keeps stock PyTorch (eager) for the other {len(rows) - len(won)}.")]
    if pending:
        parts.append(tag("p", f"{pending} candidates are still waiting for their verdict (a build is running or "
                              "was interrupted; the next `forgepack build` evaluates them).", cls="note"))
    if figure is not None:
        shown = f"the {TOP_RESULTS} largest of {len(rows)} searched cards" if len(rows) > TOP_RESULTS else None
        parts.append(plot_results(figure, rows, margin, shown))
    table_rows = []
    for r in rows:
        best = r.best or r.best_measured
        ci = f" ({r.best.ci_low:.2f}-{r.best.ci_high:.2f})" if r.best and r.best.ci_low is not None else ""
        status = ("eager kept" if r.eager_kept else "in pack" if r.pack_status == "kept" else "accepted")
        table_rows.append((
            label(r.card, r.card_id, 48), num(_pct(_share(r.card))), num(str(len(r.calls))),
            " ".join(f"{k}:{v}" for k, v in sorted(r.counts.items())),
            num((_x(r.best.speedup) + ci) if r.best else (f"best {_x(r.best_measured.speedup)}" if r.best_measured
                                                         else "-")),
            num(_us(best.eager_us if best else None)), num(_us(best.kernel_us if best else None)),
            num(_pct((r.roofline_pct(best, eager=True) or 0) / 100) if best else "-"),
            num(_pct((r.roofline_pct(r.best) or 0) / 100) if r.best else "-"),
            badge(status, "s-" + status.replace(" ", "-")), r.pack_reason if r.pack_status == "dropped" else
            served_note(r.best),
        ))
    parts.append(table(("card", "share %", "calls", "verdicts", "speed-up (95% CI)", "eager µs", "kernel µs",
                        "eager % roofline", "kernel % roofline", "outcome", "why"), table_rows))
    return join(parts)


def served_note(best: CandidateRecord | None) -> str:
    """Where a family kernel was kept for a sub-range only: which, stock serving the rest."""
    served = accepted_mod.served_of(best.verdict) if best is not None else ()
    return f"kept for {accepted_mod.served_text(served)}; stock serves the rest of the range" if served else ""


def section_trees(data: ReportData, rows: list[CardSearch]) -> Html:
    rows = [r for r in rows if r.candidates or r.calls]
    if not rows:
        return Html(missing("no search trees yet"))
    intro = ("Each card's search: a node is a candidate kernel, its children were proposed from it. "
             "The path to the best kernel is marked; open a node for its source and feedback.")
    parts: list[Any] = [tag("p", intro, cls="muted")]
    for i, r in enumerate(rows):
        head = f"{label(r.card, r.card_id, 80)} — {len(r.candidates)} candidates, {len(r.calls)} calls"
        if r.best is not None:
            head += f", best #{r.best.id} {_x(r.best.speedup)}"
        parts.append(tag("details", tag("summary", head), tree_html(data.root, r), cls="cardtree",
                         open=i < OPEN_TREES))
    return join(parts)


def tree_html(root: Path, r: CardSearch) -> Html:
    """The card's search tree as nested lists, from the candidates' parent links."""
    ids = {c.id for c in r.candidates}
    children: dict[int | None, list[CandidateRecord]] = {}
    for c in r.candidates:
        children.setdefault(c.parent_id if c.parent_id in ids else None, []).append(c)
    notes: dict[int | None, list[CallRecord]] = {}
    for call in r.calls:
        if call.outcome != "new":
            notes.setdefault(call.parent_id if call.parent_id in ids else None, []).append(call)
    path: set[int] = set()
    by_id = {c.id: c for c in r.candidates}
    walk = r.best
    while walk is not None and walk.id not in path:
        path.add(walk.id)
        walk = by_id.get(walk.parent_id) if walk.parent_id is not None else None

    def subtree(parent: int | None, depth: int) -> Html:
        items = []
        for c in children.get(parent, []):
            kids = subtree(c.id, depth + 1) if depth < 200 else Html("")
            cls = " ".join(x for x in ("on-path" if c.id in path else "", "best" if r.best and c.id == r.best.id
                                       else "") if x) or None
            items.append(tag("li", node_html(root, c), kids, cls=cls))
        for call in notes.get(parent, []):
            items.append(tag("li", f"call #{call.id} ({call.proposer}): {call.outcome}"
                                   + (f" — {_short(call.feedback, 300)}" if call.feedback else ""), cls="call-note"))
        return tag("ul", *items) if items else Html("")

    top = subtree(None, 0)
    return Html(tag("ul", tag("li", tag("span", "from scratch (no parent)", cls="node meta"),
                              top), cls="tree"))


def node_html(root: Path, c: CandidateRecord) -> Html:
    verdict = verdict_of(c)
    bits = [f"#{c.id}", " ", tag("code", c.proposer), " ", verdict_badge(verdict)]
    if c.speedup is not None:
        bits.append(f" {_x(c.speedup)}")
        if c.ci_low is not None and c.ci_high is not None:
            bits.append(tag("span", f" (95% {c.ci_low:.2f}-{c.ci_high:.2f})", cls="meta"))
    if c.kernel_us is not None:
        bits.append(tag("span", f" · {_us(c.kernel_us)} µs vs eager {_us(c.eager_us)} µs", cls="meta"))
    spent = sum(x for x in (c.compile_s, c.verify_s, c.bench_s) if x)
    if spent:
        bits.append(tag("span", f" · evaluated in {spent:.1f} s", cls="meta"))
    params = json.dumps(c.params, sort_keys=True, default=str) if c.params else ""
    if params and params != "{}":
        bits.append(tag("span", " · ", tag("code", _short(params, 140)), cls="meta"))
    if verdict not in ("accepted", "pending") and c.reason:
        bits.append(tag("span", f" · {_short(c.reason.splitlines()[0] if c.reason else '', 160)}", cls="meta"))
    more = []
    if c.feedback:
        more.append(tag("pre", c.feedback, cls="feedback"))
    more.append(tag("pre", _source(root, c.source_path)))
    return tag("div", *bits, tag("details", tag("summary", "source and feedback"), *more), cls="node")


def _source(root: Path, rel: str | None) -> str:
    """A candidate's kernel source, only from inside the workspace (a store is data, not a file browser)."""
    if not rel:
        return "(no source recorded)"
    base = root.resolve()
    path = (base / rel).resolve()
    if not path.is_relative_to(base):
        return f"(source path {rel} is outside the workspace: not shown)"
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        return f"(source {rel} could not be read: {err.strerror or err})"
    if len(text) > SOURCE_LIMIT:
        return text[:SOURCE_LIMIT] + f"\n… ({len(text) - SOURCE_LIMIT} more characters)"
    return text


def section_pack(data: ReportData, figure: type | None) -> Html:
    parts: list[Any] = []
    pack = data.pack
    if pack is None:
        text = "no pack built yet"
        if data.accepted:
            text += f": {len(data.accepted)} accepted kernels wait in accepted.json for the pack builder"
        parts.append(missing(text))
    else:
        s = pack.summary
        counts = f"{len(pack.kept)} / {len(pack.dropped)}"
        parts.append(tag("div", fact("gate", pack.gate), fact("kernels kept / dropped", counts),
                         fact("acceptance margin", f"{pack.margin:.0%}"), cls="facts"))
        parts.append(tag("p", "wheel: ", tag("code", Path(pack.wheel).name) if pack.wheel
                         else f"none: {pack.refused}" if pack.refused else "none (nothing to ship)"))
        if s.get("stock_ms") is not None:
            ci = s.get("ci") or [None, None]
            ci_text = f"{ci[0]:.3f}-{ci[1]:.3f}" if None not in ci else "-"
            parts.append(tag("h3", "End-to-end gate"))
            parts.append(table(("stock ms", "pack ms", "speed-up", "95% CI", "rounds x reps", "outputs"), [(
                num(_ms(s.get("stock_ms"))), num(_ms(s.get("pack_ms"))), num(_x(s.get("speedup"))), num(ci_text),
                num(f"{s.get('rounds', '?')} x {s.get('reps', '?')}"), s.get("outputs", ""))]))
        elif pack.gate == "skipped":
            parts.append(tag("p", "The end-to-end gate was skipped (--no-gate): no model-level numbers.", cls="note"))
        parts.append(tag("h3", "Kept and dropped kernels"))
        rows = [(label(data.card(d.card_id), d.card_id, 48),
                 badge("kept" if d.kept else "dropped", "s-kept" if d.kept else "s-dropped"),
                 d.stage, num(_x(d.speedup)), num("-" if d.e2e_ratio is None else f"{d.e2e_ratio:.3f}"), d.reason)
                for d in (*pack.kept, *pack.dropped)]
        parts.append(table(("kernel", "", "stage", "alone", "model time without / with", "why"), rows)
                     if rows else missing("no kernels reached the pack builder"))
    bars = _e2e_bars(pack, data.bench)
    parts.append(tag("h3", "Eager vs pack vs torch.compile"))
    if data.bench is None:
        parts.append(missing(f"no benchmark yet: `forgepack bench <recipe> --pack <wheel> --json > "
                             f"{data.root / BENCH}` adds it"))
    else:
        parts.append(bench_table(data.bench))
    if figure is not None and bars:
        parts.append(plot_e2e(figure, bars))
    return join(parts)


def _e2e_bars(pack: PackReport | None, bench: dict | None) -> list[tuple[str, float, str]]:
    bars = []
    s = pack.summary if pack is not None else {}
    if s.get("stock_ms") and s.get("pack_ms"):
        bars.append(("gate: stock", float(s["stock_ms"]), ""))
        bars.append(("gate: pack", float(s["pack_ms"]), f"({_x(s.get('speedup'))})"))
    for name, col in ((bench or {}).get("columns") or {}).items():
        if isinstance(col, dict) and isinstance(col.get("ms"), int | float):
            note = f"({_x(col['speedup'])})" if isinstance(col.get("speedup"), int | float) else ""
            bars.append((f"bench: {name}", float(col["ms"]), note))
    return bars


def bench_table(bench: dict[str, Any]) -> Html:
    rows = []
    for name, col in (bench.get("columns") or {}).items():
        if not isinstance(col, dict):
            continue
        if "skipped" in col:
            rows.append((name, num("-"), num("-"), num("-"), f"skipped: {col['skipped']}"))
            continue
        span = col.get("speedup_range")
        rows.append((name, num(_ms(col.get("ms"))), num(_x(col.get("speedup"))),
                     num(f"{span[0]:.2f}-{span[1]:.2f}" if span else "-"), col.get("note", "")))
    head = tag("p", f"{bench.get('recipe', '?')} on {bench.get('device', '?')} ({bench.get('dtype', '?')}): median of "
                    f"{bench.get('rounds', '?')} interleaved rounds x {bench.get('reps', '?')} forwards", cls="muted")
    hits = bench.get("pack_hits")
    used = (tag("p", f"pack kernels used in the benchmark: {sum(1 for h in hits.values() if h)} of {len(hits)}")
            if isinstance(hits, dict) else "")
    return join([head, table(("column", "ms", "vs eager", "range", "note"), rows), used])


# --- the page ---------------------------------------------------------------------------------------------


def render(data: ReportData, plots: bool = True) -> str:
    """The report as one HTML document (no script, no external resource)."""
    figure = _figure_class() if plots else None
    rows = searches(data)
    name = data.recipe.name if data.recipe else (data.profile.recipe if data.profile else data.root.name)
    generated = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    nav = tag("nav", *(tag("a", title, href=f"#{key}") for key, title in SECTIONS))
    header = tag("header", tag("h1", f"forgepack report: {name}"),
                 tag("div", f"workspace {data.root} · generated {generated} · forgepack {__version__}", cls="sub"),
                 tag("div", status_line(data, rows), cls="sub"), nav)
    notes = []
    if plots and figure is None:
        notes.append(tag("p", "Plots need matplotlib: pip install 'forgepack[report]'. Tables only below.",
                         cls="note"))
    notes.extend(tag("p", p, cls="note") for p in data.problems)
    bodies = {
        "profile": section_profile(data, figure),
        "budget": section_budget(data, figure),
        "results": section_results(data, rows, figure),
        "trees": section_trees(data, rows),
        "pack": section_pack(data, figure),
    }
    sections = [tag("section", tag("h2", f"{i}. {title}"), bodies[key], id=key)
                for i, (key, title) in enumerate(SECTIONS, 1)]
    body = join([header, tag("main", *notes, *sections)])
    return Template(TEMPLATE.read_text()).substitute(title=esc(f"forgepack report: {name}"), body=body,
                                                     version=esc(__version__))


def status_line(data: ReportData, rows: list[CardSearch]) -> str:
    parts = [f"recipe target {data.recipe.target.device}" if data.recipe else "no recipe.toml"]
    parts.append(f"{len(data.cards)} cards" + ("" if data.profile else " (not profiled)"))
    if data.store is not None:
        pending = sum(1 for c in data.store.candidates if c.state != "evaluated")
        parts.append(f"{len(data.store.calls)} calls, {len(data.store.candidates)} candidates"
                     + (f" ({pending} pending)" if pending else ""))
        parts.append(f"{sum(1 for r in rows if r.best is not None)} cards with an accepted kernel")
    else:
        parts.append("no search yet")
    parts.append(f"pack: gate {data.pack.gate}" if data.pack else "no pack yet")
    return " · ".join(parts)


def write_report(root: str | Path, out: str | Path | None = None, plots: bool = True) -> Path:
    """Gather and render the workspace's report; written atomically to `out` (default `<workspace>/report.html`)."""
    root = Path(root)
    if not is_workspace(root):
        raise ForgepackError(f"{root} is not a forgepack workspace (no recipe.toml, profile.json, cards/ or "
                             "store.sqlite in it)")
    path = Path(out) if out is not None else root / REPORT
    text = render(gather(root), plots=plots)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as err:
        raise ForgepackError(f"cannot write the report to {path}: {err.strerror or err}") from None
    return path
