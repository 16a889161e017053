"""Compile a kernel source into a self-contained shared object, with fixed flags, cached.

One kernel = one source file that includes only `forgepack_abi.h` (+ the CUDA runtime headers for
`cuda`) and exports `forgepack_kernel`. It is built in two steps, compile (`-c`) then link, because
`forgepack.staticcheck` inspects the object file before linking: the symbols a kernel defines and
imports cannot be hidden from it by preprocessor tricks, and with static cudart the linked `.so` no
longer shows which CUDA calls the kernel itself makes.

Fixed flags per target (see `compiler_flags`):
- cuda: ``nvcc -O3 -arch=sm_XX -std=c++17 -Xcompiler -fPIC,-fvisibility=hidden``, linked with static
  cudart so the object is self-contained (the exact object that was verified and timed ships);
  `sm_XX` is the local GPU's (nvidia-smi) or sm_90 when there is none; sm_90 builds as sm_90a (wgmma).
- cpu: ``g++ -O3 -std=c++17 -fPIC -fvisibility=hidden`` plus `-ftrivial-auto-var-init=pattern`
  where the compiler has it (uninitialised stack memory cannot carry results from one call to the
  next). Portable: no `-march=native`, no `-ffast-math`.
- both link with ``-z defs``: every symbol must resolve at link time against the C/C++ runtime (and
  cudart), so a kernel cannot bind to PyTorch, Python or a vendor library loaded in the process.

Cache: ``$FORGEPACK_CACHE/kernels/<key>/`` (default ``~/.cache/forgepack/kernels``) holding
``kernel.so``, ``kernel.o``, the source and ``meta.json``; `key` = sha256 of source, flags, compiler
versions and the ABI header. Failures are cached too (the log is what a proposer needs). Entries are
written to a temporary directory and renamed into place, so concurrent compiles of the same source
(a process pool) are safe.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from forgepack.errors import ForgepackError

TARGETS = ("cuda", "cpu")
ABI_DIR = Path(__file__).resolve().parent / "abi"
ABI_HEADER = ABI_DIR / "forgepack_abi.h"
ENTRY = "forgepack_kernel"
DEFAULT_ARCH = "sm_90"
SOURCE_NAMES = {"cuda": "kernel.cu", "cpu": "kernel.cpp"}
MAX_LOG_CHARS = 20_000


@dataclass(frozen=True)
class CompileResult:
    """Outcome of `compile_kernel`.

    ok: the shared object was built and exports `forgepack_kernel`.
    binary: absolute path of the cached `kernel.so` (None when not ok); its `kernel.o` sits next to it.
    log: compiler output (errors and warnings), trimmed; on failure it is what a proposer is shown.
    seconds: wall time spent in this call (about 0 on a cache hit).
    cached: the result came from the cache.
    key: the cache key (sha256 hex of source, flags, compiler versions, ABI header).
    """

    ok: bool
    binary: str | None
    log: str
    seconds: float
    cached: bool
    key: str


def cache_root() -> Path:
    base = os.environ.get("FORGEPACK_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "forgepack") / "kernels"


def nvcc_path() -> str | None:
    if os.environ.get("NVCC"):
        return os.environ["NVCC"]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None


def cxx_path() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _compiler(target: str) -> str:
    path = nvcc_path() if target == "cuda" else cxx_path()
    if not path:
        what = "nvcc (set NVCC or CUDA_HOME)" if target == "cuda" else "a C++ compiler (g++; or set CXX)"
        raise ForgepackError(f"cannot compile {target} kernels: {what} not found")
    return path


@functools.cache
def compiler_version(target: str) -> str:
    """Version text of the compiler(s) a target uses; part of the cache key."""
    tools = [_compiler(target)]
    if target == "cuda":
        tools.append(os.environ.get("NVCC_CCBIN") or cxx_path() or "g++")  # nvcc's host compiler
    parts = []
    for tool in tools:
        try:
            out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60, check=False)
            parts.append(out.stdout.strip())
        except (OSError, subprocess.TimeoutExpired) as err:
            parts.append(f"{tool}: {err}")
    return "\n".join(parts)


@functools.cache
def default_arch() -> str:
    """The local GPU's arch (`sm_90` on an H200), from nvidia-smi so CUDA is not initialised here."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        )
        first = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
        major, minor = first.split(".")
        return f"sm_{int(major)}{int(minor)}"
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return DEFAULT_ARCH


@functools.cache
def _cxx_supports(flag: str) -> bool:
    """Whether the C++ compiler accepts `flag` (probed once on an empty file)."""
    cxx = cxx_path()
    if not cxx:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text("int probe(void) { int x; return 0; }\n")
        out = subprocess.run([cxx, flag, "-Werror", "-c", str(src), "-o", str(Path(tmp) / "probe.o")],
                             capture_output=True, timeout=60, check=False)
        return out.returncode == 0


def nvcc_arch(arch: str | None) -> str:
    """The `-arch` value for `arch`: Hopper builds for sm_90a, whose code runs only on sm_90 parts but
    may use the warpgroup MMA (wgmma) the GEMM template needs. A pack is built for its GPU anyway."""
    arch = arch or default_arch()
    return f"{arch}a" if arch == "sm_90" else arch


