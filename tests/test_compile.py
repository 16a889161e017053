"""Compile (fixed flags, cache, errors, self-contained objects) and the static checks on source and object."""

from __future__ import annotations

import subprocess
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from forgepack import staticcheck
from forgepack.compile import cache_root, compile_kernel, compiler_flags, nvcc_path
from forgepack.errors import ForgepackError

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "docs" / "examples"
KERNELS = Path(__file__).parent / "kernels"
needs_nvcc = pytest.mark.skipif(nvcc_path() is None, reason="needs nvcc")

TRIVIAL = """#include <stdint.h>
#include "forgepack_abi.h"
FP_EXPORT int32_t forgepack_kernel(const fp_call* call) { return call->n_inputs == 1 ? FP_OK : FP_ERR_ABI; }
"""


def test_cache_hit_returns_the_same_object():
    first = compile_kernel(TRIVIAL, "cpu")
    assert first.ok and not first.cached, first.log
    again = compile_kernel(TRIVIAL, "cpu")
    assert again.cached and again.ok
    assert (again.binary, again.key) == (first.binary, first.key)
    assert Path(first.binary).is_relative_to(cache_root())
    assert Path(first.binary).with_name("kernel.o").exists()  # kept for the object checks
    other = compile_kernel(TRIVIAL + "\n// another candidate\n", "cpu")
    assert other.key != first.key and other.binary != first.binary


def test_compile_error_keeps_the_log_and_is_cached():
    source = (KERNELS / "compile_error.cpp").read_text()
    result = compile_kernel(source, "cpu")
    assert not result.ok and result.binary is None
    assert "undeclared_identifier" in result.log and "error" in result.log
    again = compile_kernel(source, "cpu")
    assert again.cached and not again.ok and again.log == result.log


def test_missing_entry_point_and_unresolved_symbols_fail_to_build():
    no_entry = compile_kernel('#include "forgepack_abi.h"\nint helper(int x) { return x; }\n', "cpu")
    assert not no_entry.ok and "forgepack_kernel" in no_entry.log
    # -z defs: a symbol nothing in the C/C++ runtime provides (e.g. one from PyTorch) does not link
    unresolved = compile_kernel(
        '#include <stdint.h>\n#include "forgepack_abi.h"\nextern "C" int at_softmax_cpu(const void*);\n'
        "FP_EXPORT int32_t forgepack_kernel(const fp_call* c) { return at_softmax_cpu(c); }\n",
        "cpu",
    )
    assert not unresolved.ok and "at_softmax_cpu" in unresolved.log


def test_fixed_flags():
    cpu = compiler_flags("cpu", None)
    assert "-O3" in cpu and "-shared" in cpu and "-std=c++17" in cpu
    assert not any("native" in f or "fast-math" in f for f in cpu)
    cuda = compiler_flags("cuda", "sm_90")
    assert "-O3" in cuda and "-arch=sm_90a" in cuda and "static" in cuda
    assert not any("fast-math" in f or "use_fast_math" in f for f in cuda)
    with pytest.raises(ForgepackError):
        compiler_flags("rocm", None)


def _compile_in_child(source: str) -> tuple[bool, str]:
    result = compile_kernel(source, "cpu")
    return result.ok, result.binary


def test_concurrent_compiles_of_one_source_agree():
    source = TRIVIAL + "// compiled by two processes at once\n"
    with ProcessPoolExecutor(2) as pool:
        results = list(pool.map(_compile_in_child, [source, source]))
    assert results[0][0] and results[1][0]
    assert results[0][1] == results[1][1] and Path(results[0][1]).exists()


def test_docs_cpu_example_compiles_and_passes_static_checks():
    source = (EXAMPLES / "softmax_cpu.cpp").read_text()
    result = compile_kernel(source, "cpu")
    assert result.ok, result.log
    assert staticcheck.check_source(source, "cpu") == []
    assert staticcheck.check_object(result.binary, "cpu", source) == []
    exported = subprocess.run(["nm", "-D", "--defined-only", result.binary], capture_output=True, text=True).stdout
    assert [line.split()[-1] for line in exported.splitlines()] == ["forgepack_kernel"]  # nothing else leaks


@needs_nvcc
def test_docs_cuda_example_compiles_for_sm90():
    source = (EXAMPLES / "relu_cuda.cu").read_text()
    result = compile_kernel(source, "cuda", arch="sm_90")
    assert result.ok, result.log
    assert staticcheck.check_source(source, "cuda") == []
    assert staticcheck.check_object(result.binary, "cuda", source) == []
    # static cudart: the object needs no CUDA library at load time
    needed = subprocess.run(["readelf", "-d", result.binary], capture_output=True, text=True).stdout
    assert "libcudart" not in needed


@needs_nvcc
def test_cuda_object_check_tells_constant_tables_from_device_state():
    base = '#include <cuda_runtime.h>\n#include <stdint.h>\n#include "forgepack_abi.h"\n{decl}\n' \
           "__global__ void k(float* y) {{ y[0] = {use}; }}\n" \
           "FP_EXPORT int32_t forgepack_kernel(const fp_call* c) {{ k<<<1, 1, 0, (cudaStream_t)c->stream>>>(" \
           "(float*)c->outputs[0].data); return (int32_t)cudaGetLastError(); }}\n"
    table = base.format(decl="__constant__ float lut[4] = {1, 2, 3, 4};", use="lut[1]")
    result = compile_kernel(table, "cuda", arch="sm_90")
    assert result.ok and staticcheck.check_object(result.binary, "cuda", table) == []
    # a __device__ variable written by the kernel, declared through a macro the source rules cannot see
    state = base.format(decl="#define D __dev ## ice__\nD float seen;", use="(seen += 1.0f)")
    result = compile_kernel(state, "cuda", arch="sm_90")
    assert result.ok
    assert staticcheck.check_source(state, "cuda") == []
    assert [f.rule for f in staticcheck.check_object(result.binary, "cuda", state)] == ["state"]


def test_source_rules_ignore_comments_and_strings():
    source = TRIVIAL + '// malloc(1); std::thread; cudaDeviceSynchronize()\n/* static int x; */\n' \
                       'static const char* note = "clock_gettime(0) and dlopen";\n'
    assert staticcheck.check_source(source, "cpu") == []


def test_source_rules_name_the_line():
    source = TRIVIAL + "\n\nstatic float cache[16];\n"
    (finding,) = staticcheck.check_source(source, "cpu")
    assert finding.rule == "state" and finding.where == "line 6"


def test_static_functions_and_const_tables_are_fine():
    source = TRIVIAL + "static const float lut[2] = {1, 2};\nstatic constexpr int N = 4;\n" \
                       "static inline float twice(float v) { return 2 * v; }\n" \
                       "static float half(float v) { return v / 2; }\n"
    assert staticcheck.check_source(source, "cpu") == []
    result = compile_kernel(source, "cpu")
    assert result.ok and staticcheck.check_object(result.binary, "cpu", source) == []
