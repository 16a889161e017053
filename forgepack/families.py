"""Shape families: fold variants that differ only in sizes into one card, and unfold members again.

Capture at several points of a serving envelope sees the same op with the same dtypes, ranks and
non-tensor values at different sizes. `fold` turns such a group into one family card:

- every (tensor, axis) whose size is the same at every point stays a fixed size;
- axes whose sizes vary are named dims; axes whose sizes are equal at every point share one dim
  (equal dims across arguments: `mm`'s inner size, an add's operands);
- an axis that is 1 at some points and more at others must share its dim with another axis, or it
  may be a broadcast at its 1s (variants that broadcast differently are then separate families);
- each stride is explained as `c * product of dims` (contiguous, channels-last, transposed and sliced
  views of a contiguous parent); an input's stride that has no such explanation is free (any
  non-negative stride: a slice of a buffer whose row length is no size of the tensor, which a kernel
  reading strides at run time serves); an output's must have one, else the group is left unfolded;
- a dim's range is what the points span (capture visits the envelope's corners, so the span is the
  envelope's); it may include 0 (a cache's first write): an empty tensor's strides are explained by
  the points where it has elements, and neither they nor its pointer are checked where it is empty;
- a size only an output has is a derived dim, the sum of input dims plus a constant (a cat's length:
  the decode cache's past + 1), computed once the inputs bind its base dims.

Fusion cards fold too: the same chain (ops, non-tensor values, dtypes and ranks of every value) found
at several points, at sizes that differ (a decode step's RMSNorm at each batch, a prefill's at each
prompt length). A chain value that holds a size (a `view`'s shape) differs between points, so such a
chain is no family. A member's chain values are laid out as the chain's replay on the meta device
says (`opcall.chain_layouts`); a family folded from profiled members sums their profiles, and each
point's weight is its member's share of the family's time.

`member(card, values)` gives the concrete card at any dim values: what verification, benchmarks and
tests run. A family card's own `args`/`outputs` are its most-called member, so every stage that reads
a concrete card keeps working on it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections import defaultdict
from collections.abc import Iterable

from forgepack.cards import (
    FREE_STRIDE,
    Arg,
    Card,
    Dim,
    Family,
    Layout,
    Profile,
    TensorMeta,
    ValueStats,
    card_output_key,
    chain_digest,
)

MAX_STRIDE_DIMS = 3  # a stride is explained by at most this many dims (a 4-d view's outermost stride)


# --- fold ------------------------------------------------------------------------------------------------


def _tensors(card: Card) -> list[TensorMeta | None]:
    return [*card.tensor_inputs(), *card.outputs]


def _group_key(card: Card) -> tuple:
    """What must be equal for two variants to be one family: op, schema, dtypes, ranks, devices,
    non-tensor values."""
    fixed = []
    for a in card.args:
        if a.kind == "tensor":
            fixed.append((a.name, "t", a.tensor.dtype, len(a.tensor.shape), a.tensor.device))
        elif a.kind == "tensors":
            fixed.append((a.name, "l", tuple((t.dtype, len(t.shape), t.device) for t in a.tensors)))
        else:
            fixed.append(a.key())
    outs = tuple((o.dtype, len(o.shape), o.device) for o in card.outputs)
    return (card.op, card.schema, card.kind, tuple(fixed), outs)


def _fusion_key(card: Card) -> tuple:
    """What must be equal for two fusion cards to be one family: the chain but for its sizes (each entry's
    op, tensor references and non-tensor values, its outputs' dtypes and ranks), what it returns, its
    inputs' and outputs' dtypes, ranks and devices."""
    chain = tuple((e.op, tuple((a.name, a.kind, a.ref, a.refs, repr(a.value)) for a in e.args),
                   tuple((m.dtype, len(m.shape)) for m in e.outs)) for e in card.chain)
    tensors = tuple(None if m is None else (m.dtype, len(m.shape), m.device) for m in _tensors(card))
    return ("fusion", card.op, card.schema, card.fusion.outputs, chain, tensors)


def fold(cards: Iterable[Card], min_members: int = 2) -> list[Card]:
    """Cards with variants that differ only in sizes folded into family cards; the rest unchanged.

    Groups of fewer than `min_members` stay as they are, and so does a group whose layouts `explain`
    cannot account for (it is served exactly, as before)."""
    return [card for card, _ in fold_members(cards, min_members)]


def fold_members(cards: Iterable[Card], min_members: int = 2) -> list[tuple[Card, list[Card]]]:
    """`fold`, each card with the cards it was folded from (a card left as it was: itself alone)."""
    groups: dict[tuple, list[Card]] = defaultdict(list)
    order: list[tuple] = []
    for card in cards:
        if card.family is not None:
            key = ("single", card.id)
        elif card.kind == "op":
            key = _group_key(card)
        elif card.kind == "fusion" and card.fusion is not None:
            key = _fusion_key(card)
        else:
            key = ("single", card.id)
        if key not in groups:
            order.append(key)
        groups[key].append(card)
    out = []
    for key in order:
        if key[0] == "single":
            out.extend((m, [m]) for m in groups[key])
            continue
        folded = _folded(_clusters(groups[key]), min_members)
        if any(card is not None and not _op_reproduces(card) for card, _ in folded):
            folded = _folded(_clusters(groups[key], reproduced=True), min_members)
        for card, members in folded:
            out.extend([(card, members)] if card is not None else [(m, [m]) for m in members])
    return out


def _folded(clusters: list[list[Card]], min_members: int) -> list[tuple[Card | None, list[Card]]]:
    """Each cluster's family card (None where it has too few members or no family), with its members."""
    out = []
    for members in clusters:
        family = explain(members) if len(members) >= min_members else None
        card = _family_card(members, family) if family is not None else None
        if card is not None and card.chain and not _replays_members(card, members):
            card = None
        out.append((card, members))
    return out


def _op_reproduces(card: Card) -> bool:
    """Whether the stock op, run on the meta device at each of the family's check points, gives outputs
    of the sizes and dtypes the family says (strides may differ: a member's free input stride is drawn,
    and an elementwise op's output follows its inputs' memory order). Two call sites can fold into a family
    no op computes: Phi-3's rotate_half cat of 8 + 8 lanes and its pass-through cat of 16 + 0 are one
    cat into 16 lanes, whose check point 8 + 0 stock answers with 8. Sizes the op refuses are no members
    (the verifier skips them too); an op with no meta kernel cannot be asked, and the verifier decides."""
    if card.kind != "op":
        return True
    from forgepack import opcall

    for values in check_points(card):
        m = member(card, values)
        try:
            layouts, dtypes = opcall.output_layouts(m)
        except RuntimeError:
            continue
        except (NotImplementedError, TypeError, ValueError):
            return True
        if [shape for shape, _, _ in layouts] != [o.shape for o in m.outputs] or dtypes != [o.dtype for o in m.outputs]:
            return False
    return True


def _replays_members(card: Card, members: list[Card]) -> bool:
    """A fusion family's members are laid out by replaying its chain on the meta device: replayed on each
    captured member's own inputs, that must give every chain value the layout capture saw, or the family
    is not folded. (A member at a captured point may differ from the captured card where the family's
    rules leave a stride free or never read: a size-1 axis's.)"""
    from forgepack import opcall

    for m in members:
        try:
            replayed = opcall.chain_layouts(m)
        except (RuntimeError, ValueError, TypeError, NotImplementedError):  # an op with no meta kernel
            return False
        seen = [[(o.shape, o.stride, o.storage_offset) for o in e.outs] for e in m.chain]
        if [[_addressed(*o) for o in outs] for outs in replayed] != [[_addressed(*o) for o in outs] for outs in seen]:
            return False
    return True


def _addressed(shape: tuple, stride: tuple, offset: int) -> tuple:
    """The parts of a layout that address an element: a size-1 axis's stride never does (CPU's bf16 neg
    of a decode step's rotate_half slice keeps the input's 1024 there, its meta kernel writes 32), nor
    does any stride of an empty tensor."""
    if 0 in shape:
        return shape, None, offset
    return shape, tuple(s if n != 1 else None for n, s in zip(shape, stride, strict=True)), offset


def _clusters(cards: list[Card], reproduced: bool = False) -> list[list[Card]]:
    """Split one group into the largest sets that one family explains, greedily in capture order
    (a group mixes layouts: an attention product's transposed and contiguous operands, say). With
    `reproduced`, a set must also be a family the stock op computes (`_op_reproduces`): slower, so only
    for a group whose plain split gave one that is not."""
    def explains(members: list[Card]) -> bool:
        family = explain(members)
        return family is not None and (not reproduced or _op_reproduces(_family_card(members, family)))

    clusters: list[list[Card]] = []
    for card in cards:
        for cluster in clusters:
            if explains([*cluster, card]):
                cluster.append(card)
                break
        else:
            clusters.append([card])
    # A card alone may have met only cards of its own sizes first (a batch-1 step beside another at a
    # different storage offset: no dim varies between the two); it joins a family found later.
    kept = []
    for cluster in clusters:
        home = None
        if len(cluster) == 1:
            home = next((c for c in clusters if len(c) > 1 and explains([*c, *cluster])), None)
        if home is None:
            kept.append(cluster)
        else:
            home.extend(cluster)
    return kept


def explain(members: list[Card]) -> Family | None:
    """The family these variants are members of, or None where sizes or strides follow no rule."""
    metas = [_tensors(c) for c in members]
    positions = [(t, a) for t, m in enumerate(metas[0]) if m is not None for a in range(len(m.shape))]
    values = {p: tuple(ms[p[0]].shape[p[1]] for ms in metas) for p in positions}
    names: dict[tuple, str] = {}
    for p in positions:
        vec = values[p]
        if len(set(vec)) > 1 and vec not in names:
            names[vec] = f"d{len(names)}"
    if not names:
        return None  # the same sizes: not a family (equal cards differ elsewhere)
    if any(_broadcast_at_some_points(vec, values) for vec in names):
        return None
    dim_values = {name: vec for vec, name in names.items()}
    n_in = len(members[0].tensor_inputs())
    layouts: list[Layout | None] = []
    for t, meta in enumerate(metas[0]):
        if meta is None:
            layouts.append(None)
            continue
        shape = tuple(names.get(values[(t, a)], meta.shape[a]) for a in range(len(meta.shape)))
        # an empty tensor's strides address nothing (PyTorch's vary): the points where it has elements say
        full = [i for i, ms in enumerate(metas) if ms[t].numel] or [0]
        seen = [metas[i] for i in full]
        dims_seen = {name: tuple(vec[i] for i in full) for name, vec in dim_values.items()}
        strides = []
        for a in range(len(meta.shape)):
            inner = {d for d in shape[a + 1:] if isinstance(d, str)}
            rule = _stride_rule([ms[t].stride[a] for ms in seen], [ms[t].shape[a] for ms in seen], dims_seen, inner)
            if rule is None and t < n_in and all(ms[t].stride[a] >= 0 for ms in seen):
                rule = FREE_STRIDE  # an input's stride no dims explain: bound by no rule (the kernel reads it)
            if rule is None:
                return None
            strides.append(rule)
        layouts.append(Layout(shape=shape, stride=tuple(strides)))
    bound = {s for lay in layouts[:n_in] if lay is not None for s in lay.shape if isinstance(s, str)}
    used = {s for lay in layouts if lay is not None for s in lay.shape if isinstance(s, str)}
    used |= {d for lay in layouts if lay is not None for rule in lay.stride if rule != FREE_STRIDE for d in rule[1]}
    derived = {name: _derived_rule(dim_values[name], {b: dim_values[b] for b in sorted(bound)})
               for name in sorted(used - bound)}
    if any(rule is None for rule in derived.values()):
        return None  # a size only an output has that no sum of input sizes explains: no guard can bind it
    dims = tuple(_dim(name, dim_values, derived.get(name)) for name in dim_values)
    points = tuple(tuple((name, dim_values[name][i]) for name in dim_values) for i in range(len(members)))
    return Family(dims=dims, inputs=tuple(layouts[:n_in]), outputs=tuple(layouts[n_in:]), points=points,
                  point_calls=tuple(c.calls for c in members))


def _derived_rule(vec: tuple[int, ...], bound: dict[str, tuple[int, ...]]) -> tuple[tuple[str, ...], int] | None:
    """(base dims, offset) with vec == offset + sum of the base dims' values at every point, one base dim
    before two; None if there is none. A cat's output length is its inputs' lengths summed: the decode
    cache's past + 1, or two varying parts."""
    for r in (1, 2):
        for combo in itertools.combinations(bound, r):
            offsets = {v - sum(bound[b][i] for b in combo) for i, v in enumerate(vec)}
            if len(offsets) == 1:
                return combo, offsets.pop()
    return None


def _dim(name: str, dim_values: dict[str, tuple[int, ...]], rule: tuple[tuple[str, ...], int] | None) -> Dim:
    vec = dim_values[name]
    if rule is None:
        return Dim(name, min(vec), max(vec))
    base, offset = rule  # its range follows the base dims' ranges
    low = sum(min(dim_values[b]) for b in base) + offset
    high = sum(max(dim_values[b]) for b in base) + offset
    return Dim(name, low, high, base, offset)


def _broadcast_at_some_points(vec: tuple[int, ...], values: dict[tuple, tuple[int, ...]]) -> bool:
    """A dim that is 1 at some points and more at others, held by one (tensor, axis) alone: at its 1s that
    axis may be a broadcast where elsewhere it is a real size (RMSNorm's f32[b,s,64] x f32[b,s,1] beside
    the MLP's f32[b,s,128] x f32[b,s,128]), so it is no dim. Held by several axes (an elementwise op's
    operand and its output, say), the 1s are a real size of each. An axis 1 at every point stays a fixed 1."""
    return 1 in vec and len(set(vec)) > 1 and sum(v == vec for v in values.values()) < 2


def _stride_rule(strides: list[int], sizes: list[int], dims: dict[str, tuple[int, ...]],
                 inner: set[str] = frozenset()) -> tuple | None:
    """(c, dims) with stride == c * prod(dims) at every point, fewest dims first; None if there is none.

    A size-1 axis's stride is never read (PyTorch sets it freely), so the points where the axis is 1 do
    not count: any rule that holds at the others does (a batch-1 view of a fused qkv buffer beside its
    batch-3 twin); an axis 1 at every point is recorded as (stride at the first point, ()).

    A dim may repeat (a prefill's q*k where q == k at every point so far is d*d). Where several rules
    hold at every point read, the one over `inner` (the dims of the axes after this one) wins, then one
    without a repeat: a dense tensor's. An attention mask's q axis has stride k, and where q == k at
    every prefill that fits the rule `q` too; taken as `q`, a check point with q != k would lay the
    rows over each other."""
    read = [i for i, n in enumerate(sizes) if n != 1]
    if not read:
        return (strides[0], ())
    names = list(dims)
    for r in range(MAX_STRIDE_DIMS + 1):
        fits = []
        for combo in itertools.combinations_with_replacement(names, r):
            prods = [math.prod(dims[d][i] for d in combo) for i in read]
            first = strides[read[0]]
            if any(p == 0 for p in prods) or first % prods[0]:
                continue
            c = first // prods[0]
            if all(strides[i] == c * p for i, p in zip(read, prods, strict=True)):
                fits.append((c, combo))
        if fits:  # min keeps the first of equals: the name order decides what nothing else does
            return min(fits, key=lambda rule: (not set(rule[1]) <= inner, len(set(rule[1])) < len(rule[1])))
    return None


MAX_FUSION_SITES = 8  # forgepack.fusion.MAX_SITES_PER_CARD


def _family_card(members: list[Card], family: Family) -> Card:
    rep = max(members, key=lambda c: c.calls)
    calls = sum(c.calls for c in members)
    modules = tuple(dict.fromkeys(m for c in members for m in c.modules))[:6]
    extra: dict = {}
    if rep.fusion is not None:
        sites = []
        for s in (s for c in members for s in c.fusion.sites):  # sites hold dicts: no hashing
            if s not in sites and len(sites) < MAX_FUSION_SITES:
                sites.append(s)
        extra["fusion"] = dataclasses.replace(rep.fusion, sites=tuple(sites))
    if all(c.profile is not None for c in members):  # folded after profiling (fusion cards)
        extra["profile"], weights = summed_profile([(c.calls, c.profile) for c in members], rep.profile)
        family = dataclasses.replace(family, point_weights=weights)
    return dataclasses.replace(rep, family=family, calls=calls, modules=modules, args=_pooled_args(members, rep),
                               **extra)


def _pooled_args(members: list[Card], rep: Card) -> tuple[Arg, ...]:
    """`rep`'s args with each tensor's value stats pooled over the members: the verifier draws a member's
    inputs from them, and one member's alone may miss what the others held (a mask cast to bool whose
    batch-1 member never reached 256 would let a kernel keeping the low byte pass)."""
    def pooled(metas: list[TensorMeta]) -> TensorMeta:
        like = metas[members.index(rep)]
        return dataclasses.replace(like, stats=_pooled_stats([(m.numel, m.stats) for m in metas]))

    out = []
    for i, arg in enumerate(rep.args):
        if arg.kind == "tensor":
            arg = dataclasses.replace(arg, tensor=pooled([c.args[i].tensor for c in members]))
        elif arg.kind == "tensors":
            lists = [c.args[i].tensors for c in members]
            arg = dataclasses.replace(arg, tensors=tuple(pooled(list(ts)) for ts in zip(*lists, strict=True)))
        out.append(arg)
    return tuple(out)


def _pooled_stats(parts: list[tuple[int, ValueStats | None]]) -> ValueStats | None:
    """One summary of several tensors' values (by element count): the widest range, the pooled mean and spread."""
    parts = [(n, st) for n, st in parts if st is not None and n > 0]
    if not parts:
        return None
    total = sum(n for n, _ in parts)
    mean = sum(n * st.mean for n, st in parts) / total
    second = sum(n * (st.std**2 + st.mean**2) for n, st in parts) / total
    return ValueStats(mean=mean, std=math.sqrt(max(second - mean**2, 0.0)), min=min(st.min for _, st in parts),
                      max=max(st.max for _, st in parts), nonfinite=any(st.nonfinite for _, st in parts))


def summed_profile(points: list[tuple[int, Profile]], rep: Profile) -> tuple[Profile, tuple[float, ...]]:
    """A family's profile from its points' (calls there, the profile of one call there): per-call figures
    over the envelope, totals and shares summed, the class and kernels of `rep`; and each point's share
    of the family's time (`Family.point_weights`)."""
    calls = sum(n for n, _ in points) or 1
    totals = [n * p.eager_us for n, p in points]
    total = sum(totals)

    def per_call(attr: str) -> float:
        return sum(n * getattr(p, attr) for n, p in points) / calls

    roof = per_call("roofline_us")
    profile = Profile(eager_us=total / calls, total_us=total, share=sum(p.share for _, p in points),
                      bytes=round(per_call("bytes")), flops=round(per_call("flops")), roofline_us=roof,
                      headroom=(total / calls) / roof if roof > 0 else 1.0, baseline=rep.baseline,
                      kernels=rep.kernels)
    return profile, tuple(t / total if total > 0 else 1 / len(totals) for t in totals)


# --- unfold -----------------------------------------------------------------------------------------------


def _size(entry: int | str, values: dict[str, int]) -> int:
    return values[entry] if isinstance(entry, str) else entry


def layout_meta(layout: Layout, like: TensorMeta, values: dict[str, int]) -> TensorMeta:
    """The tensor this layout describes at these dim values (dtype, device, value statistics and the
    storage offset of `like`, the captured member)."""
    shape = tuple(_size(s, values) for s in layout.shape)
    stride = tuple(like.stride[a] if (c, ds) == FREE_STRIDE else c * math.prod(values[d] for d in ds)
                   for a, (c, ds) in enumerate(layout.stride))  # a free stride: the captured member's
    return dataclasses.replace(like, shape=shape, stride=stride)


def member(card: Card, values: dict[str, int]) -> Card:
    """The concrete card of `card`'s family at these dim values (a plain variant: no family, no samples)."""
    family = card.family
    if family is None:
        raise ValueError(f"{card.id} is not a family card")
    missing = [d.name for d in family.dims if d.name not in values and not d.derived]
    if missing:
        raise ValueError(f"no value for dim(s) {', '.join(missing)} of {card.id}")
    values = complete(family, values)
    layouts = iter(family.inputs)
    args = []
    for a in card.args:
        if a.kind == "tensor":
            layout = next(layouts)
            args.append(dataclasses.replace(a, tensor=layout_meta(layout, a.tensor, values)))
        elif a.kind == "tensors":
            metas = tuple(layout_meta(next(layouts), t, values) for t in a.tensors)
            args.append(dataclasses.replace(a, tensors=metas))
        else:
            if a.kind == "none":
                next(layouts)
            args.append(a)
    outputs = tuple(layout_meta(lay, o, values) for lay, o in zip(family.outputs, card.outputs, strict=True))
    out = dataclasses.replace(card, args=tuple(args), outputs=outputs, family=None, samples=0)
    return _member_chain(out) if card.chain else out


def _member_chain(card: Card) -> Card:
    """A fusion member with its chain's values laid out at its sizes (the replay on the meta device), and
    its chain argument the digest of that chain, as a card captured at these sizes would have."""
    from forgepack import opcall

    layouts = opcall.chain_layouts(card)
    chain = tuple(dataclasses.replace(e, outs=tuple(dataclasses.replace(m, shape=shape, stride=stride,
                                                                        storage_offset=offset)
                                                    for m, (shape, stride, offset) in zip(e.outs, outs, strict=True)))
                  for e, outs in zip(card.chain, layouts, strict=True))
    digest = chain_digest(chain, card.fusion.outputs)
    args = tuple(dataclasses.replace(a, value=digest) if a.name == "chain" and a.kind == "value" else a
                 for a in card.args)
    return dataclasses.replace(card, args=args, chain=chain)


def complete(family: Family, values: dict[str, int]) -> dict[str, int]:
    """`values` with every derived dim computed from its base dims (the free dims' values are given)."""
    out = {k: v for k, v in values.items() if not family.dim(k).derived}
    out.update({d.name: d.value(out) for d in family.dims if d.derived})
    return out


def free_dims(family: Family) -> list[Dim]:
    """The dims the inputs' sizes bind (not derived)."""
    return [d for d in family.dims if not d.derived]


def members_at_points(card: Card) -> list[Card]:
    """The concrete cards at the points capture saw."""
    return [member(card, dict(p)) for p in card.family.points] if card.family is not None else [card]


def calls_at_points(card: Card) -> list[tuple[Card, int]]:
    """Each concrete card capture saw with its calls: an exact card itself; a family's members, each with
    its point's calls (evenly split where a card predates `point_calls`)."""
    if card.family is None:
        return [(card, card.calls)]
    members = members_at_points(card)
    calls = card.family.point_calls
    if len(calls) != len(members):
        calls = [card.calls // max(len(members), 1)] * len(members)
    return list(zip(members, calls, strict=True))


def calls_by_output(cards: Iterable[Card]) -> dict[tuple, list[tuple[Card, int]]]:
    """`cards.by_output` for families too: operator cards by the output layout of each concrete card
    capture saw (`calls_at_points`), each with that point's calls."""
    index: dict[tuple, list[tuple[Card, int]]] = {}
    for card in cards:
        if card.kind != "fusion":
            for m, calls in calls_at_points(card):
                index.setdefault(card_output_key(m), []).append((card, calls))
    return index


# --- verification points -------------------------------------------------------------------------------------

_PRIMES = (2, 3, 5, 7, 11, 13, 17, 31, 61, 127, 251, 509, 1021, 2039, 4093)


def candidate_sizes(d: Dim) -> list[int]:
    """The sizes of `d` a family is checked at (1, the ends and their neighbours, an odd middle, primes)."""
    lo, hi = d.min, d.max
    inside = [v for v in (1, lo, hi, lo + 1, hi - 1, (lo + hi) // 2 | 1, *_PRIMES) if lo <= v <= hi]
    return list(dict.fromkeys(inside))


def check_points(card: Card, seed: int = 0, extra: int = 3) -> list[dict[str, int]]:
    """Dim values a family kernel is verified at: the captured points, every dim at its min and max,
    1, primes and odd sizes inside the range, and `extra` random points; each a dict dim -> value."""
    family = card.family
    if family is None:
        return []
    rng = random.Random(seed)
    free = free_dims(family)
    captured = [dict(p) for p in family.points]
    base = captured[0] if captured else {d.name: d.min for d in free}
    points = list(captured)
    points.append({d.name: d.min for d in free})
    points.append({d.name: d.max for d in free})
    for d in free:  # one dim at a time through its odd and prime sizes, the others as captured
        points.extend({**base, d.name: v} for v in candidate_sizes(d))
    for _ in range(extra):
        points.append({d.name: rng.randint(d.min, d.max) for d in free})
    seen, out = set(), []
    for p in (complete(family, p) for p in points):
        key = tuple(sorted(p.items()))
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def bind(card: Card, metas: list[TensorMeta | None]) -> dict[str, int] | None:
    """The dim values these tensors (inputs in ABI order) give the family, or None where they are not a
    member: a dtype or device differs, a fixed size differs, a dim is out of range, equal dims differ, or
    a stride breaks its rule. The Python twin of the guard the shim generates (tests hold the two to the
    same answers; pointer alignment is the kernel's need, `forgepack.needs.pointers_ok`)."""
    family = card.family
    if family is None:
        return None
    values: dict[str, int] = {}
    for layout, meta, like in zip(family.inputs, metas, card.tensor_inputs(), strict=True):
        if (layout is None) != (meta is None):
            return None
        if layout is None:
            continue
        if (meta.dtype, meta.device) != (like.dtype, like.device):
            return None
        if len(layout.shape) != len(meta.shape):
            return None
        for want, got in zip(layout.shape, meta.shape, strict=True):
            if isinstance(want, int):
                if want != got:
                    return None
            elif values.setdefault(want, got) != got:
                return None
    for d in free_dims(family):
        lo, hi = family.served_range(d.name)
        if d.name not in values or not lo <= values[d.name] <= hi:
            return None
    values = complete(family, values)
    if any(not _inside(family.served_range(d.name), values[d.name]) for d in family.dims):
        return None
    for layout, meta in zip(family.inputs, metas, strict=True):
        if layout is None or meta.numel == 0:  # an empty tensor: no stride is read (nor its pointer)
            continue
        for (c, ds), n, s in zip(layout.stride, meta.shape, meta.stride, strict=True):
            if (c, ds) == FREE_STRIDE:
                if s < 0:
                    return None
            elif n != 1 and s != c * math.prod(values[d] for d in ds):
                return None
    return values


def _inside(ends: tuple[int, int], value: int) -> bool:
    return ends[0] <= value <= ends[1]


def describe(card: Card) -> str:
    """Short human form of a family: its dims and ranges, e.g. `d0 in 1..8, d1 in 16..2048`, and the
    sub-range its kernel serves where it was narrowed (`served d1 in 256..2048`)."""
    if card.family is None:
        return ""
    return card.family_text()


# --- sub-ranges -------------------------------------------------------------------------------------------


def narrow(card: Card, served: Iterable[tuple[str, int, int]]) -> Card:
    """`card` with its family served over this sub-range only (`Family.served`): what a kernel that pays
    only there is kept for. Each (dim, lo, hi) must be a free dim's and lie inside its range, the range
    the kernel was verified over: a sub-range never admits a size verification did not cover."""
    family = card.family
    if family is None:
        raise ValueError(f"{card.id} is not a family card: nothing to narrow")
    served = tuple((n, int(lo), int(hi)) for n, lo, hi in served)
    free = {d.name: d for d in free_dims(family)}
    for name, lo, hi in served:
        d = free.get(name)
        if d is None:
            raise ValueError(f"{card.id} has no free dim {name!r} to narrow")
        if not d.min <= lo <= hi <= d.max:
            raise ValueError(f"{card.id}: {name} in {lo}..{hi} is not inside its verified range {d.min}..{d.max}")
    if len({n for n, _, _ in served}) != len(served):
        raise ValueError(f"{card.id}: a dim narrowed twice in {served}")
    served = tuple((n, lo, hi) for n, lo, hi in served if (lo, hi) != (free[n].min, free[n].max))
    return dataclasses.replace(card, family=dataclasses.replace(family, served=served))
