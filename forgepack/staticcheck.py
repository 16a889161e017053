"""Static checks on a candidate kernel: its source before compiling, its object file after.

A kernel must be a pure function of its inputs, launched on the caller's stream (docs/kernel-abi.md).
Two layers enforce what running it cannot show:

- **Source rules** (comments and string literals removed first): an include whitelist (never PyTorch
  or Python headers), no stream/event/thread creation, no device or stream synchronisation, no memory
  allocation, no timers, no run-time symbol lookup, no process/environment/file access, no changes to
  the floating-point environment or the fixed compiler flags, no load-time constructors, no
  `__device__`/`__managed__` global variables and no mutable `static`/`thread_local` state. They give
  readable messages with a line number.
- **Object rules** (the `kernel.o` that `forgepack.compile` keeps next to `kernel.so`): the symbols a
  kernel really defines and imports, which macros and token pasting cannot hide. Writable data or TLS
  defined by the kernel (static state, host shadows of `__device__`/`__managed__` variables), imported
  functions on a deny list (allocation, threads, sync, timers, dlopen, PyTorch, Python, the CUDA
  driver API, every CUDA runtime call outside a small allow list), definitions of CUDA/libc names,
  and extra load-time initialisers.

Each violation is a `Finding`; an empty list means the kernel passed.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Finding:
    rule: str  # short rule name, e.g. "include", "allocation", "state"
    message: str  # one line, says what was found and why it is not allowed
    where: str = ""  # "line 12" or "object kernel.o"

    def __str__(self) -> str:
        return f"{self.message} ({self.where})" if self.where else self.message


# --- includes ------------------------------------------------------------------------------------

_C_HEADERS = {
    "stdint.h", "cstdint", "stddef.h", "cstddef", "stdbool.h", "math.h", "cmath", "float.h", "cfloat",
    "limits.h", "climits", "limits", "string.h", "cstring", "algorithm", "type_traits", "utility",
    "array", "initializer_list", "tuple", "complex", "cassert", "assert.h", "cstdio", "stdio.h",
    "numeric", "bit", "cinttypes", "inttypes.h", "cstdlib", "stdlib.h",
    "forgepack_abi.h",
}
_CPU_HEADERS = {
    "immintrin.h", "xmmintrin.h", "emmintrin.h", "pmmintrin.h", "tmmintrin.h", "smmintrin.h",
    "nmmintrin.h", "arm_neon.h",
}
_CUDA_HEADERS = {
    "cuda_runtime.h", "cuda_runtime_api.h", "cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h",
    "device_launch_parameters.h", "vector_types.h", "math_constants.h", "mma.h", "cuda_pipeline.h",
    "cuda_pipeline_primitives.h", "cooperative_groups.h", "cuda/pipeline", "cuda/barrier",
}
_CUDA_HEADER_PREFIXES = ("cooperative_groups/", "cuda/std/", "cub/")
_TORCH_HEADER = re.compile(r"^(torch|ATen|c10|caffe2|pybind11)/|^Python\.h$|^(torch|ATen)\.h$")


def allowed_headers(target: str) -> list[str]:
    extra = _CUDA_HEADERS if target == "cuda" else _CPU_HEADERS
    prefixes = [f"{p}*" for p in _CUDA_HEADER_PREFIXES] if target == "cuda" else []
    return sorted(_C_HEADERS | extra) + prefixes


def _header_allowed(name: str, target: str) -> bool:
    if name in _C_HEADERS:
        return True
    if target == "cuda":
        return name in _CUDA_HEADERS or name.startswith(_CUDA_HEADER_PREFIXES)
    return name in _CPU_HEADERS


# --- source rules --------------------------------------------------------------------------------

# (rule, pattern over code with comments and strings blanked, message); `{0}` is the matched text.
_ALLOC = (r"\b(?:malloc|calloc|realloc|free|aligned_alloc|posix_memalign|memalign|valloc|pvalloc|mmap|munmap|sbrk"
          r"|alloca|__builtin_alloca)\s*\(")
_SOURCE_RULES: list[tuple[str, str, str]] = [
    ("pytorch", r"\b(?:at|c10|torch|caffe2|pybind11)::", "uses PyTorch ({0}): kernels must not call PyTorch"),
    ("python", r"\b_?Py[A-Z]\w*\s*\(", "calls the Python C API ({0})"),
    ("stream", r"\bcuda(?:Stream|Event)(?:Create|Destroy)\w*|\bcudaGraph\w+|\bcudaStream(?:Begin|End)Capture\w*",
     "creates or manages streams, events or graphs ({0}): launch on call->stream only"),
    ("thread", r"\bstd::(?:j?thread|async)\b|\bpthread_\w+|\b(?:fork|vfork|clone)\s*\(|\bomp_\w+|#\s*pragma\s+omp\b",
     "creates threads ({0}): cpu kernels are single-threaded, cuda kernels use the GPU's"),
    ("sync", r"\bcuda(?:Device|Stream|Event|Thread)Synchronize\b|\bcuda(?:Stream|Event)Query\b|\bcudaStreamWaitEvent\b"
     r"|\bcudaLaunchHostFunc\b|\bcudaStreamAddCallback\b|\bcudaStreamIsCapturing\b|\bcudaStreamGetCaptureInfo\w*",
     "synchronises or inspects streams ({0}): return without waiting, the caller orders the work"),
    ("allocation", _ALLOC + r"|\bcuda(?:Malloc|Free|HostAlloc|HostRegister|HostUnregister)\w*|\bcudaMemPool\w*"
     r"|\bnew\b|\bdelete\b",
     "allocates memory ({0}): the caller allocates every output; use registers, shared memory or the stack"),
    ("symbol-copy", r"\bcudaMemcpy(?:To|From)Symbol\w*|\bcudaGetSymbol\w+|\bcudaMemcpy\b(?!\w)|\bcudaMemset\b(?!\w)"
     r"|\bcudaMemcpy(?:2D|3D|Peer)\b(?!\w)",
     "uses a synchronous or symbol copy ({0}): only cudaMemcpyAsync/cudaMemsetAsync on call->stream"),
    ("driver-api", r"\bcu[A-Z][A-Za-z]+\w*\s*\(|\b(?:nvrtc|cublas|cudnn|nccl|cufft|curand|cusparse|cusolver)\w*",
     "uses the CUDA driver API or a vendor library ({0}): the CUDA runtime launch path only"),
    ("timer", r"\b(?:clock_gettime|gettimeofday|clock|time|timespec_get|clock64|__globaltimer|rdtsc|rdtscp|__rdtsc"
     r"|__rdtscp|__builtin_ia32_rdtscp?|__builtin_readcyclecounter|cudaEventElapsedTime)\s*\("
     r"|\bstd::chrono\b|\b(?:steady|system|high_resolution)_clock\b",
     "reads a timer ({0}): a kernel's result must not depend on time"),
    ("dlopen", r"\b(?:dlopen|dlsym|dlvsym|dlmopen|dlclose|dladdr|dlinfo|dl_iterate_phdr)\b|\bRTLD_\w+|\b__libc_\w+"
     r"|\bsyscall\s*\(",
     "looks up or loads code at run time ({0})"),
    ("process", r"\b(?:system|popen|execl|execlp|execle|execv|execvp|execvpe|getenv|secure_getenv|setenv|putenv"
     r"|unsetenv"
     r"|fopen|freopen|open|openat|creat|socket|signal|sigaction|raise|kill|exit|_exit|_Exit|quick_exit|atexit"
     r"|at_quick_exit|setjmp|longjmp|sigsetjmp|siglongjmp|mprotect|shm_open|shmget|shmat|ftok|sleep|usleep"
     r"|nanosleep|sched_yield|rand|srand|random|srandom|rand_r|drand48|lrand48|mrand48|srand48)\s*\("
     r"|\bstd::random_device\b",
     "touches the process, environment, files or hidden library state ({0})"),
    ("fpenv", r"\b(?:fesetround|fesetenv|feupdateenv|feholdexcept|feclearexcept|fesetexceptflag|feenableexcept"
     r"|fedisableexcept|_mm_setcsr|__builtin_ia32_ldmxcsr|_MM_SET_\w+|_controlfp\w*)\b|#\s*pragma\s+STDC\s+FENV",
     "changes the floating-point environment of the whole process ({0})"),
    ("flags", r"#\s*pragma\s+(?:GCC|clang)\s+(?:optimize|target|push_options)"
     r"|\b__attribute__\s*\(\(\s*(?:__)?(?:optimize|target)"
     r"|\[\[\s*gnu::(?:optimize|target)",
     "changes the fixed compiler flags ({0}): -O3 and a portable target are fixed per target"),
    ("constructor",
     r"\b__attribute__\s*\(\(\s*(?:__)?(?:constructor|destructor)|\[\[\s*gnu::(?:constructor|destructor)",
     "runs code when the object is loaded or unloaded ({0})"),
    ("state", r"\bthread_local\b|\b__thread\b|\b__managed__\b",
     "keeps state between calls ({0}): kernels are pure functions of their inputs"),
]
_COMPILED_RULES = [(rule, re.compile(pat), msg) for rule, pat, msg in _SOURCE_RULES]
_ASM = re.compile(r"\b(?:asm|__asm__|__asm)\b")
_ASM_FORBIDDEN = re.compile(r"%clock|%globaltimer|%smid|\brdtscp?\b|\bsyscall\b|\bsysenter\b|\bcpuid\b|\bldmxcsr\b"
                            r"|\bint\s+\$?0x80\b|\brdrand\b|\brdseed\b")
_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*(.*)$", re.M)
_CUDA_DEFINITION = re.compile(r"\b((?:cuda|__cuda)[A-Za-z_]\w*|cu[A-Z]\w*)\s*\([^;{)]*\)\s*(?:const\s*)?\{")


def check_source(source: str, target: str) -> list[Finding]:
    """Source-level findings for a `target` ("cuda" | "cpu") kernel; [] when it passes."""
    stripped = strip_comments(source)
    code = blank_strings(stripped)
    code = re.sub(r"=\s*delete\b", lambda m: " " * len(m.group(0)), code)  # deleted functions allocate nothing
    findings = _check_includes(stripped, target)
    for rule, pattern, message in _COMPILED_RULES:
        for m in pattern.finditer(code):
            findings.append(Finding(rule, message.format(m.group(0).strip()), _line(code, m.start())))
            break  # one finding per rule is enough to act on
    findings += _check_asm(stripped, code, target)
    findings += _check_globals(code, target)
    for m in _CUDA_DEFINITION.finditer(code):
        findings.append(Finding("defines-cuda", f"defines {m.group(1)}, a CUDA API name: kernels must not "
                                                "replace CUDA runtime or driver functions", _line(code, m.start())))
        break
    if not re.search(r"\bforgepack_kernel\b", code):
        findings.append(Finding("entry", "no forgepack_kernel entry point: export "
                                         "`FP_EXPORT int32_t forgepack_kernel(const fp_call* call)`"))
    return findings


def _check_includes(stripped: str, target: str) -> list[Finding]:
    findings = []
    for m in _INCLUDE.finditer(stripped):
        spec = m.group(1).strip()
        name = spec[1:-1].strip() if len(spec) >= 2 and spec[0] in "<\"" and spec[-1] in ">\"" else None
        where = _line(stripped, m.start())
        if name is None:
            findings.append(Finding("include", f"computed include {spec!r} is not allowed", where))
        elif _TORCH_HEADER.search(name):
            message = f"includes <{name}>: kernels must not use PyTorch or Python headers"
            findings.append(Finding("pytorch", message, where))
        elif not _header_allowed(name, target):
            findings.append(Finding("include", f"include <{name}> is not allowed for {target} kernels "
                                               f"(see docs/kernel-abi.md for the list)", where))
    return findings


def _check_asm(stripped: str, code: str, target: str) -> list[Finding]:
    m = _ASM.search(code)
    if not m:
        return []
    if target == "cpu":
        return [Finding("asm", "inline assembly is not allowed in cpu kernels", _line(code, m.start()))]
    # cuda: inline PTX is fine, but not timers, SM ids or host instructions hidden in asm strings
    for s in re.finditer(r'"(?:[^"\\\n]|\\.)*"', stripped):
        bad = _ASM_FORBIDDEN.search(s.group(0))
        if bad:
            return [Finding("asm", f"inline assembly reads {bad.group(0)}: results must not depend on time, "
                                   "placement or the host", _line(stripped, s.start()))]
    return []


_DECL_END = re.compile(r"[;{(=]")


def _check_globals(code: str, target: str) -> list[Finding]:
    """`__device__` variables and mutable `static` variables (the object check is the authority)."""
    findings = []
    for m in re.finditer(r"\b__device__\b", code):
        head = _declaration_head(code, m.end())
        if head is None or re.search(r"\b__(?:constant|shared)__\b", head):
            continue
        if not (re.search(r"\bconst(?:expr)?\b", head) and "*" not in head):
            findings.append(Finding("state", "declares a __device__ global variable: device memory that outlives "
                                             "the call is state between calls", _line(code, m.start())))
            break
    for m in re.finditer(r"\bstatic\b(?!_)", code):
        head = _declaration_head(code, m.end())
        if head is None or re.search(r"\b(?:const|constexpr|__constant__|__shared__)\b", head):
            continue
        if re.search(r"\b(?:struct|class|union|enum|inline|__device__|__global__|__host__)\b", head):
            continue  # a static function or a type, judged by the object check otherwise
        findings.append(Finding("state", f"mutable static variable (static{head.rstrip()}): "
                                         "kernels keep no state between calls", _line(code, m.start())))
        break
    return findings


def _declaration_head(code: str, start: int) -> str | None:
    """Text from `start` to the end of a variable declaration's declarator, or None for a function."""
    m = _DECL_END.search(code, start)
    if not m or m.group(0) in "({":
        return None
    return code[start : m.start()]


