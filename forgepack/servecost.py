"""What serving a fused kernel through its patch site costs the host, beyond the kernel call itself.

The benchmark (`verify.bench`) times a candidate by calling its `forgepack_kernel` directly (ctypes,
outputs allocated beforehand). In the model a fusion kernel is reached through its patch site
(`runtime/modules.py`): the patched forward's Python guard (class, facts, call form, `_busy`), the
site's counters, then the pack's C++ op `fused(site, inputs)` called from Python (argument boxing, the
variant's guard, the outputs' allocation) and only then the kernel. On a 2-core CPU that is 10-15 us
a call, more than the whole stock chain of a small module: a fused gated activation timed at 1.19x
alone made the patched LlamaMLP 0.77x of stock (`tools/bench_modules.py`).

`measure` (in the evaluation worker) serves calls through the real `ModulePatches` code, installed on
a probe class of this module with the card's site kind, config facts and call form, into the real
generated `fused` op (`pack.fusedgen`) of a probe library whose kernel does nothing. It times, per
call and interleaved over rounds:

    served   the patched forward (or function) serving the do-nothing kernel
    around   the child modules a glue forward calls before and after the chain (stock calls them too)
    direct   the do-nothing kernel called the way the benchmark calls a candidate

and the serving cost is served - around - direct (at least 0), each the best per-call time of its
rounds: a fixed cost, read where the shared machine's load disturbed it least (a median moved with
the load from 7 to 33 us between two builds on 2 cores). A card with several sites takes its dearest.
The benchmark adds it to every timed kernel call before the medians, the speed-up and its interval are
taken (`timing.compare`), so the accept rule, a family's folded figure, the allocator and the report
all judge the kernel as the model will see it.

Only CPU fusion cards pay it (`applies`): on CUDA the benchmark times GPU work with events, and the
pack serves a model from CUDA graphs (the gate times graph replay wherever the forward replays), where
no Python guard or op dispatch runs per call; an operator card is served by the shim's C++ override at
the op's backend key, behind the same Python and dispatcher path stock takes (the tiny Llama's
`cat` served 1.6 us a call against stock's 4.3 us in the model).

The probe library is compiled once per torch version and compiler (about 13 s on 2 cores) and kept
under `$FORGEPACK_PROBE_CACHE`, default `$FORGEPACK_CACHE/probes` (`~/.cache/forgepack/probes`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from forgepack.cards import Arg, Card, Fusion, FusionSite, TensorMeta
from forgepack.runtime import modules as rt

NAMESPACE = "forgepack_probe"
MAX_INPUTS = 32  # fusedgen.MAX_INPUTS: a probe variant for every input count a fused kernel may take
MAX_OUTPUTS = 4  # outputs are allocated inside the op: more than this are timed as this many
ROUNDS = 21
CALLS = 200  # per round and path
WARMUP = 200
_NOOP = ('#include "forgepack_abi.h"\n'
         "// the serving probe's kernel: it writes nothing and returns at once\n"
         "FP_EXPORT int32_t forgepack_kernel(const fp_call* call) { (void)call; return FP_OK; }\n")
_LIBRARY = "libforgepack_probe.so"


def applies(card: Card, target: str) -> bool:
    """Whether a candidate for this card pays a serving cost in the model (module docstring): a CPU
    fusion card with patch sites and inputs the fused op can take (a card it cannot take never ships)."""
    if target != "cpu" or card.kind != "fusion" or card.fusion is None or not card.fusion.sites:
        return False
    inputs = card.tensor_inputs()
    return 1 <= len(inputs) <= MAX_INPUTS and all(m is not None for m in inputs)


def key(card: Card) -> str:
    """What the serving cost depends on: the card's sites (kind, facts, call form) and its input and
    output counts. A family's members share it, so it is measured once per card."""
    sites = sorted(json.dumps({"kind": s.kind, "facts": s.facts, "form": s.form}, sort_keys=True, default=str)
                   for s in card.fusion.sites)
    return hashlib.sha256(json.dumps([sites, len(card.tensor_inputs()), len(card.outputs)]).encode()).hexdigest()


