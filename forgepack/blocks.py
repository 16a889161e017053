"""Decode blocks: the fused blocks of a decode step, found in the step's recorded program.

At batch 1-8 a decode step reads every weight once, and what keeps it from the bandwidth floor is
launches and the tails between them. A transformer layer's step is five blocks, each one kernel:

- `qkv`: the norm before attention, the Q, K and V projections (three weights, or one fused weight
  sliced), the rotary embedding of q and k, and the write of k and v into the static cache;
- `attention`: attention of the step's queries over the cache (the mask read as given), up to the
  layout the output projection reads;
- `proj_add`: a projection with the residual add (the output projection, the down projection);
- `gate_up`: the norm before the MLP, the gate and up projections, the activation times up;
- `lm_head`: the final norm and the LM head.

Nothing here knows a model class. A block is found from the program's dataflow (`stepprogram`):
*linears* are `mm`/`addmm` calls whose second operand is the transpose of an external weight; linears
reading the same activation form one group; the group's *prologue* is the chain of row operations
(one reduction: RMSNorm) that made that activation and whose values nothing else reads; its
*epilogue* is the elementwise, view and cat calls that consume the group's outputs (rotary, the
activation, the residual add, the cache writes), extended through a value only when every reader of
it can join. An *attention* block is a scaled-dot-product call with the views and mask conversions
that only it reads. What a block computes is its chain of recorded calls, and a block's card is a
fusion card of that chain, verified like any other; the block's `params` only tell a template where
each role sits. An architecture whose step does not match keeps today's kernels, and `find` says
which group did not match and why.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from forgepack import samples as samples_mod
from forgepack.cards import Arg, Card, ChainArg, ChainEntry, Fusion, FusionSite, ValueStats, chain_digest
from forgepack.runtime.modules import STEP_SITE
from forgepack.runtime.stepprogram import Call, Program, Val, record
from forgepack.runtime.stockcall import bind, encode_value, op_key
from forgepack.templates.blocks import BLOCK_OPS, KINDS  # noqa: F401 (the kinds, as the templates serve them)

LINEAR_OPS = frozenset({"aten::mm", "aten::addmm"})
ATTENTION_OPS = frozenset({
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention",
    "aten::scaled_dot_product_attention",
})
# Calls a prologue (a row program with one reduction over the last dim) may hold.
ROW_OPS = frozenset({"aten::pow", "aten::mean", "aten::sum", "aten::add", "aten::sub", "aten::mul", "aten::div",
                     "aten::rsqrt", "aten::sqrt", "aten::_to_copy", "aten::to", "aten::clone", "aten::neg"})
REDUCTIONS = frozenset({"aten::mean", "aten::sum"})
# Calls an epilogue may hold: elementwise maths, casts, views, cats, and the cache write.
POINTWISE = frozenset({"aten::add", "aten::sub", "aten::mul", "aten::div", "aten::neg", "aten::_to_copy",
                       "aten::to", "aten::clone", "aten::silu", "aten::gelu", "aten::tanh", "aten::sigmoid",
                       "aten::relu", "aten::exp", "aten::pow", "aten::rsqrt", "aten::contiguous"})
VIEWS = frozenset({"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::unsqueeze", "aten::squeeze",
                   "aten::transpose", "aten::t", "aten::permute", "aten::slice", "aten::select", "aten::expand",
                   "aten::alias", "aten::detach", "aten::_reshape_alias", "aten::lift_fresh", "aten::split",
                   "aten::split_with_sizes", "aten::chunk", "aten::unbind"})
CATS = frozenset({"aten::cat"})
# The eager attention (`softmax(score(q @ kᵀ)) @ v`, as models with soft-capping run it): the softmax is
# its anchor, the score maths between the first product and the softmax pointwise calls.
SOFTMAX_OPS = frozenset({"aten::_softmax", "aten::softmax"})
BMM = "aten::bmm"
CACHE_WRITES = frozenset({"aten::index_copy_"})
REPEATS = VIEWS | {"aten::clone", "aten::contiguous"}  # `repeat_kv`: unsqueeze, expand, a copy, reshape
MASK_OPS = frozenset({"aten::where", "aten::scalar_tensor", "aten::logical_not", "aten::masked_fill",
                      "aten::zeros_like", "aten::full_like", "aten::_to_copy"})


@dataclass(frozen=True)
class Linear:
    """`mm(view(x), t(w))` (+ bias: `addmm`), and the view of its result."""

    nodes: tuple[int, ...]  # t, view of x (if any), mm, view of the result (if any)
    weight: int
    bias: int | None
    x: int  # the activation as the model held it (before the 2D view)
    y: int  # the result as the model reads it (after the view back)
    n: int  # output features


@dataclass(frozen=True)
class Block:
    kind: str
    nodes: tuple[int, ...]  # program positions, in order
    inputs: tuple[int, ...]  # values, in order of first use (the kernel's inputs)
    outputs: tuple[int, ...]  # values the step reads after the block (the kernel's outputs)
    writes: tuple[int, ...]  # positions in `inputs` the block writes in place
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Skipped:
    where: str
    reason: str


class _Graph:
    def __init__(self, program: Program):
        self.program = program
        self.steps: list[Call] = program.steps  # a recorded program holds calls only
        self.producer: dict[int, int] = {}
        self.readers: dict[int, list[int]] = {}
        for i, node in enumerate(self.steps):
            for v in node.outs:
                if v in program.made and v not in self.producer:
                    self.producer[v] = i
            for v in dict.fromkeys(node.reads):
                self.readers.setdefault(v, []).append(i)
        self.result = set()
        stack = [program.result]
        while stack:
            item = stack.pop()
            if isinstance(item, Val):
                self.result.add(item.id)
            elif isinstance(item, list | tuple):
                stack.extend(item)
            elif isinstance(item, dict):
                stack.extend(item.values())

    def name(self, i: int) -> str:
        return self.steps[i].name

    def made_by(self, v: int) -> int | None:
        return self.producer.get(v)

    def meta(self, v: int) -> torch.Tensor:
        return self.program.values[v]

    def external(self, v: int) -> bool:
        return v not in self.program.made


def _vals(node: Call) -> list[int]:
    return list(node.reads)


def _tensor_args(node: Call) -> list[Any]:
    return [a for a in node.args]


# --- anchors ---------------------------------------------------------------------------------------------


def _linear(g: _Graph, i: int) -> Linear | None:
    node = g.steps[i]
    if node.name not in LINEAR_OPS:
        return None
    bias = None
    if node.name == "aten::addmm":
        bias_v, a, b = node.args[0], node.args[1], node.args[2]
        if not isinstance(bias_v, Val) or not g.external(bias_v.id):
            return None
        bias = bias_v.id
    else:
        a, b = node.args[0], node.args[1]
    if not isinstance(a, Val) or not isinstance(b, Val):
        return None
    t = g.made_by(b.id)
    if t is None or g.name(t) != "aten::t" or not isinstance(g.steps[t].args[0], Val):
        return None
    weight = g.steps[t].args[0].id
    if not g.external(weight) or len(g.readers.get(b.id, ())) != 1:
        return None
    nodes = [t]
    x = a.id
    view_in = g.made_by(a.id)
    if view_in is not None and g.name(view_in) in ("aten::view", "aten::_unsafe_view", "aten::reshape") \
            and len(g.readers.get(a.id, ())) == 1:
        nodes.append(view_in)
        x = g.steps[view_in].args[0].id
    nodes.append(i)
    out = node.outs[0]
    y = out
    readers = g.readers.get(out, [])
    if len(readers) == 1 and g.name(readers[0]) in ("aten::view", "aten::_unsafe_view", "aten::reshape"):
        nodes.append(readers[0])
        y = g.steps[readers[0]].outs[0]
    return Linear(tuple(sorted(nodes)), weight, bias, x, y, int(g.meta(weight).shape[0]))


def _attention_nodes(g: _Graph, i: int, owned: set[int]) -> tuple[list[int], int] | None:
    """The attention call with the views after it up to the layout the next linear reads, and the mask
    conversions only it reads; and the value it hands on."""
    nodes = [i]
    out = g.steps[i].outs[0]
    while True:
        readers = g.readers.get(out, [])
        if len(readers) != 1 or g.name(readers[0]) not in VIEWS or readers[0] in owned:
            break
        nodes.append(readers[0])
        out = g.steps[readers[0]].outs[0]
    node = g.steps[i]
    mask = node.kwargs.get("attn_mask", node.kwargs.get("attn_bias"))
    if mask is None and len(node.args) > 3:
        mask = node.args[3]
    if isinstance(mask, Val):
        nodes += _feeders(g, mask.id, set(nodes), MASK_OPS | VIEWS, owned)
    for kv in node.args[1:3]:  # the cache repeated for every query head (`repeat_kv`): read in place instead
        if isinstance(kv, Val):
            nodes += _feeders(g, kv.id, set(nodes), REPEATS, owned)
    return sorted(set(nodes)), out


def _eager_attention_nodes(g: _Graph, i: int, owned: set[int]) -> tuple[list[int], int] | None:
    """An eager attention around the softmax at call `i`: the product of the queries with the keys
    (`bmm`), the score maths after it (scale, soft-capping, the additive mask), the softmax, the product
    with the values and the views after it; the queries' views and the cache's `repeat_kv` only it reads.
    None when the softmax is not between two such products."""
    score, first = _score_calls(g, g.steps[i].reads[0], owned)
    if first is None:
        return None
    nodes = [first, *score, i]
    out = g.steps[i].outs[0]
    while True:  # the probabilities' cast and views, up to the second product
        readers = [r for r in g.readers.get(out, []) if r not in owned]
        if len(readers) != 1 or len(g.readers.get(out, [])) != 1:
            return None
        r = readers[0]
        nodes.append(r)
        if g.name(r) == BMM:
            break
        if g.name(r) not in VIEWS | {"aten::_to_copy", "aten::to"}:
            return None
        out = g.steps[r].outs[0]
    second = nodes[-1]
    if g.steps[second].reads[0] != out:
        return None
    out = g.steps[second].outs[0]
    while True:  # the output's views up to the layout the next linear reads
        readers = g.readers.get(out, [])
        if len(readers) != 1 or g.name(readers[0]) not in VIEWS | {"aten::clone", "aten::contiguous"} \
                or readers[0] in owned:
            break
        nodes.append(readers[0])
        out = g.steps[readers[0]].outs[0]
    q, k = g.steps[first].reads[:2]
    v = g.steps[second].reads[1]
    nodes += _feeders(g, q, set(nodes), VIEWS, owned)
    for kv in (k, v):  # the cache repeated for every query head: read in place instead
        nodes += _feeders(g, kv, set(nodes), REPEATS, owned)
    return sorted(set(nodes)), out


def _score_calls(g: _Graph, v: int, owned: set[int]) -> tuple[list[int], int | None]:
    """The pointwise calls that make the softmax's input from one `bmm` (and externals: the mask), and
    that `bmm`; or no `bmm` when the input is made otherwise."""
    calls, first, todo = [], None, [v]
    while todo:
        u = todo.pop()
        p = g.made_by(u)
        if p is None or p in calls or p == first:
            continue
        if g.name(p) == BMM and p not in owned:
            if first not in (None, p):
                return [], None
            first = p
            continue
        if p in owned or g.name(p) not in POINTWISE | VIEWS:
            if g.meta(u).dim() == 4 and g.meta(u).is_floating_point():
                continue  # an external operand: the additive mask
            return [], None
        calls.append(p)
        todo.extend(g.steps[p].reads)
    return sorted(calls), first


def _feeders(g: _Graph, v: int, inside: set[int], allowed: frozenset, owned: set[int]) -> list[int]:
    """The calls that made `v` from externals, when only `inside` reads what they make."""
    found: list[int] = []
    todo = [v]
    while todo:
        u = todo.pop()
        p = g.made_by(u)
        if p is None or p in owned or p in found or g.name(p) not in allowed:
            continue
        if any(r not in inside and r not in found for r in g.readers.get(u, ())):
            continue
        if any(r not in inside and r not in found and r != p for o in g.steps[p].outs
               for r in g.readers.get(o, ())):
            continue
        found.append(p)
        todo.extend(g.steps[p].reads)
    return found


# --- a linear group's prologue and epilogue -------------------------------------------------------------------


def _prologue(g: _Graph, x: int, group: set[int], owned: set[int]) -> list[int]:
    """The row program that made `x`: calls of ROW_OPS (and views) whose results only it and the group
    read, grown backwards from `x` until a value someone else reads (the residual stream)."""
    inside: set[int] = set()
    frontier = [x]
    while frontier:
        v = frontier.pop()
        p = g.made_by(v)
        if p is None or p in inside or p in owned:
            continue
        if g.name(p) not in ROW_OPS and g.name(p) not in VIEWS:
            continue
        readers = set(g.readers.get(v, ()))
        if not readers <= inside | group:
            continue
        if any(set(g.readers.get(o, ())) - inside - group - {p} for o in g.steps[p].outs if o != v):
            continue
        inside.add(p)
        frontier.extend(g.steps[p].reads)
    return sorted(inside)


def _epilogue(g: _Graph, ys: list[int], group: set[int], owned: set[int], first: int) -> list[int]:
    """The calls that consume the group's results, in program order: each call that reads a value of the
    block joins when it can (elementwise, views, cats, a reduction, a cache write) and its other inputs
    exist apart from the block (made before it, beside it, or external). A reduction past the residual
    add is the next block's norm, never this one's. Then calls that only recompute from the block's own
    outputs for readers outside (the next norm's square) are given back."""
    inside: set[int] = set()
    internal = set(ys)
    before = {v for v, p in g.producer.items() if p < first}
    downstream = _downstream(g, set(ys), first)
    residual: set[int] = set()  # values past the residual add
    for r in range(first, len(g.steps)):
        if r in group or r in inside:
            continue
        reads = g.steps[r].reads
        if not any(u in internal for u in reads) or not _joinable(g, r, owned, internal, before, downstream):
            continue
        if g.name(r) in REDUCTIONS and any(u in residual for u in reads):
            continue
        inside.add(r)
        past = any(u in residual for u in reads) or (
            g.name(r) in ("aten::add", "aten::sub") and any(u not in internal for u in reads))
        for o in g.steps[r].outs:
            if o in g.program.made:
                internal.add(o)
                if past:
                    residual.add(o)
        for u in reads:  # what only it reads, made from externals (cos unsqueezed, Gemma's 1 + w), joins too
            inside.update(_feeders(g, u, inside | group, VIEWS, owned))
            p = g.made_by(u)
            if (p is not None and p not in owned and p not in inside and g.name(p) in POINTWISE
                    and all(g.external(w) for w in g.steps[p].reads)
                    and set(g.readers.get(u, ())) <= inside | group):
                inside.add(p)
    return sorted(_given_back(g, inside, group))


def _given_back(g: _Graph, inside: set[int], group: set[int]) -> set[int]:
    """`inside` less the calls whose results only outside calls read and whose block inputs the block
    hands out anyway: they add an output and save nothing."""
    inside = set(inside)
    block = inside | group
    while True:
        dropped = None
        for r in sorted(inside, reverse=True):
            node = g.steps[r]
            if g.name(r) in CACHE_WRITES or g.name(r) in VIEWS:
                continue
            if any(rd in block for o in node.outs for rd in g.readers.get(o, ())):
                continue  # the block reads what it makes
            made = [u for u in node.reads if g.producer.get(u) in block]
            if made and all(any(rd not in block for rd in g.readers.get(u, ())) for u in made):
                dropped = r
                break
        if dropped is None:
            return inside
        inside.discard(dropped)
        block.discard(dropped)


def _downstream(g: _Graph, values: set[int], start: int) -> set[int]:
    """Every value computed, directly or not, from `values` (the program runs in order: one pass)."""
    out = set(values)
    for node in g.steps[start:]:
        if any(v in out for v in node.reads):
            out.update(node.outs)
    return out


def _joinable(g: _Graph, r: int, owned: set[int], internal: set[int], before: set[int], downstream: set[int]
              ) -> bool:
    name = g.name(r)
    if r in owned or name not in POINTWISE | VIEWS | CATS | CACHE_WRITES | REDUCTIONS:
        return False
    node = g.steps[r]
    if name in CACHE_WRITES and not g.external(node.args[0].id):
        return False
    for u in node.reads:
        # made beside the block from what it does not make (a cache index, cos unsqueezed), or before it
        if u in internal or g.external(u) or u in before or u not in downstream:
            continue
        return False
    return True


# --- finding the blocks ------------------------------------------------------------------------------------------


def find(program: Program) -> tuple[list[Block], list[Skipped]]:
    """The decode blocks of a recorded step, in program order, and the groups that did not make one."""
    g = _Graph(program)
    linears = [lin for i in range(len(g.steps)) if (lin := _linear(g, i)) is not None]
    owned: set[int] = {i for lin in linears for i in lin.nodes}
    attentions = []
    for i, node in enumerate(g.steps):
        found = None
        if node.name in ATTENTION_OPS:
            found = _attention_nodes(g, i, owned)
        elif node.name in SOFTMAX_OPS:
            found = _eager_attention_nodes(g, i, owned)
        if found is not None:
            attentions.append(found)
            owned.update(found[0])
    groups: dict[int, list[Linear]] = {}
    for lin in linears:
        groups.setdefault(lin.x, []).append(lin)
    blocks: list[Block] = []
    skipped: list[Skipped] = []
    claimed: set[int] = set()
    for k, (x, group) in enumerate(groups.items()):
        made = _group_block(g, x, group, owned, claimed, k == len(groups) - 1)
        if isinstance(made, Block):
            blocks.append(made)
            claimed.update(made.nodes)
        else:
            skipped.append(Skipped(_where(g, group), made))
    for nodes, out in attentions:
        made = _attention_block(g, nodes, out, claimed)
        if isinstance(made, Block):
            blocks.append(made)
            claimed.update(made.nodes)
        else:
            skipped.append(Skipped(f"attention at call {nodes[0]}", made))
    blocks += [b for b in (_cache_index(g, b, claimed) for b in list(blocks) if b.kind == "qkv") if b is not None]
    blocks.sort(key=lambda b: b.nodes[-1])
    return blocks, skipped


def _cache_index(g: _Graph, qkv: Block, claimed: set[int]) -> Block | None:
    """transformers' StaticCache (5.2x) computes a layer's write slot from a device counter and bumps it:
    `arange(n) + counter`, then `counter.add_(n)`. One launch for the three: the slot written out, the
    counter bumped (a cache_index block); none where a step passes its positions instead."""
    writes = [i for i in qkv.nodes if g.name(i) in CACHE_WRITES]
    if not writes or not isinstance(g.steps[writes[0]].args[2], Val):
        return None
    index = g.steps[writes[0]].args[2].id
    add = g.made_by(index)
    if add is None or g.name(add) != "aten::add":
        return None
    a, b = g.steps[add].args[:2]
    if not (isinstance(a, Val) and isinstance(b, Val)):
        return None
    nodes, arange = [add], g.made_by(a.id)
    while arange is not None and g.name(arange) in ("aten::detach", "aten::alias"):  # arange made under no_grad
        nodes.append(arange)
        arange = g.made_by(g.steps[arange].args[0].id)
    counter = b.id
    if arange is None or g.name(arange) != "aten::arange" or not g.external(counter) or g.meta(counter).dim() != 0:
        return None
    bumps = [i for i in range(add + 1, writes[0]) if g.name(i) == "aten::add_" and g.steps[i].writes == (counter,)]
    if len(bumps) != 1 or set(g.readers.get(index, ())) - set(qkv.nodes) or set(nodes) & claimed:
        return None
    made = _as_block(g, "cache_index", sorted([arange, *nodes, bumps[0]]))
    return made if isinstance(made, Block) else None


def _where(g: _Graph, group: list[Linear]) -> str:
    shapes = "+".join(str(lin.n) for lin in group)
    return f"linears of {shapes} features at call {group[0].nodes[-1]}"


def _group_block(g: _Graph, x: int, group: list[Linear], owned: set[int], claimed: set[int], last: bool
                 ) -> Block | str:
    group_nodes = {i for lin in group for i in lin.nodes}
    first = min(group_nodes)
    free = owned - group_nodes
    prologue = [i for i in _prologue(g, x, group_nodes, free | claimed) if i not in claimed]
    reductions = [i for i in prologue if g.name(i) in REDUCTIONS]
    if len(reductions) > 1:
        return f"the calls before it are a row program with {len(reductions)} reductions (one is served)"
    if not reductions:
        prologue = []  # elementwise calls before a linear stay as they are; its input is the block's
    epilogue = _epilogue(g, [lin.y for lin in group], group_nodes, free | claimed, first)
    nodes = sorted(set(prologue) | group_nodes | set(epilogue))
    names = Counter(g.name(i) for i in epilogue)
    widest = max(int(g.meta(v).shape[0]) for v in g.program.externals() if g.meta(v).dim() == 2)
    if any(g.name(i) in CACHE_WRITES for i in epilogue):
        kind = "qkv"
    elif prologue and len(group) in (1, 2) and names["aten::mul"] and (names["aten::silu"] or names["aten::gelu"]):
        kind = "gate_up"
    elif prologue and len(group) == 1 and group[0].n == widest and last:
        kind = "lm_head"  # the step's last and widest projection: the vocabulary
    elif not prologue and len(group) == 1 and names["aten::add"]:
        kind = "proj_add"
    else:
        return "it matches no decode block (no cache write, activation, residual add or final projection)"
    if kind in ("qkv", "gate_up", "lm_head") and not prologue:
        return f"a {kind} block needs the norm before it, and no row program made its input"
    block = _as_block(g, kind, nodes)
    if isinstance(block, str):
        return block
    weights = [block.inputs.index(lin.weight) for lin in group]
    biases = [block.inputs.index(lin.bias) if lin.bias is not None else -1 for lin in group]
    params = {"linears": [[w, b, lin.n] for w, b, lin in zip(weights, biases, group, strict=True)],
              "x": block.inputs.index(x) if not prologue else -1,
              "mm": [_mm_out(g, lin) for lin in group]}
    if prologue:
        params["prologue"] = [nodes.index(i) for i in prologue]
    return dataclasses.replace(block, params=params)


def _mm_out(g: _Graph, lin: Linear) -> int:
    """Position, among the block's chain calls, is not known here: the mm call's program position."""
    return next(i for i in lin.nodes if g.name(i) in LINEAR_OPS)


def _attention_block(g: _Graph, nodes: list[int], out: int, claimed: set[int]) -> Block | str:
    if any(i in claimed for i in nodes):
        return "its calls belong to another block"
    block = _as_block(g, "attention", nodes)
    if isinstance(block, str):
        return block
    if not any(g.name(i) in ATTENTION_OPS for i in nodes):
        return _eager_attention_block(g, nodes, block)
    sdpa = next(g.steps[i] for i in nodes if g.name(i) in ATTENTION_OPS)
    q, k, v = (a.id for a in sdpa.args[:3])
    params = {"scale": sdpa.kwargs.get("scale"), "q_shape": list(g.meta(q).shape), "k_shape": list(g.meta(k).shape),
              "finite": True}
    mask = _mask_input(g, sdpa, block)
    if mask is not None and k in block.inputs and v in block.inputs:
        # slots the mask excludes are never read: the kernel's contract, and what verification draws
        params["masked_reads"] = {"mask": block.inputs.index(mask), "inputs": [block.inputs.index(k),
                                                                               block.inputs.index(v)], "axis": 2}
    return dataclasses.replace(block, params=params)


def _eager_attention_block(g: _Graph, nodes: list[int], block: Block) -> Block | str:
    """Params of an eager attention: the cache inputs its products read, and the additive mask (a 4-D
    floating input of the score maths), whose lowest value excludes a slot."""
    first, second = (i for i in nodes if g.name(i) == BMM)
    caches = [_cache_input(g, g.steps[first].reads[1], block), _cache_input(g, g.steps[second].reads[1], block)]
    if None in caches:
        return "the attention's keys or values are not the cache"
    q = g.steps[first].reads[0]
    params: dict[str, Any] = {"scale": None, "q_shape": list(g.meta(q).shape),
                              "k_shape": list(g.meta(caches[0]).shape), "finite": True, "eager": True}
    masks = [v for v in block.inputs if g.meta(v).dim() == 4 and g.meta(v).is_floating_point() and v not in caches
             and any(g.name(r) in POINTWISE for r in g.readers.get(v, ()) if r in nodes)]
    if len(masks) > 1:
        return "more than one additive mask"
    if masks:
        params["masked_reads"] = {"mask": block.inputs.index(masks[0]),
                                  "inputs": [block.inputs.index(c) for c in caches], "axis": 2, "dead": "lowest"}
    return dataclasses.replace(block, params=params)


def _cache_input(g: _Graph, v: int, block: Block) -> int | None:
    """The block input a product's keys or values come from, through `repeat_kv` and views."""
    while v not in block.inputs:
        p = g.made_by(v)
        if p is None or g.name(p) not in REPEATS:
            return None
        v = g.steps[p].reads[0]
    return v if g.meta(v).dim() == 4 else None


def _mask_input(g: _Graph, sdpa: Call, block: Block) -> int | None:
    """The block input the attention's mask comes from (itself, or through its conversion)."""
    mask = sdpa.kwargs.get("attn_mask", sdpa.kwargs.get("attn_bias"))
    if mask is None and len(sdpa.args) > 3 and isinstance(sdpa.args[3], Val):
        mask = sdpa.args[3]
    if not isinstance(mask, Val):
        return None
    todo = [mask.id]
    while todo:
        v = todo.pop()
        if v in block.inputs:
            return v
        p = g.made_by(v)
        if p is not None:
            todo.extend(u for u in g.steps[p].reads if g.meta(u).dim() == 4)
    return None


def _as_block(g: _Graph, kind: str, nodes: list[int]) -> Block | str:
    """A block of these calls: inputs by first use, outputs the values read after it, the inputs it
    writes; or why not (a value it makes is read between its calls, or it writes a value it made)."""
    inside = set(nodes)
    made: set[int] = set()
    inputs: list[int] = []
    for i in nodes:
        node = g.steps[i]
        for v in node.reads:
            if v not in made and v not in inputs:
                inputs.append(v)
        made.update(v for v in node.outs if v not in inputs)
    last = nodes[-1]
    outputs = []
    for v in sorted(made, key=lambda v: g.producer.get(v, -1)):
        readers = [r for r in g.readers.get(v, ()) if r not in inside]
        if any(r < last for r in readers):
            return "a value it makes is read before its last call"
        if readers or v in g.result:
            outputs.append(v)
    writes = sorted({inputs.index(v) for i in nodes for v in g.steps[i].writes if v in inputs})
    if not outputs and not writes:
        return "it makes nothing the step reads"
    return Block(kind, tuple(nodes), tuple(inputs), tuple(outputs), tuple(writes))


# --- cards ------------------------------------------------------------------------------------------------------


def chain_of(program: Program, block: Block) -> tuple[list[ChainEntry], list[tuple]]:
    """The block's calls as a fusion card's chain (tensor arguments as refs to the block's inputs or to
    earlier entries), and its outputs as refs."""
    steps = program.steps
    where: dict[int, tuple] = {v: ("in", k) for k, v in enumerate(block.inputs)}
    entries: list[ChainEntry] = []
    for p, i in enumerate(block.nodes):
        node = steps[i]
        args = []
        for schema_arg, value in bind(node.func, node.args, node.kwargs):
            args.append(_chain_arg(schema_arg, value, where))
        outs = tuple(dataclasses.replace(samples_mod.meta_of(program.values[v]), stats=None) for v in node.outs)
        entries.append(ChainEntry(op_key(node.func), tuple(args), outs))
        for k, v in enumerate(node.outs):
            if v not in where or where[v][0] == "t":  # an in-place result stays the value it wrote
                where.setdefault(v, ("t", p, k))
    outputs = [where[v] for v in block.outputs]
    return entries, outputs


def _chain_arg(schema_arg: Any, value: Any, where: dict[int, tuple]) -> ChainArg:
    """One argument as capture encodes it: an optional tensor passed None is "none"."""
    name = schema_arg.name
    if isinstance(value, Val):
        return ChainArg(name, "tensor", ref=where[value.id])
    if isinstance(value, list | tuple) and value and all(isinstance(v, Val) for v in value):
        return ChainArg(name, "tensors", refs=tuple(where[v.id] for v in value))
    if value is None and isinstance(schema_arg.type, torch.OptionalType) \
            and isinstance(schema_arg.type.getElementType(), torch.TensorType):
        return ChainArg(name, "none")
    return ChainArg(name, "value", value=encode_value(value))


def make_card(program: Program, block: Block) -> Card:
    """The block as a fusion card: its chain, its inputs (named by role), outputs, writes and params."""
    chain, outputs = chain_of(program, block)
    digest = chain_digest(chain, outputs)
    metas = [samples_mod.meta_of(program.values[v], with_stats=True) for v in block.inputs]
    for k, size in _cache_indices(program, block).items():  # fresh draws reach every slot of the cache
        metas[k] = dataclasses.replace(metas[k], stats=ValueStats(size / 2, size / 4, 0.0, float(size - 1)))
    names = _input_names(block)
    args = tuple(Arg(n, "tensor", tensor=m) for n, m in zip(names, metas, strict=True))
    args += (Arg("chain", "value", value=digest),)
    out_metas = tuple(samples_mod.meta_of(program.values[v]) for v in block.outputs)
    rets = "Tensor" if len(out_metas) == 1 else "(" + ", ".join("Tensor" for _ in out_metas) + ")"
    schema = f"fusion::{block.kind}({', '.join(f'Tensor {n}' for n in names)}, str chain) -> {rets}"
    site = FusionSite(STEP_SITE, "decode-step", digest, {}, {})
    launches = sum(1 for i in block.nodes if program.steps[i].launches)
    fusion = Fusion(block.kind, launches, tuple(tuple(r) for r in outputs), (site,), "", tuple(block.writes),
                    _json_params(block, chain))
    return Card(op=f"fusion.{block.kind}.default", schema=schema, args=args, outputs=out_metas, kind="fusion",
                calls=1, modules=(f"decode step ({block.kind})",), chain=tuple(chain), fusion=fusion)


def _cache_indices(program: Program, block: Block) -> dict[int, int]:
    """Block input position -> the cache length, for each index a cache write takes."""
    out = {}
    for i in block.nodes:
        node = program.steps[i]
        if node.name in CACHE_WRITES and isinstance(node.args[2], Val) and node.args[2].id in block.inputs:
            cache = program.values[node.args[0].id]
            out[block.inputs.index(node.args[2].id)] = int(cache.shape[node.args[1] % cache.dim()])
    return out


def _input_names(block: Block) -> list[str]:
    names = [f"in{k}" for k in range(len(block.inputs))]
    for k, (w, b, _) in enumerate(block.params.get("linears", ())):
        names[w] = f"w{k}"
        if b >= 0:
            names[b] = f"b{k}"
    for k in block.writes:
        names[k] = f"cache{k}"
    return names


def _json_params(block: Block, chain: list[ChainEntry]) -> dict[str, Any]:
    """The params with program positions turned into chain entry indices."""
    params = dict(block.params)
    if "mm" in params:
        params["mm"] = [block.nodes.index(i) for i in params["mm"]]
    params["kind"] = block.kind
    return params


# --- the build: decode steps recorded at the serving buckets, their blocks as cards -----------------------


@dataclass
class BlockResult:
    cards: list[Card]
    samples: dict[str, list]  # card id -> [(inputs, outputs)], CPU windows
    skipped: list[Skipped]
    points: list[tuple[int, int]]  # (rows, cache length) recorded
    launches: dict[str, tuple[int, int]] = field(default_factory=dict)  # point -> (stock launches, with blocks)


def decode_points(recipe: Any, model: Any) -> list[tuple[int, int]]:
    """(rows, cache length) of the decode steps a served model runs for this recipe: the batch buckets the
    recipe's batch sizes fall into, and cache lengths from the serving ladder up to what the model allows
    (its first, middle and last rung: a family over the cache's length is verified between them)."""
    from forgepack.recipe import high, low
    from forgepack.runtime import serving

    opts = serving.ServeOptions()
    w = recipe.workload
    rows = sorted({opts.batch_bucket(b) or b for b in range(low(w.batch), high(w.batch) + 1)})
    cap = int(getattr(model.config, "max_position_embeddings", 0) or opts.max_cache_len)
    cap = min(cap, opts.max_cache_len)
    rungs = [c for c in opts.cache_lengths if c <= cap] or [cap]
    lengths = sorted({rungs[0], rungs[len(rungs) // 2], rungs[-1]})
    return [(r, c) for r in rows for c in lengths]


def _step_weights(recipe: Any, points: list[tuple[int, int]]) -> dict[tuple[int, int], float]:
    """How many of the profile's decode steps each recorded point stands for, so that a block's share is
    weighed like the forward calls it replaces: a decode recipe profiles one step, shared out over the
    points (a block recorded at three cache lengths is one step's block, not three); a generate envelope's
    capture runs `new_tokens - 1` steps at each of its points, which fall in the points' batch buckets
    (shared out over the cache lengths recorded for that bucket). Fractions: the calls of a card are
    summed over its points first and rounded once (`_weighed`)."""
    from forgepack.models import envelope_points
    from forgepack.runtime import serving

    w = recipe.workload
    if w.phase != "generate":
        return {p: 1 / len(points) for p in points}
    opts = serving.ServeOptions()
    steps = max(w.new_tokens - 1, 1)
    out = {}
    for rows, length in points:
        captured = sum(1 for e in envelope_points(w) if (opts.batch_bucket(e["batch"]) or e["batch"]) == rows)
        lengths = sum(1 for r, _ in points if r == rows)
        out[(rows, length)] = captured * steps / lengths
    return out


def _weighed(card: Card, calls: float) -> Card:
    """The card (a block, or a family folded from blocks) at `calls` calls a profiled step, its total
    and share scaled with them (profiled at the rounded calls of each point)."""
    n = max(1, round(calls))
    if card.profile is None or card.calls == n:
        return dataclasses.replace(card, calls=n)
    scale = n / card.calls
    profile = dataclasses.replace(card.profile, total_us=card.profile.total_us * scale,
                                  share=card.profile.share * scale)
    return dataclasses.replace(card, calls=n, profile=profile)


def record_step(model: Any, rows: int, cache_len: int, prompt: int = 16, seed: int = 0) -> Program:
    """One decode step of forgepack's decode loop (`runtime.decodeloop.run_step`), recorded as a program,
    after a prefill of `prompt` random tokens into a static cache of `cache_len` slots. The caller runs it
    under `torch.no_grad()` (as the loop does)."""
    from forgepack.runtime import decodeloop
    from forgepack.runtime.servereq import static_cache
    from forgepack.runtime.transformers_hooks import cache_kwarg_of

    device = next(model.parameters()).device
    vocab = int(model.config.get_text_config().vocab_size)
    gen = torch.Generator().manual_seed(seed)
    cache = static_cache(model, cache_len)  # as the server makes it
    ids = torch.randint(0, vocab, (rows, prompt), generator=gen).to(device)
    model(input_ids=ids, use_cache=True, cache_position=torch.arange(prompt, device=device),
          **{cache_kwarg_of(model.forward): cache})
    state = decodeloop.State(rows, vocab, cache_len, device)
    dtype = decodeloop.additive_mask_dtype(model)
    if dtype is not None:
        state.additive_mask(dtype)
    state.start(rows, prompt, decodeloop.Greedy(cache_len - prompt, 0, (), 0, False, False, False))
    state.counters.add_(1)  # as the loop's pick after the prefill does: the step writes slot `prompt`
    state.token.copy_(ids[:, -1:])
    kwargs = decodeloop.step_kwargs(model.forward, state, cache)
    # writes kept (no capture follows): each block's inputs then hold what the step gave them (the mask as
    # the step set it, before the attention read it), and are its samples
    return record(decodeloop.run_step, model.forward, state, kwargs, undo=False)


def build(model: Any, recipe: Any, device: torch.device, facts: Any, op_cards: list[Card],
          note: Any = None) -> BlockResult:
    """The decode blocks of the recipe's served decode steps, as cards: recorded at every `decode_points`
    point, profiled there (the chain replayed, as fusion cards are), then the same block at several cache
    lengths folded into one family over the cache's length (`families.fold_members`)."""
    from forgepack import families, fusion

    found: list[Card] = []
    sample_sets: dict[str, list] = {}
    skipped: list[Skipped] = []
    points = decode_points(recipe, model)
    weights = _step_weights(recipe, points)
    launches: dict[str, tuple[int, int]] = {}
    calls: dict[str, float] = {}  # per card id: the profiled steps' calls its points stand for
    for k, (rows, length) in enumerate(points):
        if note is not None:
            note(f"decode blocks at batch {rows}, cache {length}", k, len(points))
        try:
            with torch.no_grad():
                program = record_step(model, rows, length)
        except Exception as err:  # a step the decode loop cannot run either (it falls back the same way)
            skipped.append(Skipped(f"b{rows} c{length}", f"the decode step could not be recorded: "
                                   f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"))
            continue
        blocks, skip = find(program)
        skipped += [Skipped(f"b{rows} c{length}: {s.where}", s.reason) for s in skip]
        covered = sum(1 for b in blocks for i in b.nodes if program.steps[i].launches)
        launches[f"b{rows} c{length}"] = (program.launches(), program.launches() - covered + len(blocks))
        for block in blocks:
            card = make_card(program, block)
            if card.id not in sample_sets:
                found.append(card)
                sample_sets[card.id] = _sample(program, block)
            calls[card.id] = calls.get(card.id, 0.0) + weights[(rows, length)]
        del program
    found = [_weighed(c, calls[c.id]) for c in found]
    total = sum(c.profile.total_us for c in op_cards if c.profile)
    profiled = fusion.profile_cards(found, sample_sets, device, facts, total, op_cards) if facts is not None else found
    cards, samples = [], {}
    for card, members in families.fold_members(profiled):
        card = _weighed(_slots_within_every_member(card, members), sum(calls[m.id] for m in members))
        cards.append(card)
        rep = max(members, key=lambda m: m.calls)
        samples[card.id] = sample_sets[rep.id]
    return BlockResult(cards, samples, skipped, points, launches)


def _slots_within_every_member(card: Card, members: list[Card]) -> Card:
    """A family over the cache's length draws its write slots from the shortest member's cache (the
    fold pools value statistics, and a slot past a short cache is no input of that member)."""
    if card.family is None or not card.fusion.writes:
        return card
    args = list(card.args)
    for k, a in enumerate(args):
        st = a.tensor.stats if a.kind == "tensor" and a.tensor is not None else None
        if st is None or a.tensor.dtype != "int64":
            continue
        top = min(m.args[k].tensor.stats.max for m in members if m.args[k].tensor.stats is not None)
        stats = dataclasses.replace(st, mean=top / 2, std=top / 4, min=0.0, max=top)
        args[k] = dataclasses.replace(a, tensor=dataclasses.replace(a.tensor, stats=stats))
    return dataclasses.replace(card, args=tuple(args))


def _sample(program: Program, block: Block) -> list:
    """The block's inputs and outputs as the step held them (CPU windows), when they fit a sample."""
    ins = [program.values[v] for v in block.inputs]
    outs = [program.values[v] for v in block.outputs]
    size = sum(samples_mod.fresh.span(tuple(t.shape), t.stride()) * t.element_size() for t in ins + outs)
    if size > samples_mod.MAX_BYTES_PER_CARD:
        return []  # a weight too large to keep: verification draws fresh inputs like it
    return [([samples_mod.window(t).cpu() for t in ins], [samples_mod.window(t).cpu() for t in outs])]
