"""What every benchmark records next to its numbers: date, GPU, commit, command; and where it writes.

Results go to `${OUT:-benchmarks/out}/<name>.json` and `<name>.md`; `tools/gpu_check.sh` bundles them.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch


def out_dir() -> Path:
    path = Path(os.environ.get("OUT", "benchmarks/out")) / "results"
    path.mkdir(parents=True, exist_ok=True)
    return path


def commit() -> str:
    if os.environ.get("FORGEPACK_COMMIT"):
        return os.environ["FORGEPACK_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()  # run from anywhere
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    import platform

    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def meta() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": device_name(),
        "commit": commit(),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def header_md(title: str, info: dict[str, Any]) -> str:
    return (f"# {title}\n\n- date: {info['date']}\n- GPU: {info['gpu']}\n- commit: {info['commit']}\n"
            f"- torch: {info['torch']} (CUDA {info['cuda']})\n- command: `{info['command']}`\n\n")


def write(name: str, data: dict[str, Any], markdown: str, quiet: bool = False, indent: int | None = 1) -> Path:
    """`<out>/results/<name>.json` and `.md`; the markdown printed too unless `quiet`. `indent=None`
    writes the JSON on one line (a results file of many rounds, read by programs more than people)."""
    folder = out_dir()
    (folder / f"{name}.json").write_text(json.dumps(data, indent=indent, default=str) + "\n")
    (folder / f"{name}.md").write_text(markdown)
    if not quiet:
        print(markdown)
    return folder
