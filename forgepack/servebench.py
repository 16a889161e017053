"""The serving benchmark behind `forgepack bench --serve` and `tools/bench_serve.py`: real
`model.generate()` over a mixed trace of requests, columns side by side.

Columns (same model object, same trace, rounds interleaved in a rotating order):
- `eager`: `generate()` as transformers runs it (default dynamic cache);
- `pack`: a kernel pack active (`pack=` a wheel or an import name), default cache;
- `pack+graphs` (`graphs` without a pack): forgepack's served `generate()` (runtime/serving.py): its
  static cache per batch bucket, padded batch and prompt buckets, decode replayed from CUDA graphs; its
  first request runs right after `activate()` (`ready s`) and captures lazily, then `warmup()` captures
  the trace's buckets before the rounds (`warmup s`). Without CUDA it runs the emulated backend: the
  served path end to end, not its speed;
- `static+compile`: `cache_implementation="static"`, transformers compiles the forward itself (CUDA);
- `reduce-overhead`: `torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)` with the
  static cache, as transformers documents it, for the decode steps (the prefill eager, as transformers'
  own automatic compile runs it: see `decode_compiled`) (CUDA).
The compiled columns run the trace once before the rounds (`warmup s`: every shape compiled), as the
graphs column captures its buckets; past `budget_s` (counted from the start of the model's run, the
cold process included) their turns are skipped, and the table says so.

Reported per column: tokens/s over the rounds (real rows x new tokens), seconds per request, the first
request's latency in a cold column of this process (`first request s`: capture or compile included;
dynamo is reset before each compiled column), peak GPU memory, and agreement with eager on the first
`agree` requests: every decode step's logits against eager teacher-forced logits of the same tokens
(max error over scale, top-1 agreement, and top-1 agreement where eager's top two logits are not a
near-tie: `top-1 (clear)`, with the share of such steps). One decode-heavy request per column is profiled: GPU time
(kernels) and host time (the rest of the wall time) per decode step. Greedy decoding,
`min_new_tokens = max_new_tokens`.

The graphs column's first request is also measured from a cold process (`cold_process`, `cold s`): a
fresh Python loads the model, then `activate()` (or `serving.serve`) and the trace's first request are
timed, nothing of this process warm (CUDA context, cuBLAS, allocator, imports of the served path). It
runs before this process loads the model, so the two never share the GPU's memory.

    result = servebench.bench_model(recipe, ServeSettings(requests=4), pack=None, note=print_note)

The fair peers (`bench_peers`, `--peers`): each column in a fresh process of its own
(`forgepack.servepeers`: no dynamo state shared, nothing reset by another column), every shape of the
trace warmed before the rounds, the rounds sent one column at a time in a rotating order. Columns
`eager`, `static-pinned`, `compiled-loop`, `graphs`, `pack+graphs` (with a pack); per column
`round_s`, median tokens/s and its bootstrap 95% `interval`, the ratio to every peer with its interval
(rounds paired), `recompiles` during the rounds (with the guard-failure reasons), the cold process's
`load_s`, `ready_s`, `first_request_s` (compile or capture included) and `warmup_s`, and how many
requests' greedy tokens equal eager's (all of them on a trained model: `forgepack.trainedlm`). Beside
the columns, `time_share` and `call_share`: the share of the stock trace's time (GPU time on CUDA,
wall time on the CPU) and of its aten calls that the pack's kernels replace, over every op of the
prefills and decode steps (`forgepack.servedshare`, in a fresh process; 0 without a pack).

    result = servebench.bench_peers(recipe, ServeSettings(requests=8, rounds=5), pack_spec=None)
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from forgepack.errors import UsageError

CUDA_MODELS = ["llama-1b-decode", "qwen2-0.5b-prefill"]
COMPILED = ("static+compile", "reduce-overhead")
TITLE = "Serving: generate() over a mixed trace"
HEADERS = ["column", "tokens/s", "s/request", "vs eager", "ready s", "first request s", "warmup s", "peak GiB",
           "err/scale", "top-1", "top-1 (clear)", "step ms", "GPU ms", "host ms (wall - GPU)", "cold s", "note"]
COLD_TIMEOUT_S = 600

Note = Callable[[str, int, int], None]  # (text, steps done, steps in all)


@dataclass(frozen=True)
class ServeSettings:
    """The trace and how it is run. `cold`: also time the graphs column's first request in a fresh process."""

    requests: int = 16
    batches: tuple[int, ...] = (1, 2, 4, 8)
    prompt: tuple[int, int] = (16, 2048)
    new: tuple[int, int] = (64, 256)
    seed: int = 0
    rounds: int = 2
    agree: int = 2
    no_compile: bool = False
    budget_s: float = 480.0
    cold: bool = True
    loop_column: bool = True  # also the same server through generate()'s own loop (decode_loop=False)

    def __post_init__(self):
        object.__setattr__(self, "batches", tuple(int(b) for b in self.batches))
        object.__setattr__(self, "prompt", tuple(int(v) for v in self.prompt))
        object.__setattr__(self, "new", tuple(int(v) for v in self.new))
        if not self.batches or min(self.batches) < 1:
            raise UsageError(f"--batches must be positive batch sizes, got {list(self.batches)}")
        for name in ("prompt", "new"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise UsageError(f"--{name} must be low,high with 1 <= low <= high, got {low},{high}")
        if self.requests < 1 or self.rounds < 1 or self.agree < 0:
            raise UsageError("--requests and --rounds must be at least 1, --agree at least 0")

    @classmethod
    def parse(cls, batches: str, prompt: str, new: str, **rest: Any) -> ServeSettings:
        """From the command line's text: `batches` "1,2,4,8", `prompt` and `new` "low,high"."""
        try:
            sizes = [int(b) for b in batches.split(",")]
            pairs = parse_pair(prompt), parse_pair(new)
        except ValueError:
            raise UsageError("--batches is a comma-separated list; --prompt and --new are low,high") from None
        return cls(batches=tuple(sizes), prompt=pairs[0], new=pairs[1], **rest)


def parse_pair(text: str) -> tuple[int, int]:
    low, high = (int(v) for v in text.split(","))
    return low, high


def make_trace(n: int, batches, prompt: tuple[int, int], new: tuple[int, int], seed: int) -> list[dict]:
    """`n` requests: batch from `batches`, prompt length log-uniform in `prompt`, new tokens uniform in `new`."""
    rng = random.Random(seed)
    trace = []
    for i in range(n):
        low, high = prompt
        length = round(low * (high / low) ** rng.random())
        trace.append({"id": i, "batch": rng.choice(list(batches)), "prompt": length, "new": rng.randint(*new)})
    return trace


def prompts(trace: list[dict], vocab: int, device, seed: int) -> list:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (r["batch"], r["prompt"]), generator=gen).to(device) for r in trace]


