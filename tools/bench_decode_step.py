"""The decode step against its bandwidth floor: GPU time, wall time and kernels per step.

Each column runs in its own fresh Python process (no dynamo state shared, nothing reset by another
column), at every (batch, prompt) point asked for:

- `compiled-loop`: the strongest PyTorch-only decode a user writes (gpt-fast's recipe): a caller-owned
  `StaticCache`, an eager prefill, then a greedy loop whose whole step (forward + argmax) is
  `torch.compile(mode="reduce-overhead", fullgraph=True)`;
- `graphs`: forgepack's served `generate()` (its decode loop replaying CUDA graphs), no pack;
- `pack+graphs`: the same with a pack (`--pack WHEEL`) activated on the model: its decode blocks
  (`forgepack/blocks.py`) replace the step's chains inside the captured graph;
- `eager`: transformers' `generate()` with a static cache, nothing compiled.

A step's time is taken over `--steps` decode steps per round, `--rounds` rounds (each kept); GPU time
and the kernel count come from the profiler over one more round. The floor is (weight bytes + live KV
bytes) over the bandwidth of a device-to-device copy on this card and over its spec sheet's.

    python tools/bench_decode_step.py --recipes llama-1b-decode,qwen2-0.5b-prefill --batches 1,8 --prompts 128,1024
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SPEC_TBPS = {"H100": 3.35, "H200": 4.8}  # the vendors' spec sheets, SXM parts
COLUMNS = ("eager", "graphs", "compiled-loop")  # and pack+graphs, given --pack
TOP_KERNELS = 12  # per column in the report: enough to name where a missed target goes


def copy_bandwidth_tbps() -> float:
    """Bytes read and written per second by a 2 GiB device-to-device copy (the reachable bandwidth)."""
    import torch

    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * x.element_size() * 10 / (start.elapsed_time(end) / 1e3) / 1e12


def spec_tbps(name: str) -> float | None:
    return next((v for k, v in SPEC_TBPS.items() if k in name), None)


def step_bytes(model, batch: int, live: int) -> tuple[int, int]:
    """Weight bytes (each parameter once: a tied LM head reads the embedding table) and the live KV
    cache bytes one step reads."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * kv_heads * head_dim * live * batch * next(model.parameters()).element_size()
    return weights, kv


# ----------------------------------------------------------------------------------------------------
# One column, in its own process


def _load(recipe_name: str):
    import torch

    from forgepack import models, recipe

    model = models.load(recipe.resolve(recipe_name)).model.eval()
    torch.manual_seed(0)
    return model


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _ms(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - t0) * 1e3


def _profiled(run_steps, steps: int) -> tuple[float, int, list]:
    """GPU ms and kernels per step over `steps` steps (kernels' self device time, CUDA graphs' included),
    and the step's top kernels by GPU time (name, µs a step, calls a step): where a missed target goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return 0.0, 0, []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_steps(steps)
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    averages = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    gpu_us = sum(e.self_device_time_total for e in averages)
    top = sorted(averages, key=lambda e: -e.self_device_time_total)[:TOP_KERNELS]
    top = [[e.key[:90], round(e.self_device_time_total / steps, 1), round(e.count / steps, 2)] for e in top]
    return gpu_us / 1e3 / steps, round(len(events) / steps), top


def _compiled_loop(model, ids, steps_total: int):
    """The gpt-fast recipe on transformers' StaticCache: eager prefill, compiled greedy step."""
    import torch
    from transformers import StaticCache

    prompt = ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=prompt + steps_total + 8)  # sized by the prefill
    with torch.inference_mode():
        pos = torch.arange(prompt, device=ids.device)
        out = model(ids, past_key_values=cache, cache_position=pos, use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)

    def step(tok, cache_position):
        logits = model(tok, past_key_values=cache, cache_position=cache_position, use_cache=True).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    mode = "reduce-overhead" if ids.is_cuda else None  # the CPU runs are a smoke test of the harness
    compiled = torch.compile(step, mode=mode, fullgraph=True)
    state = {"tok": token, "pos": prompt}

    def run_steps(n: int) -> None:
        with torch.inference_mode():
            for _ in range(n):
                p = torch.tensor([state["pos"]], device=ids.device)
                state["tok"] = compiled(state["tok"].clone(), p).clone()
                state["pos"] += 1

    return run_steps


