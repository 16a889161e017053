"""The tiny-llama pack on the cpu target, end to end: real accepted kernels -> wheel -> `pip install` into
a fresh venv -> activation in one line in a separate process, against stock PyTorch.

The workspace's kernels went through the real evaluator (verified, timed); the build skips the gate (a
negative margin keeps kernels that are slower than stock on this CPU, so the pack is not empty; the
gate has its own tests). Each scenario runs in a fresh Python process, as a user's would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
import tomllib
from pack_kernels import tiny_llama_workspace

from forgepack import recipe as recipe_mod
from forgepack import tomlwriter
from forgepack.accepted import load_all
from forgepack.pack import manifest as manifest_mod
from forgepack.pack.builder import build_pack
from forgepack.runtime.packinfo import GraphVerdict

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "forgepack_pack_tiny_llama"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack")
    with pytest.MonkeyPatch.context() as mp:  # module scope: the autouse per-test isolation is not set up yet
        mp.setenv("FORGEPACK_HOME", str(root / "home"))
        mp.setenv("FORGEPACK_CACHE", str(root / "cache"))
        ws, recipe, _ = tiny_llama_workspace(root / "ws")
        result = build_pack(ws, recipe, margin=-0.99, gate=False, out_dir=root / "packs")
    assert result.wheel is not None, result.decisions
    return result, ws


@pytest.fixture(scope="module")
def venv_python(built, tmp_path_factory) -> Path:
    """A fresh venv that sees this environment's torch (through a .pth, like --system-site-packages)
    with the wheel installed offline, without dependencies."""
    result, _ = built
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "_parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--no-deps",
                    "-q", str(result.wheel)], check=True, capture_output=True, text=True)
    return python


def run(python: Path, code: str, tmp_path: Path, env: dict | None = None,
        args: tuple = ()) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "FORGEPACK_DISABLE"}
    full.update(env or {})
    cmd = [str(python), *(("-c", code) if code else ()), *args]
    return subprocess.run(cmd, cwd=tmp_path, env=full, capture_output=True, text=True, timeout=600, check=False)


def last_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def installed_dir(python: Path) -> Path:
    out = subprocess.check_output([python, "-c", f"import {PACKAGE}, os; print(os.path.dirname({PACKAGE}.__file__))"],
                                  text=True, env={**os.environ, "PYTHONPATH": ""})
    return Path(out.strip())


def copy_of_package(python: Path, tmp_path: Path) -> Path:
    """A copy of the installed package to alter; PYTHONPATH=<returned dir> makes it the one imported."""
    alt = tmp_path / "alt"
    shutil.copytree(installed_dir(python), alt / PACKAGE)
    return alt


# --- the wheel --------------------------------------------------------------------------------------------


def test_wheel_holds_the_exact_verified_objects_and_a_complete_manifest(built):
    result, ws = built
    wheel = result.wheel
    assert re.fullmatch(rf"{PACKAGE}-[0-9.]+\+torch[0-9.]+\.cpu-py3-none-[a-z0-9_]+\.whl", wheel.name), wheel.name
    accepted = {k.card_id: k for k in load_all(ws.root)}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        m = manifest_mod.loads(z.read(f"{PACKAGE}/manifest.toml").decode())
        metadata = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
        assert {f"{PACKAGE}/{f.path}" for f in m.files} | {f"{PACKAGE}/manifest.toml"} == {
            n for n in names if n.startswith(f"{PACKAGE}/")}
        for f in m.files:
            assert hashlib.sha256(z.read(f"{PACKAGE}/{f.path}")).hexdigest() == f.sha256
        for v in m.variants:  # the object that was verified and timed, byte for byte
            assert z.read(f"{PACKAGE}/{v.kernel}") == (ws.root / accepted[v.id].binary).read_bytes()
            assert z.read(f"{PACKAGE}/{v.source}").decode() == (ws.root / accepted[v.id].source).read_text()
            assert v.speedup == accepted[v.id].speedup
    requires = re.findall(r"^Requires-Dist: (.+)$", metadata, flags=re.M)
    assert [re.split(r"[;<>=]", r)[0].strip() for r in requires] == ["torch", "tomli"]
    assert "python_version" in requires[1]
    # the torch minor it was built for: pip must not pick the newest torch, on which the pack does nothing
    import torch
    from packaging.requirements import Requirement

    built_for = Requirement(requires[0]).specifier
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert f"{major}.{minor}.0" in built_for and f"{major}.{minor}.9" in built_for
    assert f"{major}.{minor + 1}.0" not in built_for and f"{major}.{minor - 1}.9" not in built_for
    assert m.gate == "skipped" and m.target == "cpu" and m.arch is None
    assert len(m.variants) == 7 and {v.op for v in m.variants} >= {"aten.silu.default", "aten.cat.default"}
    assert m.model["recipe"] == "tiny-llama" and m.workload["seq_len"] == 32
    assert m.provenance.forgepack and m.provenance.date and m.provenance.proposers == ("manual",)
    assert all(t.rtol == 1e-5 for v in m.variants for t in v.tolerance)
    assert [v.calls for v in m.variants] == sorted((v.calls for v in m.variants), reverse=True)
    report = json.loads(result.report.read_text())
    assert report["gate"] == "skipped" and len(report["kept"]) == 7 and report["dropped"] == []


# --- installed, in a fresh process --------------------------------------------------------------------------

MAIN = r"""
import json, sys
import torch
import forgepack_pack_tiny_llama as pack
res = {"file": pack.__file__, "pack_imports_forgepack": any(m.split(".")[0] == "forgepack" for m in sys.modules)}
sys.path.insert(0, REPO)
from forgepack import models, recipe
with models.quiet_transformers():
    lm = models.load(recipe.resolve("tiny-llama").replace(target={"device": "cpu"}))