def trace_for(settings: ServeSettings, cap: int) -> list[dict]:
    """The settings' trace, less the requests longer than the model's positions."""
    trace = make_trace(settings.requests, settings.batches, settings.prompt, settings.new, settings.seed)
    return [r for r in trace if r["prompt"] + r["new"] <= cap]


# ----------------------------------------------------------------------------------------------------
# Columns


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
        import torch

        if self.name in COMPILED and torch.cuda.is_available():
            # Each generate() is a new step for cudagraph trees: outputs of the last one (the logits a
            # column returned) may be overwritten from here on, and no later read may reach them.
            torch.compiler.cudagraph_mark_step_begin()
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                              attention_mask=torch.ones_like(ids), **self.kwargs, **extra)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def load_pack(spec: str | None, stack: contextlib.ExitStack) -> Any:
    """A pack module from a wheel (unpacked for the duration of `stack`) or an importable name."""
    if not spec:
        return None
    if spec.endswith(".whl"):
        from forgepack import bench

        return bench.load_pack(Path(spec), stack)
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError:
        raise UsageError(f"pack {spec}: neither a .whl file nor an importable pack") from None


def serving_of(pack: Any) -> Any:
    """The serving module that serves the model: the pack's own copy of the runtime when there is a
    pack (its servers are not forgepack's), forgepack's runtime otherwise."""
    if pack is None:
        from forgepack.runtime import serving

        return serving
    return importlib.import_module(f"{pack.__name__}.serving")


def graphs_backend(device) -> dict:
    """Without CUDA the graphs column runs the emulated backend: the served path end to end, not its speed."""
    return {} if device.type == "cuda" else {"backend": "emulate"}


