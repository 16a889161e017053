"""Where the gap to torch.compile(mode="reduce-overhead") comes from: layout probes on the GPU.

Three questions, each answered with GPU time from CUDA graph replay (launch cost out of the picture),
columns measured side by side in one process:

1. GPT-2's LM head, f16[1024,768] @ f16[768,50257]: the vocabulary is odd, so the output's row stride
   is not a multiple of 8 elements and cuBLAS cannot use its vectorised epilogue. How much do the
   layout rewrites a pack could make (padded weight + slice copy, transposed product + transpose
   copy, padded output view) save, and are they the same numbers?
2. ResNet-50 (fp16, b16, 224 px): stock NCHW vs channels-last weights (activations follow), whole
   forward replayed from a CUDA graph.
3. Two read streams and one write stream (add, cat) vs copy: does placing the inputs at offsets that
   are not a power of two apart change the bandwidth (DRAM channel conflicts)?
4. ViT-base (fp16, b16): the whole forward replayed from a CUDA graph under each attention backend.
5. The GEMM templates on GPT-2's LM head (and a narrower product): every point of each template,
   compiled, timed from CUDA graph replay beside cuBLAS's ways of computing the same output, and
   the fastest points checked by the real verifier.
6. GPT-2's tanh GELU fusion card through every fused template's points, beside the eager chain.

    python tools/probe_layouts.py [--only lmhead,resnet,streams,vit,gemm,gelu]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib


def graph_us(fn: Callable[[], object], reps: int = 20, rounds: int = 7) -> float:
    """Median µs of one call of `fn`, replayed `reps` times from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    del graph
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item())