stock = lm.output_tensor(lm.run()).clone()

def hits():
    return {k: v["hits"] for k, v in pack.stats().items()}

res["activated"] = pack.activate()
res["activated_again"] = pack.activate()
out = lm.output_tensor(lm.run())
res["max_diff"] = float((out - stock).abs().max())
res["model_hits"] = hits()
with torch.inference_mode():
    lm.model(**lm.inputs)
res["inference_mode_hits"] = {k: v - res["model_hits"][k] for k, v in hits().items()}

g = torch.Generator().manual_seed(0)
def r(*shape, dtype=torch.float32, offset=0, **kw):
    n = 1
    for s in shape:
        n *= s
    base = torch.randn(offset + n, generator=g, dtype=dtype)
    return base[offset:].view(*shape).requires_grad_(kw.get("requires_grad", False))

silu = torch.nn.functional.silu
a128 = r(1, 32, 128)
misses = {
    "other shape": (lambda x: silu(x), r(2, 32, 128)),
    "other dtype": (lambda x: silu(x), r(1, 32, 128, dtype=torch.float64)),
    "other strides": (lambda x: silu(x), r(1, 128, 32).transpose(1, 2)),
    "misaligned pointer": (lambda x: silu(x), r(1, 32, 128, offset=1)),
    "autograd needed": (lambda x: silu(x).detach(), r(1, 32, 128, requires_grad=True)),
    "other scalar": (lambda x: x + 2e-06, r(1, 32, 1)),
    "other alpha": (lambda x: torch.add(x, 1e-06, alpha=2), r(1, 32, 1)),
    "0-dim tensor, not a number": (lambda x: x + torch.tensor(1e-06), r(1, 32, 1)),
    "other keepdim": (lambda x: x.mean(-1), r(1, 32, 64)),
    "other dim": (lambda x: x.mean(1, keepdim=True), r(1, 32, 64)),
    "broadcast": (lambda x: x * a128[0, 0], r(1, 32, 128)),
    "other exponent": (lambda x: x ** 3, r(1, 32, 64)),
    "cat of contiguous": (lambda x: torch.cat([x, x], -1), r(1, 4, 32, 8)),
}
res["miss"] = {}
for name, (fn, x) in misses.items():
    before = sum(hits().values())
    got = fn(x)
    delta = sum(hits().values()) - before
    pack.deactivate()
    ref = fn(x)
    pack.activate()
    res["miss"][name] = {"hits": delta, "bit_identical": bool(torch.equal(got, ref))}

