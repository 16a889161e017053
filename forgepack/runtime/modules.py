"""Guarded module patching: fused kernels for module-level chains of ops (shipped inside pack wheels).

A fusion kernel replaces a chain of aten calls that one module forward (or one free function of a
modeling file, such as `apply_rotary_pos_emb`) makes: RMSNorm's eight launches, rotary embedding's
fourteen, act(gate) * up, BN + ReLU. The pack patches the forward of that module's class (or the
function in its module) with a guarded version:

- the guard, in Python: the exact class (not a subclass), the forward's source digest as built, the
  module's config facts as verified (`variance_epsilon`, child classes, `training`, ...), the call's
  form (argument count, keyword names, non-tensor values), no grad needed, no autocast, no dispatch
  mode, not under `torch.compile` tracing;
- then the pack's C++ op `fused(site, inputs)` checks each input's dtype, sizes, strides, device and
  alignment against the verified variants of that site and runs the first one that matches; it
  returns no tensors on a miss;
- on any miss the original forward runs: results bit-identical to stock.

Site kinds: "module" (the whole forward of a leaf module is the chain; kernel inputs come from its
arguments and its own parameters/buffers), "function" (the whole body of a free function), and glue
kinds where the chain sits between child modules: "gated_mlp" (`down(act(gate(x)) * up(x))`),
"conv_bn_act" (`act(bn(conv(x)))`), "residual_act" (`act(layer(x) + shortcut(x))`). A glue forward
re-states the original's code; the build checks it against the original, bit for bit, and the digest
guard makes sure the source it was checked against is the one running.

This file imports only torch, the standard library and the pack runtime beside it.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib
import inspect
import textwrap
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import stepprogram
from .stockcall import flatten_outputs

SPEC_FILE = "modules.json"
STEP_SITE = "step"  # a decode block's site: served inside the decode loop's recorded step (stepprogram), no patch
_MISSING = object()
_OFF = "__forgepack_off__"  # set on a patch that could not be removed (wrapped since): it calls the original
FACT_TYPES = (bool, int, float, str, type(None))

# Glue kinds: the child modules the forward calls, and where each kernel input comes from (a child's
# name: that child's output; a dotted name: a parameter or buffer of a child). Kernel inputs are in
# this order.
GLUE_INPUTS: dict[str, tuple[str, ...]] = {
    "gated_mlp": ("gate_proj", "up_proj"),
    "conv_bn_act": ("convolution", "normalization.weight", "normalization.bias", "normalization.running_mean",
                    "normalization.running_var"),
    "residual_act": ("layer", "shortcut"),
}
GLUE_CHILDREN: dict[str, tuple[str, ...]] = {
    "gated_mlp": ("gate_proj", "up_proj", "down_proj", "act_fn"),
    "conv_bn_act": ("convolution", "normalization", "activation"),
    "residual_act": ("layer", "shortcut", "activation"),
}
# The children whose facts (class and simple attributes) decide the fused chain's meaning.
GLUE_FACT_CHILDREN: dict[str, tuple[str, ...]] = {
    "gated_mlp": ("act_fn",),
    "conv_bn_act": ("normalization", "activation"),
    "residual_act": ("activation",),
}


# --- facts and digests (the build records them; the guard compares) -----------------------------------


def qualname(obj: Any) -> str:
    """`package.module:Qualified.Name` of a class or function."""
    return f"{obj.__module__}:{obj.__qualname__}"


def plain_function(fn: Any) -> Any:
    """The Python function behind `fn`. With the `kernels` package installed (transformers 5.2x requires
    it), `@use_kernel_forward_from_hub` turns a modeling file's free function (`apply_rotary_pos_emb`)
    into an nn.Module instance whose forward calls the original, held in its closure as `func`: that
    function's source is what the instance computes, unless `kernelize` rebound the instance's forward
    (None then: no source tells what it computes)."""
    if inspect.isfunction(fn) or not isinstance(fn, torch.nn.Module):
        return fn
    if "forward" in vars(fn):
        return None
    forward = type(fn).forward
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or (), strict=True))
    inner = cells.get("func")
    return inner.cell_contents if inner is not None and inspect.isfunction(inner.cell_contents) else fn


def source_digest(fn: Any) -> str | None:
    """Digest of a function's code (its AST without docstrings): None when no source is available."""
    fn = plain_function(fn)
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()[:16]