def _with_blas(library: str, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`fn` with another BLAS backend preferred (a process-wide setting; restored after)."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        return fn()
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def probe_lmhead() -> list[dict]:
    m, k, n = 1024, 768, 50257
    npad = (n + 7) // 8 * 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen) * 0.05
    wpad = torch.nn.functional.pad(w, (0, 0, 0, npad - n))
    out = torch.empty(m, n, device="cuda", dtype=torch.float16)
    buf = torch.empty(m, npad, device="cuda", dtype=torch.float16)
    ref = x @ w.t()
    variants = {
        "stock mm (odd N)": lambda: torch.mm(x, w.t()),
        "mm into stock output buffer": lambda: torch.mm(x, w.t(), out=out),
        "padded weight, mm, slice copy": lambda: torch.mm(x, wpad.t())[:, :n].contiguous(),
        "padded weight, mm only (no copy)": lambda: torch.mm(x, wpad.t()),
        "mm into padded view (out=)": lambda: torch.mm(x, w.t(), out=buf[:, :n]),
        "padded view + contiguous copy": lambda: torch.mm(x, w.t(), out=buf[:, :n]).contiguous(),
        "transposed product W@x^T": lambda: torch.mm(w, x.t()),
        "transposed product + stock transpose copy": lambda: torch.mm(w, x.t()).t().contiguous(),
        "slice copy alone": lambda: buf[:, :n].contiguous(),
        "stock mm, cuBLASLt preferred": lambda: _with_blas("cublaslt", lambda: torch.mm(x, w.t())),
    }
    rows = []
    for name, fn in variants.items():
        try:
            us = graph_us(fn)
            res = fn()
            err = rel_err(res, ref) if res.shape == ref.shape else float("nan")
            rows.append({"variant": name, "us": us, "rel_err": err,
                         "contiguous": bool(res.is_contiguous()), "tflops": 2 * m * n * k / us / 1e6})
        except Exception as exc:  # a probe: record and go on
            rows.append({"variant": name, "us": float("nan"), "error": f"{type(exc).__name__}: {exc}"[:200]})
        print(rows[-1], flush=True)
    return rows


def _template_points(card, jobs: int = 16, limit: int | None = None) -> list[dict]:
    """Every point (up to `limit` per template) of every template serving `card`, compiled in
    parallel and loaded."""
    from concurrent.futures import ThreadPoolExecutor

    from forgepack.compile import compile_kernel
    from forgepack.templates import points, templates_for
    from forgepack.verify import load_kernel

    todo = []
    for t in templates_for(card, "cuda"):
        for p in points(t, card, "cuda", limit):
            try:
                todo.append((t, p, t.render(card, "cuda", p)))
            except ValueError:  # a point the template cannot build (shared memory, warp split)
                continue
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        built = list(pool.map(lambda j: compile_kernel(j[2], "cuda"), todo))
    out = []
    for (t, p, src), res in zip(todo, built, strict=True):
        if res.ok:
            out.append({"template": t.name, "params": p, "source": src, "compiled": res, "fn": load_kernel(res.binary)})
        else:
            print(f"{t.name} {p}: compile failed: {res.log[-500:]}", flush=True)
    return out


def probe_gemm(shapes=((1024, 768, 50257), (64, 768, 50257))) -> list[dict]:
    from forgepack.capture import card_from_call
    from forgepack.evaluate import Evaluator
    from forgepack.verify import KernelCall

    rows = []
    for m, k, n in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen) * 0.05
        ref = x @ w.t()
        exact = x.float() @ w.float().t()  # fp32 products and sums: how far each result is from it
        flops = 2 * m * n * k
        label = f"{m}x{k} @ {k}x{n}"
        stock = {"cuBLAS mm (align1)": lambda x=x, w=w: torch.mm(x, w.t()),
                 "cuBLAS transposed product + transpose copy": lambda x=x, w=w: torch.mm(w, x.t()).t().contiguous(),
                 "cuBLAS transposed product alone": lambda x=x, w=w: torch.mm(w, x.t())}
        for name, fn in stock.items():
            us = graph_us(fn)
            rows.append({"shape": label, "variant": name, "us": us, "tflops": flops / us / 1e6})
        rows[-3]["max_err_vs_fp32"] = float((ref.float() - exact).abs().max())
        card = card_from_call(torch.ops.aten.mm.default, (x, w.t()), {})[0]
        out = torch.empty(m, n, device="cuda", dtype=torch.float16)

        def launch(fn, out=out, x=x, w=w):  # on the current stream: graph_us captures on its own
            return KernelCall(fn, [x, w.t()], [out], [], torch.cuda.current_stream().cuda_stream)()

        timed = []
        for pt in _template_points(card):
            out.fill_(float("nan"))
            if launch(pt["fn"]) != 0:
                print(f"{pt['template']} {pt['params']}: returned an error", flush=True)
                continue
            torch.cuda.synchronize()
            err = rel_err(out, ref)
            vs_exact = float((out.float() - exact).abs().max())
            us = graph_us(lambda fn=pt["fn"]: launch(fn), reps=10, rounds=5)
            timed.append({**pt, "us": us, "err": err, "vs_exact": vs_exact})
            print(f"{label} {pt['template']} {pt['params']}: {us:.1f} us, rel err {err:.2e} "
                  f"(max err vs fp32 {vs_exact:.2e})", flush=True)
        timed.sort(key=lambda r: r["us"])
        with Evaluator("cuda") as ev:
            best_each = {r["template"]: r for r in reversed(timed)}  # each template's fastest
            for r in [*timed[:3], *best_each.values()]:
                if "verified" in r:
                    continue
                verdict = ev.evaluate_compiled(card, r["compiled"], r["source"], bench=False)
                r["verified"] = "yes" if verdict.accepted else f"no: {verdict.reason}"
                print(f"{label} {r['template']} {r['params']}: verified {r['verified']}", flush=True)
        for r in timed[:8]:
            rows.append({"shape": label, "variant": f"{r['template']} {r['params']}", "us": r["us"],
                         "tflops": flops / r["us"] / 1e6, "rel_err": r["err"], "max_err_vs_fp32": r["vs_exact"],
                         "verified": r.get("verified", "")[:100]})
        for r in best_each.values():
            if r not in timed[:8]:
                rows.append({"shape": label, "variant": f"{r['template']} {r['params']} (its fastest)",
                             "us": r["us"], "tflops": flops / r["us"] / 1e6, "rel_err": r["err"],
                             "max_err_vs_fp32": r["vs_exact"], "verified": r.get("verified", "")[:100]})
        bad = [r for r in timed if not r["err"] < 1e-2]
        rows.append({"shape": label, "variant": f"points timed: {len(timed)}, off by > 1e-2: {len(bad)}",
                     "us": float("nan")})
        torch.cuda.empty_cache()
    return rows


