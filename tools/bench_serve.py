"""Serving benchmark: real `model.generate()` over a mixed trace of requests, columns side by side.

Columns (same model object, same trace, rounds interleaved in a rotating order):
- `eager`: `generate()` as transformers runs it (default dynamic cache);
- `pack`: a kernel pack active (`--pack WHEEL_OR_IMPORT_NAME`), default cache;
- `pack+graphs` (`graphs` without a pack): forgepack's served `generate()` (serving.py): its static
  cache per batch bucket, padded batch and prompt buckets, decode replayed from CUDA graphs; its first
  request runs right after `activate()` (`ready s`) and captures lazily, then `warmup()` captures the
  trace's buckets before the rounds (`warmup s`);
- `static+compile`: `cache_implementation="static"`, transformers compiles the forward itself (CUDA);
- `reduce-overhead`: `torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)` with the
  static cache, as transformers documents it, for the decode steps (the prefill eager, as transformers'
  own automatic compile runs it: see `decode_compiled`) (CUDA).
The compiled columns run the trace once before the rounds (`warmup s`: every shape compiled), as the
graphs column captures its buckets; past `--budget-s` their turns are skipped, and the table says so.

Reported per column: tokens/s over the rounds (real rows x new tokens), seconds per request, the first
request's latency in a cold column (capture or compile included; dynamo is reset before each compiled
column), peak GPU memory, and agreement with eager on the first `--agree` requests: every decode step's
logits against eager teacher-forced logits of the same tokens (max error over scale, top-1
agreement). One decode-heavy request per column is profiled: GPU time (kernels) and host time (the
rest of the wall time) per decode step. Greedy decoding, `min_new_tokens = max_new_tokens`.

    python tools/bench_serve.py                                 # CUDA: llama-1b and qwen2-0.5b shapes
    python tools/bench_serve.py --models tiny-llama --requests 4 --prompt 16,64 --new 8,16   # CPU smoke
Output: `<out>/results/bench_serve-<models>.json` and `.md` (date, device, commit, command).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

from forgepack import models, recipe
from forgepack.runtime import compare, graphs, serving

CUDA_MODELS = ["llama-1b-decode", "qwen2-0.5b-prefill"]
COMPILED = ("static+compile", "reduce-overhead")
HEADERS = ["column", "tokens/s", "s/request", "vs eager", "ready s", "first request s", "warmup s", "peak GiB",
           "err/scale", "top-1", "step ms", "GPU ms", "host ms (wall - GPU)", "note"]


def parse_pair(text: str) -> tuple[int, int]:
    low, high = (int(v) for v in text.split(","))
    return low, high


def make_trace(n: int, batches: list[int], prompt: tuple[int, int], new: tuple[int, int], seed: int) -> list[dict]:
    """`n` requests: batch from `batches`, prompt length log-uniform in `prompt`, new tokens uniform in `new`."""
    rng = random.Random(seed)
    trace = []
    for i in range(n):
        low, high = prompt
        length = round(low * (high / low) ** rng.random())
        trace.append({"id": i, "batch": rng.choice(batches), "prompt": length, "new": rng.randint(*new)})
    return trace


def prompts(trace: list[dict], vocab: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (r["batch"], r["prompt"]), generator=gen).to(device) for r in trace]


class Column:
    """One way of serving: `generate(ids, new)`; `enter`/`leave` bracket each of its turns."""

    def __init__(self, name: str, kwargs: dict | None = None, enter=None, leave=None, first=None, prepare=None):
        self.name, self.kwargs = name, kwargs or {}
        self.enter, self.leave, self.first = enter or (lambda: None), leave or (lambda: None), first
        self.prepare = prepare  # after the cold first request, before the rounds (graphs: capture the trace)
        self.times: list[float] = []
        self.tokens = 0
        self.info: dict[str, Any] = {}

    def generate(self, model, ids, new, **extra):
        if self.name in COMPILED and torch.cuda.is_available():
            # Each generate() is a new step for cudagraph trees: outputs of the last one (the logits a
            # column returned) may be overwritten from here on, and no later read may reach them.
            torch.compiler.cudagraph_mark_step_begin()
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                              attention_mask=torch.ones_like(ids), **self.kwargs, **extra)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def load_pack(spec: str | None) -> Any:
    if not spec:
        return None
    from bench_graphs import load_pack as load

    return load(spec)


def serving_of(pack) -> Any:
    """The serving module that serves `pack`'s model: the copy of the runtime inside the pack's wheel
    (its registry of served models is its own), else forgepack's."""
    return importlib.import_module(f"{pack.__name__}.serving") if pack else serving


