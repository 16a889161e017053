"""Build a kernel pack: from the workspace's accepted kernels to `packs/forgepack_pack_<slug>-*.whl`.

1. Select: the accepted kernels for the recipe's target whose measured speed-up reaches the margin and
   whose card the guarded dispatch can serve (functional aten ops; see `shimgen.check_supported`).
2. Stage: a package directory (`<workspace>/pack/stage/forgepack_pack_<slug>/`) with the exact kernel
   objects that were verified and timed (copied, never recompiled), their sources, the generated shim
   (compiled here with g++ against this torch), the runtime (`forgepack/runtime/`), and
   `manifest.toml` with every file's sha256.
3. Gate (`forgepack.pack.gate`, in a subprocess): outputs agree with stock, every kernel is used and
   pays end to end, and so does the whole pack; what is dropped is restaged and checked again
   ("verify"). A pack that does not pay is not shipped: no wheel, gate "failed", `refused` says why.
   `--no-gate` skips it and the manifest says `gate = "skipped"`.
4. Wheel: setuptools `bdist_wheel` in a subprocess (nothing is compiled at `pip install`; no network),
   tagged `py3-none-<platform>` because the shim uses no Python ABI; it depends on the torch minor it
   was built for only. It replaces any earlier wheel of the same pack in `packs/`.

`pack_report.json` in the workspace and a console table say what was kept and dropped, and why.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import platform
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forgepack import __version__, families, models, packreport
from forgepack import accepted as accepted_mod
from forgepack import recipe as recipe_mod
from forgepack.accepted import AcceptedKernel
from forgepack.cards import Card, judged_dtypes
from forgepack.errors import ForgepackError
from forgepack.pack import fusedgen, shimgen
from forgepack.pack import gate as gate_mod
from forgepack.pack import manifest as manifest_mod
from forgepack.pack.manifest import (
    FusedKernel,
    GateSummary,
    Manifest,
    OutputTolerance,
    PackFile,
    PackVariant,
    Provenance,
)
from forgepack.packreport import Decision, PackReport
from forgepack.recipe import Recipe
from forgepack.runtime import tolerances
from forgepack.runtime.packinfo import GraphVerdict, file_sha256
from forgepack.workspace import Workspace

RUNTIME_DIR = Path(__file__).parent.parent / "runtime"
SHIM_LIBRARY = "shim/libforgepack_shim.so"
REPORT = packreport.FILE


@dataclass(frozen=True)
class PackResult:
    wheel: Path | None
    manifest: Manifest | None
    decisions: tuple[Decision, ...]
    report: Path
    gate: str  # "passed" | "skipped" | "empty" (nothing selected) | "failed" (the gate let nothing ship)
    gate_summary: GateSummary = dataclasses.field(default_factory=GateSummary)
    refused: str = ""  # gate "failed": why no wheel was written

    @property
    def kept(self) -> list[Decision]:
        return [d for d in self.decisions if d.kept]

    @property
    def dropped(self) -> list[Decision]:
        return [d for d in self.decisions if not d.kept]


@dataclass(frozen=True)
class _Chosen:
    kernel: AcceptedKernel
    card: Card


def package_name(recipe: Recipe) -> str:
    return f"forgepack_pack_{recipe.slug}"


# --- 1. select --------------------------------------------------------------------------------------------


def select(ws: Workspace, recipe: Recipe, margin: float) -> tuple[list[_Chosen], list[Decision]]:
    """The kernels worth packing (most called first) and a decision with a reason for each one left out."""
    target = recipe.target.device
    includes = shimgen.torch_include_dirs()
    best: dict[str, AcceptedKernel] = {}
    for k in accepted_mod.load_all(ws.root):
        if k.card_id not in best or k.speedup > best[k.card_id].speedup:
            best[k.card_id] = k
    chosen, decisions = [], []
    archs = [k.arch for k in best.values() if k.target == target]
    arch = max(set(archs), key=archs.count) if archs else None
    for k in best.values():
        card = _load_card(ws, k.card_id)
        card, narrowed = _served(card, k)
        op, sig = (card.op, card.signature()) if card else ("?", "?")
        reason = narrowed or _select_reason(ws, k, card, target, arch, margin, includes)
        if reason:
            decisions.append(Decision(k.card_id, op, sig, False, "select", reason, k.speedup))
        else:
            chosen.append(_Chosen(k, card))
    chosen.sort(key=lambda c: (-c.card.calls, c.card.id))
    return chosen, decisions


def _served(card: Card | None, k: AcceptedKernel) -> tuple[Card | None, str | None]:
    """The card as its kernel serves it: a family narrowed to the sub-range the kernel pays in (its guard
    then admits only that; the id stays the family's). A sub-range outside what was verified is refused."""
    if card is None or not k.served:
        return card, None
    try:
        return families.narrow(card, k.served), None
    except ValueError as err:
        return card, f"its sub-range is not servable: {err}"


def _load_card(ws: Workspace, card_id: str) -> Card | None:
    try:
        return ws.load_card(card_id)
    except (OSError, ValueError, KeyError):
        return None


def _select_reason(ws, k: AcceptedKernel, card: Card | None, target: str, arch: str | None, margin: float,
                   includes: list[Path]) -> str | None:
    if card is None:
        return f"no readable card {k.card_id} in the workspace"
    if k.target != target:
        return f"built for {k.target}, the recipe targets {target}"
    if k.arch != arch:
        return f"built for {k.arch}, the pack's kernels are {arch}"
    if k.speedup < 1.0 + margin:
        return f"speed-up {k.speedup:.3f}x is below the margin ({1.0 + margin:.3f}x)"
    if not k.binary or not (ws.root / k.binary).is_file():
        return f"the verified object {k.binary or '(none)'} is missing"
    if k.binary_sha256 and file_sha256(ws.root / k.binary) != k.binary_sha256:
        return f"{k.binary} is not the object that was verified and timed (its sha256 differs from {k.binary_sha256})"
    if card.kind == "fusion":
        return fusedgen.unsupported_reason(card, target)
    return shimgen.unsupported_reason(card, target, includes)


# --- 2. stage ---------------------------------------------------------------------------------------------


def _tolerance(card: Card) -> tuple[OutputTolerance, ...]:
    out = []
    for o, judged in zip(card.outputs, judged_dtypes(card), strict=True):
        tol = tolerances.tolerance(judged)
        out.append(OutputTolerance(o.dtype) if tol is None else OutputTolerance(o.dtype, tol.rtol, tol.atol))
    return tuple(out)


def _torch_tag() -> str:
    import torch

    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    cuda = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    return f"torch{major_minor}.{cuda}"


def _commit() -> str | None:
    repo = Path(__file__).resolve().parent.parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _device_name(target: str) -> str:
    import torch

    if target == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.machine()} cpu"


