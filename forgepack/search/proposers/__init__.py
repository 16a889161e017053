"""Proposers: where candidate kernels come from. One interface, one explicit registry.

A proposer is asked for one child of a node of a card's search tree:

    propose(card, parent, lineage, feedback, tried=frozenset()) -> Proposal

- ``parent``: the `Parent` to refine (its source and parameters), or None for a kernel from scratch;
- ``lineage``: the parent's ancestors with their verdicts and timings (`forgepack.search.tree.LineageEntry`,
  root first, the parent last);
- ``feedback``: what went wrong with earlier proposals from this parent (compiler errors, mismatch
  diagnostics, malformed replies), newest last;
- ``tried``: parameter keys already proposed from this parent (a deterministic proposer skips them).

Every proposer is made by `make(name, target=..., arch=..., facts=..., model=...)`: the target, the
GPU arch the pack is built for and the device facts (`forgepack.pipeline.TargetFacts.prompt()`) are
gathered once by the pipeline and passed in; a proposer ignores what it has no use for.
`preflight(name, **options)` fails before any work when a proposer cannot run here (no API key).

It returns a `Proposal` (``source`` None when the reply held no kernel: the call still counts, and its
``feedback`` goes to the next call), or raises `NothingToPropose` when it has nothing new from this
parent; that costs nothing and marks the node exhausted.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from forgepack.cards import Card
from forgepack.errors import UsageError


class NothingToPropose(Exception):  # a signal, not an error
    """The proposer has nothing new to offer from this parent."""


@dataclass(frozen=True)
class Parent:
    candidate_id: int
    source: str
    params: dict
    proposer: str
    speedup: float | None = None
    kernel_us: float | None = None


@dataclass(frozen=True)
class Proposal:
    source: str | None  # None: the call produced no kernel (see feedback)
    params: dict = field(default_factory=dict)  # what identifies it in the tree (template + parameters)
    meta: dict = field(default_factory=dict)  # e.g. the model, stop reason, retries
    tokens: tuple[int, int] = (0, 0)  # (input, output)
    cost: float = 0.0  # US dollars
    feedback: str | None = None  # why there is no source
    label: str = ""  # e.g. "templates:softmax_rows" or "anthropic:claude-sonnet-4-5"
    model: str | None = None


class Proposer(Protocol):
    name: str  # registry name; the budget counts calls per name
    paid: bool  # whether calls cost money (and count against --max-cost)
    adaptive: bool  # whether each call on a card waits for the previous verdict (its feedback)

    @classmethod
    def preflight(cls, **options: Any) -> Any:
        """Raise a ForgepackError when this proposer cannot run with `options` (before any work)."""
        ...

    def unsupported(self, card: Card) -> str | None:
        """Why this proposer cannot write kernels for `card`, or None if it can."""
        ...

    def propose(
        self,
        card: Card,
        parent: Parent | None,
        lineage: Sequence[Any],
        feedback: Sequence[str],
        tried: frozenset[str] = frozenset(),
    ) -> Proposal: ...


# name -> (module, class): imported only when asked for (the anthropic SDK is optional).
REGISTRY: dict[str, tuple[str, str]] = {
    "templates": ("forgepack.search.proposers.templates", "TemplatesProposer"),
    "anthropic": ("forgepack.search.proposers.anthropic", "AnthropicProposer"),
    "openai": ("forgepack.search.proposers.openai", "OpenAIProposer"),
}


def _class(name: str) -> type[Proposer]:
    if name not in REGISTRY:
        raise UsageError(f"unknown proposer {name!r} (known: {', '.join(REGISTRY)})")
    module, cls = REGISTRY[name]
    return getattr(importlib.import_module(module), cls)


def make(name: str, **options: Any) -> Proposer:
    """A proposer by registry name; options go to its constructor."""
    return _class(name)(**options)


def preflight(name: str, **options: Any) -> None:
    """Fail now, with the reason, when proposer `name` could not be made with `options` later."""
    _class(name).preflight(**options)
