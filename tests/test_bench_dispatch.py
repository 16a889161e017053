"""tools/bench_dispatch.py's CPU smoke run: real shims (one variant, a family, a sub-range, nine narrowed
variants) compiled and timed in C++ loops; the guards serve, miss and count as the benchmark says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench_dispatch.py"


@pytest.mark.slow
def test_cpu_smoke_run_times_every_case_and_checks_the_guards(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(TOOL), "--device", "cpu", "--calls", "50", "--rounds", "2"], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "results" / "dispatch_overhead.json").read_text())
    assert result["family_guard"].startswith("ok") and result["subrange_guard"].startswith("ok")
    assert {"backend_many_outside", "many_outside", "backend_subrange_outside"} <= set(result["us_per_call"])
    assert all(v > 0 for v in result["us_per_call"].values())
    assert "nine narrowed variants" in (tmp_path / "results" / "dispatch_overhead.md").read_text()