def _generate_steps(model, ids, generate):
    """generate() of n + 1 tokens: a prefill, then n decode steps (the caller takes a 1-token request off)."""
    import torch

    def run_steps(n: int) -> None:
        with torch.inference_mode():
            generate(model, ids, n + 1)

    return run_steps


def column_main(args) -> list[dict]:
    """Every (batch, prompt) point of one column, in this process: one model load, each point warmed."""
    model = _load(args.recipe)
    server = None
    if args.column == "graphs":
        from forgepack.runtime import serving

        server = serving.serve(model)
    elif args.column == "pack+graphs":
        pack = _installed(args.pack)
        if not pack.activate(strict=True, graphs=True, model=model):
            raise SystemExit("the pack did not activate")
        server = importlib.import_module(pack.__name__ + ".serving").server(model)
    points = [tuple(map(int, x.split("x"))) for x in args.points.split(",")]
    results = [point_main(model, args, batch, prompt) for batch, prompt in points]
    if server is not None:  # launches per step of each decode graph, stock and with the pack's blocks
        programs = server.stats()["decode_loop"].get("programs", {})
        for r in results:
            r["programs"] = programs
    return results


def _installed(wheel: str):
    """A pack wheel unpacked into a temporary folder and imported (as `pip install` would lay it out)."""
    import tempfile
    import zipfile

    root = Path(tempfile.mkdtemp(prefix="forgepack-pack-"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(root)
    sys.path.insert(0, str(root))
    name = next(p.name for p in root.iterdir()
                if p.is_dir() and p.name.startswith("forgepack_pack_") and "." not in p.name)  # not .dist-info
    return importlib.import_module(name)


def point_main(model, args, batch: int, prompt: int) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from forgepack.runtime.graphs import DEFAULT_WARMUP  # eager calls of a shape before graph mode captures it

    steps = args.steps
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=gen).to(model.device)
    if args.column == "compiled-loop":
        run_steps = _compiled_loop(model, ids, steps * (args.rounds + 4) + 8)
        generated = False
    else:
        extra = {"cache_implementation": "static", "disable_compile": True} if args.column == "eager" else {}

        def generate(m, x, new):
            return m.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False, **extra)

        run_steps, generated = _generate_steps(model, ids, generate), True
    run_steps(steps)  # warm: compile, capture, cache allocation
    # the 1-token request a generate() round takes off is warmed past graph mode's warm-up too: the first
    # round of every generate() column read low at 4405e9f (0.93 ms a step against 1.34), the suspect a
    # one-time cost in that round's 1-token request
    for _ in range(DEFAULT_WARMUP + 1 if generated else 1):
        run_steps(0 if generated else steps)
    graphs_before = counters["stats"]["unique_graphs"]
    rounds = []
    for _ in range(args.rounds):  # generate(): each round takes off a 1-token request timed beside it
        full = _ms(lambda: run_steps(steps))
        base = _ms(lambda: run_steps(0)) if generated else 0.0
        rounds.append((full - base) / steps)
    gpu_ms, kernels, top = _profiled(run_steps, steps)
    if generated:
        gpu_base, kernels_base, _ = _profiled(lambda n: run_steps(0), 1)
        gpu_ms, kernels = gpu_ms - gpu_base / steps, round(kernels - kernels_base / steps)
    weights, kv = step_bytes(model, batch, prompt + steps // 2)
    return {"column": args.column, "recipe": args.recipe, "batch": batch, "prompt": prompt, "steps": steps,
            "round_ms": [round(r, 4) for r in rounds], "step_ms": round(statistics.median(rounds), 4),
            "gpu_ms": round(gpu_ms, 4), "kernels": kernels, "top_kernels": top,
            "recompiles": counters["stats"]["unique_graphs"] - graphs_before,
            "weight_bytes": weights, "kv_bytes": kv}


# ----------------------------------------------------------------------------------------------------
# The driver


def run_column(column: str, recipe: str, points: str, steps: int, rounds: int, limit: float,
               pack: str | None = None) -> list[dict]:
    cmd = [sys.executable, __file__, "--column", column, "--recipe", recipe, "--points", points,
           "--steps", str(steps), "--rounds", str(rounds), *(["--pack", pack] if pack else [])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return [{"column": column, "error": f"over its {limit:.0f} s limit"}]
    line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("[")), None)
    if done.returncode or line is None:
        return [{"column": column, "error": (done.stderr or done.stdout)[-1500:]}]
    return json.loads(line)