def columns_for(model, pack, args, trace, ids, device) -> list[Column]:
    cols = [Column("eager")]
    stash: dict[str, Any] = {}
    kernels = (lambda on: pack.enable_only(None if on else set())) if pack else (lambda on: None)
    if pack:
        cols.append(Column("pack", enter=lambda: kernels(True), leave=lambda: kernels(False)))

    def graphs_enter():
        kernels(True)
        vars(model).update(stash)

    def graphs_leave():
        kernels(False)
        for name in ("forward", "generate"):
            if name in vars(model):
                stash[name] = vars(model).pop(name)

    # Without CUDA the graphs column runs the emulated backend: the served path end to end (a smoke test),
    # not a performance number.
    backend = {} if device.type == "cuda" else {"backend": "emulate"}

    def graphs_first():  # activate: the first request then captures lazily, as a new user's would
        if pack:
            pack.activate(graphs=True, model=model, **backend)
        else:
            serving.serve(model, **backend)

    def graphs_prepare():  # the trace's buckets captured before the rounds, as a server would at start
        serving_of(pack).warmup(model, shapes=[(r["batch"], r["prompt"], r["new"]) for r in trace])

    name = "pack+graphs" if pack else "graphs"
    cols.append(Column(name, enter=graphs_enter, leave=graphs_leave, first=graphs_first, prepare=graphs_prepare))
    if not args.no_loop_column:
        cols.append(generate_loop_column(name, model, pack, graphs_enter, graphs_leave, trace, ids))
    if device.type == "cuda" and not args.no_compile:
        cols.append(Column("static+compile", {"cache_implementation": "static"},
                           first=lambda: torch._dynamo.reset()))
        cols[-1].prepare = lambda c=cols[-1]: run_trace(c, model, trace, ids)
        compiled: dict[str, Any] = {}

        def ro_enter():
            if "forward" not in compiled:
                torch._dynamo.reset()
                compiled["forward"] = decode_compiled(model.forward)
            vars(model)["forward"] = compiled["forward"]

        cols.append(Column("reduce-overhead", {"cache_implementation": "static", "disable_compile": True},
                           enter=ro_enter, leave=lambda: vars(model).pop("forward", None)))
        cols[-1].prepare = lambda c=cols[-1]: run_trace(c, model, trace, ids)
    return cols


def generate_loop_column(name: str, model, pack, enter, leave, trace, ids) -> Column:
    """The same server with `decode_loop=False`: every decode step goes through transformers' own
    generate() loop, one graph replay per forward (the lever the decode loop pulls, side by side)."""
    saved: dict[str, Any] = {}

    def loop_enter():
        enter()
        server = serving_of(pack).server(model)
        if server is not None:
            saved["options"] = server.options
            server.options = dataclasses.replace(server.options, decode_loop=False)

    def loop_leave():
        server = serving_of(pack).server(model)
        if server is not None and "options" in saved:
            server.options = saved.pop("options")
        leave()

    col = Column(f"{name} (generate loop)", enter=loop_enter, leave=loop_leave)
    col.prepare = lambda: run_trace(col, model, trace, ids)
    return col


