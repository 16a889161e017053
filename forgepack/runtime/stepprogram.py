"""Step programs: one decode step recorded as its aten calls, replayed with block kernels in place.

Part of the pack runtime: torch and the standard library only.

Why: a decode step is served from one CUDA graph, and a graph is already a frozen trace (the kernels
of one recorded run, replayed on the same addresses). A program is that trace one level up: the
step's aten calls with their dataflow, recorded before capture. A pack's decode blocks (a layer's
norm + QKV projections + rotary + cache write, the attention over the cache, ...) are chains of aten
calls that its kernels were verified against; `Matcher` finds each chain in the program by op,
non-tensor arguments and dataflow, and the rewritten program puts the kernel where the chain's last
call was. The graph is then captured from the rewritten program. A chain that does not match, or a
kernel whose guard refuses the tensors, leaves the recorded calls in place: what the graph would
have held without the pack. The model's Python code never runs again after the recording, so a
chain matched here is exactly what the step computes, whatever code produced it.

Values: every tensor a call reads or makes is a value, numbered in order of first sight. A value that
no recorded call made is *external* (a weight, the KV cache, the step's input buffers): the program
keeps the object and every replay reads it. An in-place call's result is the value it wrote, so a
value is a variable that calls may update, and a replay runs the calls in their recorded order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .opclasses import NO_KERNEL_OPS, host_sync, needs_decompose
from .stockcall import bind, encode_value, frozen, op_key


class RecordError(RuntimeError):
    """The step cannot be recorded as a program (it needs the host, or its outputs are not tensors)."""


@dataclass(frozen=True)
class Val:
    """A tensor argument of a recorded call: value number `id`."""

    id: int


@dataclass
class Call:
    """One recorded aten call: arguments with `Val` in place of tensors, the values it made and wrote."""

    func: Any  # the OpOverload
    args: tuple
    kwargs: dict
    outs: tuple[int, ...]  # its tensor results, flattened (an in-place result is the value it wrote)
    reads: tuple[int, ...]  # every tensor argument
    writes: tuple[int, ...]  # the tensor arguments it writes in place

    @property
    def name(self) -> str:
        return self.func._schema.name

    @property
    def launches(self) -> bool:
        """Whether the call runs device work (views and bare allocations do not)."""
        return self.name not in NO_KERNEL_OPS and self.name not in _VIEW_LIKE and not _is_view(self.func)


@dataclass
class Kernel:
    """A block kernel in place of a chain: `call(inputs)` gives the outputs (None on a guard miss, and
    then `fallback`, the chain's recorded calls, runs instead)."""

    call: Callable[[list[torch.Tensor]], list[torch.Tensor] | None]
    inputs: tuple[int, ...]
    outs: tuple[int, ...]
    fallback: tuple[Call, ...]
    name: str
    hits: int = 0
    misses: int = 0

    @property
    def launches(self) -> bool:
        return True


Step = Call | Kernel
_VIEW_LIKE = frozenset({"aten::_unsafe_view"})  # a view whose schema does not say so


def _is_view(func: Any) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments the op's schema says it writes (in place, `out=`)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        out.extend(_tensors(value))
    return out


@dataclass
class Program:
    """A recorded step: its calls (or kernels) in order and the traced tensor of every value."""

    steps: list[Step]
    values: list[torch.Tensor]  # by value number: externals are live objects, the rest traced results
    made: frozenset[int]  # values some recorded call made
    result: Any = None  # what the recorded function returned, values as `Val`
    storage: list[int] = field(default_factory=list)  # by value number: its storage at trace time

    def externals(self) -> list[int]:
        return [v for v in range(len(self.values)) if v not in self.made]

    def launches(self) -> int:
        """Device launches of one replay: calls that run work, and one per kernel."""
        return sum(1 for s in self.steps if s.launches)

    def run(self) -> Any:
        """Replay: every step in order on fresh intermediates, the externals in place. Returns the
        recorded function's result rebuilt from this replay's values."""
        env: list[torch.Tensor | None] = [None] * len(self.values)
        for v in range(len(self.values)):
            if v not in self.made:
                env[v] = self.values[v]
        last = self._last_use()
        for i, step in enumerate(self.steps):
            if isinstance(step, Kernel):
                _run_kernel(step, env)
            else:
                _run_node(step, env)
            for v in last.get(i, ()):
                env[v] = None  # freed after its last reader (CUDA capture reuses the memory)
        return _rebuild(self.result, env)

    def _last_use(self) -> dict[int, list[int]]:
        cached = getattr(self, "_last", None)
        if cached is not None:
            return cached
        last: dict[int, int] = {}
        for i, step in enumerate(self.steps):
            for v in _reads(step):
                last[v] = i
        keep = set(_vals(self.result))
        out: dict[int, list[int]] = {}
        for v, i in last.items():
            if v in self.made and v not in keep:
                out.setdefault(i, []).append(v)
        self._last = out
        return out


def _reads(step: Step) -> Iterable[int]:
    return step.inputs if isinstance(step, Kernel) else step.reads


def _vals(value: Any) -> list[int]:
    if isinstance(value, Val):
        return [value.id]
    if isinstance(value, list | tuple):
        return [v for x in value for v in _vals(x)]
    if isinstance(value, dict):
        return [v for x in value.values() for v in _vals(x)]
    return []


def _bind(value: Any, env: list) -> Any:
    if isinstance(value, Val):
        return env[value.id]
    if isinstance(value, list):
        return [_bind(v, env) for v in value]
    if isinstance(value, tuple):
        return tuple(_bind(v, env) for v in value)
    return value


def _rebuild(value: Any, env: list) -> Any:
    if isinstance(value, dict):
        return {k: _rebuild(v, env) for k, v in value.items()}
    return _bind(value, env)


def _run_node(node: Call, env: list) -> None:
    out = node.func(*_bind(node.args, env), **{k: _bind(v, env) for k, v in node.kwargs.items()})
    for v, t in zip(node.outs, _tensors(out), strict=True):
        env[v] = t


def _run_kernel(kernel: Kernel, env: list) -> None:
    outs = kernel.call([env[v] for v in kernel.inputs])
    if outs is None:
        kernel.misses += 1
        for node in kernel.fallback:
            _run_node(node, env)
        return
    kernel.hits += 1
    for v, t in zip(kernel.outs, outs, strict=True):
        env[v] = t


# ----------------------------------------------------------------------------------------------------
# Recording


class _Recorder(TorchDispatchMode):
    """Records every aten call as a `Call`; saves what each call writes into a tensor that existed
    before the recording, so `undo()` can put it back (a capture that follows executes nothing)."""

    def __init__(self):
        super().__init__()
        self.values: list[torch.Tensor] = []
        self.ids: dict[int, int] = {}  # id(tensor) -> value number (the tensors are held: ids stay unique)
        self.made: set[int] = set()
        self.steps: list[Step] = []
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._saved: set[int] = set()

    def value(self, t: torch.Tensor) -> int:
        v = self.ids.get(id(t))
        if v is None:
            v = self.ids[id(t)] = len(self.values)
            self.values.append(t)
        return v

    def _encode(self, value: Any, reads: list[int]) -> Any:
        if isinstance(value, torch.Tensor):
            v = self.value(value)
            reads.append(v)
            return Val(v)
        if isinstance(value, list | tuple):
            out = [self._encode(x, reads) for x in value]
            return out if isinstance(value, list) else tuple(out)
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if needs_decompose(func):
            with self:  # the mode is off inside its own handler: on again, so the parts are recorded
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        why = host_sync(func, args, kwargs)
        if why:
            raise RecordError(f"a step program cannot hold {why}: it needs the host")
        reads: list[int] = []
        eargs = tuple(self._encode(a, reads) for a in args)
        ekwargs = {k: self._encode(v, reads) for k, v in kwargs.items()}
        written = _written(func, args, kwargs)
        for t in written:
            v = self.value(t)
            if v not in self.made and v not in self._saved:  # a tensor from before: undo its writes later
                self._saved.add(v)
                self.saved.append((t, t.detach().clone()))
        out = func(*args, **kwargs)
        outs = []
        inputs = {id(t): self.ids[id(t)] for t in _tensors(args) + _tensors(list(kwargs.values()))}
        for t in _tensors(out):
            known = inputs.get(id(t))
            if known is not None:  # in place, out=, or an op that returns its argument (lift_fresh)
                outs.append(known)
                continue
            v = self.value(t)
            self.made.add(v)
            outs.append(v)
        self.steps.append(Call(func, eargs, ekwargs, tuple(outs), tuple(reads),
                               tuple(self.ids[id(t)] for t in written)))
        return out

    def undo(self) -> None:
        for t, before in reversed(self.saved):
            t.copy_(before)
        self.saved.clear()


def record(fn: Callable[..., Any], *args: Any, undo: bool = True, **kwargs: Any) -> Program:
    """Run `fn(*args, **kwargs)` once, recording its aten calls. With `undo`, every write into a tensor
    that existed before is undone afterwards (as a CUDA capture would execute nothing): the first replay
    is the step's execution. The result's tensors must come from recorded calls or be externals."""
    recorder = _Recorder()
    # Recorded for a graph: code that asks whether the stream is capturing takes its capture-safe path
    # (transformers then avoids reading device values back to the host), as under a real capture.
    real = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        with recorder:
            result = fn(*args, **kwargs)
    finally:
        torch.cuda.is_current_stream_capturing = real
        if undo:
            recorder.undo()
    encoded = _encode_result(result, recorder)
    storage = [t.untyped_storage().data_ptr() for t in recorder.values]
    return Program(recorder.steps, recorder.values, frozenset(recorder.made), encoded, storage)


def _encode_result(value: Any, recorder: _Recorder) -> Any:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        v = recorder.ids.get(id(value))
        if v is None:
            raise RecordError("the step returned a tensor no recorded call made")
        return Val(v)
    if isinstance(value, list | tuple):
        return type(value)(_encode_result(v, recorder) for v in value)
    if isinstance(value, dict):  # a transformers ModelOutput too (an OrderedDict)
        return {k: _encode_result(v, recorder) for k, v in value.items()}
    raise RecordError(f"the step returned a {type(value).__name__}")


# ----------------------------------------------------------------------------------------------------
# Matching a verified chain and putting its kernel in its place

WINDOW = 96  # calls a chain may skip between two of its own (a layer's cache counters, say)


@dataclass(frozen=True)
class Chain:
    """A verified chain as the matcher reads it (a block card's `chain`, `fusion.outputs` and `writes`,
    from `modules.json`): per entry the op and per schema argument ("t", ref), ("ts", refs), ("n",) or
    ("v", encoded value); a ref is ("in", i) or ("t", entry, k)."""

    name: str
    entries: tuple[tuple[str, tuple], ...]
    outputs: tuple[tuple, ...]
    inputs: int
    writes: tuple[int, ...] = ()

    @classmethod
    def from_json(cls, name: str, d: dict[str, Any]) -> Chain:
        entries = []
        for e in d["chain"]:
            args = []
            for a in e["args"]:
                kind = a["kind"]
                if kind == "tensor":
                    args.append(("t", tuple(a["ref"])))
                elif kind == "tensors":
                    args.append(("ts", tuple(tuple(r) for r in a["refs"])))
                elif kind == "none":
                    args.append(("n",))
                else:
                    args.append(("v", frozen(a.get("value"))))
            entries.append((e["op"], tuple(args)))
        return cls(name, tuple(entries), tuple(tuple(r) for r in d["outputs"]), int(d["inputs"]),
                   tuple(d.get("writes", ())))


@dataclass
class Match:
    chain: Chain
    nodes: tuple[int, ...]  # program positions of the chain's entries
    inputs: tuple[int, ...]  # values bound to the chain's inputs
    outs: tuple[int, ...]  # values of the chain's outputs

    @property
    def last(self) -> int:
        return self.nodes[-1]


class _Binding:
    def __init__(self):
        self.inputs: dict[int, int] = {}
        self.made: dict[tuple[int, int], int] = {}

    def value(self, ref: tuple, v: int, trial: dict) -> bool:
        if ref[0] == "in":
            have = trial.get(("in", ref[1]), self.inputs.get(ref[1]))
            if have is None:
                trial[("in", ref[1])] = v
                return True
            return have == v
        return self.made.get((ref[1], ref[2])) == v


def _arg_matches(want: tuple, value: Any, binding: _Binding, trial: dict) -> bool:
    kind = want[0]
    if kind == "t":
        return isinstance(value, Val) and binding.value(want[1], value.id, trial)
    if kind == "ts":
        return (isinstance(value, list | tuple) and len(value) == len(want[1])
                and all(isinstance(x, Val) and binding.value(r, x.id, trial)
                        for r, x in zip(want[1], value, strict=True)))
    if kind == "n":
        return value is None
    if isinstance(value, Val) or (isinstance(value, list | tuple) and any(isinstance(x, Val) for x in value)):
        return False
    return frozen(encode_value(value)) == want[1]


def _node_matches(node: Call, entry: tuple[str, tuple], binding: _Binding) -> dict | None:
    op, wants = entry
    if op_key(node.func) != op:
        return None
    bound = bind(node.func, node.args, node.kwargs)
    if len(bound) != len(wants):
        return None
    trial: dict = {}
    for (_, value), want in zip(bound, wants, strict=True):
        if not _arg_matches(want, value, binding, trial):
            return None
    return trial


class Matcher:
    """Finds verified chains in a program and rewrites it with their kernels."""

    def __init__(self, program: Program):
        self.program = program
        self.readers: dict[int, list[int]] = {}
        for i, step in enumerate(program.steps):
            for v in _reads(step):
                self.readers.setdefault(v, []).append(i)
        self.result_values = set(_vals(program.result))

    def find(self, chain: Chain, taken: set[int]) -> list[Match]:
        """Every occurrence of `chain` (its nodes none of `taken`), in program order."""
        steps = self.program.steps
        first = chain.entries[0][0]
        found = []
        for start, step in enumerate(steps):
            if start in taken or not isinstance(step, Call) or op_key(step.func) != first:
                continue
            match = self._match_at(chain, start, taken)
            if match is not None:
                found.append(match)
                taken |= set(match.nodes)
        return found

    def _match_at(self, chain: Chain, start: int, taken: set[int]) -> Match | None:
        steps = self.program.steps
        binding = _Binding()
        nodes: list[int] = []
        pos = start
        for p, entry in enumerate(chain.entries):
            hit = None
            for i in range(pos, min(len(steps), pos + WINDOW)):
                step = steps[i]
                if i in taken or not isinstance(step, Call):
                    continue
                trial = _node_matches(step, entry, binding)
                if trial is not None:
                    hit = (i, trial)
                    break
            if hit is None:
                return None
            i, trial = hit
            for key, v in trial.items():
                binding.inputs[key[1]] = v
            for k, v in enumerate(steps[i].outs):
                binding.made[(p, k)] = v
            nodes.append(i)
            pos = i + 1
        if len(binding.inputs) != chain.inputs:
            return None
        return self._checked(chain, tuple(nodes), binding)

    def _checked(self, chain: Chain, nodes: tuple[int, ...], binding: _Binding) -> Match | None:
        """The match, if putting the kernel at the chain's last call computes what the program did: the
        skipped calls in between neither read what the chain makes nor touch memory it writes, nothing
        later reads a chain value the kernel does not return, and the chain writes only the inputs its
        kernel was verified to write."""
        program, steps = self.program, self.program.steps
        inside = set(nodes)
        inputs = set(binding.inputs.values())
        made = {v for i in nodes for v in steps[i].outs if v not in inputs}
        written = {v for i in nodes for v in steps[i].writes}
        if {k for k, v in binding.inputs.items() if v in written} != set(chain.writes):
            return None
        outs = []
        for ref in chain.outputs:
            if ref[0] != "t":
                return None
            outs.append(binding.made[(ref[1], ref[2])])
        store = program.storage
        touched = {store[v] for v in written}
        for i in range(nodes[0], nodes[-1]):
            if i in inside:
                continue
            step = steps[i]
            if any(v in made for v in _reads(step)):
                return None
            if any(store[v] in touched for v in _reads(step)):
                return None
            if isinstance(step, Call) and any(store[v] in touched or v in made for v in step.writes):
                return None
            # a chain call before this one read memory it writes: the kernel, later, would read the new bits
            read_before = {store[v] for j in nodes if j < i for v in steps[j].reads}
            if isinstance(step, Call) and any(store[v] in read_before for v in step.writes):
                return None
        returned = set(outs)
        for v in made:
            if v in self.result_values and v not in returned:
                return None
            if any(r not in inside for r in self.readers.get(v, ())) and v not in returned:
                return None
        ordered = tuple(binding.inputs[i] for i in range(chain.inputs))
        return Match(chain, nodes, ordered, tuple(outs))


def rewrite(program: Program, kernels: list[tuple[Chain, Callable]]) -> tuple[Program, list[Kernel]]:
    """The program with each matched chain's calls replaced by its kernel (placed where the chain's last
    call was), and the kernels placed. Chains are tried in the order given; a call belongs to one match."""
    matcher = Matcher(program)
    taken: set[int] = set()
    placed: dict[int, tuple[Match, Callable]] = {}
    for chain, call in kernels:
        for match in matcher.find(chain, taken):
            placed[match.last] = (match, call)
    steps, used = _assemble(program, placed)
    return Program(steps, program.values, program.made, program.result, program.storage), used


def _assemble(program: Program, placed: dict[int, tuple[Match, Callable]]) -> tuple[list[Step], list[Kernel]]:
    """Rebuild the step list; a kernel whose inputs would not exist yet at its place (made by a kernel
    placed later) is dropped again, and the assembly repeats without it."""
    while True:
        dropped = None
        chain_nodes = {i for m, _ in placed.values() for i in m.nodes}
        steps: list[Step] = []
        kernels: list[Kernel] = []
        ready = set(program.externals())
        for i, step in enumerate(program.steps):
            if i in placed:
                match, call = placed[i]
                if any(v not in ready for v in match.inputs):
                    dropped = i
                    break
                fallback = tuple(program.steps[j] for j in match.nodes)
                kernel = Kernel(call, match.inputs, match.outs, fallback, match.chain.name)
                steps.append(kernel)
                kernels.append(kernel)
                ready.update(match.outs)
                continue
            if i in chain_nodes:
                continue
            steps.append(step)
            ready.update(step.outs)
        if dropped is None:
            return steps, kernels
        del placed[dropped]


# ----------------------------------------------------------------------------------------------------
# Who offers kernels: an active pack's decode blocks (`modules.PackModules.step_kernels`)

# source -> what switches its other patches off (its pack's fused module sites, but the targets it is told to
# keep), or None, and what names those targets
Stock = Callable[[frozenset], contextlib.AbstractContextManager]
_SOURCES: dict[Callable[[], list[tuple[Chain, Callable]]], tuple[Stock | None, Callable[[], list[str]]]] = {}


def provide(source: Callable[[], list[tuple[Chain, Callable]]], stock: Stock | None = None,
            targets: Callable[[], list[str]] = list) -> None:
    """`source` offers its chains and kernels; `stock`, if given, switches off its pack's module sites
    (but those of the targets it is given) while a step is recorded for the chains (`stock_sites`);
    `targets` names the sites' targets."""
    _SOURCES.setdefault(source, (stock, targets))


def withdraw(source: Callable[[], list[tuple[Chain, Callable]]]) -> None:
    _SOURCES.pop(source, None)


def kernels() -> list[tuple[Chain, Callable]]:
    """Every chain an active pack serves in a decode step, with its kernel."""
    return [k for source in list(_SOURCES) for k in source()]


def site_targets() -> list[str]:
    """The targets of every providing pack's module sites (in the order they were offered)."""
    return [t for stock, targets in list(_SOURCES.values()) if stock is not None for t in targets()]


@contextlib.contextmanager
def stock_sites(keep: frozenset[str] = frozenset()):
    """Every providing pack's module sites switched off meanwhile, but those of the targets in `keep`;
    yields whether any was."""
    with contextlib.ExitStack() as stack:
        switched = [stack.enter_context(stock(keep)) for stock, _ in list(_SOURCES.values()) if stock is not None]
        yield any(switched)
