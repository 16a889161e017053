"""Fusion cards: module-level chains of non-vendor ops that one fused kernel can replace.

The reference models are launch-bound: HF `LlamaRMSNorm` is eight launches (casts, pow, mean, add,
rsqrt, two muls) 33 times a forward, `apply_rotary_pos_emb` fourteen per layer, GPT-2's tanh GELU
eight. A fusion card stands for one such chain, so that it is profiled, searched, verified and packed
like an operator card (same `Card` schema, `kind="fusion"`):

- `op`: `fusion.<pattern>.default` (`rmsnorm`, `rotary`, `gated_act`, `bn_act`, `add_act`,
  `gelu_tanh`, `softmax`, `layernorm`, or `chain` for any other);
- `args`: the chain's external tensor inputs (the call's tensor arguments, then parameters or child
  outputs) as tensor Args, in kernel input order, then `chain`, a digest of the chain (two chains of the
  same shapes that compute different things are different cards);
- `outputs`: what the chain returns; `chain`: the aten calls it replaces (`cards.ChainEntry`), each
  with its arguments, tensor arguments as refs (``("in", i)``: input i; ``("t", p, k)``: output k of
  chain entry p) and the metadata of its outputs; `fusion` (`cards.Fusion`): pattern, launch count,
  output refs, and the patch sites (`cards.FusionSite`, for `forgepack.runtime.modules`: class or
  function, source digest, config facts, call form).

Where chains come from (`find`): capture's per-call dataflow log (`forgepack.capture`) and its module
call records. A *module* site is a leaf module whose whole forward is the chain (RMSNorm, GELU
modules); a *function* site is a free function of a modeling file (`HOT_FUNCTIONS`, wrapped during
capture); *glue* sites are chains between child modules of known structures (`modules.GLUE_INPUTS`).
Chains with vendor ops (matmul, conv, attention), host syncs, random ops, fewer than two launches,
side effects visible to the caller, or intermediates used after them are not fused.

`check_and_sample` runs the model once more with the sites patched in observe mode: every call's
chain is replayed (`opcall.run_chain`) and must equal what the module computed, bit for bit, and the first
calls' inputs are kept as samples. `profile_cards` times each chain in isolation; its share is taken
against the same total as the operator cards (the summed isolated time of every aten call), so the
allocator can weigh it against them; the chain's calls are already inside that total. A chain's
eager time is at most what its own operator calls cost in that total (`operator_us`): replayed from
Python, a chain also pays the replay's interpretation (the Llama RMSNorm chain: 173 µs against 60 µs
of its operators), which made fusion shares sum past 100% and the search's estimates with them.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from forgepack import devices, families, opcall, roofline, templates, timing
from forgepack import samples as samples_mod
from forgepack.capture import Capture, ModuleCall, fold_path, merge
from forgepack.cards import (
    Arg,
    Card,
    ChainArg,
    ChainEntry,
    Fusion,
    FusionSite,
    Profile,
    TensorMeta,
    by_output,
    chain_digest,
    output_key,
    variant_id,
)
from forgepack.runtime import modules as rt
from forgepack.runtime import opclasses, stockcall

HOT_FUNCTIONS = ("apply_rotary_pos_emb",)
MIN_LAUNCHES = 2
MAX_SITES_PER_CARD = 8
VENDOR_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation", "addmv", "mv", "dot",
    "convolution", "_convolution", "cudnn_convolution", "mkldnn_convolution", "_slow_conv2d_forward",
    "conv2d", "embedding_bag",
})


# --- what an op is ------------------------------------------------------------------------------------


def _base(op: str) -> str:
    return op.split(".")[1]


def _is_view(op: str) -> bool:
    returns = stockcall.resolve(op)._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _writes(op: str) -> list[int]:
    """Positions (in schema argument order) of the arguments the op writes in place."""
    args = stockcall.resolve(op)._schema.arguments
    return [i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]


def _refusal(op: str) -> str | None:
    name = _base(op)
    if not op.startswith("aten."):
        return f"{op} is not an aten op"
    if name in VENDOR_OPS or "scaled_dot_product" in name or "attention" in name:
        return f"vendor op {name}"
    if f"aten::{name}" in opclasses.HOST_SYNC_OPS:
        return f"host synchronisation ({name})"
    func = stockcall.resolve(op)
    if torch.Tag.nondeterministic_seeded in func.tags:
        return f"random op {name}"
    return None


def launches(ops: list[str]) -> int:
    """Of these chain ops, those that launch a kernel (not views, not bare allocations)."""
    return sum(1 for op in ops if not _is_view(op) and f"aten::{_base(op)}" not in opclasses.NO_KERNEL_OPS)


# --- candidates ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One occurrence of a fusible chain in the capture."""

    calls: tuple[int, ...]  # indices into Capture.calls, in order
    inputs: tuple[tuple, ...]  # global refs of the kernel inputs, in order
    input_metas: tuple[TensorMeta, ...]
    outputs: tuple[tuple, ...]  # global refs of the chain's outputs
    site: FusionSite
    path: str  # module path (folded) or function path


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str