def _variant(c: _Chosen) -> PackVariant:
    k, card = c.kernel, c.card
    suffix = Path(k.source).suffix or (".cu" if k.target == "cuda" else ".cpp")
    return PackVariant(
        id=card.id, op=card.op, schema=card.schema, signature=card.signature(), args=card.args,
        outputs=card.outputs, kernel=f"kernels/{card.id}.so", source=f"sources/{card.id}{suffix}",
        tolerance=_tolerance(card), speedup=k.speedup, ci_low=k.ci_low, ci_high=k.ci_high, eager_us=k.eager_us,
        kernel_us=k.kernel_us, proposer=k.proposer, calls=card.calls, modules=card.modules, needs=k.needs,
        served=served_text(card),
    )


def served_text(card: Card) -> str:
    """`d1 in 256..2048 of 8..2048` for a family kernel kept for a sub-range, else ""."""
    fam = card.family
    if fam is None or not fam.served:
        return ""
    return ", ".join(f"{n} in {lo}..{hi} of {fam.dim(n).min}..{fam.dim(n).max}" for n, lo, hi in fam.served)


def stage(ws: Workspace, recipe: Recipe, chosen: list[_Chosen], root: Path, version: str, gate: str) -> Manifest:
    """Write the package directory under `root` and return its manifest (also written there)."""
    import torch

    name = package_name(recipe)
    pkg = root / name
    if root.exists():
        shutil.rmtree(root)
    for sub in ("shim", "kernels", "sources"):
        (pkg / sub).mkdir(parents=True)
    for f in sorted(RUNTIME_DIR.glob("*.py")):  # the runtime: torch and the standard library only
        shutil.copyfile(f, pkg / f.name)
    ops = [c for c in chosen if c.card.kind != "fusion"]
    fusions = [c for c in chosen if c.card.kind == "fusion"]
    variants = [_variant(c) for c in ops]  # the manifest's variants: the operator shim's
    for c, v in zip(ops, variants, strict=True):
        shutil.copyfile(ws.root / c.kernel.binary, pkg / v.kernel)  # the exact verified object
        source = ws.root / c.kernel.source
        if source.is_file():
            shutil.copyfile(source, pkg / v.source)
    target = recipe.target.device
    namespace = f"forgepack_{recipe.slug}"
    for header in (shimgen.GUARD_HEADER, shimgen.ABI_HEADER):
        shutil.copyfile(header, pkg / "sources" / header.name)
    try:
        if ops:
            code = shimgen.generate([shimgen.ShimVariant(c.card, v.kernel, v.needs)
                                     for c, v in zip(ops, variants, strict=True)], namespace, target, title=name)
            (pkg / "sources" / "shim.cpp").write_text(code)
            shimgen.compile_shim(pkg / "sources" / "shim.cpp", pkg / SHIM_LIBRARY, [pkg / "sources"])
        spec = {}
        if fusions:  # kernels/, sources/, shim/libforgepack_fused.so, modules.json (digested like the rest)
            items = [(c.card, ws.root / c.kernel.binary, ws.root / c.kernel.source, c.kernel.needs) for c in fusions]
            spec = fusedgen.stage(pkg, items, namespace, target, title=name)
    except RuntimeError as err:
        raise ForgepackError(str(err).splitlines()[0] + " " + " | ".join(str(err).splitlines()[1:3])) from None
    files = tuple(PackFile(str(p.relative_to(pkg)), file_sha256(p), p.stat().st_size)
                  for p in sorted(pkg.rglob("*")) if p.is_file() and p.name != manifest_mod.FILE)
    w = recipe.workload
    manifest = Manifest(
        name=name, slug=recipe.slug, version=version, target=target,
        arch=chosen[0].kernel.arch if target == "cuda" else None,
        torch=torch.__version__, cuda=torch.version.cuda if target == "cuda" else None,
        cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI), platform=shimgen.platform_tag(),
        python=".".join(map(str, sys.version_info[:2])), namespace=namespace, shim=SHIM_LIBRARY,
        shim_source="sources/shim.cpp",
        model={"recipe": recipe.name, "source": recipe.model.source(), "arch": recipe.model.arch},
        workload=_drop_none(dataclasses.asdict(w)), gate=gate, variants=tuple(variants), files=files,
        provenance=Provenance(
            forgepack=__version__, date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            commit=_commit(),
            proposers=tuple(sorted({c.kernel.proposer for c in chosen})), device=_device_name(target),
        ),
        align_bytes=shimgen.ALIGN_BYTES,
        fused=tuple(FusedKernel(v["id"], v["op"], v["signature"], v["kernel"], v.get("calls", 0), tuple(v["sites"]))
                    for v in spec.get("variants", ())),
    )
    (pkg / manifest_mod.FILE).write_text(manifest_mod.dumps(manifest))
    return manifest


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