def columns_for(model, pack, settings: ServeSettings, trace, ids, device) -> list[Column]:
    import torch

    cols = [Column("eager")]
    stash: dict[str, Any] = {}
    serving = serving_of(pack)
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

    backend = graphs_backend(device)

    def graphs_first():  # activate: the first request then captures lazily, as a new user's would
        if pack:
            pack.activate(graphs=True, model=model, **backend)
        else:
            serving.serve(model, **backend)

    def graphs_prepare():  # the trace's buckets captured before the rounds, as a server would at start
        serving.warmup(model, shapes=[(r["batch"], r["prompt"], r["new"]) for r in trace])

    name = "pack+graphs" if pack else "graphs"
    cols.append(Column(name, enter=graphs_enter, leave=graphs_leave, first=graphs_first, prepare=graphs_prepare))
    if settings.loop_column:
        cols.append(generate_loop_column(name, model, serving, graphs_enter, graphs_leave, trace, ids))
    if device.type == "cuda" and not settings.no_compile:
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


def generate_loop_column(name: str, model, serving, enter, leave, trace, ids) -> Column:
    """The same server with `decode_loop=False`: every decode step goes through transformers' own
    generate() loop, one graph replay per forward (the lever the decode loop pulls, side by side)."""
    saved: dict[str, Any] = {}

    def loop_enter():
        enter()
        server = serving.server(model)
        if server is not None:
            saved["options"] = server.options
            server.options = dataclasses.replace(server.options, decode_loop=False)

    def loop_leave():
        server = serving.server(model)
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
    import torch

    compiled = torch.compile(forward, mode="reduce-overhead", fullgraph=True)

    def dispatch(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        return compiled(*args, **kwargs) if ids is not None and ids.shape[-1] == 1 else forward(*args, **kwargs)

    return dispatch


def graphs_prepare_of(cols: list[Column]) -> Any:
    return next((c.prepare for c in cols if "graphs" in c.name), None)


def run_trace(col: Column, model, trace: list[dict], ids_list: list) -> None:
    """Every request of the trace once: compiled columns compile each new shape here, before the rounds,
    as graph mode captures its buckets in `warmup()`."""
    for ids, req in zip(ids_list, trace, strict=True):
        col.generate(model, ids, req["new"])


@dataclass
class Agreement:
    """Teacher-forced agreement, tallied over generate() outputs: each decode step's logits against eager
    logits of the same sequence (no cache), for the first two rows of each output."""

    errs: list[float] = dataclasses.field(default_factory=list)
    agree: int = 0
    total: int = 0
    clear_agree: int = 0
    clear_total: int = 0

    def add(self, twin_forward, out, new: int) -> None:
        """`out`: a generate() output with `.logits` (output_logits=True) of `new` steps."""
        import torch

        from forgepack.runtime import compare

        steps = torch.stack(out.logits, 1).float()  # [batch, new, vocab]
        for row in range(min(steps.shape[0], 2)):
            seq = out.sequences[row:row + 1]
            ref = twin_forward(input_ids=seq, use_cache=False, logits_to_keep=new + 1).logits[0, :-1].float()
            self.errs.append(compare.scale_error(ref, steps[row]))
            same = ref.argmax(-1) == steps[row].argmax(-1)
            clear = clear_positions(ref)
            self.agree += int(same.sum())
            self.total += ref.shape[0]
            self.clear_agree += int((same & clear).sum())
            self.clear_total += int(clear.sum())

    def summary(self) -> dict:
        t, c = self.total, self.clear_total
        return {"max_err_over_scale": max(self.errs) if self.errs else None, "top1": self.agree / t if t else None,
                "top1_clear": self.clear_agree / c if c else None, "clear_share": c / t if t else None}


def agreement(col: Column, model, twin_forward, ids_list, trace, count: int) -> dict:
    """A column's agreement with eager over the trace's first `count` requests."""
    tally = Agreement()
    for ids, req in list(zip(ids_list, trace, strict=True))[:count]:
        out = col.generate(model, ids, req["new"], output_logits=True, return_dict_in_generate=True)
        tally.add(twin_forward, out, req["new"])
    return tally.summary()


# A step whose eager top two logits lie closer than this share of the step's logit scale is a near-tie:
# random-weight models have many, and every column (eager's own cached decode included, against its
# teacher-forced twin) flips some of them, since the columns' errors run at 2-3% of the scale in bf16.
CLEAR_GAP = 0.05


def clear_positions(ref):
    """Decode steps (rows of `ref`, [steps, vocab]) whose eager top-1 leads its runner-up by at least
    CLEAR_GAP of the step's largest |logit|: there a different top-1 is an error, not a tie broken."""
    top = ref.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]) >= CLEAR_GAP * ref.abs().amax(-1)


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