def interval(values: list[float]) -> list[float]:
    """Bootstrap 95% interval of the median (the ratio to a constant 1: one resampler for the project)."""
    from forgepack.intervals import bootstrap_ratio_ci

    return [round(v, 4) for v in bootstrap_ratio_ci(values, [1.0])]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="llama-1b-decode")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompts", default="128,1024")
    p.add_argument("--columns", default=",".join(COLUMNS))
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--limit", type=float, default=150, help="seconds per column process")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/out"), "results"))
    p.add_argument("--column")
    p.add_argument("--recipe")
    p.add_argument("--points", help="a column process's points: BxP,BxP")
    p.add_argument("--pack", help="a pack wheel for the pack+graphs column (added to the columns when given)")
    args = p.parse_args()
    if args.column:  # a column's own process
        print(json.dumps(column_main(args)))
        return 0
    import torch

    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    copy_tbps, spec = (copy_bandwidth_tbps() if cuda else 0.0), spec_tbps(name)
    rows, results = [], []
    points = ",".join(f"{b}x{q}" for b in args.batches.split(",") for q in args.prompts.split(","))
    columns = args.columns.split(",")
    if args.pack and "pack+graphs" not in columns:
        columns.append("pack+graphs")
    for recipe in args.recipes.split(","):
        for column in columns:
            for r in run_column(column, recipe, points, args.steps, args.rounds, args.limit, args.pack):
                r.setdefault("recipe", recipe)
                if "error" not in r:
                    floor_bytes = r["weight_bytes"] + r["kv_bytes"]
                    r["floor_ms_copy"] = round(floor_bytes / (copy_tbps * 1e12) * 1e3, 4) if cuda else None
                    r["floor_ms_spec"] = round(floor_bytes / (spec * 1e12) * 1e3, 4) if spec else None
                    r["interval_ms"] = interval(r["round_ms"])
                results.append(r)
                print(json.dumps(r)[:400], flush=True)
                rows.append(_row(r))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": name, "copy_tbps": round(copy_tbps, 3), "spec_tbps": spec, "torch": torch.__version__,
            "commit": os.environ.get("FORGEPACK_COMMIT"), "argv": sys.argv[1:]}
    (out / "bench_decode_step.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    from tabulate import tabulate

    table = tabulate(rows, headers=["recipe", "b", "prompt", "column", "step ms [95%]", "GPU ms", "kernels",
                                    "recompiles", "floor ms (copy / spec)", "GPU / floor(copy)"],
                     tablefmt="github")
    text = f"# Decode step, {name}\n\ncopy bandwidth {copy_tbps:.2f} TB/s, spec {spec} TB/s\n\n{table}\n"
    for r in results:
        if r.get("top_kernels"):  # generate()'s columns include a 1-token request's prefill, spread over the steps
            text += (f"\n## Top kernels: {r['recipe']} b{r['batch']} p{r['prompt']} {r['column']}\n\n"
                     + tabulate(r["top_kernels"], headers=["kernel", "µs / step", "calls / step"],
                                tablefmt="github") + "\n")
    (out / "bench_decode_step.md").write_text(text)
    print(text)
    return 0


def _row(r: dict) -> list:
    if "error" in r:
        return [r["recipe"], "", "", r["column"], "error: " + r["error"].splitlines()[-1][:60],
                "", "", "", "", ""]
    lo, hi = r["interval_ms"]
    return [r["recipe"], r["batch"], r["prompt"], r["column"], f"{r['step_ms']:.3f} [{lo:.3f}, {hi:.3f}]",
            f"{r['gpu_ms']:.3f}", r["kernels"], r["recompiles"], f"{r['floor_ms_copy']} / {r['floor_ms_spec']}",
            f"{r['gpu_ms'] / r['floor_ms_copy']:.2f}x" if r["floor_ms_copy"] else ""]


if __name__ == "__main__":
    sys.exit(main())