# --- 4. wheel ---------------------------------------------------------------------------------------------

_SETUP = """
import sys, setuptools
name, version, plat, dist, torch_req = sys.argv[1:6]
setuptools.setup(
    name=name, version=version, packages=[name],
    package_data={name: ["manifest.toml", "modules.json", "shim/*", "kernels/*", "sources/*"]},
    install_requires=[torch_req, "tomli; python_version < '3.11'"], python_requires=">=3.10",
    description="forgepack kernel pack: verified kernels behind C++ guards for one model",
    script_args=["-q", "bdist_wheel", "--python-tag", "py3", "--plat-name", plat, "--dist-dir", dist],
)
"""


def build_wheel(root: Path, manifest: Manifest, out_dir: Path) -> Path:
    """`bdist_wheel` of the staged package (setuptools, in a subprocess, offline); returns the wheel."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dist = (root / "dist").resolve()  # setuptools runs with cwd=root: a relative path would point elsewhere
    shutil.rmtree(dist, ignore_errors=True)
    cmd = [sys.executable, "-c", _SETUP, manifest.name, manifest.version, manifest.platform, str(dist),
           torch_requirement(manifest.torch)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False)
    wheels = sorted(dist.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise ForgepackError(f"building the wheel failed: {tail}")
    _check_wheel(wheels[0], manifest)
    final = out_dir / wheels[0].name
    for old in out_dir.glob(f"{manifest.name}-*.whl"):  # one wheel per pack: `pip install packs/<name>-*.whl`
        old.unlink()
    shutil.copyfile(wheels[0], final)
    for leftover in ("build", "dist", f"{manifest.name}.egg-info"):
        shutil.rmtree(root / leftover, ignore_errors=True)
    return final


def torch_requirement(version: str) -> str:
    """The torch the shim was compiled against, to its minor: on any other the pack does nothing, so
    pip must not pick another (a fresh environment would get the newest, a multi-GB download)."""
    major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    return f"torch>={major}.{minor},<{major}.{minor + 1}"


def _check_wheel(wheel: Path, manifest: Manifest) -> None:
    """Every file the manifest lists is in the wheel, byte for byte."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for f in manifest.files:
            member = f"{manifest.name}/{f.path}"
            if member not in names or hashlib.sha256(z.read(member)).hexdigest() != f.sha256:
                raise ForgepackError(f"the wheel is missing {member} or holds another version of it")
        if f"{manifest.name}/{manifest_mod.FILE}" not in names:
            raise ForgepackError("the wheel has no manifest.toml")


