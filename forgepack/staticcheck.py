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
    ("thread", r"\bstd::(?:j?thread|async)\b|\bpthread_\w+|\b(?:fork|vfork|clone)\s*\(|\bomp_\w+|#\s*pragma\s+omp\b"
     r"|\b(?:thrd|mtx|cnd|tss)_\w+|\bcall_once\b",
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
    ("loader", r"\b(?:_DYNAMIC|_r_debug|r_debug|link_map|_GLOBAL_OFFSET_TABLE_|__ehdr_start|__executable_start|_etext"
     r"|_edata|_end|__bss_start|dl_phdr_info|auxv|getauxval)\b|\b__builtin_(?:return|frame|extract_return)_address\b"
     r"|\bElf(?:32|64)_\w+|\bElfW\b",
     "walks the loader's or the process's own data ({0}): a kernel reaches no code but its own"),
    ("process", r"\b(?:system|popen|execl|execlp|execle|execv|execvp|execvpe|getenv|secure_getenv|setenv|putenv"
     r"|unsetenv"
     r"|fopen|freopen|open|openat|creat|socket|signal|sigaction|raise|kill|exit|_exit|_Exit|quick_exit|atexit"
     r"|at_quick_exit|setjmp|longjmp|sigsetjmp|siglongjmp|mprotect|shm_open|shmget|shmat|ftok|sleep|usleep"
     r"|nanosleep|sched_yield|rand|srand|random|srandom|rand_r|drand48|lrand48|mrand48|srand48|getpid|getppid|getsid"
     r"|getpgid|getpgrp|gettid|prctl|isatty|sysconf|uname|gethostname|getrusage|times|getcwd|readlink)\s*\("
     r"|\bstd::random_device\b|\b(?:environ|__environ|program_invocation_\w*)\b",
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


# What a kernel object may import, by general rule: C math, the memory builtins the compiler emits,
# printing (harmless: the worker's stdout goes to its log), the C++ runtime's unwinding and throw
# helpers, abort/assert; for cuda the launch path nvcc generates and the CUDA runtime calls in
# `_CUDA_ALLOWED`. Everything else (threads of any API, sleeping, timers, the loader, the process,
# files, other libraries' symbols) is refused without needing a name on a list.
_MATH = (r"(?:a?sinh?|a?cosh?|a?tanh?|atan2|exp|exp2|exp10|expm1|log|log2|log10|log1p|logb|ilogb|pow|sqrt|cbrt"
         r"|hypot|erfc?|lgamma|tgamma|ceil|floor|trunc|round|lround|llround|rint|lrint|llrint|nearbyint|fmod"
         r"|remainder|remquo|fma|fmax|fmin|fdim|fabs|copysign|nan|nextafter|nexttoward|frexp|ldexp|modf|scalbl?n"
         r"|sincos|significand)[fl]?")
_ALLOWED_IMPORTS = re.compile(
    rf"^(?:{_MATH}|__{_MATH}_finite"
    r"|memcpy|memmove|memset|memcmp|__mem(?:cpy|move|set)_chk|strlen|strcmp|strncmp"
    r"|printf|puts|putchar|fprintf|fputs|fputc|fwrite|fflush|snprintf|sprintf|vprintf|vfprintf|vsnprintf"
    r"|__(?:f|s|sn|v|vf|vsn)?printf_chk|stderr|stdout"
    r"|abort|__assert_fail|qsort|bsearch|l?l?abs|l?l?div|strto[dfl]|strtol[ld]?|strtoul+|ato[ifl]"
    r"|__stack_chk_fail|__gxx_personality_v0|_Unwind_Resume|__cxa_begin_catch|__cxa_end_catch|__cxa_rethrow"
    r"|__cxa_call_unexpected|_ZSt9terminatev|__cxa_guard_(?:acquire|release|abort)|_ZSt\d+__throw_\w+)$")
_CUDA_IMPORTS = re.compile(r"^(?:__cuda(?:RegisterFatBinary|RegisterFatBinaryEnd|UnregisterFatBinary|RegisterFunction"
                           r"|RegisterVar|PushCallConfiguration|PopCallConfiguration|LaunchKernel\w*|GetKernel"
                           r"|InitModule|RegisterLinkedBinary\w*)|atexit)$")
# x86 instructions no kernel needs: time stamps, hardware randomness, system calls (what the import rules
# cannot see: intrinsics and builtins compile to these directly)
_FORBIDDEN_INSTRUCTIONS = re.compile(r"\t(rdtscp?|rdpid|rdpmc|rdrand|rdseed|syscall|sysenter|int\s+\$0x80|wrfsbase"
                                     r"|wrgsbase|rdfsbase|rdgsbase)\b")


@dataclass(frozen=True)
class _Symbol:
    name: str
    type: str  # FUNC, OBJECT, TLS, NOTYPE, SECTION, FILE
    bind: str  # LOCAL, GLOBAL, WEAK
    section: str  # section name, "UND" when undefined
    value: int = 0
    size: int = 0


@dataclass(frozen=True)
class _Section:
    name: str
    flags: str
    size: int
    align: int


@dataclass(frozen=True)
class _Elf:
    symbols: list[_Symbol]
    sections: dict[str, _Section]
    relocations: list[tuple[str, int, str]]  # (section relocated, offset, symbol name)
    init_entries: int


def object_path(binary: str | Path) -> Path:
    """The object file `forgepack.compile` keeps next to a compiled `kernel.so`."""
    return Path(binary).with_name("kernel.o")


def check_object(binary: str | Path, target: str, source: str = "") -> list[Finding]:
    """Object-level findings for a compiled kernel (`binary` is the `kernel.so`); [] when it passes."""
    obj = object_path(binary)
    if not obj.exists():
        return [Finding("object", f"no object file next to {binary}: compile it with forgepack.compile")]
    elf = _read_elf(obj)
    constants = set(re.findall(r"__constant__[^;=({]*?\b([A-Za-z_]\w*)\s*(?:\[[^\]]*\]\s*)*[;=]", blank_strings(
        strip_comments(source)))) if target == "cuda" else set()
    code = _disassemble(obj)
    findings = _state_findings(elf, constants) + _import_findings(elf, target, code) + _instruction_findings(code)
    for s in elf.symbols:
        if s.section != "UND" and s.bind != "LOCAL" and _DENIED_DEFINITIONS.match(s.name):
            findings.append(Finding("defines-cuda", f"defines {s.name}: kernels must not replace CUDA or C library "
                                                    "functions", f"object symbol {s.name}"))
            break
    allowed_init = 1 if target == "cuda" else 0  # nvcc registers the fat binary from one initialiser
    if elf.init_entries > allowed_init:
        findings.append(Finding("constructor", "runs code when loaded (a constructor function or a global object "
                                               "with a constructor)", "object .init_array"))
    return findings


def _allowed_data(s: _Symbol, constants: set[str]) -> bool:
    return bool(_INTERNAL.search(s.name)) or _base_name(s.name) in constants


def _state_findings(elf: _Elf, constants: set[str]) -> list[Finding]:
    """Writable data the kernel owns: named objects in writable sections (static, global, thread-local,
    host shadows of __device__/__managed__ variables), and writable bytes no allowed symbol accounts
    for (data placed by section attributes or assembler directives: hidden state)."""
    names, hidden = [], []
    writable = {n for n, sec in elf.sections.items() if _is_state_section(sec)}
    for s in elf.symbols:
        if s.section not in writable or s.type not in ("OBJECT", "TLS", "NOTYPE"):
            continue
        if not s.name or s.name.startswith(".") or _allowed_data(s, constants):
            continue
        names.append(s.name)
    for name in sorted(writable):
        uncovered = _uncovered_bytes(elf.sections[name], [s for s in elf.symbols if s.section == name and s.size
                                                          and _allowed_data(s, constants)])
        if uncovered:
            hidden.append(f"{uncovered} bytes of {name}")
    findings = []
    if names:
        shown = ", ".join(demangle(names[:4]))
        findings.append(Finding("state", f"keeps mutable global or static state ({shown}): kernels are pure "
                                         "functions of their inputs (no static, thread_local, __device__ or "
                                         "__managed__ variables)", "object kernel.o"))
    elif hidden:
        findings.append(Finding("state", f"keeps writable data outside any variable ({', '.join(hidden[:3])}): "
                                         "kernels keep no state between calls", "object kernel.o"))
    return findings


def _is_state_section(sec: _Section) -> bool:
    """Writable and allocated, and not data the loader makes read-only (RELRO) or the initialiser list."""
    if "W" not in sec.flags or "A" not in sec.flags or sec.size == 0:
        return False
    return not sec.name.startswith((".data.rel.ro", ".init_array", ".fini_array", ".ctors", ".dtors"))


def _uncovered_bytes(sec: _Section, symbols: list[_Symbol]) -> int:
    """Bytes of `sec` outside every symbol in `symbols`, alignment padding forgiven."""
    spans = sorted((s.value, s.value + s.size) for s in symbols)
    uncovered, at = 0, 0
    for start, end in [*spans, (sec.size, sec.size)]:
        gap = start - at
        if gap > 0 and gap >= _alignment_at(start, sec.align):
            uncovered += gap
        at = max(at, end)
    return uncovered


def _alignment_at(offset: int, section_align: int) -> int:
    """The alignment an object starting at `offset` can have in a section aligned to `section_align`: a
    gap shorter than it is the padding before that object (nvcc puts a 1-byte guard before an 8-byte
    handle, and a `__constant__` table's 32-byte-aligned host shadow after them)."""
    align = max(section_align, 1)
    return min(align, offset & -offset) if offset else align


def _import_findings(elf: _Elf, target: str, code: str) -> list[Finding]:
    findings, seen = [], set()
    stubs = _device_function_host_bodies(elf, code) if target == "cuda" else set()
    for s in elf.symbols:
        if s.section != "UND" or not s.name or s.name in seen:
            continue
        seen.add(s.name)
        if _ALLOWED_IMPORTS.match(s.name) or (target == "cuda" and (s.name in _CUDA_ALLOWED
                                                                     or _CUDA_IMPORTS.match(s.name))):
            continue
        if s.name == "exit" and target == "cuda" and _only_from(elf, "exit", stubs):
            continue  # nvcc's host body of a __device__ function is `exit(1)`: never called from the host
        if s.name.startswith("cuda"):
            findings.append(Finding("cuda-call", f"calls {s.name}, which kernels may not use (allowed CUDA runtime "
                                                 "calls: launches, error queries, attributes, async copies on "
                                                 "call->stream)", f"object symbol {s.name}"))
            continue
        for rule, pattern, what in _DENIED_IMPORTS:
            if pattern.match(s.name):
                findings.append(Finding(rule, f"{what}: calls {demangle([s.name])[0]}", f"object symbol {s.name}"))
                break
        else:
            findings.append(Finding("import", f"imports {demangle([s.name])[0]}, which is not on the kernel import "
                                              "allow-list (C math, memory builtins, printing, abort; see "
                                              "docs/verification.md)", f"object symbol {s.name}"))
    return findings


def _device_function_host_bodies(elf: _Elf, code: str) -> set[str]:
    """Functions nvcc wrote as the host side of a `__device__` function: tiny, containing one relocation,
    to `exit`, and called or referenced from nowhere in the object (no relocation names them, and no
    instruction targets them: a call within one section needs no relocation)."""
    funcs = [s for s in elf.symbols if s.type == "FUNC" and s.section != "UND" and s.size]
    referenced = {name for _, _, name in elf.relocations}
    targeted = _called_from_elsewhere(code)
    bodies = set()
    for f in funcs:
        inside = [name for sec, off, name in elf.relocations if sec == f.section and f.value <= off < f.value + f.size]
        if inside == ["exit"] and f.size <= 48 and f.name not in referenced and f.name not in targeted:
            bodies.add(f.name)
    return bodies


def _called_from_elsewhere(code: str) -> set[str]:
    """Functions some instruction outside them names as its operand (`call 0 <name>`)."""
    targets, current = set(), None
    for line in code.splitlines():
        head = re.match(r"^[0-9a-f]+ <([^>]+)>:$", line)
        if head:
            current = head.group(1)
            continue
        if "\t" in line:
            targets |= {t for t in re.findall(r"<([^>+]+)(?:\+0x[0-9a-f]+)?>", line) if t != current}
    return targets


def _only_from(elf: _Elf, name: str, functions: set[str]) -> bool:
    """Every relocation to `name` lies inside one of `functions`."""
    by_name = {s.name: s for s in elf.symbols if s.type == "FUNC" and s.section != "UND"}
    for sec, off, target in elf.relocations:
        if target != name:
            continue
        if not any(f in by_name and by_name[f].section == sec and by_name[f].value <= off < by_name[f].value
                   + by_name[f].size for f in functions):
            return False
    return True


def _disassemble(obj: Path) -> str:
    try:
        out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True,
                             check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout


def _instruction_findings(code: str) -> list[Finding]:
    """Host machine code that reads time stamps or hardware randomness or enters the kernel directly."""
    if not code:
        return [Finding("object", "could not disassemble the object (objdump)")]
    m = _FORBIDDEN_INSTRUCTIONS.search(code)
    if not m:
        return []
    return [Finding("instruction", f"executes {m.group(1)}: a kernel reads no clock, no hardware randomness and "
                                   "makes no system calls", "object kernel.o")]


def _base_name(symbol: str) -> str:
    """`_ZL3lut` -> `lut`; plain C names unchanged (to match `__constant__` declarations)."""
    m = re.match(r"^_ZL(\d+)(\w+)$", symbol)
    if m and len(m.group(2)) >= int(m.group(1)):
        return m.group(2)[: int(m.group(1))]
    return demangle([symbol])[0].rsplit("::", 1)[-1]


# section header: [Nr] Name Type Address Off Size ES Flg Lk Inf Al (Flg may be empty)
_SECTION = re.compile(r"^\s*\[\s*(\d+)\]\s+(\S+)\s+\S+\s+[0-9a-f]+\s+[0-9a-f]+\s+([0-9a-f]+)\s+[0-9a-f]+"
                      r"\s+([A-Za-z]*)\s+\d+\s+\d+\s+(\d+)")
_RELOC = re.compile(r"^([0-9a-f]+)\s+[0-9a-f]+\s+\S+\s+[0-9a-f]+\s+([^\s+-]+)")


def _read_elf(obj: Path) -> _Elf:
    out = subprocess.run(["readelf", "-W", "-S", "-s", "-r", str(obj)], capture_output=True, text=True, check=False)
    index: dict[str, str] = {}
    sections: dict[str, _Section] = {}
    symbols: list[_Symbol] = []
    relocations: list[tuple[str, int, str]] = []
    init_entries, in_symtab, relocating = 0, False, None
    for line in out.stdout.splitlines():
        sec = _SECTION.match(line)
        if sec and not in_symtab:
            index[sec.group(1)] = sec.group(2)
            sections[sec.group(2)] = _Section(sec.group(2), sec.group(4), int(sec.group(3), 16), int(sec.group(5)))
            continue
        rel = re.match(r"^Relocation section '\.rela?(\.\S+)' .* contains (\d+) entr", line)
        if rel:
            relocating = rel.group(1)
            if relocating.startswith((".init_array", ".ctors")):
                init_entries += int(rel.group(2))
            continue
        if line.startswith("Symbol table"):
            in_symtab, relocating = True, None
            continue
        entry = _RELOC.match(line.strip()) if relocating else None
        if entry:
            relocations.append((relocating, int(entry.group(1), 16), entry.group(2)))
            continue
        sym = re.match(r"^\s*\d+:\s+([0-9a-f]+)\s+(\d+)\s+(\w+)\s+(\w+)\s+\w+\s+(\w+)\s*(\S*)", line)
        if in_symtab and sym:
            value, size, typ, bind, ndx, name = sym.groups()
            symbols.append(_Symbol(name, typ, bind, "UND" if ndx == "UND" else index.get(ndx, ndx), int(value, 16),
                                   int(size)))
    return _Elf(symbols, sections, relocations, init_entries)


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