def _line(text: str, pos: int) -> str:
    return f"line {text.count(chr(10), 0, pos) + 1}"


def strip_comments(source: str) -> str:
    """Source with // and /* */ comments blanked (newlines kept, so line numbers still match)."""
    out, i, n = [], 0, len(source)
    while i < n:
        c = source[i]
        if c == '"' or c == "'":
            j = _end_of_literal(source, i)
            out.append(source[i:j])
            i = j
        elif source.startswith("//", i):
            j = source.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif source.startswith("/*", i):
            j = source.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in source[i:j]))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def blank_strings(stripped: str) -> str:
    """Comment-free source with string and character literals emptied (`""`), lines kept."""
    out, i, n = [], 0, len(stripped)
    while i < n:
        c = stripped[i]
        if c == '"' or c == "'":
            j = _end_of_literal(stripped, i)
            out.append(c + "".join(ch if ch == "\n" else " " for ch in stripped[i + 1 : j - 1]) + c)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _end_of_literal(text: str, i: int) -> int:
    quote, j = text[i], i + 1
    if quote == "'" and i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_"):
        return i + 1  # a digit separator (1'000) or suffix, not a character literal
    while j < len(text) and text[j] != quote and text[j] != "\n":
        j += 2 if text[j] == "\\" else 1
    return min(j + 1, len(text))


