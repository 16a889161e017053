"""What the evaluation worker answers: small frozen values that round-trip their JSON.

The worker (`forgepack.worker`, which runs `forgepack.verify`) sends one of these per request and the
parent (`forgepack.evaluate`) reads it back with `from_json`; neither side passes loose dicts:

- `Failure`: the kernel was rejected (category, one-line reason, diagnostics for people and proposers);
- `Verified`: every verification input set passed;
- `Timed`: the benchmark's numbers, after every timed call's output was checked;
- `ServingCost`: what serving a fused kernel through its patch site costs beyond the kernel call
  (`forgepack.servecost`).

This module imports nothing heavy (no torch): the parent side never loads torch for it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# What the worker answers when the stock op cannot give a reference for a card's inputs (a
# `verify.StockOpError`): it raised on them, or it gave outputs other than the card's.
STOCK_FAILED = "the stock op failed"
STOCK_DIFFERS = "the stock op gave"


@dataclass(frozen=True)
class Failure:
    """A rejection: `category` is one of `evaluate.CATEGORIES`."""

    category: str
    reason: str
    diagnostics: dict[str, Any] = field(default_factory=dict)

    ok = False

    def with_diagnostics(self, **extra: Any) -> Failure:
        return dataclasses.replace(self, diagnostics={**self.diagnostics, **extra})

    def to_json(self) -> dict[str, Any]:
        return {"kind": "failure", "ok": False, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class Verified:
    """Verification passed: which input sets, the largest error seen per output, the tolerance applied
    per output, and how many kernel calls were checked."""

    input_sets: tuple[str, ...]
    max_abs_err: dict[str, float]
    tolerances: dict[str, str]
    calls: int = 0
    skipped_sets: tuple[str, ...] = ()  # adversarial sets the stock op itself cannot run

    ok = True

    def to_json(self) -> dict[str, Any]:
        return {"kind": "verified", "ok": True, **_plain(self)}


@dataclass(frozen=True)
class Timed:
    """The interleaved benchmark (`timing.compare`): medians, speed-up and its bootstrap interval, the
    input it ran on, and how many calls were checked (every timed call bitwise, `checked` of them fully)."""

    eager_us: float
    kernel_us: float
    speedup: float
    ci_low: float
    ci_high: float
    reps: int
    input: str
    checked: int = 0
    calls: int = 0
    serving_us: float = 0.0  # added to every timed kernel call before kernel_us, speedup and the interval

    ok = True

    def to_json(self) -> dict[str, Any]:
        return {"kind": "timed", "ok": True, **_plain(self)}


@dataclass(frozen=True)
class ServingCost:
    """Microseconds a call that serving a card's kernel through its patch site adds to the kernel call
    (its dearest site), and each site's figures (`servecost.measure`)."""

    serving_us: float
    sites: tuple[dict[str, Any], ...] = ()

    ok = True

    def to_json(self) -> dict[str, Any]:
        return {"kind": "serving", "ok": True, **_plain(self)}


Outcome = Failure | Verified | Timed | ServingCost
_KINDS = {"failure": Failure, "verified": Verified, "timed": Timed, "serving": ServingCost}


def from_json(data: dict[str, Any]) -> Outcome:
    """The value `to_json` wrote; unknown keys are ignored, a missing kind is a failure if not ok."""
    kind = data.get("kind") or ("failure" if not data.get("ok") else "verified")
    cls = _KINDS[kind]
    names = {f.name: f for f in dataclasses.fields(cls)}
    values = {k: v for k, v in data.items() if k in names}
    for name in ("input_sets", "skipped_sets", "sites"):
        if name in values:
            values[name] = tuple(values[name])
    return cls(**values)


def _plain(value: Any) -> dict[str, Any]:
    out = dataclasses.asdict(value)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
