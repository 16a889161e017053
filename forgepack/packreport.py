"""`pack_report.json`: what the pack builder kept and dropped, and why; written by
`forgepack.pack.builder`, read by `forgepack.report` and the benchmark tools.

Small frozen values that round-trip their JSON (`PackReport.from_json(r.to_json()) == r`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

FILE = "pack_report.json"
GATE_STATUSES = ("passed", "skipped", "empty", "failed")  # "empty": nothing to ship; "failed": it would not pay


@dataclass(frozen=True)
class Decision:
    """One accepted kernel's fate in the pack builder."""

    card_id: str
    op: str
    signature: str
    kept: bool
    stage: str  # "select" | "gate"
    reason: str
    speedup: float | None = None  # in isolation (the search's measurement)
    e2e_ratio: float | None = None  # gate: model time without it / with it

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Decision:
        return cls(str(d["card_id"]), str(d["op"]), str(d["signature"]), bool(d["kept"]), str(d["stage"]),
                   str(d["reason"]), _number(d.get("speedup")), _number(d.get("e2e_ratio")))


@dataclass(frozen=True)
class PackReport:
    recipe: str
    wheel: str | None  # the wheel's path; None when nothing was shipped
    gate: str  # one of GATE_STATUSES
    margin: float
    summary: dict[str, Any] = field(default_factory=dict)  # the gate's summary (stock_ms, pack_ms, ...)
    kept: tuple[Decision, ...] = ()
    dropped: tuple[Decision, ...] = ()
    refused: str = ""  # why no wheel was written although kernels were kept (the pack would not pay)

    @classmethod
    def of(cls, recipe: str, wheel: str | None, gate: str, margin: float, summary: dict[str, Any],
           decisions: tuple[Decision, ...] | list[Decision], refused: str = "") -> PackReport:
        return cls(recipe, wheel, gate, margin, dict(summary), tuple(d for d in decisions if d.kept),
                   tuple(d for d in decisions if not d.kept), refused)

    def to_json(self) -> dict[str, Any]:
        doc = {"recipe": self.recipe, "wheel": self.wheel, "gate": self.gate, "margin": self.margin,
               "summary": self.summary, "kept": [d.to_json() for d in self.kept],
               "dropped": [d.to_json() for d in self.dropped]}
        return {**doc, "refused": self.refused} if self.refused else doc

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PackReport:
        """Raises ValueError, KeyError or TypeError for a report that is not one (the report says so)."""
        if not isinstance(d, dict):
            raise TypeError(f"a pack report is a JSON object, not {type(d).__name__}")
        if d["gate"] not in GATE_STATUSES:
            raise ValueError(f"gate {d['gate']!r} is not one of {', '.join(GATE_STATUSES)}")
        summary = d.get("summary") or {}
        if not isinstance(summary, dict):
            raise TypeError("the summary is not a JSON object")
        return cls(str(d["recipe"]), None if d.get("wheel") is None else str(d["wheel"]), d["gate"],
                   float(d["margin"]), summary, tuple(Decision.from_json(x) for x in d.get("kept") or ()),
                   tuple(Decision.from_json(x) for x in d.get("dropped") or ()), str(d.get("refused") or ""))


def _number(x: Any) -> float | None:
    return None if x is None else float(x)