def function_sites(model: torch.nn.Module) -> tuple[tuple[Any, str], ...]:
    """(python module, name) of the hot free functions in the modeling files this model's classes use."""
    found, seen = [], set()
    for m in model.modules():
        owner = sys.modules.get(type(m).__module__)
        if owner is None or owner.__name__ in seen:
            continue
        seen.add(owner.__name__)
        for name in HOT_FUNCTIONS:
            if callable(getattr(owner, name, None)):
                found.append((owner, name))
    return tuple(found)


class _Log:
    """Indexes over a capture: who uses each ref, and each module call's direct children."""

    def __init__(self, cap: Capture):
        self.cap = cap
        self.users: dict[tuple, list[int]] = {}
        for i, rec in enumerate(cap.calls):
            for ref in rec.inputs:
                if ref is not None:
                    self.users.setdefault(tuple(ref), []).append(i)
        self.children: dict[int, list[int]] = {}
        for k, mc in enumerate(cap.module_calls):
            if mc.parent >= 0:
                self.children.setdefault(mc.parent, []).append(k)

    def meta_of(self, ref: tuple) -> TensorMeta | None:
        """Metadata of a ref, from a call that produced or used it."""
        if ref[0] == "call":
            return self.cap.calls[ref[1]].outputs[ref[2]]
        for i in self.users.get(ref, ()):
            rec = self.cap.calls[i]
            metas = [m for a in rec.args for m in ((a.tensor,) if a.kind == "tensor" else a.tensors)]
            for r, m in zip([r for r in rec.inputs if r is not None], metas, strict=False):
                if tuple(r) == ref:
                    return m
        return None


def _chain_problem(log: _Log, calls: list[int]) -> str | None:
    for i in calls:
        reason = _refusal(log.cap.calls[i].op)
        if reason:
            return reason
    if launches([log.cap.calls[i].op for i in calls]) < MIN_LAUNCHES:
        return f"fewer than {MIN_LAUNCHES} launches"
    return None


def _externals(log: _Log, calls: list[int]) -> list[tuple]:
    inside = set(calls)
    out: list[tuple] = []
    for i in calls:
        for ref in log.cap.calls[i].inputs:
            if ref is None:
                continue
            ref = tuple(ref)
            if ref[0] == "call" and ref[1] in inside:
                continue
            if ref not in out:
                out.append(ref)
    return out


def _escapes(log: _Log, calls: list[int], outputs: list[tuple]) -> str | None:
    """An intermediate used outside the chain (not one of its outputs) cannot be fused away."""
    inside = set(calls)
    for i in calls:
        for k in range(len(log.cap.calls[i].outputs)):
            ref = ("call", i, k)
            if ref in outputs:
                continue
            if any(u not in inside for u in log.users.get(ref, ())):
                return f"an intermediate ({log.cap.calls[i].op}) is used outside the chain"
    return None


def _writes_external(log: _Log, calls: list[int], allowed: set[tuple]) -> str | None:
    inside = set(calls)
    for i in calls:
        rec = log.cap.calls[i]
        positions = _writes(rec.op)
        if not positions:
            continue
        flat = _tensor_positions(rec)
        for pos in positions:
            ref = flat.get(pos)
            if ref is None:
                continue
            if ref[0] == "call" and ref[1] in inside:
                continue
            if ref not in allowed:
                return f"{rec.op} writes into a tensor the caller can see"
    return None