# ----------------------------------------------------------------------------------------------------
# One model


def _silent(text: str, done: int, total: int) -> None:
    pass


def bench_model(recipe, settings: ServeSettings, pack: Any = None, note: Note | None = None, label: str | None = None,
                pack_spec: str | None = None) -> dict:
    """Every column over the settings' trace on `recipe`'s model; `note` hears each cold column and each
    round (text, done, total). `pack`: a loaded pack module; `pack_spec`: how a cold process loads it."""
    import torch

    from forgepack import models
    from forgepack.runtime import graphs

    note = note or _silent
    name = label or recipe.name
    start = time.perf_counter()  # the budget counts the cold process too: the whole run stays near it
    cold = None
    if settings.cold:
        note(f"{name}: the first request from a cold process", 0, 1)
        cold = cold_process(recipe, settings, pack_spec or (pack.__name__ if pack else None))
    note(f"{name}: loading the model", 0, 1)
    lm = models.load(recipe)
    model = lm.model
    device = next(model.parameters()).device
    twin_forward = graphs.eager_forward(model)
    trace = trace_for(settings, int(getattr(model.config, "max_position_embeddings", 1 << 30)))
    if not trace:
        raise UsageError(f"{name}: no request of the trace fits the model's {model.config.max_position_embeddings} "
                         "positions (lower --prompt or --new)")
    ids_list = prompts(trace, int(model.config.vocab_size), device, settings.seed)
    cols = columns_for(model, pack, settings, trace, ids_list, device)
    serving = serving_of(pack)
    if pack:
        pack.activate()
        pack.enable_only(set())
    total_steps, done = len(cols) * (1 + settings.rounds), 0
    over = lambda: time.perf_counter() - start > settings.budget_s  # noqa: E731
    for col in cols:  # cold: the first request of each column, capture/compile included
        done += 1
        if col.name in COMPILED and over():
            col.info["note"] = f"skipped: over the time budget ({settings.budget_s:g} s)"
            continue
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        ready = 0.0
        if col.first:
            ready, _ = timed(col.first, device)
        if col.prepare is graphs_prepare_of(cols) and serving.server(model) is None:
            col.info["note"] = "graph mode is off in the pack's manifest: not served"
            continue
        col.enter()
        first, _ = timed(lambda c=col: c.generate(model, ids_list[0], trace[0]["new"]), device)
        col.info.update({"ready_s": round(ready, 3), "first_request_s": round(first, 3)})
        if col.prepare:
            col.info["warmup_s"] = round(timed(col.prepare, device)[0], 3)
        with torch.no_grad():
            col.info.update(agreement(col, model, twin_forward, ids_list, trace, settings.agree))
        col.info.update(profile_step(col, model, ids_list[0][:1], min(64, trace[0]["new"]), device))
        col.leave()
        note(f"{name} {col.name}: ready {ready:.2f} s, first request {first:.2f} s", done, total_steps)
    for r in range(settings.rounds):
        for col in cols[r % len(cols):] + cols[:r % len(cols)]:
            done += 1
            if "note" in col.info or (col.name in COMPILED and over()):
                col.info.setdefault("note", f"rounds cut at the time budget ({settings.budget_s:g} s)")
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
        note(f"{name}: round {r + 1}/{settings.rounds} done", done, total_steps)
    graphs_col = next(c for c in cols if c.first is not None and "graphs" in c.name)
    served = serving.server(model)
    if served is not None:
        graphs_col.info["serving"] = served.stats()
    if cold is not None:
        graphs_col.info["cold_process"] = cold
    serving.stop_all()
    result = {"trace": trace, "columns": summarise(cols, len(trace))}
    lm.model = model = None  # free the weights before the next model
    gc.collect()
    return result