# --- the probe library (build side) --------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """A compiled probe: the `fused` op's library and the directory its do-nothing kernel is under."""

    library: str
    root: str

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def site_index(inputs: int, outputs: int) -> int:
    """The probe site whose one variant takes `inputs` tensors and returns `outputs` (capped) tensors."""
    if not 1 <= inputs <= MAX_INPUTS:
        raise ValueError(f"a fused kernel takes 1 to {MAX_INPUTS} tensor inputs, not {inputs}")
    return (inputs - 1) * MAX_OUTPUTS + min(max(outputs, 1), MAX_OUTPUTS) - 1


def _probe_cards() -> list[Card]:
    """One card per (inputs, outputs): float32 tensors of one element, each card its own site (the output
    count is a string value: it tells the cards apart without being a kernel scalar)."""
    one = TensorMeta("float32", (1,), (1,))
    cards = []
    for n_in in range(1, MAX_INPUTS + 1):
        for n_out in range(1, MAX_OUTPUTS + 1):
            tensors = tuple(Arg(f"in{i}", "tensor", tensor=one) for i in range(n_in))
            args = (*tensors, Arg("outputs", "value", value=str(n_out)))
            site = FusionSite("module", f"{__name__}:probe_{n_in}_{n_out}", "probe")
            fusion = Fusion("probe", 0, tuple(("in", 0) for _ in range(n_out)), (site,))
            cards.append(Card("fusion.probe.default", "", args, (one,) * n_out, kind="fusion", fusion=fusion))
    return cards


def probe_root() -> Path:
    base = os.environ.get("FORGEPACK_PROBE_CACHE")
    if base:
        return Path(base)
    from forgepack.compile import cache_root

    return cache_root().parent / "probes"


def probe_library() -> Probe:
    """The probe library for this torch and compiler, compiled into the cache on first use."""
    from forgepack.compile import compile_kernel, compiler_version
    from forgepack.errors import ForgepackError
    from forgepack.pack import fusedgen, shimgen

    cards = _probe_cards()
    code = fusedgen.generate([fusedgen.FusedVariant(c, "kernels/noop.so") for c in cards], NAMESPACE, "cpu",
                             title="the serving probe")
    command = shimgen.compile_command(Path("fused.cpp"), Path(_LIBRARY))
    digest = hashlib.sha256(json.dumps([code, _NOOP, command, torch.__version__, compiler_version("cpu"),
                                        shimgen.GUARD_HEADER.read_text(), shimgen.ABI_HEADER.read_text()]).encode())
    entry = probe_root() / digest.hexdigest()[:32]
    probe = Probe(str(entry / _LIBRARY), str(entry))
    if (entry / _LIBRARY).is_file():
        return probe
    noop = compile_kernel(_NOOP, "cpu")
    if not noop.ok:
        raise ForgepackError(f"the serving probe's kernel does not compile: {noop.log[-500:]}")
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{entry.name[:12]}.", dir=entry.parent))
    try:
        (tmp / "kernels").mkdir()
        shutil.copyfile(noop.binary, tmp / "kernels" / "noop.so")
        (tmp / "fused.cpp").write_text(code)
        for header in (shimgen.GUARD_HEADER, shimgen.ABI_HEADER):
            shutil.copyfile(header, tmp / header.name)
        try:
            shimgen.compile_shim(tmp / "fused.cpp", tmp / _LIBRARY, [tmp])
        except RuntimeError as err:
            raise ForgepackError(f"the serving probe does not compile: {err}") from err
        try:
            tmp.rename(entry)
        except OSError:  # another process published the same entry first: it is as good as ours
            if not (entry / _LIBRARY).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return probe


# --- the measurement (worker side) ---------------------------------------------------------------------