def _tensor_positions(rec) -> dict[int, tuple]:
    """Schema position -> ref, for the call's single-tensor arguments."""
    refs = iter(rec.inputs)
    out = {}
    for pos, a in enumerate(rec.args):
        if a.kind == "tensor":
            r = next(refs)
            out[pos] = tuple(r) if r is not None else None
        elif a.kind == "tensors":
            for _ in a.tensors:
                next(refs)
        elif a.kind == "none":
            next(refs)
    return out


def _form(mc: ModuleCall, externals: list[tuple], param_prefix: str | None) -> tuple[dict, list[tuple], list] | str:
    """The call form of a module/function site and the kernel inputs in order: every tensor argument
    (used or not: its metadata decides the result too), then the parameters the chain reads."""
    args, kwargs, inputs, refs, metas = [], {}, [], [], []

    def one(item, where):
        if item[0] == "t":
            inputs.append(where)
            refs.append(tuple(item[1]))
            metas.append(item[2])
            return ["t"]
        if item[0] == "v":
            return ["v", item[1]]
        return None

    for i, item in enumerate(mc.args):
        entry = one(item, ["arg", i])
        if entry is None:
            return f"argument {i} is a {item[1]} (only tensors and plain values can be guarded)"
        args.append(entry)
    for k, item in mc.kwargs.items():
        entry = one(item, ["kwarg", k])
        if entry is None:
            return f"argument {k} is a {item[1]} (only tensors and plain values can be guarded)"
        kwargs[k] = entry
    if len(set(refs)) != len(refs):
        return "the same tensor is passed twice"
    for ref in externals:
        if ref in refs:
            continue
        if param_prefix is not None and ref[0] == "param" and ref[1].startswith(param_prefix):
            local = ref[1][len(param_prefix):]
            if "." in local:
                return f"reads {ref[1]}, a parameter of a child module"
            inputs.append(["param", local])
            refs.append(ref)
            metas.append(None)
            continue
        return f"reads a tensor that is neither an argument nor its own parameter ({ref[0]})"
    returns = mc.returns
    if returns not in ("tensor", "tuple"):
        return "returns something other than a tensor or a tuple of tensors"
    return {"args": args, "kwargs": kwargs, "inputs": inputs, "returns": returns}, refs, metas


def _whole_call(log: _Log, k: int, mc: ModuleCall) -> Candidate | str:
    """A leaf module's forward or a free function's body, as one chain."""
    if mc.kind == "module" and any(log.cap.module_calls[c].kind == "module" for c in log.children.get(k, ())):
        return "not a leaf module"
    calls = list(range(mc.first, mc.last))
    if not calls:
        return "no aten calls"
    problem = _chain_problem(log, calls)
    if problem:
        return problem
    externals = _externals(log, calls)
    prefix = None  # a function reads only its arguments
    if mc.kind == "module":
        prefix = "" if mc.path == "<model>" else mc.path + "."
    formed = _form(mc, externals, prefix)
    if isinstance(formed, str):
        return formed
    form, refs, metas = formed
    outputs = [tuple(r) for r in mc.outputs]
    if not outputs or any(r[0] != "call" or r[1] not in set(calls) for r in outputs):
        return "returns a tensor it did not compute"
    problem = _escapes(log, calls, outputs) or _writes_external(log, calls, set())
    if problem:
        return problem
    metas = [m if m is not None else log.meta_of(r) for r, m in zip(refs, metas, strict=True)]
    if mc.kind == "module":
        cls = type(mc.module)
        site = FusionSite("module", rt.qualname(cls), rt.source_digest(cls.forward), rt.simple_facts(mc.module), form)
    else:
        owner, _, name = mc.path.removeprefix("fn:").rpartition(".")
        site = FusionSite("function", f"{owner}:{name}", rt.source_digest(mc.module), {}, form)
    if site.digest is None:
        return "its source is not available (the guard could not tell a changed forward)"
    return Candidate(tuple(calls), tuple(refs), tuple(metas), tuple(outputs), site,
                     fold_path(mc.path) if mc.kind == "module" else mc.path)