# --- object rules --------------------------------------------------------------------------------

# Internal symbols nvcc and the C++ ABI generate in every object: not the kernel's state.
_INTERNAL = re.compile(r"__cudaFatCubinHandle|__fatDeviceText|__device_stub__|__nv_|__cudaPrelinkedFatbin"
                       r"|^DW\.ref\.|__cuda_|^_ZGVZ\d+__device_stub__")
# Every CUDA runtime function a kernel may import; any other `cuda*` import is refused.
_CUDA_ALLOWED = {
    "cudaGetLastError", "cudaPeekAtLastError", "cudaGetErrorString", "cudaGetErrorName",
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel", "cudaFuncSetAttribute",
    "cudaFuncGetAttributes", "cudaFuncSetCacheConfig", "cudaFuncSetSharedMemConfig", "cudaGetDevice",
    "cudaDeviceGetAttribute", "cudaGetDeviceProperties", "cudaGetDeviceProperties_v2", "cudaMemcpyAsync",
    "cudaMemcpy2DAsync", "cudaMemsetAsync", "cudaMemset2DAsync", "cudaOccupancyMaxActiveBlocksPerMultiprocessor",
    "cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags", "cudaOccupancyMaxPotentialBlockSize",
    "cudaOccupancyAvailableDynamicSMemPerBlock", "cudaLaunchKernel_ptsz", "cudaMemcpyAsync_ptsz",
    "cudaMemsetAsync_ptsz", "cudaDriverGetVersion", "cudaRuntimeGetVersion", "cudaGetKernel",
}
_DENIED_IMPORTS: list[tuple[str, re.Pattern, str]] = [
    ("allocation", re.compile(r"^(?:malloc|calloc|realloc|free|aligned_alloc|posix_memalign|memalign|valloc|pvalloc"
                              r"|mmap"
                              r"|mmap64|munmap|sbrk|brk|_Znw\w*|_Zna\w*)$"), "allocates memory"),
    ("thread", re.compile(r"^(?:pthread_\w+|_ZNSt6thread\w*|_ZNSt7jthread\w*|clone|clone3|fork|vfork|omp_\w+|GOMP_\w+"
                          r"|__kmpc_\w+|_ZSt5async\w*)$"), "creates threads"),
    ("timer", re.compile(r"^(?:clock_gettime|gettimeofday|time|clock|timespec_get|_ZNSt6chrono\w*|__vdso_\w+)$"),
     "reads a timer"),
    ("dlopen", re.compile(r"^(?:dlopen|dlsym|dlvsym|dlmopen|dlclose|dladdr|dladdr1|dlinfo|dl_iterate_phdr|syscall"
                          r"|__libc_\w+)$"), "looks up or loads code at run time"),
    ("process", re.compile(r"^(?:system|popen|exec\w*|getenv|secure_getenv|setenv|putenv|unsetenv|fopen\w*|freopen\w*"
                           r"|open"
                           r"|open64|openat\w*|creat\w*|socket|connect|signal|sigaction|raise|kill|exit|_exit|_Exit"
                           r"|quick_exit|at_quick_exit|_?setjmp|longjmp|_?sigsetjmp|siglongjmp|__sigsetjmp"
                           r"|mprotect|shm_open|shmget|shmat|sleep|usleep|nanosleep|sched_yield|s?rand|s?random|rand_r"
                           r"|[dlmsej]rand48\w*|_ZNSt13random_device\w*|write|read|pwrite\w*|pread\w*|ioctl)$"),
     "touches the process, environment, files or hidden library state"),
    ("fpenv", re.compile(r"^(?:fesetround|fesetenv|feupdateenv|feholdexcept|feclearexcept|fesetexceptflag"
                         r"|feenableexcept"
                         r"|fedisableexcept)$"), "changes the floating-point environment"),
    ("pytorch", re.compile(r"^(?:_ZN\d*(?:at|c10|torch|caffe2|pybind11)\w*|_ZNK\d*(?:at|c10|torch)\w*|_?Py\w+"
                           r"|THP\w*)$"),
     "calls into PyTorch or Python"),
    ("driver-api", re.compile(r"^(?:cu[A-Z]\w*|nvrtc\w*|cublas\w*|cudnn\w*|nccl\w*|cufft\w*|curand\w*|cusparse\w*"
                              r"|cusolver\w*|nvml\w*)$"), "uses the CUDA driver API or a vendor library"),
]
_DENIED_DEFINITIONS = re.compile(r"^(?:cuda\w+|__cuda\w+|cu[A-Z]\w*|malloc|calloc|realloc|free|dlopen|dlsym|pthread_\w+"
                                 r"|clock_gettime|gettimeofday|time|clock|nvrtc\w+|cublas\w+|cudnn\w+)$")


