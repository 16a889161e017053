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