def _child_calls(log: _Log, k: int, module: torch.nn.Module, names: tuple[str, ...]) -> dict[str, ModuleCall] | str:
    found: dict[str, ModuleCall] = {}
    for c in log.children.get(k, ()):
        mc = log.cap.module_calls[c]
        for name in names:
            if mc.kind == "module" and mc.module is getattr(module, name, None):
                if name in found:
                    return f"{name} is called more than once"
                found[name] = mc
    missing = [n for n in names if n not in found]
    return f"does not call {', '.join(missing)}" if missing else found


def _glue(log: _Log, k: int, mc: ModuleCall, kind: str) -> Candidate | str:
    """A chain between the child modules of a known structure (`modules.GLUE_INPUTS`)."""
    module = mc.module
    children = _child_calls(log, k, module, rt.GLUE_CHILDREN[kind])
    if isinstance(children, str):
        return children
    if len(mc.args) != 1 or mc.args[0][0] != "t" or mc.kwargs:
        return "not called with one tensor argument"
    owned = set(range(mc.first, mc.last))
    for c in log.children.get(k, ()):
        owned -= set(range(log.cap.module_calls[c].first, log.cap.module_calls[c].last))
    if kind == "gated_mlp":
        chain_children = ("act_fn",)
    elif kind == "conv_bn_act":
        chain_children = ("normalization", "activation")
    else:
        chain_children = ("activation",)
    calls = sorted(owned | {i for n in chain_children for i in range(children[n].first, children[n].last)})
    if not calls:
        return "no aten calls"
    problem = _chain_problem(log, calls)
    if problem:
        return problem
    sources = []
    for name in rt.GLUE_INPUTS[kind]:
        if "." in name:
            sources.append(("param", f"{mc.path}.{name}"))
        else:
            out = children[name].outputs
            if len(out) != 1:
                return f"{name} does not return one tensor"
            sources.append(tuple(out[0]))
    externals = _externals(log, calls)
    if set(externals) != set(sources) or len(sources) != len(set(sources)):
        return "the chain does not read exactly the expected tensors"
    if kind == "gated_mlp":
        down = children["down_proj"]
        if len(down.args) != 1 or down.args[0][0] != "t":
            return "down_proj is not called with one tensor"
        outputs = [tuple(down.args[0][1])]
    else:
        outputs = [tuple(r) for r in mc.outputs]
    if len(outputs) != 1 or outputs[0][0] != "call" or outputs[0][1] not in set(calls):
        return "the chain's result is not what the next step uses"
    # Writing into a child's output is invisible to the caller (residual_act's `h += residual`).
    allowed = {s for s in sources if s[0] == "call" and mc.first <= s[1] < mc.last}
    problem = _escapes(log, calls, outputs) or _writes_external(log, calls, allowed)
    if problem:
        return problem
    cls = type(module)
    site = FusionSite(kind, rt.qualname(cls), rt.source_digest(cls.forward), rt.glue_facts(kind, module), {})
    if site.digest is None:
        return "its source is not available"
    metas = tuple(log.meta_of(r) for r in sources)
    return Candidate(tuple(calls), tuple(sources), metas, tuple(outputs), site, fold_path(mc.path))


def _glue_kind(module: Any) -> str | None:
    for kind, names in rt.GLUE_CHILDREN.items():
        if all(isinstance(getattr(module, n, None), torch.nn.Module) for n in names):
            return kind
    return None


def find(cap: Capture) -> tuple[list[Candidate], list[Skipped]]:
    """Every fusible chain in the capture, and why the other leaf modules and functions were left."""
    log = _Log(cap)
    found, skipped = [], []
    for k, mc in enumerate(cap.module_calls):
        if mc.last < 0:
            continue
        if mc.kind == "module" and getattr(mc.module, "training", False):
            continue
        glue = _glue_kind(mc.module) if mc.kind == "module" else None
        leaf = mc.kind == "function" or not any(cap.module_calls[c].kind == "module" for c in log.children.get(k, ()))
        if glue is None and not leaf:
            continue
        result = _glue(log, k, mc, glue) if glue else _whole_call(log, k, mc)
        if isinstance(result, Candidate):
            found.append(result)
        elif mc.last > mc.first:
            skipped.append(Skipped(fold_path(mc.path), result))
    return found, skipped