def _compile_flags(target: str, arch: str | None) -> list[str]:
    if target == "cuda":
        return ["-O3", f"-arch={nvcc_arch(arch)}", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden",
                f"-I{ABI_DIR}"]
    flags = ["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden"]
    if _cxx_supports("-ftrivial-auto-var-init=pattern"):
        flags.append("-ftrivial-auto-var-init=pattern")
    return [*flags, f"-I{ABI_DIR}"]


def _link_flags(target: str, arch: str | None) -> list[str]:
    if target == "cuda":
        return [f"-arch={nvcc_arch(arch)}", "-shared", "-cudart", "static", "-Xlinker", "-z,defs"]
    return ["-shared", "-Wl,-z,defs"]


def compiler_flags(target: str, arch: str | None) -> list[str]:
    """The fixed flags for `target`: the compile step's, then the link step's (all part of the key)."""
    _check_target(target)
    return [*_compile_flags(target, arch), *_link_flags(target, arch)]


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise ForgepackError(f"unknown target {target!r}: expected one of {', '.join(TARGETS)}")


def cache_key(source: str, target: str, arch: str | None) -> str:
    h = hashlib.sha256()
    for part in (target, source, "\0".join(compiler_flags(target, arch)), compiler_version(target)):
        h.update(part.encode())
        h.update(b"\0")
    h.update(ABI_HEADER.read_bytes())
    return h.hexdigest()


def compile_kernel(source: str, target: str, arch: str | None = None, timeout: float = 120.0) -> CompileResult:
    """Compile `source` for `target` ("cuda" or "cpu") into a cached shared object.

    `arch` (cuda only) defaults to the local GPU's, or sm_90 without one. A compiler error, a
    timeout or a missing `forgepack_kernel` export gives `ok=False` with the log; a missing
    compiler raises `ForgepackError` (an environment problem, not the candidate's).
    """
    _check_target(target)
    start = time.perf_counter()
    key = cache_key(source, target, arch)
    entry = cache_root() / key
    hit = _read_entry(entry)
    if hit is not None:
        return CompileResult(hit["ok"], hit["binary"], hit["log"], time.perf_counter() - start, True, key)
    ok, log = _build(source, target, arch, entry, timeout)
    hit = _read_entry(entry)  # another process may have won the race; its entry is as good as ours
    if ok and hit is None:
        ok, log = False, f"{log}\ncould not store the object in the cache at {entry}"
    binary = hit["binary"] if ok and hit else None
    return CompileResult(ok, binary, log, time.perf_counter() - start, False, key)


def _read_entry(entry: Path) -> dict | None:
    meta = entry / "meta.json"
    if not meta.exists():
        return None
    data = json.loads(meta.read_text())
    binary = entry / "kernel.so"
    if data["ok"] and not binary.exists():
        return None
    return {"ok": data["ok"], "log": data["log"], "binary": str(binary) if data["ok"] else None}


def _build(source: str, target: str, arch: str | None, entry: Path, timeout: float) -> tuple[bool, str]:
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{entry.name[:16]}.", dir=entry.parent))
    try:
        src = tmp / SOURCE_NAMES[target]
        src.write_text(source)
        compiler = _compiler(target)
        steps = [
            [compiler, *_compile_flags(target, arch), "-c", str(src), "-o", str(tmp / "kernel.o")],
            [compiler, *_link_flags(target, arch), str(tmp / "kernel.o"), "-o", str(tmp / "kernel.so")],
        ]
        ok, log = _run_steps(steps, timeout, cwd=tmp)
        if ok and not _exports_entry(tmp / "kernel.so"):
            missing = f"the object does not export `{ENTRY}`: define it with FP_EXPORT (see docs/kernel-abi.md)"
            ok, log = False, f"{log}\n{missing}"
        log = _trim(log.replace(str(tmp) + "/", ""))
        (tmp / "meta.json").write_text(json.dumps({"ok": ok, "log": log, "target": target, "arch": arch}) + "\n")
        _publish(tmp, entry)
        return ok, log
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, entry: Path) -> None:
    """Rename the finished build into place; keep an identical entry that won the race."""
    try:
        tmp.rename(entry)
    except OSError:
        if _read_entry(entry) is None:  # a broken leftover, not a winner: replace it
            shutil.rmtree(entry, ignore_errors=True)
            with contextlib.suppress(OSError):
                tmp.rename(entry)


def _run_steps(steps: list[list[str]], timeout: float, cwd: Path) -> tuple[bool, str]:
    deadline = time.monotonic() + timeout
    logs = []
    for cmd in steps:
        left = deadline - time.monotonic()
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=max(left, 1.0), cwd=cwd, check=False)
        except subprocess.TimeoutExpired:
            return False, "\n".join([*logs, f"compiler timed out after {timeout:.0f} s"])
        logs.append((out.stdout + out.stderr).strip())
        if out.returncode != 0:
            return False, "\n".join(log for log in logs if log)
    return True, "\n".join(log for log in logs if log)


def _exports_entry(binary: Path) -> bool:
    out = subprocess.run(["nm", "-D", "--defined-only", str(binary)], capture_output=True, text=True, check=False)
    return any(line.split()[-1] == ENTRY for line in out.stdout.splitlines() if line.strip())


def _trim(log: str) -> str:
    if len(log) <= MAX_LOG_CHARS:
        return log
    half = MAX_LOG_CHARS // 2
    return f"{log[:half]}\n... [{len(log) - MAX_LOG_CHARS} characters cut] ...\n{log[-half:]}"
