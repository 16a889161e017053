"""Accepted kernels: what the search hands to the pack builder (`accepted.json` in the workspace).

Each record points at the exact compiled object that was verified and timed: that object, not a
recompilation, is what ships in the pack.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forgepack import needs as needs_mod
from forgepack.needs import Needs

FILE = "accepted.json"


@dataclass(frozen=True)
class AcceptedKernel:
    card_id: str
    target: str  # "cuda" | "cpu"
    arch: str | None  # e.g. "sm_90"; None for cpu
    source: str  # path of the kernel source, relative to the workspace
    binary: str  # path of the compiled shared object, relative to the workspace
    source_hash: str
    speedup: float  # eager / kernel, median of interleaved timings
    ci_low: float
    ci_high: float
    eager_us: float
    kernel_us: float
    proposer: str  # "templates:<template name>", "anthropic:<model>", "manual"
    candidate_id: int | None = None
    kind: str = "op"  # "op" | "fusion"
    needs: Needs | None = None  # what the kernel states it needs of its inputs (None: `needs.default`)
    binary_sha256: str = ""  # of the object that was verified and timed; the builder ships only that content
    # A family kernel that pays on part of its range only: per free dim (name, lo, hi), the sub-range it is
    # kept for (`familyeval.narrowest_paying`; verified, as the whole range was); () serves the whole range.
    served: tuple[tuple[str, int, int], ...] = ()


def served_of(verdict: dict | None) -> tuple[tuple[str, int, int], ...]:
    """The sub-range a family verdict (as the store keeps it) kept its kernel for (`familyeval`), ()
    for the whole range."""
    family = ((verdict or {}).get("diagnostics") or {}).get("family") or {}
    return tuple((n, int(lo), int(hi)) for n, lo, hi in family.get("served", ()))


def served_text(served: tuple[tuple[str, int, int], ...]) -> str:
    """`d1 in 256..2048`, the form reports show a sub-range in."""
    return ", ".join(f"{n} in {lo}..{hi}" for n, lo, hi in served)


def save_all(workspace_root: Path, kernels: list[AcceptedKernel]) -> Path:
    path = Path(workspace_root) / FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps([_to_json(k) for k in kernels], indent=1) + "\n")
    tmp.replace(path)
    return path


def load_all(workspace_root: Path) -> list[AcceptedKernel]:
    path = Path(workspace_root) / FILE
    if not path.exists():
        return []
    return [_from_json(d) for d in json.loads(path.read_text())]


def _to_json(k: AcceptedKernel) -> dict[str, Any]:
    return {**dataclasses.asdict(k), "needs": None if k.needs is None else needs_mod.to_json(k.needs)}


def _from_json(d: dict[str, Any]) -> AcceptedKernel:
    stated = d.get("needs")
    served = tuple((n, int(lo), int(hi)) for n, lo, hi in d.get("served", ()))
    return AcceptedKernel(**{**d, "needs": None if stated is None else needs_mod.from_json(stated), "served": served})