# --- cards ---------------------------------------------------------------------------------------------


def _value(v: Any) -> Any:
    return [_value(x) for x in v] if isinstance(v, list | tuple) else v


def chain_entries(cap: Capture, cand: Candidate) -> list[ChainEntry]:
    """The chain in card form: tensor arguments as refs to inputs or to earlier entries."""
    local = {i: p for p, i in enumerate(cand.calls)}
    inputs = {ref: i for i, ref in enumerate(cand.inputs)}

    def ref_of(r) -> tuple:
        r = tuple(r)
        if r[0] == "call" and r[1] in local:
            return ("t", local[r[1]], r[2])
        return ("in", inputs[r])

    entries = []
    for i in cand.calls:
        rec = cap.calls[i]
        refs = iter(rec.inputs)
        args = []
        for a in rec.args:
            if a.kind == "tensor":
                args.append(ChainArg(a.name, "tensor", ref=ref_of(next(refs))))
            elif a.kind == "tensors":
                args.append(ChainArg(a.name, "tensors", refs=tuple(ref_of(next(refs)) for _ in a.tensors)))
            elif a.kind == "none":
                next(refs)
                args.append(ChainArg(a.name, "none"))
            else:
                args.append(ChainArg(a.name, "value", value=_value(a.value)))
        outs = tuple(dataclasses.replace(m, stats=None) for m in rec.outputs)  # layouts: what the JSON keeps
        entries.append(ChainEntry(rec.op, tuple(args), outs))
    return entries


def pattern(chain: list[ChainEntry], kind: str) -> str:
    """A name for what the chain computes (for people and for the templates' first look)."""
    ops = Counter(_base(e.op) for e in chain)
    if kind == "gated_mlp":
        return "gated_act"
    if kind == "residual_act":
        return "add_act"
    if kind == "conv_bn_act":
        return "bn_act"
    if ops["cat"] and ops["neg"] and ops["slice"]:
        return "rotary"
    reductions = ops["mean"] + ops["sum"]
    if ops["rsqrt"] and reductions == 1 and ops["pow"]:
        return "rmsnorm"
    if (ops["rsqrt"] or ops["sqrt"]) and reductions >= 2:
        return "layernorm"
    if ops["amax"] and ops["exp"] and reductions:
        return "softmax"
    if ops["tanh"] and ops["pow"]:
        return "gelu_tanh"
    return "chain"


def _arg_names(site: FusionSite, n: int) -> list[str]:
    if site.kind in rt.GLUE_INPUTS:
        return [s.replace(".", "_") for s in rt.GLUE_INPUTS[site.kind]]
    names = []
    for src, key in site.form["inputs"]:
        names.append(f"arg{key}" if src == "arg" else str(key).replace(".", "_"))
    return names[:n]


def make_card(cap: Capture, cand: Candidate) -> Card:
    chain = chain_entries(cap, cand)
    local = {i: p for p, i in enumerate(cand.calls)}
    outputs = [("t", local[r[1]], r[2]) for r in cand.outputs]
    name = pattern(chain, cand.site.kind)
    names = _arg_names(cand.site, len(cand.input_metas))
    digest = chain_digest(chain, outputs)
    args = tuple(Arg(n, "tensor", tensor=m) for n, m in zip(names, cand.input_metas, strict=True))
    args += (Arg("chain", "value", value=digest),)
    out_metas = tuple(cap.calls[r[1]].outputs[r[2]] for r in cand.outputs)
    rets = "Tensor" if len(out_metas) == 1 else "(" + ", ".join("Tensor" for _ in out_metas) + ")"
    schema = f"fusion::{name}({', '.join(f'Tensor {n}' for n in names)}, str chain) -> {rets}"
    fusion = Fusion(name, launches([e.op for e in chain]), tuple(outputs), (cand.site,), cand.site.target)
    return Card(op=f"fusion.{name}.default", schema=schema, args=args, outputs=out_metas, kind="fusion", calls=1,
                modules=(cand.path,), chain=tuple(chain), fusion=fusion)