@dataclass(frozen=True)
class _Symbol:
    name: str
    type: str  # FUNC, OBJECT, TLS, NOTYPE, SECTION, FILE
    bind: str  # LOCAL, GLOBAL, WEAK
    section: str  # section name, "UND" when undefined


def object_path(binary: str | Path) -> Path:
    """The object file `forgepack.compile` keeps next to a compiled `kernel.so`."""
    return Path(binary).with_name("kernel.o")


def check_object(binary: str | Path, target: str, source: str = "") -> list[Finding]:
    """Object-level findings for a compiled kernel (`binary` is the `kernel.so`); [] when it passes."""
    obj = object_path(binary)
    if not obj.exists():
        return [Finding("object", f"no object file next to {binary}: compile it with forgepack.compile")]
    symbols, writable, init_entries = _read_elf(obj)
    constants = set(re.findall(r"__constant__[^;=({]*?\b([A-Za-z_]\w*)\s*(?:\[[^\]]*\]\s*)*[;=]", blank_strings(
        strip_comments(source)))) if target == "cuda" else set()
    findings = _state_findings(symbols, writable, constants) + _import_findings(symbols, target)
    for s in symbols:
        if s.section != "UND" and s.bind != "LOCAL" and _DENIED_DEFINITIONS.match(s.name):
            findings.append(Finding("defines-cuda", f"defines {s.name}: kernels must not replace CUDA or C library "
                                                    "functions", f"object symbol {s.name}"))
            break
    allowed_init = 1 if target == "cuda" else 0  # nvcc registers the fat binary from one initialiser
    if init_entries > allowed_init:
        findings.append(Finding("constructor", "runs code when loaded (a constructor function or a global object "
                                               "with a constructor)", "object .init_array"))
    return findings


