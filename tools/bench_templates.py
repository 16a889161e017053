"""How close the offline templates get to the memory roofline, and what they gain on real variants.

(1) Per family, a large synthetic card (hundreds of MB moved, far beyond L2): a bounded hill-climb over
    the template's parameter space; best GB/s against the measured device copy bandwidth (a large D2D
    copy, bytes read + written). Target: >= 80%. Stock PyTorch on the same card, inputs and timing
    method is the "eager GB/s" column: its own kernel on the same access pattern.
(2) Per recipe (default: the six GPU reference recipes), every captured variant some template serves:
    the same bounded search, then the best point goes through the real `Evaluator` (verification and
    the interleaved, L2-flushed A/B benchmark against eager). Table: variant, eager µs, best µs,
    speed-up, % of roofline; the count beating eager by >= 5% and the geomean speed-up.

Candidates are compiled in batches (several kernels per compiler run, in parallel) and timed in process
through the kernel ABI with `forgepack.timing` (device events, L2 flushed before every call). Every
reported best is verified by the Evaluator, which compiles the single source with the fixed flags.

    python tools/bench_templates.py                         # on the H200: synthetic + reference recipes
    python tools/bench_templates.py --recipes none          # synthetic cards only
    python tools/bench_templates.py --target cpu --quick --recipes tiny-llama   # CPU dry run

Writes `templates.json` and `templates.md` under `${OUT:-benchmarks/out}/results/`.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

from forgepack import opcall, samples, timing
from forgepack.capture import card_from_call
from forgepack.cards import Card
from forgepack.compile import ABI_DIR, compile_kernel
from forgepack.roofline import card_bytes
from forgepack.templates import neighbours, refusals, templates_for
from forgepack.templates.common import Template, batch_unit
from forgepack.verify import FpCall, KernelCall

REFERENCE = ["llama-1b-prefill", "qwen2-0.5b-prefill", "gpt2", "vit-base", "resnet-50", "llama-1b-decode"]
BATCH = 8  # kernels per compiler run


@dataclass
class Search:
    """The bounded search of one (card, template): points tried and their median µs."""

    card: Card
    template: Template
    label: str
    inputs: list | None = None  # tensors to time on (default: fresh ones drawn like the card's)
    tried: dict[str, float] = field(default_factory=dict)  # repr(params) -> µs (inf: failed)
    params: dict[str, dict] = field(default_factory=dict)
    best: dict | None = None
    frontier: list[dict] = field(default_factory=list)

    def best_us(self) -> float:
        return min(self.tried.values(), default=math.inf)


# --- compiling and timing candidates ---------------------------------------------------------------


def compile_batches(sources: list[str], target: str, workdir: Path, jobs: int) -> list:
    """Callable entry points (or None where a batch failed), one per source."""
    batches = [list(range(i, min(i + BATCH, len(sources)))) for i in range(0, len(sources), BATCH)]

    def build(k: int):
        idx = batches[k]
        ext = "cu" if target == "cuda" else "cpp"
        src, lib = workdir / f"b{k}_{time.monotonic_ns()}.{ext}", None
        src.write_text(batch_unit([sources[i] for i in idx], target))
        out = src.with_suffix(".so")
        if target == "cuda":
            cmd = ["nvcc", "-O3", "-arch=sm_90", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-I", str(ABI_DIR)]
        else:
            cmd = ["g++", "-O3", "-std=c++17", "-shared", "-fPIC", "-I", str(ABI_DIR)]
        res = subprocess.run([*cmd, str(src), "-o", str(out)], capture_output=True, text=True, check=False)
        if res.returncode != 0:
            print(f"  batch {k} failed to compile: {res.stderr[-800:]}", flush=True)
            return [None] * len(idx)
        lib = ctypes.CDLL(str(out), mode=ctypes.RTLD_LOCAL)
        fns = []
        for j in range(len(idx)):
            fn = getattr(lib, f"forgepack_kernel_{j}")
            fn.restype, fn.argtypes = ctypes.c_int32, [ctypes.POINTER(FpCall)]
            fn._lib = lib
            fns.append(fn)
        return fns

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(build, range(len(batches))))
    return [fn for chunk in results for fn in chunk]


class Bench:
    """Inputs and outputs of one card on the device, reused for every candidate of that card."""

    def __init__(self, card: Card, device: torch.device, inputs: list | None = None):
        self.card, self.device = card, device
        self.inputs = inputs if inputs is not None else samples.fresh_inputs(card, seed=0, device=device)
        self.outputs = [samples.materialize(m, torch.zeros(m.span()), device) for m in card.outputs]
        self.stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None

    def time_kernel(self, fn, reps: int) -> float:
        call = KernelCall(fn, self.inputs, self.outputs, self.card.scalars(), self.stream)
        if call() != 0:
            return math.inf
        return timing.median(timing.time_us(call, self.device, reps=reps, warmup=2))

    def time_eager(self, reps: int) -> float:
        return timing.median(timing.time_us(lambda: opcall.run_stock(self.card, self.inputs, self.device),
                                            self.device, reps=reps, warmup=2))


def search_all(searches: list[Search], target: str, device: torch.device, rounds: int, width: int, reps: int,
               jobs: int, deadline: float) -> None:
    """Bounded hill-climb for every search at once: each round compiles all frontiers together."""
    benches = {id(s): Bench(s.card, device, s.inputs) for s in searches}
    for s in searches:
        s.frontier = [s.template.default(s.card, target)]
    with tempfile.TemporaryDirectory(prefix="fp-bench-") as tmp:
        for rnd in range(rounds):
            todo = [(s, p) for s in searches for p in s.frontier if repr(p) not in s.tried]
            if not todo or time.monotonic() > deadline:
                break
            t0 = time.monotonic()
            sources = [s.template.render(s.card, target, p) for s, p in todo]
            fns = compile_batches(sources, target, Path(tmp), jobs)
            t1 = time.monotonic()
            for (s, p), fn in zip(todo, fns, strict=True):
                us = benches[id(s)].time_kernel(fn, reps) if fn is not None else math.inf
                s.tried[repr(p)], s.params[repr(p)] = us, p
            print(f"  round {rnd}: {len(todo)} candidates, compile {t1 - t0:.1f} s, time {time.monotonic() - t1:.1f} s",
                  flush=True)
            for s in searches:
                key = min(s.tried, key=s.tried.get)
                s.best = s.params[key]
                near = [p for p in neighbours(s.template, s.card, target, s.best) if repr(p) not in s.tried]
                s.frontier = near[:width]


# --- (1) synthetic cards ---------------------------------------------------------------------------


def synthetic_cards(device: torch.device, quick: bool) -> list[tuple[str, Card, list]]:
    """One large card per template (shrunk 64x with --quick): each moves hundreds of MB on the GPU."""
    a = torch.ops.aten
    s = 8 if quick else 1  # linear shrink factor per dim pair
    bf, fp = torch.bfloat16, torch.float16

    def t(*shape, dtype=bf):
        return torch.randn(*shape, device=device, dtype=dtype)

    rows, cols = 65536 // s, 2048 // s
    x = t(rows, cols * 2)
    specs = [
        ("elementwise.unary silu", a.silu.default, (t(16384 // s, 8192 // s),), {}),
        ("elementwise.binary mul (broadcast row)", a.mul.Tensor, (x, t(1, cols * 2)), {}),
        ("elementwise.binary add", a.add.Tensor, (x, x.clone()), {}),
        ("elementwise.copy cast f32->bf16", a._to_copy.default, (t(rows, cols * 2, dtype=torch.float32),),
         {"dtype": bf}),
        ("elementwise.copy transpose", a.clone.default, (t(8192 // s, 8192 // s).t(),),
         {"memory_format": torch.contiguous_format}),
        ("elementwise.cat", a.cat.default, ([t(rows, cols), t(rows, cols)], -1), {}),
        ("rowreduce.softmax", a._softmax.default, (x, -1, False), {}),
        ("rowreduce.layer_norm", a.native_layer_norm.default, (t(rows // 2, 4096 // s * 2), [4096 // s * 2],
                                                                t(4096 // s * 2), t(4096 // s * 2), 1e-5), {}),
        ("rowreduce.reduce mean", a.mean.dim, (x, [-1], True), {}),
        ("norm.batch_norm", a.native_batch_norm.default,
         (t(64 // s, 256, 112, 112 // s, dtype=fp), *[t(256, dtype=fp) for _ in range(3)],
          torch.rand(256, device=device, dtype=fp) + 0.5, False, 0.1, 1e-5), {}),
        # Groups of 16 x 1024 elements fit in registers (one read); much larger groups are re-read.
        ("norm.group_norm", a.native_group_norm.default,
         (t(128 // s, 512, 32, 32, dtype=fp), t(512, dtype=fp), t(512, dtype=fp), 128 // s, 512, 1024, 32, 1e-5), {}),
        ("pool.adaptive_avg 1x1", a._adaptive_avg_pool2d.default, (t(256 // s, 2048, 14, 14, dtype=fp), [1, 1]), {}),
        ("pool.max2d 3x3/2", a.max_pool2d_with_indices.default,
         (t(64 // s, 128, 112, 112, dtype=fp), [3, 3], [2, 2], [1, 1]), {}),
    ]
    out = []
    for label, op, args, kwargs in specs:
        card, tensors, _ = card_from_call(op, args, kwargs)
        out.append((label, card, tensors))
    return [*out, fused_bn_relu_card(device, s)]


def fused_bn_relu_card(device: torch.device, shrink: int) -> tuple[str, Card, list]:
    """Inference batch norm as CUDA serves it: on CUDA, eval batch norm leaves its saved statistics
    uninitialised, so the op card is refused and the family is served by the fused BN + ReLU chain of
    a conv layer (what ResNets run). One HF ResNet conv layer, channels-last fp16, captured."""
    from transformers.models.resnet.modeling_resnet import ResNetConvLayer

    from forgepack import fusion
    from forgepack.capture import capture

    # Fusion sites are child modules of the model: the layer sits in a container, as in a ResNet.
    layer = torch.nn.Sequential(ResNetConvLayer(256, 256, kernel_size=1)).to(device, torch.float16).eval()
    layer = layer.to(memory_format=torch.channels_last)
    x = torch.randn(128 // shrink, 256, 56, 56 // shrink, device=device, dtype=torch.float16)
    x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        cap = capture(layer, lambda: layer(x), keep_samples=False)
    candidates, _ = fusion.find(cap)
    (card,) = [c for c in fusion.group(cap, candidates) if c.fusion.pattern == "bn_act"]
    return "fused batch norm + relu (channels-last)", card, samples.fresh_inputs(card, 0, device)


def copy_gbps(device: torch.device, quick: bool) -> float:
    n = (64 << 20) if quick else (1 << 30)
    src = torch.empty(n // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    us = timing.median(timing.time_us(lambda: dst.copy_(src), device, reps=10, warmup=2, flush=False))
    return 2 * n / (us * 1e-6) / 1e9


def run_synthetic(target: str, device: torch.device, args, bw: float, deadline: float) -> tuple[list, str]:
    searches, unserved = [], []
    for label, card, tensors in synthetic_cards(device, args.quick):
        served = templates_for(card, target)
        if not served:  # say so: a family missing from the table without a word reads as covered
            why = "; ".join(f"{name}: {reason}" for name, reason in refusals(card, target).items())
            unserved.append(f"- {label} ({card.signature()[:60]}): not served on {target}: {why or 'no template'}")
        searches += [Search(card, tpl, label, tensors) for tpl in served]
    search_all(searches, target, device, args.rounds, args.width, args.reps, args.jobs, deadline)
    rows, data = [], []
    for s in searches:
        nbytes = card_bytes(s.card)
        us = s.best_us()
        gbps = nbytes / (us * 1e-6) / 1e9 if math.isfinite(us) else 0.0
        # Stock PyTorch on the same card, inputs and timing method: its own kernel on this access pattern.
        eager_us = Bench(s.card, device, s.inputs).time_eager(args.reps)
        eager_gbps = nbytes / (eager_us * 1e-6) / 1e9
        rows.append([s.label, s.card.signature()[:60], f"{nbytes / 1e6:.0f}", f"{us:.1f}", f"{gbps:.0f}",
                     f"{100 * gbps / bw:.0f}%", f"{eager_gbps:.0f}", len(s.tried), s.best])
        data.append({"family": s.template.family, "template": s.template.name, "label": s.label,
                     "card": s.card.signature(), "bytes": nbytes, "best_us": us, "gbps": gbps,
                     "fraction_of_copy": gbps / bw, "eager_us": eager_us, "eager_gbps": eager_gbps,
                     "points": len(s.tried), "best_params": s.best})
    table = tabulate(rows, ["card", "signature", "MB moved", "best µs", "GB/s", "of copy", "eager GB/s", "points",
                            "best params"], tablefmt="github")
    ok = sum(d["fraction_of_copy"] >= 0.8 for d in data)
    md = (f"## (1) Large synthetic cards vs the device copy bandwidth ({bw:.0f} GB/s, read + written)\n\n{table}\n\n"
          f"{ok} of {len(data)} reach >= 80% of copy bandwidth.\n\n")
    if unserved:
        md += "Not in the table:\n\n" + "\n".join(unserved) + "\n\n"
    return data, md


# --- (2) captured variants of recipes ---------------------------------------------------------------


def captured_cards(name: str) -> list[Card]:
    from forgepack import capture, models, recipe

    r = recipe.resolve(name)
    with models.quiet_transformers():
        lm = models.load(r)
        cap = capture.capture(lm.model, lm.forward, keep_samples=False)
    del lm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return cap.cards


def run_recipes(names: list[str], target: str, device: torch.device, args, bw: float, deadline: float):
    from forgepack.evaluate import Evaluator

    searches = []
    for name in names:
        if time.monotonic() > deadline:
            print(f"  skipping {name}: time budget spent", flush=True)
            continue
        t0 = time.monotonic()
        try:
            cards = captured_cards(name)
        except Exception:  # one broken recipe must not lose the others' results
            traceback.print_exc()
            continue
        served = [(c, t) for c in cards for t in templates_for(c, target)]
        # The variants that move the most bytes per forward first (calls x bytes), up to --per-recipe.
        served.sort(key=lambda ct: -ct[0].calls * card_bytes(ct[0]))
        print(f"  {name}: {len(cards)} variants, {len(served)} served (searching {min(len(served), args.per_recipe)}),"
              f" captured in {time.monotonic() - t0:.1f} s", flush=True)
        searches += [Search(c, t, name) for c, t in served[: args.per_recipe]]
    search_all(searches, target, device, args.recipe_rounds, args.recipe_width, args.reps, args.jobs, deadline)
    searches = [s for s in searches if s.best is not None]
    sources = [s.template.render(s.card, target, s.best) for s in searches]
    # The winners, each compiled alone with the fixed flags (in parallel), then verified and timed.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        compiled = list(pool.map(lambda src: compile_kernel(src, target), sources))
    rows, data = [], []
    with Evaluator(target, timeout_s=120) as ev:
        for s, src, obj in zip(searches, sources, compiled, strict=True):
            verdict = ev.evaluate_compiled(s.card, obj, src, margin=0.05, bench=True)
            roof_us = card_bytes(s.card) / (bw * 1e9) * 1e6
            rec = {"recipe": s.label, "op": s.card.op, "card": s.card.signature(), "calls": s.card.calls,
                   "template": s.template.name, "best_params": s.best, "points": len(s.tried),
                   "verified": verdict.category not in ("mismatch", "crash", "timeout", "compile", "static",
                                                        "nondeterministic", "mutates-input"),
                   "category": verdict.category, "reason": verdict.reason, "eager_us": verdict.eager_us,
                   "best_us": verdict.kernel_us, "speedup": verdict.speedup, "roofline_us": roof_us}
            data.append(rec)
            if verdict.speedup is None:
                rows.append([s.label, s.card.op_name, s.card.signature()[:48], "-", "-", "-", "-", verdict.category])
                continue
            rows.append([s.label, s.card.op_name, s.card.signature()[:48], f"{verdict.eager_us:.1f}",
                         f"{verdict.kernel_us:.1f}", f"{verdict.speedup:.2f}x",
                         f"{100 * roof_us / verdict.kernel_us:.0f}%", verdict.category or "accepted"])
    timed = [d for d in data if d["speedup"]]
    wins = sum(d["speedup"] >= 1.05 for d in timed)
    geo = math.exp(statistics.fmean(math.log(d["speedup"]) for d in timed)) if timed else float("nan")
    table = tabulate(rows, ["recipe", "op", "variant", "eager µs", "best µs", "speed-up", "% roofline", "verdict"],
                     tablefmt="github")
    failed = sum(not d["verified"] for d in data)
    md = (f"## (2) Captured variants: {', '.join(names)}\n\n{table}\n\n"
          f"{wins} of {len(timed)} verified variants beat eager by >= 5%; geomean speed-up {geo:.3f}x; "
          f"{failed} failed verification.\n\n")
    return {"rows": data, "wins": wins, "timed": len(timed), "geomean": geo, "failed_verification": failed}, md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--recipes", default=None, help="comma-separated recipe names or .toml paths; 'none' to skip "
                                                    "(default: the six reference recipes on cuda, none on cpu)")
    ap.add_argument("--quick", action="store_true", help="small cards, one search round (a dry run)")
    ap.add_argument("--rounds", type=int, default=4, help="hill-climb rounds on synthetic cards")
    ap.add_argument("--recipe-rounds", type=int, default=2, help="hill-climb rounds on captured variants")
    ap.add_argument("--width", type=int, default=8, help="neighbours tried per round (synthetic cards)")
    ap.add_argument("--recipe-width", type=int, default=4, help="neighbours tried per round (captured variants)")
    ap.add_argument("--per-recipe", type=int, default=10, help="captured variants searched per recipe")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2)))
    ap.add_argument("--budget-s", type=float, default=210.0, help="stop searching after this many seconds")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.recipe_rounds, args.reps = 1, 1, 5
    if args.target == "cuda" and not torch.cuda.is_available():
        print("--target cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda" if args.target == "cuda" else "cpu")
    names = args.recipes if args.recipes is not None else (",".join(REFERENCE) if args.target == "cuda" else "none")
    names = [] if names == "none" else [n for n in names.split(",") if n]
    start = time.monotonic()
    deadline = start + args.budget_s
    info = benchlib.meta()
    bw = copy_gbps(device, args.quick)
    print(f"copy bandwidth: {bw:.0f} GB/s", flush=True)
    synth, md1 = run_synthetic(args.target, device, args, bw, start + args.budget_s * (0.4 if names else 1.0))
    recipes, md2 = ({}, "") if not names else run_recipes(names, args.target, device, args, bw, deadline)
    info["elapsed_s"] = time.monotonic() - start
    md = benchlib.header_md("Offline kernel templates vs the memory roofline", info) + md1 + md2
    md += f"Whole run: {info['elapsed_s']:.0f} s.\n"
    benchlib.write("templates", {"meta": info, "copy_gbps": bw, "synthetic": synth, "recipes": recipes}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
