# ruff: noqa: F811  (the fixtures `card` and `profiled` are shared from the anthropic and build tests)

"""What a proposer is told of a verdict: the compiler's log raw (not JSON-escaped, cut at a line end,
never mid-line) and, where CUDA is the target, each kernel's registers and spills from ptxas."""

from __future__ import annotations

import re
from concurrent.futures import Future

import pytest
from test_anthropic_proposer import card  # noqa: F401  (the fixture)
from test_build import fresh_workspace, profiled  # noqa: F401  (the fixture)
from test_llm_search import Model, serve

from forgepack import compile as compile_mod
from forgepack.evaluate import Evaluator, Verdict
from forgepack.search import resources, run
from forgepack.search.executor import compile_candidate
from forgepack.search.proposers import make
from forgepack.search.proposers.prompt import build_prompt
from forgepack.search.tree import LineageEntry
from forgepack.templates import on_device

# 300 undeclared names: g++ reports each, a log far longer than one feedback
MANY_ERRORS = ('#include "forgepack_abi.h"\nFP_EXPORT int32_t forgepack_kernel(const fp_call* call) {\n'
               + "".join(f"  int v{k} = undeclared_{k} + 1;\n" for k in range(300)) + "  return 0;\n}\n")

# 96 live accumulators under __launch_bounds__(1024, 2): ptxas has 32 registers a thread and spills
PRESSURE = r'''#include "forgepack_abi.h"
#include <cuda_runtime.h>
__global__ void __launch_bounds__(1024, 2) pressure(const float* x, float* y, int n) {
  float acc[96];
#pragma unroll
  for (int k = 0; k < 96; ++k) acc[k] = x[threadIdx.x + k * n];
#pragma unroll
  for (int r = 0; r < 8; ++r)
#pragma unroll
    for (int k = 0; k < 96; ++k) acc[k] = acc[k] * acc[(k + r + 1) % 96] + acc[(k * 7 + r) % 96];
  float s = 0;
#pragma unroll
  for (int k = 0; k < 96; ++k) s += acc[k];
  y[threadIdx.x] = s;
}
__global__ void relu(const float* x, float* y, long n) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] > 0 ? x[i] : 0;
}
FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {
  relu<<<1, 32, 0, (cudaStream_t)call->stream>>>((const float*)call->inputs[0].data,
                                                  (float*)call->outputs[0].data, 32);
  return (int32_t)cudaGetLastError();
}
'''


def test_a_compile_log_reaches_the_proposer_raw_and_cut_at_a_line_end(card):
    with Evaluator("cpu") as evaluator:
        verdict = evaluator.evaluate(card, MANY_ERRORS, bench=False)
    assert verdict.category == "compile"
    log = verdict.diagnostics["compile_log"]
    assert len(log) > 3 * run.FEEDBACK_CHARS
    text = run.feedback_text(verdict, 0.05)
    head, label, *kept, tail = text.splitlines()
    assert head.startswith("compile: does not compile:") and "undeclared_0" in head
    assert label == "compile_log:" and "\\n" not in text and '\\"' not in text  # not JSON-escaped
    log_lines = log.rstrip().splitlines()
    assert kept == log_lines[: len(kept)]  # the log's first lines, each whole, in order
    assert re.search(r"error: .undeclared_0. was not declared", "\n".join(kept))  # quotes as the locale has them
    assert tail == f"[{len(log_lines) - len(kept)} more lines]"
    assert len(text) <= run.FEEDBACK_CHARS + len(tail) + 1
    # in the prompt each item's log lines sit under it, as the compiler printed them
    prompt = build_prompt(card, "cpu", None, [], [f"candidate #4: {text}"])
    assert f"- candidate #4: {head}\n    compile_log:\n    {kept[0]}\n" in prompt


