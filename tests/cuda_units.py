"""Several template-rendered CUDA kernels compiled in one nvcc run (`templates.common.batch_unit`), as the
sm_90 tests do: warnings are errors, the flags are those a shipped kernel is compiled with."""

from __future__ import annotations

import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from forgepack.compile import _compile_flags
from forgepack.templates.common import batch_unit


def compile_unit(sources: list[str], arch: str = "sm_90") -> tuple[int, str]:
    """nvcc's exit status and the tail of its log for `sources` in one translation unit."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "batch.cu"
        path.write_text(batch_unit(sources, "cuda"))
        cmd = ["nvcc", *_compile_flags("cuda", arch), "-Werror", "all-warnings", "-c", str(path),
               "-o", str(Path(tmp) / "batch.o")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        return out.returncode, out.stderr[-4000:]


def compile_units(units: list[list[str]], arch: str = "sm_90", workers: int = 2) -> list[tuple[int, str]]:
    """`compile_unit` of each unit, `workers` nvcc runs at a time (threads: nvcc is a subprocess)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda unit: compile_unit(unit, arch), units))
