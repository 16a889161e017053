"""Facts about the GPU machine's software that the design depends on; prints them, writes JSON.

Which aten ops common modules reach on CUDA under no_grad, whether torch.library.get_kernel exists,
how long a minimal torch C++ extension takes to compile, and whether a StaticCache decode step is
repeatable and CUDA-graph capturable with the installed transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

from forgepack.capture import capture


def ops_of(fn) -> list[str]:
    return sorted({c.op for c in capture(torch.nn.Identity(), fn).cards})


def module_ops() -> dict[str, list[str]]:
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(4, 64, 256, device=dev, dtype=bf)
    w = torch.ones(256, device=dev, dtype=bf)
    img = torch.randn(2, 16, 8, 8, device=dev, dtype=torch.float16)
    bn = torch.nn.BatchNorm2d(16).to(dev, torch.float16).eval()
    q = torch.randn(1, 8, 64, 64, device=dev, dtype=bf)
    return {
        "F.rms_norm": ops_of(lambda: F.rms_norm(x, (256,), w, 1e-6)),
        "F.layer_norm": ops_of(lambda: F.layer_norm(x, (256,), w, w)),
        "BatchNorm2d.eval": ops_of(lambda: bn(img)),
        "F.silu": ops_of(lambda: F.silu(x)),
        "sdpa causal": ops_of(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)),
        "adaptive_avg_pool2d": ops_of(lambda: F.adaptive_avg_pool2d(img, 1)),
        "max_pool2d": ops_of(lambda: F.max_pool2d(img, 3, 2, 1)),
        "group_norm": ops_of(lambda: F.group_norm(img, 4)),
    }


def shim_compile_seconds() -> float:
    from torch.utils import cpp_extension

    src = Path(tempfile.mkdtemp()) / "shim.cpp"
    src.write_text('#include <torch/library.h>\n#include <ATen/core/Tensor.h>\n#include <c10/core/Stream.h>\n'
                   'at::Tensor f(const at::Tensor& x) { return x; }\n'
                   'TORCH_LIBRARY(fp_probe, m) { m.def("f(Tensor x) -> Tensor", &f); }\n')
    inc = " ".join(f"-I{p}" for p in cpp_extension.include_paths())
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = f"g++ -O2 -std=c++17 -shared -fPIC {inc} -D_GLIBCXX_USE_CXX11_ABI={abi} {src} -o {src.with_suffix('.so')}"
    t0 = time.time()
    proc = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    return round(time.time() - t0, 1) if proc.returncode == 0 else -1.0


def decode_facts() -> dict:
    from forgepack import models, recipe

    r = recipe.resolve("tiny-llama").replace(target={"device": "cuda"}, workload={
        "phase": "decode", "seq_len": 1, "cache_len": 16, "static_cache": True, "dtype": "bfloat16"})
    lm = models.load(r)
    a = lm.output_tensor(lm.run()).clone()
    b = lm.output_tensor(lm.run()).clone()
    facts = {"repeatable": bool(torch.equal(a, b)), "input_keys": sorted(lm.inputs)}
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            lm.run()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            out = lm.forward()
        lm.reset()
        g.replay()
        lm.reset()
        facts["graph_capture"] = "ok"
        facts["graph_matches_eager"] = bool(torch.allclose(lm.output_tensor(out).float(), a.float(), atol=1e-2))
    except Exception as err:  # a fact to report, not a failure of this script
        facts["graph_capture"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return facts


def main() -> None:
    import transformers

    info = benchlib.meta()
    facts = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "python": sys.version.split()[0], "get_kernel": hasattr(torch.library, "get_kernel"),
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI), "cpus": os.cpu_count(),
        "module_ops": module_ops(), "shim_compile_s": shim_compile_seconds(),
    }
    try:
        facts["decode"] = decode_facts()
    except Exception as err:  # report it; the other facts still count
        facts["decode"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}"
    text = json.dumps(facts, indent=1)
    md = benchlib.header_md("GPU machine facts", info) + f"```\n{text}\n```\n"
    benchlib.write("gpu_facts", {"meta": info, **facts}, md)


if __name__ == "__main__":
    main()