def summarise(cols: list[Column], requests: int) -> dict[str, dict]:
    """Tokens/s and seconds per request per column, and each request's median over the rounds."""
    out, eager_tps = {}, None
    for col in cols:
        total = sum(col.times)
        if not total:
            out[col.name] = {"tokens_per_s": None, "s_per_request": None, "vs_eager": None, **col.info}
            continue
        tps = col.tokens / total
        eager_tps = eager_tps or tps
        per_request = [round(statistics.median(col.times[i::requests]), 4) for i in range(requests)
                       if col.times[i::requests]]
        out[col.name] = {"tokens_per_s": round(tps, 1), "s_per_request": round(total / len(col.times), 4),
                         "vs_eager": round(tps / eager_tps, 3), "request_s": per_request, **col.info}
    return out


# ----------------------------------------------------------------------------------------------------
# The first request from a cold process


def cold_process(recipe, settings: ServeSettings, pack_spec: str | None) -> dict:
    """The graphs column's first request timed in a fresh Python (see the module docstring): `load_s`
    (the model), `ready_s` (activate or serve), `first_request_s`, `since_activate_s` (the two
    together: what a server started cold waits before its first answer). A failure is reported, not
    raised: it must not cost the rest of the benchmark."""
    from forgepack import recipe as recipe_mod

    with tempfile.TemporaryDirectory(prefix="forgepack-cold-") as tmp:
        path = Path(tmp) / "recipe.toml"
        path.write_text(recipe_mod.dumps(recipe))
        job = {"recipe": str(path), "settings": asdict(settings), "pack": pack_spec}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_repo_root(), os.environ.get("PYTHONPATH")]))}
        limit = min(COLD_TIMEOUT_S, max(60.0, settings.budget_s))  # a hung process must not eat the run
        try:
            proc = subprocess.run([sys.executable, "-m", "forgepack.servebench", json.dumps(job)], capture_output=True,
                                  text=True, timeout=limit, env=env, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"the cold process ran past {limit:g} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"the cold process failed (exit {proc.returncode}): {tail}"}
    return json.loads(lines[-1])


def _repo_root() -> str:
    return str(Path(__file__).resolve().parent.parent)


def _cold_main(job_text: str) -> int:
    """In the fresh process: load the model, then time activation and the trace's first request."""
    job = json.loads(job_text)
    settings = ServeSettings(**job["settings"])
    import torch

    from forgepack import models
    from forgepack import recipe as recipe_mod

    start = time.perf_counter()
    with contextlib.ExitStack() as stack, models.quiet_transformers():
        pack = load_pack(job["pack"], stack)
        lm = models.load(recipe_mod.load(job["recipe"]))
        model, device = lm.model, lm.device
        trace = trace_for(settings, int(getattr(model.config, "max_position_embeddings", 1 << 30)))
        ids = prompts(trace[:1], int(model.config.vocab_size), device, settings.seed)[0]
        sync(device)
        load_s = time.perf_counter() - start
        backend = graphs_backend(device)
        activate = (lambda: pack.activate(graphs=True, model=model, **backend)) if pack else (
            lambda: serving_of(None).serve(model, **backend))
        ready, _ = timed(activate, device)
        first, _ = timed(lambda: Column("graphs").generate(model, ids, trace[0]["new"]), device)
        served = serving_of(pack).server(model)
        replays = served.stats()["graphs"]["replays"] if served is not None else None
    print(json.dumps({"load_s": round(load_s, 3), "ready_s": round(ready, 3), "first_request_s": round(first, 3),
                      "since_activate_s": round(ready + first, 3), "served": served is not None,
                      "replays": replays, "device": str(torch.device(device))}))
    return 0


# ----------------------------------------------------------------------------------------------------
# The fair peers: one fresh process per column (forgepack.servepeers), rounds in a rotating order

PEER_TIMEOUT_S = 900  # one column's setup and warm-up, or one round; a hung process must not hang the run
PEER_HEADERS = ["column", "tokens/s", "95% interval", "vs eager", "vs eager 95%", "ready s", "first request s",
                "warmup s", "recompiles", "tokens = eager", "note"]


def peer_columns(pack_spec: str | None, no_compile: bool = False) -> list[str]:
    names = ["eager"] + ([] if no_compile else ["static-pinned", "compiled-loop"]) + ["graphs"]
    return names + (["pack+graphs"] if pack_spec else [])


def trained_grammar(recipe) -> bool:
    """A model trained by forgepack.trainedlm: its prompts come from its grammar, its tokens are checkable."""
    from forgepack import trainedlm

    path = getattr(recipe.model, "path", None)
    return bool(path) and (Path(path) / trainedlm._MARKER).is_file()


def positions_of(recipe) -> int:
    """The model's positions, read from its config without loading it (the columns load it, each its own)."""
    config = dict(recipe.model.config or {})
    path = getattr(recipe.model, "path", None)
    if not config and path and (Path(path) / "config.json").is_file():
        config = json.loads((Path(path) / "config.json").read_text())
    return int(config.get("max_position_embeddings", 1 << 30))


class Peer:
    """One column's process: started, set up and warmed (`ready`), then driven one round at a time."""

    def __init__(self, name: str, args: list[str], env: dict, log: Path):
        self.name, self.log = name, log
        with log.open("w") as err:  # a file, not a pipe: a chatty compile must not fill a pipe and block
            self.proc = subprocess.Popen([sys.executable, "-m", "forgepack.servepeers", "--column", name, *args],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                         env=env)
        self.info: dict[str, Any] = {}
        self.rounds: list[dict] = []
        self.lines: queue.Queue = queue.Queue()
        # a reader thread, so that a column that hangs is waited on for PEER_TIMEOUT_S, not for ever
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def read(self, event: str) -> dict:
        while True:
            try:
                line = self.lines.get(timeout=PEER_TIMEOUT_S)
            except queue.Empty:
                self.close()
                raise RuntimeError(f"column {self.name} gave no answer in {PEER_TIMEOUT_S} s") from None
            if line is None:
                break
            if line.startswith("{") and json.loads(line).get("event") == event:
                return json.loads(line)
        tail = (self.log.read_text().strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"column {self.name} ended (exit {self.proc.wait()}): {tail}")

    def send(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_peer(name: str, args: list[str], env: dict, log: Path) -> Peer:
    """A column's process, waited on until it is warm: columns set up one after the other, so each one's
    first request and compile times are its own, not shared with another column's compile."""
    peer = Peer(name, args, env, log)
    try:
        peer.info = peer.read("ready")
    except RuntimeError as err:
        peer.info = {"error": str(err)}
        peer.close()
    return peer


def bench_peers(recipe, settings: ServeSettings, pack_spec: str | None = None, note: Note | None = None,
                label: str | None = None) -> dict:
    """Every peer column in a process of its own over the settings' trace, `settings.rounds` rounds in a
    rotating order (one process runs at a time); per column the rounds' times, tokens/s with its bootstrap
    interval, its ratio to every peer (paired by round), recompiles during the rounds, tokens against eager."""
    from forgepack import recipe as recipe_mod

    note = note or _silent
    name = label or recipe.name
    trace = trace_for(settings, positions_of(recipe))
    if not trace:
        raise UsageError(f"{name}: no request of the trace fits the model's positions (lower --prompt or --new)")
    names = peer_columns(pack_spec, settings.no_compile)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_repo_root(), os.environ.get("PYTHONPATH")]))}
    total, done = len(names) * (1 + settings.rounds), 0
    with tempfile.TemporaryDirectory(prefix="forgepack-peers-") as tmp, contextlib.ExitStack() as stack:
        (Path(tmp) / "recipe.toml").write_text(recipe_mod.dumps(recipe))
        (Path(tmp) / "trace.json").write_text(json.dumps(trace))
        args = ["--model", str(Path(tmp) / "recipe.toml"), "--trace", str(Path(tmp) / "trace.json"),
                "--seed", str(settings.seed), *(["--grammar"] if trained_grammar(recipe) else [])]
        peers = []
        for col in names:
            note(f"{name} {col}: a fresh process, set up and warmed", done, total)
            extra = ["--pack", pack_spec] if col == "pack+graphs" else []
            peers.append(start_peer(col, args + extra, env, Path(tmp) / f"{col}.log"))
            stack.callback(peers[-1].close)
            done += 1
        live = [p for p in peers if "error" not in p.info]
        for r in range(settings.rounds):
            for peer in live[r % len(live):] + live[:r % len(live)]:
                drive(peer, "round", peer.rounds.append)
                done += 1
            live = [p for p in live if "error" not in p.info]
            note(f"{name}: round {r + 1}/{settings.rounds} done", done, total)
        for peer in live:
            drive(peer, "stop", peer.info.update)
        for peer in peers:
            peer.close()
        note(f"{name}: the stock time the pack replaces", done, total)
        coverage = coverage_process(args + (["--pack", pack_spec] if pack_spec else []), env)
    eager = next((p for p in peers if p.name == "eager"), None)
    return {"trace": trace, "peers": True, "grammar": trained_grammar(recipe), "columns": summarise_peers(peers),
            "eager_tokens": eager.info.get("tokens") if eager else None, "time_share": coverage.get("time_share"),
            "call_share": coverage.get("call_share"), "coverage": coverage}