# --- the whole build ----------------------------------------------------------------------------------------


def build_pack(workspace: Workspace, recipe: Recipe, margin: float = 0.05, gate: bool = True,
               out_dir: Path = Path("packs"), note: Callable[[str], None] | None = None,
               rounds: int = gate_mod.ROUNDS, console: Any = None) -> PackResult:
    """Select, stage, gate and wheel the workspace's accepted kernels; see the module docstring.

    `note(text)` hears about each stage; with a rich `console`, the report table and a summary line are
    printed at the end (they are also in `<workspace>/pack_report.json`).
    """
    result = _build(workspace, recipe, margin, gate, Path(out_dir), note or (lambda _text: None), rounds)
    if console is not None:
        console.print(report_table(result))
        console.print(summary_line(result))
    return result


def _build(workspace: Workspace, recipe: Recipe, margin: float, gate: bool, out_dir: Path,
           note: Callable[[str], None], rounds: int) -> PackResult:
    # target "auto" -> the device here; task "auto" -> the checkpoint's (the manifest records what ran)
    recipe = models.resolve_task(recipe_mod.concrete(recipe))
    chosen, decisions = select(workspace, recipe, margin)
    if not chosen:
        return _finish(workspace, recipe, None, None, decisions, "empty", GateSummary(), margin)
    version = f"{__version__}.{dt.datetime.now(dt.timezone.utc):%Y%m%d%H%M%S}+{_torch_tag()}"
    root = workspace.pack_dir / "stage"
    note(f"staging {len(chosen)} kernels and compiling the guarded dispatch shim")
    manifest = stage(workspace, recipe, chosen, root, version, "pending" if gate else "skipped")
    ratios: dict[str, float] = {}
    summary = GateSummary()
    if gate:
        note("end-to-end gate: outputs, use and pay of every kernel in the model")
        outcome = gate_mod.run(recipe, root, manifest.name, "full", rounds=rounds)
        ratios = {i: r[0] for i, r in outcome.ratios.items()}
        for c in chosen:
            if c.card.id in outcome.dropped:
                decisions.append(Decision(c.card.id, c.card.op, c.card.signature(), False, "gate",
                                          outcome.dropped[c.card.id], c.kernel.speedup, ratios.get(c.card.id)))
        kept_ids, summary, verdict = set(outcome.kept), outcome.summary, outcome.graphs
        if not kept_ids or outcome.refused:
            return _refuse(workspace, recipe, chosen, decisions, outcome, margin)
        if kept_ids != {c.card.id for c in chosen}:
            chosen = [c for c in chosen if c.card.id in kept_ids]
            note(f"rebuilding with the {len(chosen)} kernels that pay, and checking it again")
            manifest = stage(workspace, recipe, chosen, root, version, "pending")
            check = gate_mod.run(recipe, root, manifest.name, "verify", rounds=rounds)
            if set(check.kept) != kept_ids:
                raise ForgepackError(f"the rebuilt pack failed the end-to-end check: {check.dropped}")
            if check.refused:
                return _refuse(workspace, recipe, chosen, decisions, check, margin)
            summary = dataclasses.replace(check.summary, graphs_first=outcome.summary.graphs_first)
            verdict = check.graphs
        manifest = finalize(root, manifest, "passed", ratios, summary, verdict)
    for c in chosen:
        decisions.append(Decision(c.card.id, c.card.op, c.card.signature(), True, "gate" if gate else "select",
                                  "kept" if gate else "kept (gate skipped)", c.kernel.speedup,
                                  ratios.get(c.card.id)))
    note("writing the wheel")
    wheel = build_wheel(root, manifest, out_dir)
    return _finish(workspace, recipe, wheel, manifest, decisions, "passed" if gate else "skipped", summary, margin)