def group(cap: Capture, candidates: list[Candidate]) -> list[Card]:
    """One card per distinct chain and signature; `calls` counts its occurrences, sites are merged."""
    by_id: dict[str, Card] = {}
    paths: dict[str, Counter] = {}
    for cand in candidates:
        card = make_card(cap, cand)
        paths.setdefault(card.id, Counter())[cand.path] += 1
        if card.id not in by_id:
            by_id[card.id] = card
            continue
        old = by_id[card.id]
        sites = old.fusion.sites
        if cand.site not in sites and len(sites) < MAX_SITES_PER_CARD:
            sites = (*sites, cand.site)
        fused = dataclasses.replace(old.fusion, sites=sites)
        by_id[card.id] = dataclasses.replace(old, calls=old.calls + 1, fusion=fused)
    return [dataclasses.replace(c, modules=tuple(p for p, _ in paths[c.id].most_common(6))) for c in by_id.values()]


# --- sites for the runtime -------------------------------------------------------------------------------


def sites_of(cards: list[Card]) -> tuple[list[rt.Site], dict[int, list[Card]]]:
    """Runtime sites for these cards (identical sites merged), and the cards each site serves."""
    keyed: dict[str, int] = {}
    sites: list[FusionSite] = []
    served: dict[int, list[Card]] = {}
    for card in cards:
        for s in card.fusion.sites:
            key = json.dumps(s.to_json(), sort_keys=True)
            if key not in keyed:
                keyed[key] = len(sites)
                sites.append(s)
            served.setdefault(keyed[key], []).append(card)
    out = [rt.Site(i, s.kind, s.target, s.digest, s.facts, s.form, tuple(c.id for c in served[i]))
           for i, s in enumerate(sites)]
    return out, served


def matching_card(cards: list[Card], tensors: list[torch.Tensor]) -> Card | None:
    """The card whose inputs have exactly these tensors' metadata."""
    keys = [samples_mod.meta_of(t).key() for t in tensors]
    for card in cards:
        metas = card.tensor_inputs()
        if len(metas) == len(keys) and all(m.key() == k for m, k in zip(metas, keys, strict=True)):
            return card
    return None


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


@dataclass
class Checked:
    """What `check_and_sample` found: cards that replay exactly, their samples, and what was dropped."""

    cards: list[Card]
    samples: dict[str, list]  # card id -> [(inputs, outputs)] (CPU windows, as capture keeps them)
    dropped: dict[str, str]  # card id -> why