def simple_facts(module: Any, prefix: str = "") -> dict[str, Any]:
    """The module's plain attributes (numbers, strings, bools, None), `training` included."""
    out = {f"{prefix}__class__": qualname(type(module))}
    for k, v in vars(module).items():
        if not k.startswith("_") and isinstance(v, FACT_TYPES):
            out[prefix + k] = v
    return out


def glue_facts(kind: str, module: Any) -> dict[str, Any]:
    facts = simple_facts(module)
    for child in GLUE_FACT_CHILDREN[kind]:
        facts.update(simple_facts(getattr(module, child), prefix=f"{child}."))
    return facts


def _resolve(module: Any, dotted: str) -> Any:
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            return _MISSING
    return obj


def _same(value: Any, want: Any) -> bool:
    return value is want or (type(value) is type(want) and value == want)


_QUALNAMES: dict[type, str] = {}


def _class_name(cls: type) -> str:
    name = _QUALNAMES.get(cls)
    if name is None:
        name = _QUALNAMES[cls] = qualname(cls)
    return name


def _fact_checks(facts: dict[str, Any]) -> tuple:
    """Facts grouped per object: ((child path or (), class name or None, ((attribute, value), ...)), ...)."""
    groups: dict[tuple[str, ...], list] = {}
    for key, want in facts.items():
        child, _, attr = key.rpartition(".")
        path = tuple(child.split(".")) if child else ()
        groups.setdefault(path, [None, []])
        if attr == "__class__":
            groups[path][0] = want
        else:
            groups[path][1].append((attr, want))
    return tuple((path, cls, tuple(attrs)) for path, (cls, attrs) in groups.items())


def _child(module: Any, path: tuple[str, ...]) -> Any:
    obj = module
    for name in path:
        obj = getattr(obj, "_modules", {}).get(name)
        if obj is None:
            return None
    return obj


def facts_hold(module: Any, checks: tuple) -> bool:
    """Every fact as recorded: child classes by qualified name, plain attributes by type and value."""
    for path, cls, attrs in checks:
        obj = _child(module, path) if path else module
        if obj is None or (cls is not None and _class_name(type(obj)) != cls):
            return False
        d = obj.__dict__
        for attr, want in attrs:
            if not _same(d.get(attr, _MISSING), want):
                return False
    return True


# --- sites ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Site:
    """One patched call form: where (target), under which guard, and the fused op's site number.

    form (module and function kinds): ``args``: per positional argument ``["t"]`` (a tensor) or
    ``["v", value]``; ``kwargs``: the same by name; ``inputs``: per kernel input ``["arg", i]``,
    ``["kwarg", name]`` or ``["param", name]`` (the module's own parameter or buffer); ``returns``:
    "tensor" (one tensor) or "tuple" (a tuple of the outputs).
    """

    index: int
    kind: str  # "module" | "function" | a GLUE_INPUTS kind
    target: str  # "package.module:Class" or "package.module:function"
    digest: str
    facts: dict[str, Any] = field(default_factory=dict)
    form: dict[str, Any] = field(default_factory=dict)
    variants: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Site:
        return cls(d["index"], d["kind"], d["target"], d["digest"], dict(d.get("facts", {})), dict(d.get("form", {})),
                   tuple(d.get("variants", ())))

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "kind": self.kind, "target": self.target, "digest": self.digest,
                "facts": self.facts, "form": self.form, "variants": list(self.variants)}


def _busy(tensors: list[torch.Tensor] | None = None) -> bool:
    """Conditions under which a kernel must not replace the chain (the original sees them instead). A
    dispatch mode would not see the chain's calls; `pack.record_misses()` alone is let through, since
    declining there would change what it records (the length first: one C call when no mode is on)."""
    depth = torch._C._len_torch_dispatch_stack()
    if depth > 0:
        mode = torch._C._get_dispatch_stack_at(0) if depth == 1 else None
        if not getattr(type(mode), "__forgepack_miss_recorder__", False):  # misses.MARK: any pack's copy
            return True
    if torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"):
        return True
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and compiler.is_compiling():
        return True
    if tensors is not None and torch.is_grad_enabled():
        return any(t.requires_grad for t in tensors)
    return False


