"""The templates proposer: hand-written parametrised kernels; its search space is their parameters.

From the root (no parent) it offers each supporting template's default parameters, then the points
next to those defaults (a failed default is never a parent, its neighbours still get tried); from a
parent it offers the neighbours of the parent's parameters in that template's space.
Deterministic and free: a node with nothing untried left raises `NothingToPropose` (no call is spent).
A candidate's params are ``{"template": <name>, "params": {...}}``; the render is a pure function of
them, so parameter keys identify sources and ``tried`` (every key already in the card's tree) keeps
it from proposing a kernel twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from forgepack.cards import Card
from forgepack.search.proposers import NothingToPropose, Parent, Proposal
from forgepack.search.tree import params_key


class TemplatesProposer:
    name = "templates"
    paid = False
    adaptive = False  # deterministic: its untried points go out in parallel

    def __init__(self, target: str = "cuda", arch: str | None = None, **_options: Any):
        from forgepack import templates  # lazy: the registry may be imported without the template code

        self._lib = templates
        self.target = target
        self.arch = arch  # the GPU the pack is built for: arch-specific templates (wgmma) need theirs
        self._cache: dict[str, list] = {}

    @classmethod
    def preflight(cls, **_options: Any) -> None:
        """Offline and free: it can always run."""

    def _templates(self, card: Card) -> list:
        if card.id not in self._cache:
            self._cache[card.id] = self._lib.templates_for(card, self.target, self.arch)
        return self._cache[card.id]

    def unsupported(self, card: Card) -> str | None:
        if self._templates(card):
            return None
        return f"no {self.target} template serves {card.op_name}"

    def propose(
        self,
        card: Card,
        parent: Parent | None,
        lineage: Sequence[Any],
        feedback: Sequence[str],
        tried: frozenset[str] = frozenset(),
    ) -> Proposal:
        if parent is None:
            # each template's default first; then the points next to the defaults, so a default that
            # failed (and so can never be a parent) still has its neighbourhood searched
            defaults = [(t, t.default(card, self.target)) for t in self._templates(card)]
            around = [(t, p) for t, d in defaults for p in self._lib.neighbours(t, card, self.target, d)]
            options = defaults + around
        else:
            template = self._by_name(card, parent.params.get("template"))
            around = self._lib.neighbours(template, card, self.target, parent.params["params"])
            options = [(template, p) for p in around]
        for template, params in options:
            key = {"template": template.name, "params": params}
            if params_key(key) in tried:
                continue
            try:
                source = template.render(card, self.target, params)
            except ValueError:  # a point the template refuses to render: not a kernel, skip it
                continue
            return Proposal(source=source, params=key, meta={"family": template.family},
                            label=f"templates:{template.name}")
        where = "from scratch" if parent is None else f"around candidate #{parent.candidate_id}"
        raise NothingToPropose(f"every template configuration {where} has been tried")

    def _by_name(self, card: Card, name: str | None):
        for template in self._templates(card):
            if template.name == name:
                return template
        # the parent came from another proposer (or a template since removed): nothing to vary
        raise NothingToPropose(f"no template named {name!r} for {card.op_name}")
