"""Offline kernel templates: the default proposer's search space.

Each `Template` serves a set of op overloads, refuses any variant it cannot compute exactly (with the
reason), and renders a complete kernel source for the ABI at any point of its parameter space:

    >>> from forgepack.templates import templates_for, neighbours
    >>> for t in templates_for(card, "cuda"):
    ...     params = t.default(card, "cuda")
    ...     source = t.render(card, "cuda", params)
    ...     nearby = neighbours(t, card, "cuda", params)

Families (one module each), in the order the reference profiles weigh them: `elementwise` (unary,
binary with broadcasting, casts and copies, cat), `rowreduce` (softmax, layer/RMS norm, sum/mean/amax),
`norm` (inference batch norm, group norm), `pool` (adaptive average, max), `gemm` (matrix products
into unaligned outputs, where cuBLAS falls off its fast path). The cpu target renders plain
C++17 loops from the same programs: correct first, fast second.
"""

from __future__ import annotations

from forgepack.cards import Card
from forgepack.needs import Needs
from forgepack.templates import blocks, elementwise, fused, gemm, norm, pool, rowreduce
from forgepack.templates.common import Template, on_device

REGISTRY: tuple[Template, ...] = (elementwise.TEMPLATES + rowreduce.TEMPLATES + norm.TEMPLATES + pool.TEMPLATES
                                   + fused.TEMPLATES + gemm.TEMPLATES + blocks.TEMPLATES)
FAMILIES = ("elementwise", "rowreduce", "norm", "pool", "fused", "gemm", "blocks")


def templates_for(card: Card, target: str, arch: str | None = None) -> list[Template]:
    """The templates whose `supports()` accepts this card on this target (and GPU arch, when given)."""
    return [t for t in REGISTRY if t.supports(card, target, arch) is None]


def refusals(card: Card, target: str, arch: str | None = None) -> dict[str, str]:
    """Why each template that names the card's op refuses it (for reports and the proposer's log)."""
    out = {}
    for t in REGISTRY:
        if card.op in t.ops:
            reason = t.supports(card, target, arch)
            if reason:
                out[t.name] = reason
    return out


def by_name(name: str) -> Template:
    for t in REGISTRY:
        if t.name == name:
            return t
    raise KeyError(f"no template named {name!r}")


def needs_of(card: Card, target: str, params: dict) -> Needs | None:
    """The needs a templates candidate's kernel states (`params` as the proposer records them:
    {"template": name, "params": {...}}); None for another proposer's kernel (the default applies)."""
    name = params.get("template") if isinstance(params, dict) else None
    if name is None:
        return None
    try:
        return by_name(name).needs(card, target, params.get("params", {}))
    except KeyError:  # a template since removed: its kernel was verified as it was, by today's rule
        return None


def neighbours(template: Template, card: Card, target: str, params: dict) -> list[dict]:
    """Points one step away on one axis (the next value up or down), for tree search."""
    axes = template.space(card, target)
    out = []
    for axis, values in axes.items():
        if params.get(axis) not in values:
            continue
        i = values.index(params[axis])
        for j in (i - 1, i + 1):
            if 0 <= j < len(values):
                out.append({**params, axis: values[j]})
    return out


def points(template: Template, card: Card, target: str, limit: int | None = None) -> list[dict]:
    """Every point of the space (the default first), optionally only the first `limit`."""
    import itertools

    axes = template.space(card, target)
    first = template.default(card, target)
    out = [first]
    for combo in itertools.product(*axes.values()):
        p = dict(zip(axes, combo, strict=True))
        if p != first:
            out.append(p)
        if limit is not None and len(out) >= limit:
            break
    return out


__all__ = ["FAMILIES", "REGISTRY", "Template", "by_name", "neighbours", "on_device", "points", "refusals",
           "templates_for"]
