"""tools/gpu_check.sh's bundle: the device returns a few files, so every result travels in results.tar.gz."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "gpu_check.sh"


def _run(out: Path) -> subprocess.CompletedProcess:
    # an unknown stage runs nothing: the script's own setup and bundling only (no GPU needed)
    env = {**os.environ, "OUT": str(out)}
    return subprocess.run(["bash", str(SCRIPT), "no-such-stage"], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_a_second_run_in_the_same_call_keeps_the_first_runs_results(tmp_path):
    out = tmp_path / "out"
    first = out / "lane0" / "results"
    first.mkdir(parents=True)
    (first / "trace-from-the-first-run.md").write_text("served: 51%\n")
    with tarfile.open(out / "results.tar.gz", "w:gz") as tar:  # as the first run left it
        tar.add(out / "lane0", arcname="lane0")
    shutil.rmtree(out / "lane0")
    proc = _run(out)
    assert "unknown stage no-such-stage" in proc.stdout
    with tarfile.open(out / "results.tar.gz") as tar:
        names = tar.getnames()
    assert "lane0/results/trace-from-the-first-run.md" in names
    assert not (out / "lane0").exists()  # bundled, not left loose (the device returns at most 8 files)


def _run_tests_stage(out: Path, test_file: Path, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "GPU_TESTS": str(test_file), "TESTS_TIME": "100", **env}
    return subprocess.run(["bash", str(SCRIPT), "tests"], env=env, capture_output=True, text=True,
                          timeout=180, check=False)


GPU_MODULE = '''
import pytest
{head}

@pytest.mark.gpu
def test_on_the_device():
    assert 1 + 1 == 2
'''


def test_a_gpu_module_skipped_for_a_missing_package_fails_the_check_and_says_why(tmp_path):
    module = tmp_path / "tests" / "test_needs_pkg.py"
    module.parent.mkdir()
    module.write_text(GPU_MODULE.format(head='pytest.importorskip("no_such_optional_package")'))
    proc = _run_tests_stage(tmp_path / "out", module)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "GPU tests skipped that were expected to run" in summary
    assert "no_such_optional_package" in summary  # the skip reason, printed by -rs
    assert "FAILED: GPU tests were skipped" in proc.stdout


def test_gpu_tests_that_all_run_pass_the_check(tmp_path):
    module = tmp_path / "tests" / "test_runs.py"
    module.parent.mkdir()
    module.write_text(GPU_MODULE.format(head=""))
    proc = _run_tests_stage(tmp_path / "out", module)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tests-test_runs: rc=0" in summary and "skipped that were expected" not in summary
    # ALLOW_SKIPS=1 lists the skip but does not fail the check
    skipped = tmp_path / "tests" / "test_needs_pkg.py"
    skipped.write_text(GPU_MODULE.format(head='pytest.importorskip("no_such_optional_package")'))
    allowed = _run_tests_stage(tmp_path / "out2", skipped, ALLOW_SKIPS="1")
    assert allowed.returncode == 0 and "no_such_optional_package" in (tmp_path / "out2" / "summary.txt").read_text()
