"""Registers, spills, stack and shared memory per CUDA kernel, as the compiler reports them.

An LLM refining a CUDA kernel needs what a person would look at next to the timing: how many registers
each ``__global__`` function uses (occupancy) and whether it spills to local memory. `forgepack.compile`
builds the shared object with fixed flags and keeps no ptxas report, so the same source is compiled once
more to a cubin with ``-Xptxas -v`` (the same arch and include path; well under a second for a kernel of
this size) and its report parsed:

    ptxas info    : Compiling entry function '_Z4reluPKfPfl' for 'sm_90a'
    ptxas info    : Function properties for _Z4reluPKfPfl
        0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info    : Used 10 registers, used 0 barriers, 4096 bytes smem, 368 bytes cmem[0]

Names are demangled with ``c++filt`` where it is installed. Nothing here raises: a source that does not
compile, or a host without nvcc, has no report (its compile log is the feedback).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


@dataclass(frozen=True)
class KernelUsage:
    name: str
    registers: int = 0
    spill_stores: int = 0  # bytes
    spill_loads: int = 0  # bytes
    stack: int = 0  # bytes of stack frame per thread
    smem: int = 0  # bytes of static shared memory

    def text(self) -> str:
        extra = f", {self.smem} B smem" if self.smem else ""
        return (f"{self.name}: {self.registers} registers, {self.spill_stores} B spill stores, "
                f"{self.spill_loads} B spill loads, {self.stack} B stack{extra}")


def parse_ptxas(log: str) -> list[KernelUsage]:
    """Per entry function, in the report's order.

    >>> parse_ptxas("ptxas info    : Compiling entry function '_Z1kPf' for 'sm_90a'\\n"
    ...             "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\\n"
    ...             "ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem")[0].text()
    '_Z1kPf: 255 registers, 4 B spill stores, 4 B spill loads, 8 B stack, 1024 B smem'
    """
    out: list[dict] = []
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            out.append({"name": m.group(1)})
        elif out and (m := _FRAME.search(line)):
            out[-1].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif out and (m := _USED.search(line)):
            out[-1]["registers"] = int(m.group(1))
            if s := _SMEM.search(line):
                out[-1]["smem"] = int(s.group(1))
    return [KernelUsage(**k) for k in out]


def demangled(kernels: list[KernelUsage]) -> list[KernelUsage]:
    tool = shutil.which("c++filt")
    if not tool or not kernels:
        return kernels
    try:
        done = subprocess.run([tool], input="\n".join(k.name for k in kernels), capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return kernels
    names = done.stdout.splitlines()
    if done.returncode != 0 or len(names) != len(kernels):
        return kernels
    return [KernelUsage(**{**asdict(k), "name": n.strip()}) for k, n in zip(kernels, names, strict=True)]


@functools.lru_cache(maxsize=512)
def usage(source: str, arch: str | None = None, timeout: float = 120.0) -> tuple[KernelUsage, ...]:
    """The ptxas report of `source` compiled for `arch` as the build compiles it (empty where there is none)."""
    from forgepack import compile as compile_mod

    nvcc = compile_mod.nvcc_path()
    if not nvcc:
        return ()
    with tempfile.TemporaryDirectory(prefix="forgepack-ptxas-") as tmp:
        src = Path(tmp) / "kernel.cu"
        src.write_text(source)
        cmd = [nvcc, "-cubin", "-O3", f"-arch={compile_mod.nvcc_arch(arch)}", "-std=c++17",
               f"-I{compile_mod.ABI_DIR}", "-Xptxas", "-v", "-o", str(Path(tmp) / "kernel.cubin"), str(src)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return ()
    if done.returncode != 0:
        return ()
    return tuple(demangled(parse_ptxas(done.stdout + done.stderr)))


def summary(kernels: tuple[KernelUsage, ...] | list[KernelUsage] | list[dict]) -> str | None:
    """One line for a prompt: each kernel's registers and spills (None: no report)."""
    items = [k if isinstance(k, KernelUsage) else KernelUsage(**k) for k in kernels]
    if not items:
        return None
    return "ptxas: " + "; ".join(k.text() for k in items)