def _state_findings(symbols: list[_Symbol], writable: set[str], constants: set[str]) -> list[Finding]:
    """Named objects in writable sections: static, global, thread-local, __device__/__managed__ shadows."""
    names = []
    for s in symbols:
        if s.section not in writable or s.type not in ("OBJECT", "TLS", "NOTYPE"):
            continue
        if _INTERNAL.search(s.name) or not s.name or s.name.startswith(".") or _base_name(s.name) in constants:
            continue
        names.append(s.name)
    if not names:
        return []
    shown = ", ".join(demangle(names[:4]))
    message = (f"keeps mutable global or static state ({shown}): kernels are pure functions of their inputs "
               "(no static, thread_local, __device__ or __managed__ variables)")
    return [Finding("state", message, "object kernel.o")]


def _import_findings(symbols: list[_Symbol], target: str) -> list[Finding]:
    findings, seen = [], set()
    for s in symbols:
        if s.section != "UND" or not s.name or s.name in seen:
            continue
        seen.add(s.name)
        if s.name.startswith("cuda") and s.name not in _CUDA_ALLOWED:
            findings.append(Finding("cuda-call", f"calls {s.name}, which kernels may not use (allowed CUDA runtime "
                                                 "calls: launches, error queries, attributes, async copies on "
                                                 "call->stream)", f"object symbol {s.name}"))
            continue
        for rule, pattern, what in _DENIED_IMPORTS:
            if pattern.match(s.name):
                findings.append(Finding(rule, f"{what}: calls {demangle([s.name])[0]}", f"object symbol {s.name}"))
                break
    return findings