sid = next(k for k, v in pack.stats().items() if v["op"] == "aten.silu.default")
aligned = r(1, 32, 128, offset=4)  # 16 bytes in: the alignment the kernel was verified with
before = hits()[sid]
got = silu(aligned)
res["hit_offset16"] = {"hits": hits()[sid] - before}
pack.deactivate()
res["hit_offset16"]["close"] = bool(torch.allclose(got, silu(aligned), rtol=1e-5, atol=1e-5))

frozen = pack.stats()
after = lm.output_tensor(lm.run())
res["after_deactivate_bit_identical"] = bool(torch.equal(after, stock))
res["counters_frozen"] = pack.stats() == frozen
res["misses_counted"] = pack.stats()[sid]["misses"]
with pack.active():
    inside = pack.is_active()
    lm.run()
res["context"] = {"inside": inside, "after": pack.is_active(),
                  "hits": sum(v["hits"] for v in pack.stats().values()) - sum(v["hits"] for v in frozen.values())}
print(json.dumps(res))
"""


def test_installed_pack_activates_in_one_line_and_falls_back_exactly(venv_python, tmp_path):
    res = last_json(run(venv_python, f"REPO = {str(REPO)!r}\n{MAIN}", tmp_path))
    assert "/site-packages/" in res["file"]  # the installed wheel, not the build directory
    assert not res["pack_imports_forgepack"]
    assert res["activated"] and res["activated_again"]
    assert res["max_diff"] < 1e-4  # matches eager (fp32)
    assert len(res["model_hits"]) == 7 and all(h > 0 for h in res["model_hits"].values()), res["model_hits"]
    assert all(h > 0 for h in res["inference_mode_hits"].values()), res["inference_mode_hits"]
    for name, case in res["miss"].items():  # a guard miss is stock PyTorch, bit for bit
        assert case == {"hits": 0, "bit_identical": True}, name
    assert res["hit_offset16"] == {"hits": 1, "close": True}
    assert res["after_deactivate_bit_identical"] and res["counters_frozen"]
    assert res["misses_counted"] >= 5
    assert res["context"] == {"inside": True, "after": False, "hits": sum(res["model_hits"].values())}


TAMPERED = r"""
import json, warnings
import torch
import forgepack_pack_tiny_llama as pack
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ok = pack.activate()
res = {"ok": ok, "warnings": [str(w.message) for w in caught], "loaded": pack._STATE["loaded"],
       "libraries": sorted(torch.ops.loaded_libraries)}
try:
    pack.activate(strict=True)
    res["strict"] = None
except pack.PackError as err:
    res["strict"] = str(err)