def finalize(root: Path, manifest: Manifest, gate: str, ratios: dict[str, float], summary: GateSummary,
             graphs: GraphVerdict | None) -> Manifest:
    """Record the gate's outcome in the staged manifest (the manifest is not among the digested files)."""
    variants = tuple(dataclasses.replace(v, e2e_ratio=ratios.get(v.id)) for v in manifest.variants)
    final = dataclasses.replace(manifest, gate=gate, variants=variants, gate_summary=summary,
                                graphs=graphs or _no_graphs(manifest))
    (root / manifest.name / manifest_mod.FILE).write_text(manifest_mod.dumps(final))
    return final


def _no_graphs(manifest: Manifest) -> GraphVerdict:
    if manifest.target != "cuda":
        return GraphVerdict(False, "cpu target: CUDA graphs need a GPU")
    return GraphVerdict()


def _refuse(ws: Workspace, recipe: Recipe, chosen: list[_Chosen], decisions: list[Decision],
            outcome: gate_mod.GateOutcome, margin: float) -> PackResult:
    """The gate let no pack ship: no wheel, the kernels it kept so far recorded as dropped with why."""
    why = outcome.refused or "no kernel passed the end-to-end gate (see the reasons per kernel)"
    for c in chosen:
        if c.card.id in outcome.kept:
            decisions.append(Decision(c.card.id, c.card.op, c.card.signature(), False, "gate", why,
                                      c.kernel.speedup, outcome.ratios.get(c.card.id, (None,))[0]))
    return _finish(ws, recipe, None, None, decisions, "failed", outcome.summary, margin, refused=why)


def _finish(ws: Workspace, recipe: Recipe, wheel: Path | None, manifest: Manifest | None,
            decisions: list[Decision], status: str, summary: GateSummary, margin: float,
            refused: str = "") -> PackResult:
    doc = PackReport.of(recipe.name, str(wheel) if wheel else None, status, margin, summary.to_json(), decisions,
                        refused=refused)
    report = ws.write_json(REPORT, doc.to_json())
    return PackResult(wheel, manifest, tuple(decisions), report, status, summary, refused)


def report_table(result: PackResult):
    """A rich table of what was kept and dropped, and why."""
    from rich.table import Table

    title = f"pack: {result.wheel.name if result.wheel else 'no wheel (nothing to ship)'} (gate {result.gate})"
    if result.refused:
        title = f"pack: no wheel (gate {result.gate}: {result.refused})"
    table = Table(title=title)
    for name, justify in (("variant", "left"), ("signature", "left"), ("alone", "right"), ("e2e", "right"),
                          ("", "left"), ("why", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    for d in sorted(result.decisions, key=lambda d: (not d.kept, d.card_id)):
        alone = f"{d.speedup:.2f}x" if d.speedup is not None else ""
        e2e = f"{d.e2e_ratio:.3f}" if d.e2e_ratio is not None else ""
        table.add_row(d.card_id, d.signature[:60], alone, e2e, "kept" if d.kept else "dropped", d.reason)
    return table


def summary_line(result: PackResult) -> str:
    s = result.gate_summary
    text = f"{len(result.kept)} kernels kept, {len(result.dropped)} dropped"
    if s.stock_ms:
        # the ratio is the two medians' (per-round median times), so it is the one these times give
        text += (f"; model median {s.stock_ms:.2f} ms stock, {s.pack_ms:.2f} ms with the pack: "
                 f"{s.stock_ms / s.pack_ms:.3f}x")
        text += f" (95% CI {s.ci[0]:.3f}-{s.ci[1]:.3f})" if s.ci else ""
        text += ", both replayed from CUDA graphs" if s.timed_under == "graphs" else ""
    if result.refused:
        return text + f"; no wheel written: {result.refused}"
    return text + (f"; wheel: {result.wheel}" if result.wheel else "; no wheel written")


def report_json(result: PackResult) -> str:
    return json.dumps(json.loads(result.report.read_text()), indent=1)