def _base_name(symbol: str) -> str:
    """`_ZL3lut` -> `lut`; plain C names unchanged (to match `__constant__` declarations)."""
    m = re.match(r"^_ZL(\d+)(\w+)$", symbol)
    if m and len(m.group(2)) >= int(m.group(1)):
        return m.group(2)[: int(m.group(1))]
    return demangle([symbol])[0].rsplit("::", 1)[-1]


# section header: [Nr] Name Type Address Off Size ES Flg Lk Inf Al (Flg may be empty)
_SECTION = re.compile(r"^\s*\[\s*(\d+)\]\s+(\S+)\s+\S+\s+[0-9a-f]+\s+[0-9a-f]+\s+[0-9a-f]+\s+[0-9a-f]+"
                      r"\s+([A-Za-z]*)\s+\d+")
# writable in an object file, but not state: relocated read-only data (vtables), initialiser arrays
_NOT_STATE_SECTIONS = (".data.rel.ro", ".init_array", ".fini_array", ".ctors", ".dtors", ".nvFatBinSegment")


def _read_elf(obj: Path) -> tuple[list[_Symbol], set[str], int]:
    out = subprocess.run(["readelf", "-W", "-S", "-s", "-r", str(obj)], capture_output=True, text=True, check=False)
    sections: dict[str, str] = {}
    writable: set[str] = set()
    symbols: list[_Symbol] = []
    init_entries = 0
    in_symtab = False
    for line in out.stdout.splitlines():
        sec = _SECTION.match(line)
        if sec and not in_symtab:
            sections[sec.group(1)] = sec.group(2)
            if "W" in sec.group(3) and not sec.group(2).startswith(_NOT_STATE_SECTIONS):
                writable.add(sec.group(2))
            continue
        rel = re.match(r"^Relocation section '\.rela?\.(?:init_array|ctors)' .* contains (\d+) entr", line)
        if rel:
            init_entries += int(rel.group(1))
            continue
        if line.startswith("Symbol table"):
            in_symtab = True
            continue
        sym = re.match(r"^\s*\d+:\s+[0-9a-f]+\s+\d+\s+(\w+)\s+(\w+)\s+\w+\s+(\w+)\s*(\S*)", line)
        if in_symtab and sym:
            typ, bind, ndx, name = sym.groups()
            symbols.append(_Symbol(name, typ, bind, "UND" if ndx == "UND" else sections.get(ndx, ndx)))
    return symbols, writable, init_entries


def demangle(names: list[str]) -> list[str]:
    if not names:
        return []
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=False,
                             timeout=30)
        lines = out.stdout.splitlines()
        return lines if len(lines) == len(names) else names
    except (OSError, subprocess.TimeoutExpired):
        return names
