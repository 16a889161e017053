"""`forgepack inspect <wheel>`: what a kernel pack holds, from its manifest, as tables."""

from __future__ import annotations

import json
import zipfile
import zlib
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from forgepack.cli.common import out
from forgepack.errors import ForgepackError, UsageError
from forgepack.pack import manifest as manifest_mod
from forgepack.pack.manifest import GateSummary, Manifest


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_command)


def inspect_command(
    pack: Annotated[str, typer.Argument(help="a pack wheel (.whl), an installed pack directory, or a manifest.toml")],
    files: Annotated[bool, typer.Option("--files", help="also list every file with its sha256")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the manifest as JSON")] = False,
) -> None:
    """Print a pack's manifest: build facts, every kernel with its guard and speed-up, file digests."""
    m = read_manifest(Path(pack))
    if as_json:
        out.print_json(json.dumps(manifest_mod.to_dict(m)))
        return
    out.print(overview(m))
    out.print(variants_table(m))
    if files:
        out.print(files_table(m))


def read_manifest(path: Path) -> Manifest:
    """The manifest of a wheel, a package directory or a manifest file; a one-line error otherwise."""
    if not path.exists():
        raise UsageError(f"{path} does not exist")
    if path.is_file() and path.stat().st_size == 0:
        raise ForgepackError(f"{path} is an empty file: not a kernel pack")
    if path.suffix == ".whl" and not zipfile.is_zipfile(path):
        raise ForgepackError(f"{path} is not a readable wheel: not a zip archive (truncated or not a wheel)")
    try:
        if path.is_dir():
            text = (path / manifest_mod.FILE).read_text()
        elif zipfile.is_zipfile(path):
            text = _from_wheel(path)
        else:
            text = path.read_text()
        return manifest_mod.loads(text)
    except FileNotFoundError:
        raise ForgepackError(f"{path} has no {manifest_mod.FILE}: not a forgepack pack") from None
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:  # a member's bytes do not decompress or check
        raise ForgepackError(f"{path} is a corrupt wheel: {(str(err).splitlines() or [''])[0]}") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        first = (str(err).splitlines() or [""])[0]
        raise ForgepackError(f"{path}: not a readable forgepack manifest ({type(err).__name__}: {first})") from None


def _from_wheel(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(f"/{manifest_mod.FILE}")]
        if len(names) != 1:
            raise ForgepackError(f"{path} is a zip without a forgepack manifest: not a kernel pack")
        return z.read(names[0]).decode()


def overview(m: Manifest) -> Table:
    table = Table(title=f"{m.name} {m.version}", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    w = {k: f"{v['min']}-{v['max']}" if isinstance(v, dict) else v for k, v in m.workload.items()}  # ranges
    shape = f"batch {w.get('batch')}, " + (f"{w.get('image_size')}px" if w.get("task") == "image-classification"
                                          else f"seq {w.get('seq_len')}" + (f", cache {w['cache_len']}"
                                                                            if w.get("cache_len") else ""))
    if w.get("phase") == "generate":
        shape += f", {w.get('new_tokens')} new tokens per capture point"
    rows = [
        ("model", f"{m.model.get('recipe', '?')} ({m.model.get('source', '?')})"),
        ("workload", f"{w.get('task')} {w.get('phase', '')}, {shape}, {w.get('dtype')}"
                     + (f", {w['memory_format']}" if w.get("memory_format", "contiguous") != "contiguous" else "")),
        ("target", m.target + (f" {m.arch}" if m.arch else "")),
        ("built with", f"torch {m.torch}" + (f", CUDA {m.cuda}" if m.cuda else "") + f", {m.platform}, "
                       f"python {m.python}"),
        ("gate", m.gate + _gate_text(m.gate_summary)),
        ("kernels", str(len(m.variants) + len(m.fused)) + (f" ({len(m.fused)} fused)" if m.fused else "")),
        ("provenance", f"forgepack {m.provenance.forgepack}, {m.provenance.date}"
                       + (f", commit {m.provenance.commit[:12]}" if m.provenance.commit else "")
                       + (f", on {m.provenance.device}" if m.provenance.device else "")),
        ("proposers", ", ".join(m.provenance.proposers) or "-"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    return table


def _gate_text(s: GateSummary) -> str:
    if not s.stock_ms:
        return ""
    ci = f", 95% CI {s.ci[0]:.3f}-{s.ci[1]:.3f}" if s.ci else ""
    return f": model median {s.stock_ms:.2f} ms stock, {s.pack_ms:.2f} ms with the pack ({s.speedup:.3f}x{ci})"


def variants_table(m: Manifest) -> Table:
    table = Table(title="kernels (guard: exactly this signature, or a family's sizes in its ranges "
                        "(d0 in 1..8); anything else runs stock PyTorch)")
    for name, justify in (("variant", "left"), ("signature", "left"), ("calls", "right"), ("alone", "right"),
                          ("95% CI", "right"), ("e2e", "right"), ("tolerance", "left"), ("proposer", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    for v in m.variants:
        tol = ", ".join("exact" if t.exact else f"rtol {t.rtol:g} atol {t.atol:g}" for t in v.tolerance)
        table.add_row(v.id, v.signature, str(v.calls), f"{v.speedup:.2f}x", f"{v.ci_low:.2f}-{v.ci_high:.2f}",
                      "" if v.e2e_ratio is None else f"{v.e2e_ratio:.3f}", tol, v.proposer)
    for f in m.fused:  # module-level chains: their guard is the patched forward's (modules.json)
        table.add_row(f.id, f"fused: {f.signature}", str(f.calls), "", "", "", "", "")
    return table


def files_table(m: Manifest) -> Table:
    table = Table(title="files (sha256 checked by the loader before anything is loaded)")
    table.add_column("path")
    table.add_column("bytes", justify="right")
    table.add_column("sha256")
    for f in m.files:
        table.add_row(f.path, str(f.bytes), f.sha256)
    return table
