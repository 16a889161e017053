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

An LLM behind an API is an `Exchanger` as well: the search splits its call into ``request`` (the JSON
body, built on the search's thread from the card, the parent, the feedback and a `Context` of what
else the search knows), ``send`` (the network round trip, retried; several run at once) and ``parse``
(the reply's `Proposal`). The search records every request and reply (`forgepack.search.cassette`),
replays one offline, and checks ``worst_case_cost(request)`` against ``--max-cost`` before sending.
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


@dataclass(frozen=True)
class Example:
    """A kernel the prompt shows for reference: the card's best so far, or one accepted for a similar card."""

    candidate_id: int
    card_id: str
    signature: str  # the card's, e.g. `f32[1,32,64], f32[64]`
    source: str
    speedup: float | None
    verdict: str  # "accepted" or the rejecting category


@dataclass(frozen=True)
class Context:
    """What the search knows beyond the parent's lineage, for an LLM's prompt.

    ``evaluated``: the card's other evaluated kernels, outside the parent's lineage (its siblings and
    other branches; `forgepack.search.tree.LineageEntry`, fastest first, then the failed): correct but
    slower ones included, so the model sees what was already tried;
    ``best``: the card's best kernel, when it is not the parent; ``similar``: accepted kernels of cards
    of the same operator (other shapes), best first; ``attempt``: calls made from this parent before this
    one (several are sampled at once: each is asked for a different kernel, and the requests differ)."""

    evaluated: tuple[Any, ...] = ()
    best: Example | None = None
    similar: tuple[Example, ...] = ()
    attempt: int = 0


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


class Exchanger(Proposer, Protocol):
    """A proposer that is a remote model: one request and one reply per call (see the module doc)."""

    def request(self, card: Card, parent: Parent | None, lineage: Sequence[Any], feedback: Sequence[str],
                context: Context | None = None) -> dict:
        """The JSON body of the call (no key in it: it is recorded)."""
        ...

    def worst_case_cost(self, request: dict) -> float:
        """Dollars this request can cost at most (every prompt byte a token, the most output it allows)."""
        ...

    def send(self, request: dict) -> tuple[dict, int]:
        """The reply's JSON and the attempts it took; thread-safe (several calls are in flight)."""
        ...

    def parse(self, request: dict, reply: dict, attempts: int, seconds: float) -> Proposal:
        """The `Proposal` of a reply (live or replayed)."""
        ...


def exchanges(proposer: Any) -> bool:
    """Whether `proposer` is an `Exchanger` (its calls are split, run in parallel and recorded)."""
    return all(callable(getattr(proposer, name, None)) for name in ("request", "send", "parse", "worst_case_cost"))


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