class _Counters:
    """Per site: [calls, hits, declined by the Python guard, missed by the kernels' guards]."""

    def __init__(self, n: int):
        self.rows = [[0, 0, 0, 0] for _ in range(n)]


class _Form:
    """A module/function site's call form, compiled for the per-call check."""

    def __init__(self, site: Site):
        form = site.form
        self.nargs = len(form["args"])
        self.values = tuple((i, a[1]) for i, a in enumerate(form["args"]) if a[0] == "v")
        self.tensor_args = tuple(i for i, a in enumerate(form["args"]) if a[0] == "t")
        self.kw = dict(form.get("kwargs", {}))
        self.kw_names = frozenset(self.kw)
        self.kw_values = tuple((k, a[1]) for k, a in self.kw.items() if a[0] == "v")
        self.inputs = tuple((src, key) for src, key in form["inputs"])
        self.tuple_result = form.get("returns", "tensor") == "tuple"

    def tensors(self, module: Any, args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
        if len(args) != self.nargs or (kwargs.keys() != self.kw_names if kwargs or self.kw_names else False):
            return None
        for i, want in self.values:
            if not _same(args[i], want):
                return None
        for k, want in self.kw_values:
            if not _same(kwargs[k], want):
                return None
        out = []
        for src, key in self.inputs:
            if src == "arg":
                t = args[key]
            elif src == "kwarg":
                t = kwargs[key]
            else:
                t = module._parameters.get(key)
                if t is None:
                    t = module._buffers.get(key)
            if not isinstance(t, torch.Tensor):
                return None
            out.append(t)
        return out


Call = Callable[[Site, list[torch.Tensor]], list[torch.Tensor] | None]
Observe = Callable[[Site, list[torch.Tensor], list[torch.Tensor]], None]


class ModulePatches:
    """Installs guarded forwards for a set of sites; `remove()` restores every original exactly.

    `call(site, tensors)` runs the site's fused kernels: their outputs, or None on a miss. `observe`, if
    given, sees every call that fell back, with the chain's outputs as the original computed them (the
    build uses it to take samples and to check chains against the modules they came from).
    """

    def __init__(self, sites: list[Site], call: Call, observe: Observe | None = None,
                 shapes: dict[int, frozenset[tuple]] | None = None):
        self.sites = list(sites)
        self.call = call
        self.observe = observe
        # per site, the input sizes its variants take (`site_shapes`): a call of other sizes misses
        # here, without the grad/autocast checks and the fused op's dispatch (tens of microseconds a
        # call, paid at every other shape an exact pack is served at)
        self.shapes = shapes or {}
        self.counters = _Counters(1 + max((s.index for s in self.sites), default=-1))
        # (target, owner, attribute, original or _MISSING, patch)
        self._restore: list[tuple[str, Any, str, Any, Any]] = []
        self._lock = threading.Lock()
        self.skipped: dict[str, str] = {}

    # --- install / remove ---

    def install(self) -> dict[str, str]:
        """Patch every target whose code is the one the kernels were built for; returns target -> why
        it was not patched, for the targets that were not."""
        with self._lock:
            if self._restore:
                return dict(self.skipped)
            by_target: dict[str, list[Site]] = {}
            for s in self.sites:
                by_target.setdefault(s.target, []).append(s)
            self.skipped = {}
            for target, sites in by_target.items():
                reason = self._install_target(target, sites)
                if reason:
                    self.skipped[target] = reason
            return dict(self.skipped)

    def _install_target(self, target: str, sites: list[Site]) -> str | None:
        module_name, _, attr = target.partition(":")
        try:
            owner = importlib.import_module(module_name)
        except Exception as err:  # a missing or broken module only means: nothing to patch
            return f"cannot import {module_name}: {type(err).__name__}"
        obj = getattr(owner, attr, _MISSING) if "." not in attr else _resolve(owner, attr)
        if obj is _MISSING:
            return f"{module_name} has no {attr}"
        kinds = {s.kind for s in sites}
        function = kinds == {"function"}
        if not function and (not isinstance(obj, type) or "function" in kinds):
            return "a module site must name a class"
        current = obj if function else obj.forward
        if getattr(current, "__forgepack_patch__", False):
            return "already patched by another forgepack pack"
        digest = source_digest(current)
        sites = [s for s in sites if s.digest == digest]
        if not sites:
            return "its source differs from the one the kernels were verified against"
        if function:
            patched = self._function(current, sites)
            self._restore.append((target, owner, attr, obj, patched))
            setattr(owner, attr, patched)
        else:
            patched = self._forward(obj, current, sites)
            self._restore.append((target, obj, "forward", obj.__dict__.get("forward", _MISSING), patched))
            obj.forward = patched
        return None

    def remove(self) -> None:
        """Put every original back (the exact objects); a patch someone else has since wrapped is left in
        place, switched off: it then always calls the original."""
        with self._lock:
            for _, owner, attr, original, patched in reversed(self._restore):
                if owner.__dict__.get(attr, _MISSING) is not patched:
                    setattr(patched, _OFF, True)
                elif original is _MISSING:
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, original)
            self._restore = []

    @property
    def installed(self) -> bool:
        return bool(self._restore)

    @property
    def targets(self) -> list[str]:
        """The targets patched now."""
        with self._lock:
            return [target for target, *_ in self._restore]

    @contextlib.contextmanager
    def suspended(self, keep: frozenset[str] = frozenset()):
        """Every installed patch but those of the targets in `keep` calls its original meanwhile (yields
        whether any was switched): the decode loop records a step as stock runs it, so that a decode
        block's chain is not cut by a fused call of a site inside it."""
        with self._lock:
            switched = [p for t, *_, p in self._restore if t not in keep and _OFF not in p.__dict__]
        for patched in switched:
            setattr(patched, _OFF, True)
        try:
            yield bool(switched)
        finally:
            for patched in switched:
                patched.__dict__.pop(_OFF, None)

    # --- the guarded callables ---

    def _run(self, site: Site, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        row = self.counters.rows[site.index]
        row[0] += 1
        sizes = self.shapes.get(site.index)
        if sizes is not None and tuple(t.shape for t in tensors) not in sizes:
            row[3] += 1
            return None
        if _busy(tensors):
            row[2] += 1
            return None
        out = self.call(site, tensors)
        if out:
            row[1] += 1
            return out
        row[3] += 1
        return None

    def _quick(self, entries: list) -> tuple[int, int | None, frozenset] | None:
        """A necessary condition a call must meet to be served, checked before anything else: (argument
        position, leading dims or None for the whole size, the sizes it may have). Only for a target with
        one site whose variants list their input sizes, taking that input as a positional argument.
        Off its shapes a pack pays only this test (an exact pack's fused sites are called at every
        other shape it serves: the whole guard there cost about 5% of an H200 Llama-1B forward)."""
        if len(entries) != 1:
            return None
        site, _, form = entries[0]
        sizes = self.shapes.get(site.index)
        if sizes is None:
            return None
        for k, (src, key) in enumerate(form.inputs):
            if src == "arg":
                return key, None, frozenset(shape[k] for shape in sizes)
        return None

    def _declined_quickly(self, site: Site) -> None:
        """Counted as the site's missed call (before its facts were read: a module of the class whose
        config facts differ counts here too)."""
        row = self.counters.rows[site.index]
        row[0] += 1
        row[3] += 1

    def _serve(self, entries: list, module: Any, original: Callable, head: tuple, args: tuple, kwargs: dict) -> Any:
        """The first site whose facts hold and whose call form this call has: its kernel's outputs, or on
        a miss the original's (shown to the observer); the original's when no site takes the call.
        `head` is what the original takes before the call's arguments (a forward's module)."""
        for site, checks, form in entries:
            if not facts_hold(module, checks):
                continue
            tensors = form.tensors(module, args, kwargs)
            if tensors is None:
                continue
            out = self._run(site, tensors)
            if out is not None:
                return tuple(out) if form.tuple_result else out[0]
            result = original(*head, *args, **kwargs)
            if self.observe is not None:
                self.observe(site, tensors, flatten_outputs(result))
            return result
        return original(*head, *args, **kwargs)

    def _function(self, original: Callable, sites: list[Site]) -> Callable:
        entries = [(s, (), _Form(s)) for s in sites]  # a free function has no module facts
        patches = self
        quick = self._quick(entries)

        def guarded(*args, **kwargs):
            if _OFF in guarded.__dict__:
                return original(*args, **kwargs)
            if quick is not None and _off_shape(quick, args):
                patches._declined_quickly(entries[0][0])
                return original(*args, **kwargs)
            return patches._serve(entries, None, original, (), args, kwargs)

        return _marked(guarded, original)

    def _forward(self, cls: type, original: Callable, sites: list[Site]) -> Callable:
        kinds = {s.kind for s in sites}
        if len(kinds) != 1:
            raise ValueError(f"sites of {qualname(cls)} mix kinds {sorted(kinds)}")
        kind = kinds.pop()
        checks = [(s, _fact_checks(s.facts)) for s in sites]
        if kind == "module":
            return self._module_forward(cls, original, [(s, c, _Form(s)) for s, c in checks])
        return _GLUE_FORWARDS[kind](self, cls, original, checks)

    def _module_forward(self, cls: type, original: Callable, entries: list) -> Callable:
        patches = self
        quick = self._quick(entries)

        def forward(module, *args, **kwargs):
            if type(module) is cls and not module.training and _OFF not in forward.__dict__:
                if quick is not None and _off_shape(quick, args):
                    patches._declined_quickly(entries[0][0])
                    return original(module, *args, **kwargs)
                return patches._serve(entries, module, original, (module,), args, kwargs)
            return original(module, *args, **kwargs)

        return _marked(forward, original)

    # --- counters ---

    def stats(self) -> dict[int, dict[str, int]]:
        """Per site index: calls, hits, `declined` (the Python guard: grad, autocast, a dispatch mode,
        compiling) and `missed` (no verified variant matched the inputs, or the kernel refused)."""
        return {s.index: dict(zip(("calls", "hits", "declined", "missed"), self.counters.rows[s.index], strict=True))
                for s in self.sites}


def _off_shape(quick: tuple[int, int | None, frozenset], args: tuple) -> bool:
    """The call's argument at the quick test's position is a tensor of sizes no variant takes (its
    leading dims, for a glue whose kernel inputs are children's outputs of the argument)."""
    position, lead, sizes = quick
    if len(args) <= position:
        return False
    t = args[position]
    if not isinstance(t, torch.Tensor):
        return False
    return (t.shape if lead is None else t.shape[:-1]) not in sizes  # a torch.Size hashes as its tuple


def _marked(patch: Callable, original: Callable) -> Callable:
    """A guarded callable as installed: it unwraps to the original and says it is forgepack's."""
    patch.__wrapped__ = original
    patch.__forgepack_patch__ = True
    return patch


def _matching(module: Any, checks: list) -> Site | None:
    for site, c in checks:
        if facts_hold(module, c):
            return site
    return None


# --- glue forwards: the original's code, with the chain between children replaced --------------------


def _glue_site(forward: Callable, module: Any, cls: type, args: tuple, kwargs: dict, checks: list) -> Any:
    """The site a glue forward serves for this call, or None (then the original forward runs): the exact
    class, eval mode, the one-positional-argument call form the glue was verified for, not switched off,
    and the config facts of a site holding."""
    if type(module) is not cls or module.training or len(args) != 1 or kwargs or _OFF in forward.__dict__:
        return None
    return _matching(module, checks)


@dataclass(frozen=True)
class _Glue:
    """A glue kind's code, split where the chain sits: `inputs(children, x)` runs the children before the
    chain and gives the kernel's inputs, `chain(children, inputs)` is the chain as the original computes
    it, `finish(children, chain_output)` is what the forward does after it. `in_place`: the chain
    writes its first input, so the observer is shown a copy taken before."""

    inputs: Callable[[dict, Any], list]
    chain: Callable[[dict, list], Any]
    finish: Callable[[dict, Any], Any] = lambda children, h: h
    in_place: bool = False
    leading: bool = False  # the kernel's first input keeps the argument's leading dims (linear children)


def _glue_quick(patches: ModulePatches, checks: list, glue: _Glue) -> tuple[int, int, frozenset] | None:
    """`ModulePatches._quick` for a glue whose kernel inputs keep the argument's leading dims."""
    sizes = patches.shapes.get(checks[0][0].index) if len(checks) == 1 and glue.leading else None
    return None if sizes is None else (0, 1, frozenset(tuple(shape[0][:-1]) for shape in sizes))


def _glue_forward(patches: ModulePatches, cls: type, original: Callable, checks: list, glue: _Glue) -> Callable:
    quick = _glue_quick(patches, checks, glue)

    def forward(module, *args, **kwargs):
        if quick is not None and type(module) is cls and _off_shape(quick, args):
            patches._declined_quickly(checks[0][0])
            return original(module, *args, **kwargs)
        site = _glue_site(forward, module, cls, args, kwargs, checks)
        if site is None:
            return original(module, *args, **kwargs)
        mods = module._modules  # children by dict: nn.Module.__getattr__ costs microseconds
        tensors = glue.inputs(mods, args[0])
        if all(isinstance(t, torch.Tensor) for t in tensors):
            out = patches._run(site, tensors)
            if out is not None:
                return glue.finish(mods, out[0])
        observing = patches.observe is not None
        seen = [tensors[0].clone(), *tensors[1:]] if observing and glue.in_place else tensors
        h = glue.chain(mods, tensors)
        if observing:
            patches.observe(site, seen, [h])
        return glue.finish(mods, h)

    return _marked(forward, original)


def _gated_mlp_inputs(mods: dict, x: Any) -> list:
    return [mods["gate_proj"](x), mods["up_proj"](x)]


def _conv_bn_inputs(mods: dict, x: Any) -> list:
    bn = mods["normalization"]
    return [mods["convolution"](x), bn._parameters.get("weight"), bn._parameters.get("bias"),
            bn._buffers.get("running_mean"), bn._buffers.get("running_var")]


def _residual_inputs(mods: dict, x: Any) -> list:
    return [mods["layer"](x), mods["shortcut"](x)]


def _residual_chain(mods: dict, tensors: list) -> Any:
    h, residual = tensors
    h += residual
    return mods["activation"](h)


# The factories `_forward` calls for each glue kind: (patches, cls, original, checks) -> guarded forward.
_GLUE_FORWARDS = {
    # `down_proj(act_fn(gate_proj(x)) * up_proj(x))`: act(gate) * up is the chain
    "gated_mlp": functools.partial(_glue_forward, glue=_Glue(
        _gated_mlp_inputs, lambda mods, t: mods["act_fn"](t[0]) * t[1], lambda mods, h: mods["down_proj"](h),
        leading=True)),
    # `activation(normalization(convolution(x)))` with an eval-mode batch norm: BN + act is the chain
    "conv_bn_act": functools.partial(_glue_forward, glue=_Glue(
        _conv_bn_inputs, lambda mods, t: mods["activation"](mods["normalization"](t[0])))),
    # `h = layer(x); h += shortcut(x); activation(h)`: the add and the activation are the chain
    "residual_act": functools.partial(_glue_forward, glue=_Glue(_residual_inputs, _residual_chain, in_place=True)),
}


# --- the pack's side: sites from modules.json, kernels through the shim's `fused` op ------------------


def site_shapes(spec: dict[str, Any]) -> dict[int, frozenset[tuple]]:
    """Per site, every input-size combination its variants were verified for (`modules.json`: each
    fused variant's input sizes). A site with a variant that does not list them (a pack built before
    they were written) gets no entry: its calls all reach the fused op's own guard."""
    out: dict[int, set[tuple]] = {}
    unknown: set[int] = set()
    for v in spec.get("variants", ()):
        for site in v["sites"]:
            if "shapes" not in v:
                unknown.add(site)
                continue
            out.setdefault(site, set()).add(tuple(tuple(s) for s in v["shapes"]))
    return {site: frozenset(sizes) for site, sizes in out.items() if site not in unknown}


class PackModules:
    """A pack's module patches: reads `modules.json`, runs kernels through `torch.ops.<ns>.fused`."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.namespace = spec["namespace"]
        every = [Site.from_json(s) for s in spec.get("sites", [])]
        self.sites = [s for s in every if s.kind != STEP_SITE]  # module and function patches
        self.steps = [s for s in every if s.kind == STEP_SITE]  # decode blocks (`step_kernels`)
        self.variant_ids = [v["id"] for v in spec.get("variants", [])]
        self.patches: ModulePatches | None = None
        self.loaded = False
        self.active = False
        self._chains = [stepprogram.Chain.from_json(s.variants[0] if s.variants else str(s.index), s.form)
                        for s in self.steps]

    @classmethod
    def read(cls, root: Any) -> PackModules | None:
        """The pack's module patches, or None when it has no `modules.json`."""
        import json
        from pathlib import Path

        path = Path(root) / SPEC_FILE
        return cls(json.loads(path.read_text())) if path.is_file() else None

    def _ops(self):
        return getattr(torch.ops, self.namespace)

    def activate(self, root: Any, devices: list[int]) -> dict[str, str]:
        """Load the fused op's library and kernels (once), then patch the targets; returns target -> why
        it was left alone."""
        if self.patches is not None and self.patches.installed:
            return dict(self.patches.skipped)
        if not self.loaded:
            torch.ops.load_library(str(root) + "/" + self.spec["library"])
            self.loaded = True
        ops = self._ops()
        if list(ops.fused_variants()) != self.variant_ids:
            raise RuntimeError("the fused library's variants are not modules.json's")
        ops.fused_load(str(root), list(devices))
        if self.patches is None:  # kept across activations: its counters live as long as the process
            fused = ops.fused.default

            def call(site: Site, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
                return fused(site.index, tensors) or None

            self.patches = ModulePatches(self.sites, call, shapes=site_shapes(self.spec))
        skipped = self.patches.install()
        self.active = True
        if self.steps:
            stepprogram.provide(self.step_kernels, self.stock_sites, self.site_targets)
        return skipped

    def stock_sites(self, keep: frozenset[str] = frozenset()) -> contextlib.AbstractContextManager:
        """The pack's module sites off (stock code) meanwhile, but those of the targets in `keep`
        (`ModulePatches.suspended`)."""
        return self.patches.suspended(keep) if self.patches is not None else contextlib.nullcontext(False)

    def site_targets(self) -> list[str]:
        """The targets whose module sites are installed (what `stock_sites` can leave on)."""
        return self.patches.targets if self.patches is not None else []

    def step_kernels(self) -> list[tuple[stepprogram.Chain, Callable]]:
        """The decode blocks' chains and their kernels, for the decode loop's recorded step (empty while
        the pack is not active)."""
        if not self.active:
            return []
        fused = self._ops().fused.default

        def caller(index: int) -> Callable:
            return lambda tensors: fused(index, tensors) or None

        return [(chain, caller(site.index)) for chain, site in zip(self._chains, self.steps, strict=True)]

    def deactivate(self) -> None:
        self.active = False
        if self.steps:
            stepprogram.withdraw(self.step_kernels)
        if self.patches is not None:
            self.patches.remove()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per fused variant: `hits`, `misses` (calls of its site it did not serve), `errors`, its site."""
        n = len(self.variant_ids)
        raw = list(self._ops().fused_stats()) if self.loaded else [0] * (2 * n)
        site_rows = self.patches.stats() if self.patches is not None else {}
        out = {}
        steps = {s.index for s in self.steps}
        for k, v in enumerate(self.spec.get("variants", [])):
            if set(v["sites"]) <= steps:  # a decode block: counted per captured decode graph, no misses
                out[v["id"]] = {"op": v["op"], "hits": raw[k], "misses": 0, "errors": raw[n + k],
                                "sites": list(v["sites"])}
                continue
            calls = sum(site_rows.get(s, {"calls": 0})["calls"] for s in v["sites"])
            out[v["id"]] = {"op": v["op"], "hits": raw[k], "misses": calls - raw[k], "errors": raw[n + k],
                            "sites": list(v["sites"])}
        return out

    def site_stats(self) -> dict[int, dict[str, int]]:
        """Per site: calls, hits, declined (the Python guard), missed (no variant matched)."""
        return self.patches.stats() if self.patches is not None else {}

    def enable_only(self, ids: set[str] | None) -> None:
        """Serve only these variants (None: all); needs the library loaded (`activate` first)."""
        if self.loaded:
            self._ops().fused_set_enabled([1 if ids is None or i in ids else 0 for i in self.variant_ids])