def check_and_sample(model: torch.nn.Module, run: Callable[[], Any], cards: list[Card],
                     keep: int = samples_mod.MAX_SAMPLES_PER_CARD) -> Checked:
    """Run the model with every site patched in observe mode (nothing replaced): each call's chain is
    replayed and must equal the module's own result bit for bit; the first calls are kept as samples.
    The model's output must be bit-identical to an unpatched run (the glue forwards re-state code)."""
    if not cards:
        return Checked([], {}, {})
    sites, served = sites_of(cards)
    kept: dict[str, list] = {c.id: [] for c in cards}
    seen: Counter = Counter()
    bad: dict[str, str] = {}

    def observe(site: rt.Site, tensors: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        card = matching_card(served[site.index], tensors)
        if card is None:
            return
        seen[card.id] += 1
        if card.id in bad:
            return
        replay = opcall.run_chain(card, tensors)
        if len(replay) != len(outputs) or not all(_bits_equal(a, b) for a, b in zip(replay, outputs, strict=True)):
            bad[card.id] = "replaying the chain does not give what the module computed"
            return
        if len(kept[card.id]) < keep:
            kept[card.id].append(([samples_mod.window(t).cpu() for t in tensors],
                                  [samples_mod.window(o).cpu() for o in outputs]))

    with torch.no_grad():
        reference = stockcall.flatten_outputs(_output(run()))
        again = stockcall.flatten_outputs(_output(run()))
        patches = rt.ModulePatches(sites, call=lambda site, tensors: None, observe=observe)
        patches.install()
        try:
            patched = stockcall.flatten_outputs(_output(run()))
        finally:
            patches.remove()
    # Bit for bit where the model itself is deterministic; else within a generous bound (a wrong glue
    # forward is off by far more than run-to-run noise).
    exact = _same_outputs(reference, again, 0.0)
    if not _same_outputs(reference, patched, 0.0 if exact else 1e-2):
        glue = {c.id for c in cards if any(s.kind in rt.GLUE_INPUTS for s in c.fusion.sites)}
        bad.update({i: "the model's output changed with the patched forwards in place" for i in glue})
    out = []
    for card in cards:
        if card.id not in bad and not kept[card.id]:
            bad[card.id] = "no call of the model reached it through its patched site"
        if card.id in bad:
            continue
        out.append(_with_stats(card, kept[card.id][0][0]))
    return Checked(out, {c.id: kept[c.id] for c in out}, bad)


def _same_outputs(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float) -> bool:
    """Bitwise (rtol 0), or every output within rtol of its largest magnitude, NaNs in the same places."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if rtol == 0.0 or not x.is_floating_point():
            if not _bits_equal(x, y):
                return False
            continue
        if x.shape != y.shape or not torch.equal(torch.isnan(x), torch.isnan(y)):
            return False
        fx, fy = x.double(), y.double()
        finite = torch.isfinite(fx) & torch.isfinite(fy)
        if not torch.equal(fx[~finite].nan_to_num(), fy[~finite].nan_to_num()):
            return False
        scale = float(fx[finite].abs().max()) if bool(finite.any()) else 0.0
        if bool(finite.any()) and float((fx - fy)[finite].abs().max()) > rtol * max(scale, 1e-30):
            return False
    return True


def _output(result: Any) -> Any:
    for name in ("logits", "last_hidden_state"):
        value = getattr(result, name, None)
        if isinstance(value, torch.Tensor):
            return value
    return result


def _with_stats(card: Card, inputs: list[torch.Tensor]) -> Card:
    """Value statistics of the first sample, so fresh inputs are drawn like the real ones."""
    metas = iter(inputs)
    args = []
    for a in card.args:
        if a.kind == "tensor":
            window = next(metas)
            stats = samples_mod.value_stats(window)
            args.append(dataclasses.replace(a, tensor=dataclasses.replace(a.tensor, stats=stats)))
        else:
            args.append(a)
    return dataclasses.replace(card, args=tuple(args))


# --- profile ------------------------------------------------------------------------------------------------


def operator_us(card: Card, by_key: dict[tuple, list[Card]]) -> float | None:
    """Per call, what the chain's operator calls cost as the operator cards measured them (`by_key`:
    the profiled operator cards, `cards.by_output`; entries matched by op and output layout,
    calls-weighted where several cards match; views launch nothing). None when an entry that launches
    work has no profiled operator card."""
    total = 0.0
    for entry in card.chain:
        matches = by_key.get(output_key(entry.op, entry.outs))
        if not matches:
            if _is_view(entry.op):
                continue
            return None
        calls = sum(c.calls for c in matches) or 1
        total += sum(c.profile.eager_us * c.calls for c in matches) / calls
    return total


def profile_cards(cards: list[Card], sample_sets: dict[str, list], device: torch.device, facts: Any,
                  total_us: float, op_cards: list[Card] = ()) -> list[Card]:
    """Each chain timed in isolation (replayed, L2 flushed, median), on the roofline of its external
    bytes; `share` is against `total_us`, the summed isolated time of every aten call of the model
    (the same total the operator cards' shares use), and its eager time is at most `operator_us`
    (see the module docstring). Baseline class "fusion"."""
    out = []
    reps = 20 if device.type == "cuda" else 7
    by_key = by_output(c for c in op_cards if c.profile is not None)
    for card in cards:
        sets = sample_sets.get(card.id) or []
        if sets:
            metas = card.tensor_inputs()
            inputs = [samples_mod.materialize(m, t, device) for m, t in zip(metas, sets[0][0], strict=True)]
        else:
            inputs = samples_mod.fresh_inputs(card, seed=0, device=device)

        fn = opcall.served_stock_call(card, inputs, device)
        eager_us = timing.median(timing.time_us(fn, device, reps=reps, warmup=2))
        ops_us = operator_us(card, by_key)
        if ops_us is not None and ops_us > 0:
            eager_us = min(eager_us, ops_us)
        kernels = devices.kernel_names(fn) if device.type == "cuda" else []
        roof = roofline.roofline(card, facts)
        total = eager_us * card.calls
        out.append(card.with_profile(Profile(
            eager_us=eager_us, total_us=total, share=total / total_us if total_us > 0 else 0.0,
            bytes=roof.bytes, flops=roof.flops, roofline_us=roof.us,
            headroom=eager_us / roof.us if roof.us > 0 else 1.0, baseline="fusion",
            kernels=tuple(dict.fromkeys(kernels))[:8],
        )))
    return out


@dataclass
class FusionResult:
    cards: list[Card]
    samples: dict[str, list]
    dropped: dict[str, str]  # card id -> why it was dropped after capture
    skipped: list[Skipped]  # leaf modules and functions not fused, with the reason


def build(model: torch.nn.Module, run: Callable[[], Any], cap: Capture, device: torch.device, facts: Any,
          op_cards: list[Card]) -> FusionResult:
    """Fusion cards for a captured model, checked, sampled and profiled (for `forgepack profile`).

    `cap` must come from `capture(..., functions=function_sites(model))`; `run` runs one forward and
    returns its output, leaving model state as it found it; `op_cards` are the profiled operator cards
    (their summed time is the share's denominator)."""
    candidates, skipped = find(cap)
    checked = check_and_sample(model, run, group(cap, candidates))
    total = sum(c.profile.total_us for c in op_cards if c.profile)
    cards = (profile_cards(checked.cards, checked.samples, device, facts, total, op_cards) if facts is not None
             else checked.cards)
    return FusionResult(cards, checked.samples, checked.dropped, skipped)


def build_points(model: torch.nn.Module, points: list[tuple[Capture, Callable[[], Any], int]], device: torch.device,
                 facts: Any, op_cards: list[Card]) -> FusionResult:
    """Fusion cards for a serving envelope: `build` at each capture point, (capture, run, prompt length)
    triples, each capture taken with `functions=function_sites(model)`. Chains come from one shape's
    dataflow: each point gives exact-shape cards (calls summed over the points where the same card
    recurs), each profiled; then the same chain at different sizes folds into a family card
    (`families.fold`: a decode step's RMSNorm at every batch, a prefill's at every prompt length).
    A chain that does not fold stays exact: a decode step's still serves every decode step at its
    batch, but one with its point's prompt length among its sizes (a prefill's) would serve only
    prompts of exactly that length, and is left out. A card any point found unsafe stays dropped."""
    found: list[Capture] = []
    dropped: dict[str, str] = {}
    skipped: list[Skipped] = []
    prefill_only: set[str] = set()
    elsewhere: set[str] = set()
    for cap, run, prompt in points:
        candidates, skip = find(cap)
        skipped += skip
        checked = check_and_sample(model, run, group(cap, candidates))
        dropped.update(checked.dropped)
        for c in checked.cards:
            (prefill_only if _has_size(c, prompt) else elsewhere).add(c.id)
        found.append(Capture(checked.cards, checked.samples, [], 0))
    merged = merge(found)  # as the operator cards of the points are: calls summed, the first samples kept
    kept = [c for c in merged.cards if c.id not in dropped]
    total = sum(c.profile.total_us for c in op_cards if c.profile)
    profiled = profile_cards(kept, merged.samples, device, facts, total, op_cards) if facts is not None else kept
    def wanted(c: Card) -> bool:
        return c.family is not None or c.id not in prefill_only or c.id in elsewhere

    cards = []
    for card, members in families.fold_members(profiled):
        if card.family is None or templates.templates_for(card, device.type):
            cards.append(card)
            continue
        # a family no template renders size-generic (rotary over batch and tokens): the decode steps'
        # members alone may fold into one that is (rotary over the batch); else each member stays exact
        for again, some in families.fold_members([m for m in members if wanted(m)]):
            servable = again.family is None or templates.templates_for(again, device.type)
            cards += [again] if servable else [m for m in some if wanted(m)]
    # a family keeps its most-called member's samples (its args are that member's)
    samples = {c.id: merged.samples[variant_id(c.op, c.args) if c.family else c.id] for c in cards}
    return FusionResult(cards, samples, dropped, skipped)


def _has_size(card: Card, size: int) -> bool:
    """Some tensor input of `card` has a dim of this size (1 and 0 never count: every shape has them)."""
    return size > 1 and any(m is not None and size in m.shape for m in card.tensor_inputs())