def test_diagnostics_keep_what_a_proposer_can_act_on():
    verdict = Verdict(False, "mismatch", "output 0 differs at [3, 1]: expected 1.5, got nan",
                      {"index": [3, 1], "expected": 1.5, "got": "nan", "seed": 1234, "binary_sha256": "ab" * 32,
                       "family": {"failed_at": {"d0": 7}, "checked": [{"d0": 1}]}})
    text = run.feedback_text(verdict, 0.05)
    assert text.splitlines() == ["mismatch: output 0 differs at [3, 1]: expected 1.5, got nan",
                                 "index: [3, 1]", "expected: 1.5", "got: nan"]


@pytest.mark.skipif(compile_mod.nvcc_path() is None, reason="needs nvcc (CUDA code compiles without a GPU)")
def test_ptxas_reports_registers_and_spills_of_each_cuda_kernel(card):
    kernels = {k.name.split("(")[0]: k for k in resources.usage(PRESSURE, "sm_90")}
    assert set(kernels) == {"pressure", "relu"}  # demangled
    assert kernels["pressure"].registers <= 32 and kernels["pressure"].spill_stores > 0
    assert kernels["relu"].registers > 0 and kernels["relu"].spill_stores == 0
    assert resources.usage("this is not CUDA", "sm_90") == ()  # no report: the compile log says why
    line = resources.summary(tuple(kernels.values()))
    assert line.startswith("ptxas: ") and "B spill stores" in line
    # a verdict carrying them tells the proposer, as does the lineage of a kernel refined later
    usage = [vars(k) for k in kernels.values()]
    slower = Verdict(False, "slower", "verified but not fast enough", {"resources": usage, "seed": 1},
                     speedup=0.8, ci_low=0.7, ci_high=0.9, eager_us=1.0, kernel_us=1.25)
    assert run.feedback_text(slower, 0.05).splitlines()[1] == line
    entry = LineageEntry(7, "openai:m", {}, "slower", False, 0.8, 1.25, 1.0, "slower", resources=line)
    assert line in build_prompt(card, "cuda", None, [entry], [])


class CompileOnly:
    """The `Executor` seam for CUDA on a host without a GPU: each candidate is compiled for real (nvcc
    runs here), and, since it cannot run, answered as verified and a little slower than stock."""

    slots = 1

    def submit(self, card, source, samples_path=None) -> Future:
        built = compile_candidate(source, "cuda", "sm_90")
        done: Future = Future()
        done.set_result(Verdict(False, "slower" if built.ok else "compile", "not fast enough (no GPU here)",
                                {} if built.ok else {"compile_log": built.log}, binary=built.binary,
                                speedup=0.9 if built.ok else None, ci_low=0.85, ci_high=0.95, eager_us=1.0,
                                kernel_us=1.1))
        return done

    def summary(self) -> str:
        return "compile only"

    def close(self) -> None:
        pass


@pytest.mark.skipif(compile_mod.nvcc_path() is None, reason="needs nvcc (CUDA code compiles without a GPU)")
def test_a_cuda_candidates_registers_and_spills_reach_the_next_prompt(profiled, tmp_path, monkeypatch):
    ws = fresh_workspace(profiled, tmp_path / "ws")
    card = on_device(next(c for c in ws.load_cards() if c.op == "aten.silu.default"), "cuda")
    ws.save_card(card)
    model = Model({card.id: PRESSURE}, delay_s=0.0)
    server = serve(model)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    proposer = make("openai", target="cuda", base_url=f"{server.url}/v1", model="local-coder", price=(0.0, 0.0))
    try:
        found = run.Search(ws, [card], proposer, CompileOnly(), run.Settings(target="cuda", arch="sm_90", budget=2))
        found.run()
        found.store.close()
    finally:
        server.close()
    first, second = model.prompts
    assert "ptxas" not in first
    lineage = second.split("Lineage of the kernel to improve", 1)[1].split("\n\n")[0]
    assert re.search(r"#1 .*slower, 0\.900x vs eager.*; ptxas: .*pressure\(float const\*, float\*, int\): "
                     r"\d+ registers, [1-9]\d* B spill stores", lineage), lineage