def coverage_process(args: list[str], env: dict) -> dict:
    """`forgepack.servedshare` in a fresh process (the stock trace, then the pack's): its JSON line, or
    the error, reported and not raised."""
    try:
        proc = subprocess.run([sys.executable, "-m", "forgepack.servedshare", *args], capture_output=True, text=True,
                              timeout=PEER_TIMEOUT_S, env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"the coverage process ran past {PEER_TIMEOUT_S} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"the coverage process failed (exit {proc.returncode}): {tail}"}
    return json.loads(lines[-1])


def coverage_line(result: dict) -> str:
    """The pack's share of the stock trace, in a sentence under the peers' table."""
    cov = result.get("coverage") or {}
    if result.get("time_share") is None:
        return f"pack coverage: not measured ({cov.get('error', 'no figure')})"
    return (f"pack coverage: its kernels replace {result['time_share']:.1%} of the stock trace's {cov['time']} time "
            f"({cov['replaced_ms']:.1f} of {cov['stock_ms']:.1f} ms) and {result['call_share']:.1%} of its "
            f"{cov['stock_calls']} aten calls")


def drive(peer: Peer, command: str, keep: Callable[[dict], Any]) -> None:
    """One command to a column's process; a column that fails says so in its row, the others go on."""
    try:
        peer.send(command)
        keep(peer.read("done" if command == "stop" else command))
    except (RuntimeError, OSError) as err:
        peer.info["error"] = str(err)
        peer.close()


def tokens_per_s(peer: Peer) -> list[float]:
    return [r["tokens"] / r["round_s"] for r in peer.rounds]


def median_interval(values: list[float]) -> tuple[float, float]:
    """Bootstrap 95% interval of the median: the ratio interval against a constant 1 (its median is 1)."""
    from forgepack.intervals import bootstrap_ratio_ci

    return bootstrap_ratio_ci(values, [1.0] * len(values), paired=True)


def summarise_peers(peers: list[Peer]) -> dict[str, dict]:
    """Per column: `round_s`, tokens/s (median, `interval`), `vs` every peer (ratio of medians and its
    interval, rounds paired), `recompiles` during the rounds, and whether its greedy tokens equal eager's."""
    from forgepack.intervals import bootstrap_ratio_ci

    eager = next((p for p in peers if p.name == "eager" and p.rounds), None)
    out = {}
    for peer in peers:
        info = {k: v for k, v in peer.info.items() if k not in ("event", "column", "tokens")}
        if not peer.rounds:
            out[peer.name] = {"tokens_per_s": None, **info}
            continue
        tps = tokens_per_s(peer)
        low, high = median_interval(tps)
        vs = {}
        for other in peers:
            if other is not peer and other.rounds:
                ratio = statistics.median(tps) / statistics.median(tokens_per_s(other))
                ci = bootstrap_ratio_ci(tps, tokens_per_s(other), paired=True)
                vs[other.name] = {"ratio": round(ratio, 4), "interval": [round(ci[0], 4), round(ci[1], 4)]}
        mine, theirs = peer.info.get("tokens"), eager.info.get("tokens") if eager else None
        same = sum(x == y for x, y in zip(mine, theirs, strict=True)) if mine and theirs else None
        out[peer.name] = {"tokens_per_s": round(statistics.median(tps), 2), "interval": [round(low, 2), round(high, 2)],
                          "round_s": [r["round_s"] for r in peer.rounds], "vs": vs,
                          "requests_equal_eager": same, "requests": len(mine or []), **info}
    return out


def peer_rows(result: dict) -> list[list]:
    """One table row per peer column, in PEER_HEADERS' order."""
    rows = []
    for col, v in result["columns"].items():
        if v.get("tokens_per_s") is None:
            rows.append([col] + [None] * (len(PEER_HEADERS) - 2) + [v.get("error", "no rounds")])
            continue
        eager = v["vs"].get("eager", {"ratio": 1.0, "interval": [1.0, 1.0]})
        recompiles = str(v["recompiles"]) + (f" ({v['reasons'][-1][:60]})" if v.get("reasons") else "")
        rows.append([col, v["tokens_per_s"], "{}-{}".format(*v["interval"]), eager["ratio"],
                     "{}-{}".format(*eager["interval"]), v["ready_s"], v["first_request_s"], v["warmup_s"],
                     recompiles, f"{v['requests_equal_eager']}/{v['requests']}", ""])
    return rows


# ----------------------------------------------------------------------------------------------------
# Tables


def rows_of(result: dict) -> list[list]:
    """One table row per column, in HEADERS' order (PEER_HEADERS' for the fair peers)."""
    if result.get("peers"):
        return peer_rows(result)
    rows = []
    for col, v in result["columns"].items():
        cold = v.get("cold_process") or {}
        rows.append([col, v["tokens_per_s"], v["s_per_request"], v["vs_eager"], v.get("ready_s"),
                     v.get("first_request_s"), v.get("warmup_s"), v.get("peak_gib") and round(v["peak_gib"], 2),
                     v.get("max_err_over_scale") is not None and f"{v['max_err_over_scale']:.2e}",
                     v.get("top1") is not None and f"{v['top1']:.4f}",
                     v.get("top1_clear") is not None and f"{v['top1_clear']:.4f} ({v['clear_share']:.0%})",
                     v.get("step_ms"), v.get("gpu_ms"),
                     v.get("host_ms"), cold.get("since_activate_s", cold.get("error")), v.get("note", "")])
    return rows


def describe_trace(settings: ServeSettings) -> str:
    return (f"Trace: {settings.requests} requests, batch {list(settings.batches)}, prompts {settings.prompt[0]}-"
            f"{settings.prompt[1]}, {settings.new[0]}-{settings.new[1]} new tokens, seed {settings.seed}; "
            f"{settings.rounds} rounds interleaved.")


NO_CUDA = "No CUDA: the graphs column is the emulated backend (the served path, not its speed)."
COLD = ("`cold s`: the graphs column's first request in a fresh process, from `activate()` to its answer "
        "(the model's load not included; nothing of this process warm).")


def markdown(header: str, results: dict, settings: ServeSettings, cuda: bool) -> str:
    from tabulate import tabulate

    text = header + describe_trace(settings) + "\n\n"
    if not cuda:
        text += NO_CUDA + "\n\n"
    if settings.cold and not all(r.get("peers") for r in results.values()):
        text += COLD + "\n\n"
    for name, res in results.items():
        headers = PEER_HEADERS if res.get("peers") else HEADERS
        text += f"## {name}\n\n" + tabulate(rows_of(res), headers=headers, tablefmt="github") + "\n\n"
        if res.get("peers"):
            text += coverage_line(res) + "\n\n"
        text += launches_line(res)
    return text


def launches_line(result: dict) -> str:
    """Launches of one decode step per column and bucket the decode loop captured, stock beside the
    pack's blocks (issue 41's goal: at most 7 a layer plus 3)."""
    parts = []
    for col, v in result["columns"].items():
        programs = v.get("launches") or ((v.get("serving") or {}).get("decode_loop") or {}).get("programs") or {}
        for bucket, p in sorted(programs.items()):
            parts.append(f"{col} {bucket}: {p['launches']} stock, {p['with_blocks']} with {p['blocks']} blocks")
    return ("decode step launches: " + "; ".join(parts) + "\n\n") if parts else ""


if __name__ == "__main__":
    sys.exit(_cold_main(sys.argv[1]))
