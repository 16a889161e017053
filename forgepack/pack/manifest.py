"""A pack's manifest: what is in the wheel, what it was built for, and every variant's guard.

`manifest.toml` sits next to the pack's `__init__.py`. The loader (which imports nothing of forgepack)
reads it to check the torch and CUDA versions and the GPU arch, to verify every file's sha256 before
loading anything, and to name the shim's counters; the self-test draws fresh inputs from each
variant's recorded arguments. `forgepack inspect` prints it.

The manifest is tamper-evident: `dumps` writes its digest into it (`runtime.packinfo.manifest_digest`,
over everything else in it), and the loader refuses a manifest whose content does not match it, as it
refuses any file of the pack the manifest does not list or whose sha256 differs.

`loads(dumps(m)) == m` for every manifest (written by `forgepack.tomlwriter`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import tomllib

from forgepack import needs as needs_mod
from forgepack import tomlwriter
from forgepack.cards import Arg, TensorMeta, ValueStats
from forgepack.needs import Needs
from forgepack.runtime.packinfo import DIGEST_KEY, GraphVerdict, OutputTolerance, manifest_digest

FORMAT = 1
FILE = "manifest.toml"


@dataclass(frozen=True)
class PackVariant:
    id: str  # the card id
    op: str  # "aten.silu.default"
    schema: str
    signature: str  # short form for tables
    args: tuple[Arg, ...]  # the guard: every schema argument as the card fixed it
    outputs: tuple[TensorMeta, ...]  # allocated on a hit
    kernel: str  # path of the kernel's shared object inside the package
    source: str  # its source, for audit
    tolerance: tuple[OutputTolerance, ...]
    speedup: float  # eager / kernel, in isolation (the search's measurement)
    ci_low: float
    ci_high: float
    eager_us: float
    kernel_us: float
    proposer: str
    calls: int = 0  # per model forward, from capture
    modules: tuple[str, ...] = ()
    e2e_ratio: float | None = None  # gate: model time without this kernel / with it (> 1: it pays)
    needs: Needs | None = None  # what the kernel needs of its inputs, as its guard checks (None: the default)
    served: str = ""  # a family kernel kept for a sub-range: that range, as its guard checks ("": all verified)


@dataclass(frozen=True)
class FusedKernel:
    """A fused kernel of the pack (a module-level chain; served by module patches, `modules.json`)."""

    id: str  # the card id
    op: str  # the chain's name, e.g. "fused.rmsnorm"
    signature: str
    kernel: str  # path of its shared object inside the package
    calls: int = 0  # per model forward
    sites: tuple[int, ...] = ()  # the patched call forms it serves (modules.json's site numbers)


@dataclass(frozen=True)
class PackFile:
    path: str  # relative to the package directory
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Provenance:
    forgepack: str
    date: str  # ISO 8601, UTC
    commit: str | None = None
    proposers: tuple[str, ...] = ()
    device: str = ""  # the device the kernels were verified and timed on


@dataclass(frozen=True)
class GateSummary:
    """What the end-to-end gate measured for the pack it passed: the model's median time per round
    stock and with the pack, `speedup` = stock_ms / pack_ms (those same medians) with the paired
    bootstrap 95% interval `ci` of that ratio; `pays`: the interval lies above 1."""

    stock_ms: float | None = None
    pack_ms: float | None = None
    speedup: float | None = None
    ci: tuple[float, float] | None = None
    rounds: int = 0
    reps: int = 0
    timed_under: str = ""  # "graphs" | "eager"
    pays: bool | None = None
    outputs: str = ""  # the output check's note
    graphs_first: GraphVerdict | None = None  # graph replay with every candidate kernel, when it failed

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if v is not None and v != ""}
        if self.ci is not None:
            d["ci"] = list(self.ci)
        if self.graphs_first is not None:
            d["graphs_first"] = self.graphs_first.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> GateSummary:
        d = dict(d or {})
        if d.get("ci") is not None:
            d["ci"] = tuple(d["ci"])
        if d.get("graphs_first") is not None:
            d["graphs_first"] = GraphVerdict.from_json(d["graphs_first"])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True)
class Manifest:
    name: str  # the Python package: forgepack_pack_<slug>
    slug: str
    version: str
    target: str  # "cuda" | "cpu"
    arch: str | None  # "sm_90" for cuda
    torch: str  # torch.__version__ the shim was compiled against
    cuda: str | None  # torch.version.cuda at build time
    cxx11_abi: bool
    platform: str
    python: str
    namespace: str  # torch.ops namespace of the shim's control ops
    shim: str  # path of the shim library inside the package
    shim_source: str
    model: dict[str, Any]
    workload: dict[str, Any]
    gate: str  # "passed" | "skipped"
    variants: tuple[PackVariant, ...]
    files: tuple[PackFile, ...] = ()
    provenance: Provenance = field(default_factory=lambda: Provenance("", ""))
    gate_summary: GateSummary = field(default_factory=GateSummary)  # stock/pack model time, speed-up
    align_bytes: int = 16
    graphs: GraphVerdict = field(default_factory=GraphVerdict)  # graph mode's verdict from the gate
    fused: tuple[FusedKernel, ...] = ()

    def file(self, path: str) -> PackFile | None:
        return next((f for f in self.files if f.path == path), None)


# --- to and from plain data ------------------------------------------------------------------------


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_drop_none(v) for v in value]
    return value


def _meta_dict(m: TensorMeta) -> dict[str, Any]:
    return _drop_none(dataclasses.asdict(m))


def _arg_dict(a: Arg) -> dict[str, Any]:
    d: dict[str, Any] = {"name": a.name, "kind": a.kind}
    if a.kind == "tensor":
        d["tensor"] = _meta_dict(a.tensor)
    elif a.kind == "tensors":
        d["tensors"] = [_meta_dict(t) for t in a.tensors]
    elif a.kind == "value" and a.value is not None:
        d["value"] = a.value
    return d


def to_dict(m: Manifest) -> dict[str, Any]:
    variants = []
    for v in m.variants:
        d = dataclasses.asdict(v)
        d["args"] = [_arg_dict(a) for a in v.args]
        d["outputs"] = [_meta_dict(o) for o in v.outputs]
        d["needs"] = None if v.needs is None else needs_mod.to_json(v.needs)
        if not v.served:
            del d["served"]  # served over every size verified: the manifests before sub-ranges
        variants.append(_drop_none(d))
    return _drop_none({
        "format": FORMAT,
        "name": m.name,
        "slug": m.slug,
        "version": m.version,
        "gate": m.gate,
        "model": m.model,
        "workload": m.workload,
        "target": {"device": m.target, "arch": m.arch},
        "build": {"torch": m.torch, "cuda": m.cuda, "cxx11_abi": m.cxx11_abi, "platform": m.platform,
                  "python": m.python, "align_bytes": m.align_bytes},
        "shim": {"namespace": m.namespace, "library": m.shim, "source": m.shim_source},
        "provenance": dataclasses.asdict(m.provenance),
        "gate_summary": m.gate_summary.to_json(),
        "graphs": m.graphs.to_json(),
        "variants": variants,
        "fused": [dataclasses.asdict(f) for f in m.fused],
        "files": [dataclasses.asdict(f) for f in m.files],
    })


def _meta(d: dict[str, Any]) -> TensorMeta:
    stats = ValueStats(**d["stats"]) if d.get("stats") else None
    return TensorMeta(d["dtype"], tuple(d["shape"]), tuple(d["stride"]), d.get("storage_offset", 0),
                      d.get("device", "cpu"), stats)


def _arg(d: dict[str, Any]) -> Arg:
    return Arg(
        name=d["name"],
        kind=d["kind"],
        tensor=_meta(d["tensor"]) if "tensor" in d else None,
        tensors=tuple(_meta(t) for t in d.get("tensors", ())),
        value=d.get("value"),
    )


def _variant(d: dict[str, Any]) -> PackVariant:
    d = dict(d)
    d["args"] = tuple(_arg(a) for a in d["args"])
    d["outputs"] = tuple(_meta(o) for o in d["outputs"])
    d["tolerance"] = tuple(OutputTolerance(**t) for t in d["tolerance"])
    d["modules"] = tuple(d.get("modules", ()))
    if "needs" in d:
        d["needs"] = needs_mod.from_json(d["needs"])
    return PackVariant(**d)


def from_dict(d: dict[str, Any]) -> Manifest:
    if d.get("format") != FORMAT:
        raise ValueError(f"manifest format {d.get('format')!r} is not {FORMAT}")
    build, shim, target = d["build"], d["shim"], d["target"]
    prov = dict(d.get("provenance", {}))
    prov["proposers"] = tuple(prov.get("proposers", ()))
    return Manifest(
        name=d["name"],
        slug=d["slug"],
        version=d["version"],
        target=target["device"],
        arch=target.get("arch"),
        torch=build["torch"],
        cuda=build.get("cuda"),
        cxx11_abi=build["cxx11_abi"],
        platform=build["platform"],
        python=build["python"],
        namespace=shim["namespace"],
        shim=shim["library"],
        shim_source=shim["source"],
        model=d.get("model", {}),
        workload=d.get("workload", {}),
        gate=d["gate"],
        variants=tuple(_variant(v) for v in d.get("variants", ())),
        files=tuple(PackFile(**f) for f in d.get("files", ())),
        provenance=Provenance(**prov),
        gate_summary=GateSummary.from_json(d.get("gate_summary")),
        align_bytes=build.get("align_bytes", 16),
        graphs=GraphVerdict.from_json(d.get("graphs")),
        fused=tuple(FusedKernel(**{**f, "sites": tuple(f.get("sites", ()))}) for f in d.get("fused", ())),
    )


def dumps(m: Manifest) -> str:
    return seal(to_dict(m))


def seal(doc: dict[str, Any]) -> str:
    """TOML for a manifest document with its digest (re)computed, as the loader will check it: over
    the document as TOML gives it back."""
    body = {k: v for k, v in doc.items() if k != DIGEST_KEY}
    return tomlwriter.dumps({**body, DIGEST_KEY: manifest_digest(tomllib.loads(tomlwriter.dumps(body)))})


def loads(text: str) -> Manifest:
    return from_dict(tomllib.loads(text))