def probe_gelu() -> list[dict]:
    """GPT-2's tanh GELU (one fusion card, [4,256,3072] fp16) through every fused template's points,
    beside the eager chain, all replayed from CUDA graphs."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from forgepack import capture, fusion, opcall, samples
    from forgepack.templates import templates_for
    from forgepack.verify import KernelCall

    cfg = GPT2Config(n_embd=768, n_layer=1, n_head=12, vocab_size=50257, n_positions=1024)
    model = GPT2LMHeadModel(cfg).eval().to("cuda", torch.float16)
    ids = torch.randint(0, cfg.vocab_size, (4, 256), device="cuda")
    with torch.no_grad():
        cap = capture.capture(model, lambda: model(input_ids=ids), keep_samples=False)
    cards = [c for c in fusion.group(cap, fusion.find(cap)[0]) if "gelu" in c.op]
    rows = []
    for card in cards:
        inputs = samples.fresh_inputs(card, seed=0, device=torch.device("cuda"))
        outs = [samples.materialize(m, torch.zeros(m.span()), torch.device("cuda")) for m in card.outputs]
        eager = graph_us(lambda card=card, inputs=inputs: opcall.run_chain(card, inputs, "cuda"))
        rows.append({"card": card.signature()[:50], "variant": "eager chain", "us": eager})
        print(rows[-1], [t.name for t in templates_for(card, "cuda")], flush=True)
        timed = []
        def launch(fn, inputs=inputs, outs=outs, card=card):
            return KernelCall(fn, inputs, outs, card.scalars(), torch.cuda.current_stream().cuda_stream)()

        for pt in _template_points(card, limit=40):
            if launch(pt["fn"]) != 0:
                continue
            timed.append((graph_us(lambda fn=pt["fn"]: launch(fn), reps=20, rounds=5), pt["template"], pt["params"]))
        timed.sort(key=lambda r: r[0])
        best = {}
        for us, name, params in timed:
            best.setdefault(name, []).append((us, params))
        for name, runs in best.items():
            for us, params in runs[:3]:
                rows.append({"card": card.signature()[:50], "variant": f"{name} {params}", "us": us,
                             "x eager": eager / us})
            rows.append({"card": card.signature()[:50], "variant": f"{name}: {len(runs)} points, slowest",
                         "us": runs[-1][0]})
    return rows


def resnet(channels_last: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    import transformers

    cfg = transformers.ResNetConfig(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3],
                                    layer_type="bottleneck", hidden_act="relu", num_labels=1000)
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(cfg).to("cuda", torch.float16).eval()
    x = torch.randn(16, 3, 224, 224, device="cuda", dtype=torch.float16)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, x


def probe_resnet() -> list[dict]:
    rows = []
    ref = None
    for cl in (False, True):
        model, x = resnet(cl)
        with torch.no_grad():
            logits = model(pixel_values=x).logits
            ref = logits if ref is None else ref
            us = graph_us(lambda m=model, x=x: m(pixel_values=x), reps=5)
        rows.append({"variant": "channels-last weights" if cl else "stock NCHW", "us": us,
                     "rel_err": rel_err(logits, ref)})
        print(rows[-1], flush=True)
    return rows


def probe_vit() -> list[dict]:
    """ViT-base fp16 b16: a stock graph replay took 5.3 ms on the H200 while its kernels summed to
    1.8 ms in the profile. Which attention backend is slow under capture?"""
    import transformers
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = transformers.ViTConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                 intermediate_size=3072, image_size=224, patch_size=16, num_labels=1000)
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(cfg).to("cuda", torch.float16).eval()
    x = torch.randn(16, 3, 224, 224, device="cuda", dtype=torch.float16)
    rows = []
    backends = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    with torch.no_grad():
        ref = model(pixel_values=x).logits
        for name, backend in backends.items():
            try:
                with contextlib.nullcontext() if backend is None else sdpa_kernel([backend]):
                    us = graph_us(lambda: model(pixel_values=x), reps=5)
                    out = model(pixel_values=x).logits
                rows.append({"variant": f"sdpa {name}", "us": us, "rel_err": rel_err(out, ref)})
            except Exception as exc:  # a backend that cannot run this shape: record and go on
                error = f"{type(exc).__name__}: {exc}"[:160]
                rows.append({"variant": f"sdpa {name}", "us": float("nan"), "error": error})
            print(rows[-1], flush=True)
    return rows


def probe_streams() -> list[dict]:
    rows = []
    rows_n, cols = 65536, 4096
    numel = rows_n * cols
    base = torch.empty(3 * numel + 3 * 65536, device="cuda", dtype=torch.bfloat16)
    for label, gap in (("power-of-two apart", 0), ("+64 KiB skew", 32768), ("+4 KiB skew", 2048)):
        a = base[:numel].view(rows_n, cols).normal_()
        b = base[numel + gap: 2 * numel + gap].view(rows_n, cols).normal_()
        c = base[2 * numel + 2 * gap: 3 * numel + 2 * gap].view(rows_n, cols)
        half = cols // 2
        rows += stream_rows(label, a, b, c, half)
    return rows


def stream_rows(label: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, half: int) -> list[dict]:
    a2, b2 = a[:, :half].contiguous(), b[:, :half].contiguous()
    rows = []
    for name, fn, nbytes in (
        ("copy", lambda: c.copy_(a), 2 * a.nbytes),
        ("add", lambda: torch.add(a, b, out=c), 3 * a.nbytes),
        ("cat", lambda: torch.cat([a2, b2], dim=-1, out=c), 2 * c.nbytes),
    ):
        us = graph_us(fn, reps=5)
        rows.append({"variant": f"{name}, {label}", "us": us, "gbps": nbytes / us / 1e3})
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="lmhead,resnet,streams,vit,gemm,gelu")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("probe_layouts needs a CUDA GPU")
        return 1
    info = benchlib.meta()
    probes = {"lmhead": probe_lmhead, "resnet": probe_resnet, "streams": probe_streams, "vit": probe_vit,
              "gemm": probe_gemm, "gelu": probe_gelu}
    data: dict = {"meta": info}
    md = benchlib.header_md("Layout probes (GPU time from CUDA graph replay)", info)
    for name in args.only.split(","):
        try:
            data[name] = probes[name]()
        except Exception as exc:
            data[name] = [{"variant": "probe failed", "error": f"{type(exc).__name__}: {exc}"[:300]}]
        md += f"## {name}\n\n{tabulate(data[name], headers='keys', floatfmt='.3g', tablefmt='github')}\n\n"
        torch.cuda.empty_cache()
    benchlib.write("probe_layouts", data, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