class ProbeModule(torch.nn.Module):
    """Stands for a patched module class: the probe's sites patch this class's forward (module and glue
    kinds alike; the site's kind, not the class, chooses the guarded forward)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0]


def probe_function(*args: Any, **kwargs: Any) -> Any:
    """Stands for a patched free function (function sites)."""
    return args[0]


class _Given(torch.nn.Module):
    """A child module that returns its tensor at once: a glue forward's children, which stock calls too."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value

    def forward(self, x: Any) -> torch.Tensor:
        return self.value


class _Child(torch.nn.Module):
    """A child whose class and facts the glue's guard checks (the chain's own modules: act_fn, ...)."""

    def forward(self, x: Any) -> Any:
        return x


_LOADED: dict[str, Any] = {}


def _fused(probe: dict[str, str]):
    """The probe's `fused` op, its library loaded and its kernel opened once per process."""
    if probe["library"] not in _LOADED:
        if _LOADED:
            raise RuntimeError("another serving probe library is already loaded in this process")
        torch.ops.load_library(probe["library"])
        ops = getattr(torch.ops, NAMESPACE)
        ops.fused_load(probe["root"], [0])
        _LOADED[probe["library"]] = ops
    return _LOADED[probe["library"]]


def _per_call_us(fn, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls / 1e3


def _with_facts(module: torch.nn.Module, facts: dict[str, Any]) -> dict[str, Any]:
    """Give the probe module (and its children) the site's config facts; the facts as they now hold
    (classes are the probe's)."""
    out = {}
    for name, value in facts.items():
        path, _, attr = name.rpartition(".")
        obj = module.get_submodule(path) if path else module
        if attr == "__class__":
            out[name] = rt.qualname(type(obj))
            continue
        obj.__dict__[attr] = value
        out[name] = value
    return out


class _Served:
    """One site of the card installed on the probe: `served()` serves one call, `around()` calls what
    stock calls too (a glue's children); `remove()` takes the patch off."""

    def __init__(self, site: FusionSite, ops, index: int, inputs: list[torch.Tensor], exact: bool):
        fused = ops.fused.default
        self.children: list[torch.nn.Module] = []
        self.patches: rt.ModulePatches | None = None
        if site.kind == rt.STEP_SITE:  # a decode block: the decode loop's recorded step calls the op itself
            self.served = lambda: fused(index, inputs) or None
            return
        function = site.kind == "function"
        module = ProbeModule().eval()
        supply = iter(inputs)
        if site.kind in rt.GLUE_INPUTS:
            args, kwargs = (torch.zeros(1),), {}
            self.children = _glue_children(module, site.kind, supply)
        else:
            args, kwargs = _call_form(module, site.form, supply)
        facts = {} if function else _with_facts(module, site.facts)
        target = f"{__name__}:{'probe_function' if function else ProbeModule.__name__}"
        digest = rt.source_digest(probe_function if function else ProbeModule.forward)
        probe_site = rt.Site(index, site.kind, target, digest, facts, site.form, ("probe",))
        shapes = {index: frozenset({tuple(tuple(t.shape) for t in inputs)})} if exact else None
        self.patches = rt.ModulePatches([probe_site], lambda s, tensors: fused(s.index, tensors) or None,
                                        shapes=shapes)
        skipped = self.patches.install()
        if skipped:
            raise RuntimeError(f"the serving probe could not patch its {site.kind} site: {skipped}")
        if function:
            patched = globals()["probe_function"]
            self.served = lambda: patched(*args, **kwargs)
        else:
            forward = ProbeModule.forward
            self.served = lambda: forward(module, *args, **kwargs)

    def around(self) -> None:
        for child in self.children:
            child(None)

    def remove(self) -> None:
        if self.patches is not None:
            self.patches.remove()


def _glue_children(module: torch.nn.Module, kind: str, supply) -> list[torch.nn.Module]:
    """The glue's children on the probe, the kernel's inputs drawn from `supply` (a child's output or a
    child's parameter or buffer); returns the children stock calls too (all but the chain's own)."""
    chained = set(rt.GLUE_FACT_CHILDREN[kind])
    for child in rt.GLUE_CHILDREN[kind]:
        module.add_module(child, _Child() if child in chained else _Given(torch.zeros(1)))
    for source in rt.GLUE_INPUTS[kind]:
        child, _, attr = source.partition(".")
        owner = module.get_submodule(child)
        if not attr:
            owner.value = next(supply)
        elif attr in ("weight", "bias"):
            owner.register_parameter(attr, torch.nn.Parameter(next(supply), requires_grad=False))
        else:
            owner.register_buffer(attr, next(supply))
    return [module.get_submodule(c) for c in rt.GLUE_CHILDREN[kind] if c not in chained]


def _call_form(module: torch.nn.Module, form: dict[str, Any], supply) -> tuple[tuple, dict]:
    """Arguments of a module or function site's call form, the kernel's inputs drawn from `supply` where
    the form takes them (arguments, keyword arguments, the module's own parameters or buffers)."""
    def value(spec: list) -> Any:
        return torch.zeros(1) if spec[0] == "t" else spec[1]

    args = [value(a) for a in form.get("args", ())]
    kwargs = {k: value(a) for k, a in form.get("kwargs", {}).items()}
    for source, name in form.get("inputs", ()):
        t = next(supply)
        if source == "arg":
            args[name] = t
        elif source == "kwarg":
            kwargs[name] = t
        else:
            module.register_buffer(name, t)
    return tuple(args), kwargs


def measure(card: Card, probe: dict[str, str], rounds: int = ROUNDS, calls: int = CALLS) -> dict[str, Any]:
    """The card's serving cost in microseconds a call (`serving_us`, its dearest site) and each site's
    figures; raises RuntimeError when the probe did not serve every call it timed."""
    from forgepack import verify

    ops = _fused(probe)
    n_in, n_out = len(card.tensor_inputs()), len(card.outputs)
    index = site_index(n_in, n_out)
    inputs = [torch.zeros(1) for _ in range(n_in)]
    outputs = [torch.empty(1) for _ in range(min(n_out, MAX_OUTPUTS))]
    noop = verify.KernelCall(verify.load_kernel(Path(probe["root"]) / "kernels" / "noop.so"), inputs, outputs, [],
                             None)

    def direct() -> None:  # as `verify.TimedCalls.__call__` calls a candidate
        if noop() != 0:
            raise RuntimeError("the serving probe's kernel failed")

    sites = []
    with torch.no_grad(), _one_thread():
        for site in {json.dumps(s.to_json(), sort_keys=True): s for s in card.fusion.sites}.values():
            served = _Served(site, ops, index, inputs, exact=card.family is None)
            try:
                before = _hits(ops)
                figures = _timed(served.served, served.around, direct, rounds, calls)
                hits = _hits(ops) - before
            finally:
                served.remove()
            expected = rounds * calls + WARMUP
            if hits < expected:
                raise RuntimeError(f"the serving probe's {site.kind} site served {hits} of {expected} calls")
            sites.append({"kind": site.kind, "target": site.target, **figures})
    return {"serving_us": max(s["us"] for s in sites), "sites": sites}


def _hits(ops) -> int:
    """Calls the probe's kernel served, over every site (`fused_stats`: hits per variant, then errors)."""
    stats = list(ops.fused_stats())
    return sum(stats[: len(stats) // 2])


def _timed(served, around, direct, rounds: int, calls: int) -> dict[str, float]:
    """Each path's best per-call time over the rounds (interleaved, each path first in a third of them),
    and the cost: served - around - direct, at least 0."""
    paths = {"served": served, "around": around, "direct": direct}
    for fn in paths.values():
        for _ in range(WARMUP):
            fn()
    best = {name: float("inf") for name in paths}
    for r in range(rounds):
        for name in list(paths)[r % 3:] + list(paths)[: r % 3]:
            best[name] = min(best[name], _per_call_us(paths[name], calls))
    return {"us": max(0.0, best["served"] - best["around"] - best["direct"]),
            **{f"{name}_us": us for name, us in best.items()}}


def _one_thread():
    from forgepack import timing

    return timing.one_thread_on_cpu(torch.device("cpu"))
