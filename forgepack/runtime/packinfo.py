"""`manifest.toml` as the pack runtime reads it: small frozen values, read once.

The build side writes the full manifest (`forgepack.pack.manifest`: provenance, timings, file sizes,
outputs); the runtime reads only what it acts on: what the pack was built for (`environment_problem`),
the files and their digests (`file_problem`), the shim, each variant's op, guard arguments and output
tolerances (`stats`, the self-test), the model's class and layout, and graph mode's verdict. Keys the
runtime does not read are ignored, so a newer build's manifest still reads. Part of the pack
runtime: the standard library only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DIGEST_KEY = "digest"  # the manifest's own sha256, over everything else in it (`manifest_digest`)


def manifest_digest(doc: dict[str, Any]) -> str:
    """sha256 of a manifest's content without its digest key, as canonical JSON: the build writes it
    into the manifest and the loader recomputes it, so an edited manifest is refused."""
    body = {k: v for k, v in doc.items() if k != DIGEST_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, read in blocks: the manifest lists each pack file's, the loader checks
    them, and the builder checks that a kernel object is the one that was verified and timed."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class TensorRecord:
    """A recorded tensor argument: exact layout, and value statistics to draw fresh inputs like it."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int = 0
    stats: dict[str, float] = field(default_factory=dict)  # mean, std, min, max (what capture saw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorRecord:
        return cls(d["dtype"], tuple(d["shape"]), tuple(d["stride"]), d.get("storage_offset", 0),
                   dict(d.get("stats") or {}))


@dataclass(frozen=True)
class ArgRecord:
    """One schema argument of a variant's guard: "tensor", "tensors", "none" or "value"."""

    name: str
    kind: str
    tensor: TensorRecord | None = None
    tensors: tuple[TensorRecord, ...] = ()
    value: Any = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArgRecord:
        tensor = TensorRecord.from_dict(d["tensor"]) if "tensor" in d else None
        return cls(d.get("name", ""), d["kind"], tensor, tuple(TensorRecord.from_dict(t) for t in d.get("tensors", ())),
                   d.get("value"))

    def recorded(self) -> tuple[str, int, Any]:
        """As the stock-call decoder reads it (`stockcall.Recorded`)."""
        return (self.kind, len(self.tensors), self.value)


@dataclass(frozen=True)
class OutputTolerance:
    """How close an output must be to stock: |out - ref| <= atol + rtol * |ref|; exact when both are 0."""

    dtype: str
    rtol: float = 0.0
    atol: float = 0.0

    @property
    def exact(self) -> bool:
        return self.rtol == 0.0 and self.atol == 0.0


@dataclass(frozen=True)
class VariantInfo:
    id: str
    op: str  # "aten.silu.default"
    signature: str
    args: tuple[ArgRecord, ...]
    tolerance: tuple[OutputTolerance, ...]
    served: str = ""  # a family kernel kept for a sub-range of what it was verified for: that sub-range

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VariantInfo:
        return cls(d["id"], d["op"], d.get("signature", ""), tuple(ArgRecord.from_dict(a) for a in d["args"]),
                   tuple(OutputTolerance(t.get("dtype", ""), t.get("rtol", 0.0), t.get("atol", 0.0))
                         for t in d.get("tolerance", ())), d.get("served", ""))


@dataclass(frozen=True)
class GraphVerdict:
    """Graph mode's verdict, as the build's gate found it and the manifest's `[graphs]` carries it:
    whether the forward replays from CUDA graphs like eager with the pack's kernels. `enabled` None:
    never judged (the gate skipped), so graph mode is allowed and unproven. The gate, builder, manifest
    writer and bench use this one value."""

    enabled: bool | None = None
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {} if self.enabled is None else {"enabled": self.enabled, "reason": self.reason}

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> GraphVerdict:
        d = d or {}
        enabled = d.get("enabled")
        return cls(None if enabled is None else bool(enabled), str(d.get("reason", "")))


@dataclass(frozen=True)
class PackedFile:
    path: str  # relative to the package directory
    sha256: str


@dataclass(frozen=True)
class PackInfo:
    name: str
    version: str
    device: str  # "cuda" | "cpu"
    arch: str  # "sm_90" ('' for cpu)
    torch: str  # the torch version the shim was compiled against
    cuda: str | None
    cxx11_abi: bool
    namespace: str  # torch.ops namespace of the shim's control ops
    library: str  # the shim library's path inside the package
    model_arch: str  # the transformers class the pack was built for ('' if unknown)
    recipe: str
    memory_format: str  # the layout the model was built in ("channels_last", "contiguous", '')
    graphs: GraphVerdict
    variants: tuple[VariantInfo, ...]
    files: tuple[PackedFile, ...]
    digest: str = ""  # the digest the manifest states (DIGEST_KEY)
    content_digest: str = ""  # the digest of what was read (`manifest_digest`): differs when edited

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PackInfo:
        build, target, shim = d["build"], d["target"], d.get("shim", {})
        model, workload = d.get("model", {}), d.get("workload", {})
        return cls(
            name=d["name"], version=d["version"], device=target["device"], arch=target.get("arch", ""),
            torch=build["torch"], cuda=build.get("cuda"), cxx11_abi=bool(build["cxx11_abi"]),
            namespace=shim.get("namespace", ""), library=shim.get("library", ""),
            model_arch=model.get("arch", ""), recipe=model.get("recipe", "?"),
            memory_format=workload.get("memory_format", ""),
            graphs=GraphVerdict.from_json(d.get("graphs")),
            variants=tuple(VariantInfo.from_dict(v) for v in d.get("variants", ())),
            files=tuple(PackedFile(f["path"], f["sha256"]) for f in d.get("files", ())),
            digest=str(d.get(DIGEST_KEY, "")), content_digest=manifest_digest(d),
        )