torch.nn.functional.silu(torch.randn(1, 32, 128))
res["hits"] = sum(v["hits"] for v in pack.stats().values())
print(json.dumps(res))
"""


def test_a_tampered_kernel_is_refused_naming_the_file(venv_python, tmp_path):
    alt = copy_of_package(venv_python, tmp_path)
    target = next((alt / PACKAGE / "kernels").glob("silu-*.so"))
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    res = last_json(run(venv_python, TAMPERED, tmp_path, env={"PYTHONPATH": str(alt)}))
    name = f"kernels/{target.name}"
    assert res["ok"] is False and res["loaded"] is False and res["hits"] == 0
    assert not any("libforgepack_shim" in lib for lib in res["libraries"])  # nothing of the pack was loaded
    assert len(res["warnings"]) == 1 and name in res["warnings"][0] and "sha256" in res["warnings"][0]
    assert name in res["strict"]


def _drop_files_entry_and_flip(alt: Path, reseal: bool) -> str:
    """Remove the silu kernel's [[files]] entry from the manifest and flip a byte of that kernel."""
    path = alt / PACKAGE / "manifest.toml"
    data = tomllib.loads(path.read_text())
    target = next((alt / PACKAGE / "kernels").glob("silu-*.so"))
    name = f"kernels/{target.name}"
    data["files"] = [f for f in data["files"] if f["path"] != name]
    path.write_text(manifest_mod.seal(data) if reseal else tomlwriter.dumps(data))
    blob = bytearray(target.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    target.write_bytes(bytes(blob))
    return name


def test_the_manifest_itself_is_tamper_evident(venv_python, tmp_path):
    """Removing a kernel's [[files]] entry and flipping a byte of the kernel let it serve 5 calls."""
    for reseal, words in ((False, "manifest.toml does not match its own digest"),
                          (True, "is not listed in the manifest")):
        alt = copy_of_package(venv_python, tmp_path / str(reseal))
        name = _drop_files_entry_and_flip(alt, reseal)
        res = last_json(run(venv_python, TAMPERED, tmp_path, env={"PYTHONPATH": str(alt)}))
        assert res["ok"] is False and res["loaded"] is False and res["hits"] == 0, res
        assert len(res["warnings"]) == 1 and words in res["warnings"][0], res["warnings"]
        assert reseal is False or name in res["warnings"][0]


def test_stats_works_after_a_refused_activate(venv_python, tmp_path):
    """An unreadable manifest (TOMLDecodeError) and a shim whose variants are not the manifest's
    (ValueError) made stats() raise after activate() had refused."""
    broken = copy_of_package(venv_python, tmp_path / "toml")
    (broken / PACKAGE / "manifest.toml").write_text("format = 1\n[build\n")
    res = last_json(run(venv_python, TAMPERED, tmp_path, env={"PYTHONPATH": str(broken)}))
    assert res["ok"] is False and res["hits"] == 0 and "could not activate" in res["warnings"][0]
    other = copy_of_package(venv_python, tmp_path / "variants")
    path = other / PACKAGE / "manifest.toml"
    data = tomllib.loads(path.read_text())
    data["variants"] = data["variants"][1:]  # a manifest of other variants than its shim's (consistently sealed)
    path.write_text(manifest_mod.seal(data))
    res = last_json(run(venv_python, TAMPERED, tmp_path, env={"PYTHONPATH": str(other)}))
    assert res["ok"] is False and res["hits"] == 0 and "variants are not the manifest's" in res["warnings"][0]


def test_selftest_under_forgepack_disable_says_it_is_disabled(venv_python, tmp_path):
    proc = run(venv_python, "", tmp_path, env={"FORGEPACK_DISABLE": "1"}, args=("-m", PACKAGE, "selftest"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "disabled" in proc.stdout and "FORGEPACK_DISABLE" in proc.stdout and "verified" not in proc.stdout


def test_a_rebuild_leaves_one_wheel_per_pack(built, tmp_path):
    """The README's `pip install packs/forgepack_pack_<name>-*.whl` failed with ResolutionImpossible
    once a second build had left two wheels there."""
    result, ws = built
    packs = tmp_path / "packs"
    packs.mkdir()
    older = packs / result.wheel.name.replace(f"{PACKAGE}-", f"{PACKAGE}-0.0.0.")
    shutil.copyfile(result.wheel, older)  # an earlier build's wheel of the same pack
    (packs / "forgepack_pack_other-0.1-py3-none-any.whl").write_bytes(b"another pack's wheel")
    recipe = recipe_mod.resolve("tiny-llama").replace(target={"device": "cpu"})
    again = build_pack(ws, recipe, margin=-0.99, gate=False, out_dir=packs)
    mine = sorted(packs.glob(f"{PACKAGE}-*.whl"))
    assert mine == [again.wheel] and (packs / "forgepack_pack_other-0.1-py3-none-any.whl").exists()
    proc = subprocess.run(f"{sys.executable} -m pip install --dry-run --no-index --no-deps -q {packs}/{PACKAGE}-*.whl",
                          shell=True, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


DISABLED = r"""
import json
import torch
import forgepack_pack_tiny_llama as pack
ok = pack.activate()
x = torch.randn(1, 32, 128)
print(json.dumps({"ok": ok, "active": pack.is_active(), "hits": sum(v["hits"] for v in pack.stats().values())}))
"""


def test_forgepack_disable_is_a_logged_no_op(venv_python, tmp_path):
    proc = run(venv_python, DISABLED, tmp_path, env={"FORGEPACK_DISABLE": "1"})
    assert last_json(proc) == {"ok": False, "active": False, "hits": 0}
    assert "FORGEPACK_DISABLE" in proc.stderr


def test_another_torch_version_warns_and_does_nothing(venv_python, tmp_path):
    alt = copy_of_package(venv_python, tmp_path)
    path = alt / PACKAGE / "manifest.toml"
    data = tomllib.loads(path.read_text())
    data["build"]["torch"] = "2.9.0"
    path.write_text(tomlwriter.dumps(data))
    res = last_json(run(venv_python, TAMPERED, tmp_path, env={"PYTHONPATH": str(alt)}))
    assert res["ok"] is False and res["loaded"] is False and res["hits"] == 0
    assert len(res["warnings"]) == 1 and "built for torch 2.9.0" in res["warnings"][0]


def test_selftest_reverifies_every_kernel_and_fails_loudly(venv_python, tmp_path):
    proc = run(venv_python, "", tmp_path, args=("-m", PACKAGE, "selftest"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "7 of 7 kernels verified" in proc.stdout
    assert len(re.findall(r"  ok\s*$", proc.stdout, flags=re.M)) == 7
    # the same pack with an exact tolerance for silu (whose kernel differs from stock in the last bits)
    alt = copy_of_package(venv_python, tmp_path)
    path = alt / PACKAGE / "manifest.toml"
    data = tomllib.loads(path.read_text())
    silu = next(v for v in data["variants"] if v["op"] == "aten.silu.default")
    silu["tolerance"] = [{"dtype": "float32", "rtol": 0.0, "atol": 0.0}]
    path.write_text(manifest_mod.seal(data))  # a rebuilt manifest, not a tampered one
    proc = run(venv_python, "", tmp_path, env={"PYTHONPATH": str(alt)}, args=("-m", PACKAGE, "selftest"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith(silu["id"]))
    assert "elements differ" in row and "6 of 7 kernels verified" in proc.stdout


# --- the CLI on the wheel -------------------------------------------------------------------------------------


def test_inspect_prints_the_manifest_as_tables(built):
    from typer.testing import CliRunner

    from forgepack.cli import app

    result, _ = built
    runner = CliRunner()
    shown = runner.invoke(app, ["inspect", str(result.wheel), "--files"], terminal_width=240)
    assert shown.exit_code == 0, shown.output
    for v in result.manifest.variants:
        assert v.id in shown.output
    assert "tiny-llama" in shown.output and "skipped" in shown.output and "kernels/" in shown.output
    as_json = runner.invoke(app, ["inspect", str(result.wheel), "--json"])
    assert manifest_mod.from_dict(json.loads(as_json.output)) == result.manifest


def test_inspect_rejects_what_is_not_a_pack_in_one_line(tmp_path, monkeypatch, capsys):
    from forgepack.cli import main

    not_a_wheel = tmp_path / "x.whl"
    not_a_wheel.write_bytes(b"\x00\x01garbage")
    zipped = tmp_path / "y.whl"
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("something/else.txt", "hello")
    for path, words in ((tmp_path / "missing.whl", "does not exist"), (not_a_wheel, "not a readable"),
                        (zipped, "not a kernel pack")):
        monkeypatch.setattr(sys, "argv", ["forgepack", "inspect", str(path)])
        with pytest.raises(SystemExit) as exit_info:
            main()
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, err
        assert "Traceback" not in err and words in err and len(err.strip().splitlines()) == 1


def _corrupt_member(wheel: Path, out: Path) -> Path:
    """The wheel with a byte of the manifest's compressed data flipped (its CRC no longer checks)."""
    blob = bytearray(wheel.read_bytes())
    with zipfile.ZipFile(wheel) as z:
        info = z.getinfo(f"{PACKAGE}/manifest.toml")
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    blob[start + info.compress_size // 2] ^= 0xFF
    out.write_bytes(bytes(blob))
    return out


def test_inspect_on_a_corrupt_truncated_random_or_empty_file_says_so_in_one_line(built, tmp_path, monkeypatch,
                                                                                capsys):
    """A corrupt member printed a 51-line traceback; truncated, random or empty files misleading lines."""
    from forgepack.cli import main

    result, _ = built
    data = result.wheel.read_bytes()
    truncated, random_bytes, empty = tmp_path / "t.whl", tmp_path / "r.whl", tmp_path / "e.whl"
    truncated.write_bytes(data[: len(data) // 2])
    random_bytes.write_bytes(os.urandom(4096))
    empty.write_bytes(b"")
    cases = ((_corrupt_member(result.wheel, tmp_path / "c.whl"), "corrupt wheel"),
             (truncated, "not a zip archive"), (random_bytes, "not a zip archive"), (empty, "empty file"))
    for path, words in cases:
        monkeypatch.setattr(sys, "argv", ["forgepack", "inspect", str(path)])
        with pytest.raises(SystemExit) as exit_info:
            main()
        err = capsys.readouterr().err
        assert exit_info.value.code != 0, err
        assert "Traceback" not in err and words in err and len(err.strip().splitlines()) == 1, (path.name, err)


def test_bench_times_eager_pack_and_compile_side_by_side(built, tmp_path):
    result, _ = built
    cmd = [sys.executable, "-m", "forgepack", "bench", "tiny-llama", "--target", "cpu", "--pack", str(result.wheel),
           "--json", "--rounds", "2", "--reps", "1", "--compile-backend", "eager"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert list(doc["columns"]) == ["eager", "pack", "compile"]
    for name, col in doc["columns"].items():
        assert col["ms"] > 0 and len(col["rounds_ms"]) == 2, name
    assert doc["columns"]["eager"]["speedup"] == 1.0
    assert "backend='eager'" in doc["columns"]["compile"]["note"]
    assert len(doc["pack_hits"]) == 7 and all(h > 0 for h in doc["pack_hits"].values())


def test_bench_gives_no_graph_number_where_the_manifest_turns_graph_mode_off(built, tmp_path):
    """`pack+graphs` is what activate(graphs=True) does: where the pack's manifest turns graph mode
    off (here: a cpu pack), that is eager, and the column says why instead of timing a graph anyway."""
    result, _ = built
    wheel = tmp_path / result.wheel.name  # the gate's verdict for a cpu build, written into a copy
    with zipfile.ZipFile(result.wheel) as src, zipfile.ZipFile(wheel, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("/manifest.toml"):
                m = manifest_mod.loads(data.decode())
                off = GraphVerdict(False, "cpu target: CUDA graphs need a GPU")
                data = manifest_mod.dumps(dataclasses.replace(m, graphs=off)).encode()
            dst.writestr(item, data)
    cmd = [sys.executable, "-m", "forgepack", "bench", "tiny-llama", "--target", "cpu", "--pack", str(wheel),
           "--json", "--rounds", "1", "--reps", "1", "--columns", "eager,pack+graphs"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    skipped = json.loads(proc.stdout)["columns"]["pack+graphs"]["skipped"]
    assert "manifest turns graph mode off" in skipped and "cpu target" in skipped, skipped


def test_bench_serve_serves_the_pack_s_generate_from_its_own_runtime(built, tmp_path):
    """`forgepack bench --serve --pack`: pack+graphs is the pack's activate(graphs=True, model=...), and
    the server it installs lives in the pack's copy of the runtime. The benchmark asked forgepack's own
    runtime for it, found none, and skipped the column as if the manifest had turned graph mode off."""
    result, _ = built
    cmd = [sys.executable, "-m", "forgepack", "bench", "tiny-llama", "--target", "cpu", "--serve", "--pack",
           str(result.wheel), "--json", "--requests", "2", "--batches", "1,2", "--prompt", "16,24", "--new", "3,4",
           "--rounds", "1", "--agree", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    cols = json.loads(proc.stdout)["columns"]
    assert list(cols) == ["eager", "pack", "pack+graphs", "pack+graphs (generate loop)"]
    assert cols["pack+graphs (generate loop)"]["tokens_per_s"] > 0  # the same pack's server, through generate()
    served = cols["pack+graphs"]
    assert "note" not in served and served["tokens_per_s"] > 0 and served["top1"] >= 0.9, served
    assert served["serving"]["graphs"]["replays"] > 0 and served["cold_process"]["served"], served