def decode_compiled(forward):
    """`torch.compile(mode="reduce-overhead")` for the decode steps, the prefill eager, as transformers'
    own automatic compile does: a static cache allocates its tensors lazily in its first forward, and
    allocated inside a CUDA graph tree they are graph outputs the next replay overwrites (the H200 raised
    "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run")."""
    compiled = torch.compile(forward, mode="reduce-overhead", fullgraph=True)

    def dispatch(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        return compiled(*args, **kwargs) if ids is not None and ids.shape[-1] == 1 else forward(*args, **kwargs)

    return dispatch


def graphs_prepare_of(cols: list[Column]) -> Any:
    return next((c.prepare for c in cols if "graphs" in c.name), None)


def run_trace(col: Column, model, trace: list[dict], ids_list: list[torch.Tensor]) -> None:
    """Every request of the trace once: compiled columns compile each new shape here, before the rounds,
    as graph mode captures its buckets in `warmup()`."""
    for ids, req in zip(ids_list, trace, strict=True):
        col.generate(model, ids, req["new"])


def agreement(col: Column, model, twin_forward, ids_list, trace, count: int) -> dict:
    """Teacher-forced: each decode step's logits against eager logits of the same sequence, per row."""
    errs, agree, total = [], 0, 0
    for ids, req in list(zip(ids_list, trace, strict=True))[:count]:
        out = col.generate(model, ids, req["new"], output_logits=True, return_dict_in_generate=True)
        steps = torch.stack(out.logits, 1).float()  # [batch, new, vocab]
        for row in range(min(ids.shape[0], 2)):
            seq = out.sequences[row:row + 1]
            ref = twin_forward(input_ids=seq, use_cache=False, logits_to_keep=req["new"] + 1).logits[0, :-1].float()
            got = steps[row]
            errs.append(compare.scale_error(ref, got))
            agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
            total += ref.shape[0]
    return {"max_err_over_scale": max(errs) if errs else None, "top1": agree / total if total else None}


def profile_step(col: Column, model, ids, new, device) -> dict:
    """GPU (kernel) time and host time per decode step of one request: a profiled request of `new`
    tokens less a profiled request of one token (its prefill), over the `new - 1` decode steps."""
    if device.type != "cuda" or new < 2:
        return {}
    from torch.profiler import ProfilerActivity, profile

    def measured(tokens: int) -> tuple[float, float]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall, _ = timed(lambda: col.generate(model, ids, tokens), device)
        # self device time is the kernels' own (an op's total would count its kernels again)
        return wall, sum(e.self_device_time_total for e in prof.key_averages()) / 1e3

    wall_one, gpu_one = measured(1)
    wall, gpu = measured(new)
    step_ms, gpu_ms = (wall - wall_one) * 1e3 / (new - 1), (gpu - gpu_one) / (new - 1)
    return {"step_ms": round(step_ms, 3), "gpu_ms": round(gpu_ms, 3), "host_ms": round(max(step_ms - gpu_ms, 0), 3)}


def bench_model(name: str, args, pack) -> dict:
    lm = models.load(recipe.resolve(name))
    model = lm.model
    device = next(model.parameters()).device
    twin_forward = graphs.eager_forward(model)
    trace = make_trace(args.requests, args.batches, args.prompt, args.new, args.seed)
    cap = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    trace = [r for r in trace if r["prompt"] + r["new"] <= cap]
    ids_list = prompts(trace, int(model.config.vocab_size), device, args.seed)
    cols = columns_for(model, pack, args, trace, ids_list, device)
    if pack:
        pack.activate()
        pack.enable_only(set())
    start = time.perf_counter()
    over = lambda: time.perf_counter() - start > args.budget_s  # noqa: E731
    for col in cols:  # cold: the first request of each column, capture/compile included
        if col.name in COMPILED and over():
            col.info["note"] = f"skipped: over the time budget ({args.budget_s:g} s)"
            continue
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        ready = 0.0
        if col.first:
            ready, _ = timed(col.first, device)
        if col.prepare is graphs_prepare_of(cols) and serving_of(pack).server(model) is None:
            col.info["note"] = "generate() not served (the warnings above say why)"
            continue
        col.enter()
        first, _ = timed(lambda c=col: c.generate(model, ids_list[0], trace[0]["new"]), device)
        col.info.update({"ready_s": round(ready, 3), "first_request_s": round(first, 3)})
        if col.prepare:
            col.info["warmup_s"] = round(timed(col.prepare, device)[0], 3)
        with torch.no_grad():
            col.info.update(agreement(col, model, twin_forward, ids_list, trace, args.agree))
        col.info.update(profile_step(col, model, ids_list[0][:1], min(64, trace[0]["new"]), device))
        col.leave()
        print(f"{name} {col.name}: ready {ready:.2f} s, first request {first:.2f} s", flush=True)
    for r in range(args.rounds):
        for col in cols[r % len(cols):] + cols[:r % len(cols)]:
            if "note" in col.info or (col.name in COMPILED and over()):
                col.info.setdefault("note", f"rounds cut at the time budget ({args.budget_s:g} s)")
                continue
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            col.enter()
            for ids, req in zip(ids_list, trace, strict=True):
                seconds, _ = timed(lambda c=col, i=ids, n=req["new"]: c.generate(model, i, n), device)
                col.times.append(seconds)
                col.tokens += ids.shape[0] * req["new"]
            if device.type == "cuda":
                col.info["peak_gib"] = max(col.info.get("peak_gib", 0), torch.cuda.max_memory_allocated(device) / 2**30)
            col.leave()
        print(f"{name}: round {r + 1}/{args.rounds} done", flush=True)
    served = serving_of(pack).server(model)
    if served is not None:
        next(c for c in cols if c.first is not None and "graphs" in c.name).info["serving"] = served.stats()
    serving_of(pack).stop_all()
    result = {"trace": trace, "columns": {}}
    eager_tps = None
    for col in cols:
        total = sum(col.times)
        if not total:
            result["columns"][col.name] = {"tokens_per_s": None, "s_per_request": None, "vs_eager": None, **col.info}
            continue
        tps = col.tokens / total
        eager_tps = eager_tps or tps
        per_request = [round(statistics.median(col.times[i::len(trace)]), 4) for i in range(len(trace))]
        result["columns"][col.name] = {"tokens_per_s": round(tps, 1), "s_per_request": round(total / len(col.times), 4),
                                       "vs_eager": round(tps / eager_tps, 3), "request_s": per_request, **col.info}
    lm.model = model = None  # free the weights before the next model
    gc.collect()
    return result


def markdown(info: dict, results: dict, args) -> str:
    text = benchlib.header_md("Serving: generate() over a mixed trace", info)
    text += (f"Trace: {args.requests} requests, batch {args.batches}, prompts {args.prompt[0]}-{args.prompt[1]}, "
             f"{args.new[0]}-{args.new[1]} new tokens, seed {args.seed}; {args.rounds} rounds interleaved.\n\n")
    if not torch.cuda.is_available():
        text += "No CUDA: the graphs column is the emulated backend (the served path, not its speed).\n\n"
    for name, res in results.items():
        rows = []
        for col, v in res["columns"].items():
            rows.append([col, v["tokens_per_s"], v["s_per_request"], v["vs_eager"], v.get("ready_s"),
                         v.get("first_request_s"), v.get("warmup_s"), v.get("peak_gib") and round(v["peak_gib"], 2),
                         v.get("max_err_over_scale") is not None and f"{v['max_err_over_scale']:.2e}",
                         v.get("top1") is not None and f"{v['top1']:.4f}", v.get("step_ms"), v.get("gpu_ms"),
                         v.get("host_ms"), v.get("note", "")])
        text += f"## {name}\n\n" + tabulate(rows, headers=HEADERS, tablefmt="github") + "\n\n"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="recipes, comma-separated (default: the 1B/0.5B shapes on "
                                                       "CUDA, tiny-llama on CPU)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--prompt", default="16,2048", help="prompt lengths, low,high (log-uniform)")
    parser.add_argument("--new", default="64,256", help="new tokens, low,high")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--agree", type=int, default=2, help="requests checked teacher-forced against eager")
    parser.add_argument("--pack", default=None, help="a pack wheel or import name (pack and pack+graphs columns)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile columns")
    parser.add_argument("--no-loop-column", action="store_true",
                        help="leave out the graphs column served through generate()'s own loop (decode_loop=False)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="per model: compiled columns' turns are skipped (and say so) after this many seconds")
    parser.add_argument("--out", default=None, help="output folder (default ${OUT:-benchmarks/out}/results)")
    args = parser.parse_args()
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
        args.prompt, args.new = parse_pair(args.prompt), parse_pair(args.new)
    except ValueError:
        parser.error("--batches is a comma-separated list; --prompt and --new are low,high")
    names = args.models.split(",") if args.models else (CUDA_MODELS if torch.cuda.is_available() else ["tiny-llama"])
    if args.out:
        import os

        os.environ["OUT"] = args.out
    pack = load_pack(args.pack)
    info = benchlib.meta()
    results = {name: bench_model(name, args, pack) for name in names}
    name = "bench_serve-" + "-".join(names)  # one run per model can share an --out folder
    folder = benchlib.write(name, {**info, "args": dict(vars(args)), "results": results}, markdown(info, results, args))
    print(f"wrote {folder}/{name}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
