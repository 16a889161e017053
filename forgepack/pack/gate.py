"""The end-to-end gate: before a wheel is written, the model runs with and without the staged pack.

Run in a subprocess (`python -m forgepack.pack.gate`), so the build process never loads a shim:

1. Outputs: the model's output tensor (logits, or the last hidden state) on the recipe's inputs and on
   fresh inputs of the same shapes must agree with stock within the model tolerance below, NaNs in the
   same places; for causal LMs the greedy tokens of a 32-token continuation must be the same (a
   divergence is accepted only where stock's two candidates were tied within that tolerance). A kernel
   that fails alone is dropped; if the rest still fails together, all are dropped.
2. Use: a kernel whose guard never fires is dropped (it only costs guard checks). The use runs are the
   forward and, for a serving envelope, every capture point (phase generate: a whole generate(), its
   prefill and decode steps; the decode families fire only there). For phase generate the tokens of
   step 1 are generate()'s at every point, and step 3 times whole generate() calls at the envelope's
   largest corner, eagerly.
3. Pay (mode "full"): model time with the pack, without it, and without each kernel in turn, in
   interleaved rounds (order shuffled per round); a kernel is kept only when the paired bootstrap 95%
   interval of (model time without it) / (with it) lies above 1: on a launch-bound model, a kernel
   faster in isolation can be slower end to end. An interval that straddles 1 is measured again with
   more rounds (`MORE_ROUNDS`) before the kernel is dropped. Then the whole pack against stock, the
   same way: until its interval lies above 1, the kernel that pays least is dropped and the rest timed
   again; a pack that never pays is not shipped (the builder writes no wheel). On CUDA,
   when the forward replays correctly from a CUDA graph with the kernels active (`check_graphs`),
   every configuration is timed under graph replay, each from its own graph: that is how such a
   model is served, and in eager mode launch overhead hides the GPU time a kernel saves. When replay
   with every kernel fails but stock replays, a kernel whose replay differs from eager on its own is
   dropped (`graph_breakers`), and the rest are judged under graph replay.

4. Decode blocks (`forgepack.blocks`) run only inside the served decode loop's recorded step, never in a
   forward: they are judged on generate() served by the pack (`gate_blocks`): the served tokens equal
   stock's (else each kind of block is tried alone), each block is placed in the step, each kind pays
   (the served generate() without that kind against with every block, re-measured when the interval
   straddles 1) and the blocks together pay against none.

Every ratio printed is median(a) / median(b) of the per-round times printed with it. `decide_pay` and
`pack_pays` (pure) turn the measurements into keep/drop decisions with reasons; the parent
(`forgepack.pack.builder`) rebuilds the pack from what is kept and runs mode "verify" on it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forgepack import intervals, modeltiming
from forgepack.errors import ForgepackError
from forgepack.pack.manifest import GateSummary
from forgepack.runtime import tolerances
from forgepack.runtime.packinfo import GraphVerdict

GREEDY_TOKENS = 32
ROUNDS = 7
REPS = 3
MORE_ROUNDS = 3  # an interval that straddles 1 is measured again with this many times the rounds
TIMEOUT_S = 3600


def model_rtol(lm) -> float:
    return tolerances.model_rtol(str(lm.dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Timing:
    """Per-round model times in ms for each configuration ("stock", "pack", "without:<id>")."""

    rounds: dict[str, list[float]]

    def median(self, name: str) -> float:
        return statistics.median(self.rounds[name])

    def ratio(self, a: str, b: str) -> tuple[float, float, float]:
        """median(a) / median(b), the ratio of the medians reported with it, and its paired bootstrap 95%
        interval (both were measured in each round, so rounds are resampled whole)."""
        low, high = intervals.bootstrap_ratio_ci(self.rounds[a], self.rounds[b], paired=True)
        return self.median(a) / self.median(b), low, high


def interval(low: float, high: float) -> str:
    """Where a time ratio's interval lies against 1: "above" (it pays), "straddles", "below"."""
    return "above" if low > 1.0 else ("straddles" if high > 1.0 else "below")


@dataclass(frozen=True)
class GateOutcome:
    kept: tuple[str, ...]
    dropped: dict[str, str]  # variant id -> why
    hits: dict[str, int] = field(default_factory=dict)  # over the use runs (`use_runs`), before drops
    ratios: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # id -> (without/with, lo, hi)
    outputs: dict[str, Any] = field(default_factory=dict)
    summary: GateSummary = field(default_factory=GateSummary)  # the kept pack against stock
    graphs: GraphVerdict | None = None  # graph mode's verdict with the kept kernels (CUDA only)
    refused: str = ""  # why no pack may ship (it never paid end to end), or ""

    def to_json(self) -> dict[str, Any]:
        return {"kept": list(self.kept), "dropped": self.dropped, "hits": self.hits,
                "ratios": {k: list(v) for k, v in self.ratios.items()}, "outputs": self.outputs,
                "summary": self.summary.to_json(), "graphs": None if self.graphs is None else self.graphs.to_json(),
                "refused": self.refused}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GateOutcome:
        graphs = None if d.get("graphs") is None else GraphVerdict.from_json(d["graphs"])
        return cls(tuple(d["kept"]), d["dropped"], d["hits"], {k: tuple(v) for k, v in d["ratios"].items()},
                   d["outputs"], GateSummary.from_json(d["summary"]), graphs, d.get("refused", ""))


# --- pure decisions ------------------------------------------------------------------------------------


def decide_pay(ids: list[str], timing: Timing, under: str = "") -> tuple[list[str], dict[str, str], dict[str, tuple]]:
    """Keep a kernel when the model is slower without it: the interval of (time without it) / (with
    it) lies above 1. `under` says how the model was timed, for the reasons."""
    kept, dropped, ratios = [], {}, {}
    for vid in ids:
        ratio, low, high = timing.ratio(f"without:{vid}", "pack")
        ratios[vid] = (ratio, low, high)
        if interval(low, high) == "above":
            kept.append(vid)
            continue
        how = (f"{' ' + under if under else ''} (median time without/with {ratio:.3f}, "
               f"95% CI {low:.3f}-{high:.3f}, over {len(timing.rounds['pack'])} rounds)")
        if interval(low, high) == "straddles":
            dropped[vid] = f"does not pay end to end: the model is not shown to be slower without it{how}"
        else:
            dropped[vid] = f"does not pay end to end: the model is {(1 / ratio - 1) * 100:.1f}% faster without it{how}"
    return kept, dropped, ratios


def least_paying(ids: list[str], ratios: dict[str, tuple]) -> str:
    """The kernel to drop first when the pack as a whole does not pay: the one the model misses least."""
    return min(ids, key=lambda i: (ratios.get(i, (0.0,))[0], i))


def pack_text(timing: Timing) -> str:
    ratio, low, high = timing.ratio("stock", "pack")
    return (f"model {timing.median('stock'):.3f} ms stock, {timing.median('pack'):.3f} ms with the pack: "
            f"{ratio:.3f}x (95% CI {low:.3f}-{high:.3f}, {len(timing.rounds['pack'])} rounds)")


def decide_use(ids: list[str], hits: dict[str, int]) -> tuple[list[str], dict[str, str]]:
    kept = [i for i in ids if hits.get(i, 0) > 0]
    dropped = {i: "never used: its guard matched no call of the forward or of the envelope's runs" for i in ids
               if i not in kept}
    return kept, dropped


def greedy_agree(stock: list[list[int]], pack: list[list[int]], stock_logits: list, rtol: float) -> tuple[bool, str]:
    """Same greedy tokens, or the first divergence is a tie within tolerance in stock's own logits."""
    for row, (a, b) in enumerate(zip(stock, pack, strict=True)):
        for step, (x, y) in enumerate(zip(a, b, strict=True)):
            if x == y:
                continue
            logits = stock_logits[step][row]
            gap = float(logits[x] - logits[y])
            scale = float(logits.abs().max())
            if gap <= rtol * scale:
                return True, f"row {row} diverges at token {step} where stock's top two are tied ({gap:.3g})"
            return False, f"row {row} diverges at token {step}: stock prefers {x} over {y} by {gap:.3g}"
    return True, f"same {len(stock[0]) if stock else 0} greedy tokens"


# --- measurements (in the subprocess) -------------------------------------------------------------------


def _output(lm, inputs) -> Any:
    return lm.output_tensor(lm.run(inputs)).detach().clone()


def compare_outputs(lm, pack, ids: set[str] | None, input_sets: list[dict]) -> tuple[bool, str, float]:
    """Model outputs with the pack (only `ids` enabled) against stock; (ok, note, worst relative error)."""
    import torch

    from forgepack.runtime.compare import scale_error

    rtol = model_rtol(lm)
    worst = 0.0
    for n, inputs in enumerate(input_sets):
        pack.deactivate()
        ref = _output(lm, inputs)
        pack.activate(strict=True)
        pack.enable_only(ids)
        got = _output(lm, inputs)
        if got.shape != ref.shape:
            return False, f"output shape {tuple(got.shape)} differs from stock's {tuple(ref.shape)}", float("inf")
        r, g = ref.double(), got.double()
        if not torch.equal(torch.isnan(r), torch.isnan(g)):
            return False, f"input set {n}: NaN in different places than stock", float("inf")
        err = scale_error(r, g)
        worst = max(worst, err)
        if err > rtol:
            return False, f"input set {n}: outputs differ by {err:.2e} of their scale (tolerance {rtol:g})", err
    return True, f"outputs within {worst:.2e} of their scale (tolerance {rtol:g})", worst


def greedy(lm, steps: int = GREEDY_TOKENS) -> tuple[list[list[int]], list]:
    """A greedy continuation of the recipe's prompt, recomputing the full sequence each step (no cache)."""
    import torch

    ids = lm.inputs["input_ids"]
    logits_per_step = []
    with torch.no_grad():
        for _ in range(steps):
            out = lm.model(input_ids=ids, use_cache=False)
            logits = out.logits[:, -1, :].double().cpu()
            logits_per_step.append(logits)
            nxt = logits.argmax(dim=-1, keepdim=True).to(ids.device)
            ids = torch.cat([ids, nxt], dim=1)
    prompt = lm.inputs["input_ids"].shape[1]
    return ids[:, prompt:].tolist(), logits_per_step


def check_tokens(lm, pack, ids: set[str] | None) -> tuple[bool, str]:
    pack.deactivate()
    stock, stock_logits = greedy(lm)
    pack.activate(strict=True)
    pack.enable_only(ids)
    got, _ = greedy(lm)
    rtol = model_rtol(lm)
    return greedy_agree(stock, got, stock_logits, rtol)


def check_correct(lm, pack, ids: set[str] | None, input_sets: list[dict], tokens: bool) -> tuple[bool, str]:
    ok, note, _ = compare_outputs(lm, pack, ids, input_sets)
    if ok and tokens:
        ok, token_note = check_generate(lm, pack, ids) if is_generate(lm) else check_tokens(lm, pack, ids)
        note = f"{note}; {token_note}"
    return ok, note


# --- a serving envelope ------------------------------------------------------------------------------------
# A pack built for an envelope serves every point of it: the use check runs each capture point, and for
# phase generate the tokens are compared and the time is taken over whole generate() calls (prefill and
# decode steps), not over the representative prefill alone, whose calls no decode family sees.


def is_generate(lm) -> bool:
    return lm.recipe.workload.phase == "generate" and bool(lm.points)


def use_runs(lm) -> list[Callable[[], Any]]:
    """What the use check runs: the representative forward, then every capture point of the envelope
    (phase generate: a whole generate(), its prefill and every decode step)."""
    return [lm.run, *(point.prepare() for point in lm.points)]


def check_generate(lm, pack, ids: set[str] | None) -> tuple[bool, str]:
    """At every capture point of a generate envelope, generate()'s tokens with the pack are stock's; a
    divergence is accepted only where stock's top two were tied within the model tolerance."""
    from forgepack import models

    n, rtol = lm.recipe.workload.new_tokens, model_rtol(lm)
    points = [dict(p.sizes) for p in lm.points]
    for sizes in points:
        prompt = models.generate_prompt(lm.model, sizes, lm.device)
        pack.deactivate()
        stock = models.generate(lm.model, prompt, n, logits=True)
        pack.activate(strict=True)
        pack.enable_only(ids)
        got = models.generate(lm.model, prompt, n)
        start = prompt.shape[1]
        logits = [step.double().cpu() for step in stock.logits]
        ok, note = greedy_agree(stock.sequences[:, start:].tolist(), got[:, start:].tolist(), logits, rtol)
        if not ok:
            return False, f"generate() at batch {sizes['batch']}, prompt {sizes['seq_len']}: {note}"
    return True, f"generate() gives stock's {n} tokens at {len(points)} envelope points"


def timed_step(lm) -> Callable[[], Any]:
    """What one timed forward runs: the representative forward, or for phase generate a whole generate()
    at the envelope's largest corner (its prefill and decode steps, as the pack will be served)."""
    if not is_generate(lm):
        return lm.run
    from forgepack import models

    prompt = models.generate_prompt(lm.model, models.representative(lm.recipe.workload), lm.device)
    n = lm.recipe.workload.new_tokens
    return lambda: models.generate(lm.model, prompt, n)


def check_graphs(lm, pack, ids: set[str]) -> GraphVerdict:
    """Graph mode's verdict for the manifest: with the kept kernels active, the forward replayed from a
    CUDA graph must match eager on fresh inputs (a host sync or data-dependent control flow fails)."""
    replaycheck = importlib.import_module(f"{pack.__name__}.replaycheck")
    pack.activate(strict=True)
    pack.enable_only(ids)
    try:
        # Held to the pack's own model tolerance: under capture transformers and the runtime take
        # other (equivalent) routes, whose bf16 roundings differ through 16 layers by a few ulps.
        ok, reason = replaycheck.verify_replay(lm.model, lambda step: lm.make_inputs(seed=100 + step),
                                               scale_rtol=model_rtol(lm))
    except Exception as err:  # a verdict to record, not a failed build
        ok, reason = False, f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
    finally:
        pack.deactivate()
    return GraphVerdict(bool(ok), reason)


def graph_breakers(check: Callable[[set[str]], GraphVerdict], ids: list[str]) -> dict[str, str]:
    """The kernels that on their own make graph replay differ from eager: {id: check's reason}.

    Asked when replay with every kernel fails. Empty when replay fails with no kernel at all (the model
    is not replayable: no kernel is to blame) or when no kernel fails alone (then they fail together,
    and the gate judges them in eager mode as before)."""
    if not check(set()).enabled:
        return {}
    found = {}
    for vid in ids:
        verdict = check({vid})
        if not verdict.enabled:
            found[vid] = verdict.reason
    return found


def _without_graph_breakers(lm, pack, keep: list[str], verdict: GraphVerdict, dropped: dict[str, str]
                            ) -> tuple[list[str], GraphVerdict]:
    """Replay with every kernel failed: a kernel that computes differently under replay must not serve
    graph mode. Those that fail alone go into `dropped`; the rest are checked again, to be judged as
    they will run."""
    breakers = graph_breakers(lambda only: check_graphs(lm, pack, only), keep)
    dropped.update({i: f"graph replay differs from eager with it alone: {why}" for i, why in breakers.items()})
    keep = [i for i in keep if i not in breakers]
    return keep, (check_graphs(lm, pack, set(keep)) if breakers and keep else verdict)


def count_hits(lm, pack, ids: list[str]) -> dict[str, int]:
    """Each kernel's hits over `use_runs`: the representative forward and every envelope point."""
    pack.activate(strict=True)
    pack.enable_only(set(ids))
    before = pack.stats()
    for run in use_runs(lm):
        run()
    after = pack.stats()
    return {i: after[i]["hits"] - before[i]["hits"] for i in ids}


class _Forward:
    """One timed forward of a configuration: eager, or replayed from a CUDA graph captured with exactly
    that configuration's kernels active (one graph per configuration, built on first use)."""

    def __init__(self, lm, pack, graphed: bool):
        self.lm, self.pack, self.graphed = lm, pack, graphed
        self._graphs: dict[str, Any] = {}
        self._step = None if graphed else timed_step(lm)

    def __call__(self, name: str) -> None:
        if not self.graphed:
            self._step()
            return
        import torch

        if name not in self._graphs:
            runtime = importlib.import_module(f"{self.pack.__name__}.graphs")
            self._graphs[name] = runtime.GraphedForward(runtime.eager_forward(self.lm.model), copy_outputs=False)
            for _ in range(runtime.DEFAULT_WARMUP + 1):  # warm-up calls, then the capture
                self(name)
        with torch.no_grad():
            self._graphs[name](**self.lm.inputs)
        self.lm.reset()

    def failures(self) -> dict[str, str]:
        """Configurations whose forward could not be captured (they ran eagerly: their timings mislead)."""
        return {name: "; ".join(g.failures.values()) for name, g in self._graphs.items() if g.failures}


Clock = Callable[[], float]  # seconds, as time.perf_counter; tests inject a deterministic one


@dataclass(frozen=True)
class Timer:
    """How the gate times configurations: rounds, repetitions per round, the clock, and whether each
    configuration is replayed from its own CUDA graph."""

    rounds: int = ROUNDS
    reps: int = REPS
    clock: Clock = time.perf_counter
    graphed: bool = False

    def more(self) -> Timer:
        return dataclasses.replace(self, rounds=self.rounds * MORE_ROUNDS)


def measure(lm, pack, configs: dict[str, set[str] | None], rounds: int, reps: int, seed: int = 0,
            graphed: bool = False, clock: Clock = time.perf_counter) -> Timing:
    """Per-round median model time (ms) for each config; None = stock (pack deactivated). `graphed`:
    each config's forward is replayed from its own CUDA graph, so GPU time counts, not launches."""
    forward = _Forward(lm, pack, graphed)

    @contextlib.contextmanager
    def switched(name: str):
        ids = configs[name]
        if ids is None:
            pack.deactivate()
        else:
            pack.activate(strict=True)
            pack.enable_only(ids)
        yield

    forwards = {name: functools.partial(forward, name) for name in configs}
    times = modeltiming.interleaved_ms(forwards, rounds, reps, modeltiming.device_sync(lm.device), seed, switched,
                                     clock=clock)
    pack.deactivate()
    failed = forward.failures()
    if failed:
        raise GraphTimingFailed(f"graph capture failed while timing: {failed}")
    return Timing(times)


class GraphTimingFailed(ForgepackError):
    """A configuration could not be captured although the graph check passed; time eagerly instead."""


def measure_best(lm, pack, configs: dict[str, set[str] | None], timer: Timer, seed: int) -> tuple[Timing, bool, str]:
    """`measure` under graph replay when asked and possible, else eagerly; (timing, timed under graphs,
    why a graph timing that was asked for failed)."""
    args = (lm, pack, configs, timer.rounds, timer.reps, seed)
    if timer.graphed:
        try:
            return measure(*args, graphed=True, clock=timer.clock), True, ""
        except GraphTimingFailed as err:
            print(f"gate: {err}; timing eagerly", file=sys.stderr)
            return measure(*args, clock=timer.clock), False, str(err)
    return measure(*args, clock=timer.clock), False, ""


def eager_because(verdict: GraphVerdict | None, timing_failure: str) -> str:
    """Why kernels were judged in eager mode, for the reasons a build prints: graph mode's verdict with
    every kept kernel active, or the capture that failed while timing."""
    if verdict is None:
        return "in eager mode"
    why = timing_failure or ("" if verdict.enabled else f"graph replay with every kernel: {verdict.reason}")
    return f"in eager mode ({why[:200]})" if why else "in eager mode"


def _correct(lm, pack, ids: list[str], tokens: bool) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """Step 1: (kept, dropped with reasons, the output check's notes)."""
    input_sets = [lm.inputs, lm.make_inputs(seed=1)]
    ok, note = check_correct(lm, pack, set(ids), input_sets, tokens)
    if ok:
        return list(ids), {}, {"ok": ok, "note": note}
    dropped = {}
    for vid in ids:  # find the kernels that break the model on their own
        alone_ok, alone_note = check_correct(lm, pack, {vid}, input_sets, tokens)
        if not alone_ok:
            dropped[vid] = f"changes the model's outputs: {alone_note}"
    keep = [i for i in ids if i not in dropped]
    first = note
    ok, note = check_correct(lm, pack, set(keep), input_sets, tokens)
    if not ok:
        dropped.update({i: f"changes the model's outputs together with the others: {note}" for i in keep})
        keep = []
    return keep, dropped, {"ok": ok, "note": note, "first": first}


def _each_pays(lm, pack, keep: list[str], timer: Timer, under_graphs: str, verdict: GraphVerdict | None
               ) -> tuple[list[str], dict[str, str], dict[str, tuple]]:
    """Step 3, per kernel: the model without each kernel against the model with all; the kernels whose
    interval straddles 1 are measured again, with more rounds, before they are judged."""
    configs = {"stock": None, "pack": set(keep), **{f"without:{i}": set(keep) - {i} for i in keep}}
    timing, graphed, failure = measure_best(lm, pack, configs, timer, 0)
    under = under_graphs if graphed else eager_because(verdict, failure)
    kept, dropped, ratios = decide_pay(keep, timing, under)
    unsure = [i for i in keep if i in dropped and interval(*ratios[i][1:]) == "straddles"]
    if unsure:
        again = {"pack": set(keep), **{f"without:{i}": set(keep) - {i} for i in unsure}}
        timing, graphed, failure = measure_best(lm, pack, again, dataclasses.replace(timer.more(), graphed=graphed), 2)
        more_kept, more_dropped, more_ratios = decide_pay(unsure, timing, under)
        ratios.update(more_ratios)
        for i in unsure:
            dropped.pop(i)
        dropped.update(more_dropped)
        kept = [i for i in keep if i in kept or i in more_kept]
    return kept, dropped, ratios


def _whole_pack(lm, pack, keep: list[str], timer: Timer, ratios: dict[str, tuple], may_drop: bool,
                dropped: dict[str, str]) -> tuple[list[str], Timing, bool]:
    """The kept pack against stock; while its interval is not above 1 (measured again with more rounds
    when it straddles), the kernel that pays least is dropped (`may_drop`, mode "full") and the rest
    timed again. (kept, the last timing, timed under graphs)."""
    while True:
        final, graphed, _ = measure_best(lm, pack, {"stock": None, "pack": set(keep)}, timer, 1)
        if interval(*final.ratio("stock", "pack")[1:]) == "straddles":
            final, graphed, _ = measure_best(lm, pack, {"stock": None, "pack": set(keep)},
                                             dataclasses.replace(timer.more(), graphed=graphed), 3)
        if interval(*final.ratio("stock", "pack")[1:]) == "above" or not may_drop or len(keep) == 1:
            return keep, final, graphed
        worst = least_paying(keep, ratios)
        dropped[worst] = f"dropped so that the pack pays end to end: with it, {pack_text(final)}"
        keep = [i for i in keep if i != worst]


# --- decode blocks: judged where they run, in the served decode loop --------------------------------------
# A block's kernel runs only inside the decode loop's recorded step (`runtime/stepprogram`), never in a
# forward: its use, its outputs and what it saves are measured on generate() served by the pack (CUDA
# graphs, or the emulation on the CPU), against generate() without the pack and without each kind of
# block in turn.

BLOCK_TOKENS = 32
BLOCK_PROMPT = 16


def block_ids(pack) -> list[str]:
    """The pack's decode blocks (their ops are `blocks.BLOCK_OPS`)."""
    from forgepack.blocks import BLOCK_OPS

    return [v["id"] for v in pack.fused_kernels() if v["op"] in BLOCK_OPS]


class Served:
    """generate() of BLOCK_TOKENS tokens on fixed prompts, one per batch bucket the blocks were built for,
    served by the pack's decode loop with only the given kernels enabled (`serve`), or stock (`stock`)."""

    def __init__(self, lm, pack):
        import torch

        from forgepack import blocks

        self.lm, self.pack = lm, pack
        rows = sorted({r for r, _ in blocks.decode_points(lm.recipe, lm.model)})
        vocab = int(lm.model.config.get_text_config().vocab_size)
        gen = torch.Generator().manual_seed(7)
        self.prompts = [torch.randint(0, vocab, (r, BLOCK_PROMPT), generator=gen).to(lm.device) for r in rows]
        self.backend = "cuda" if lm.device.type == "cuda" else "emulate"
        self.serving = False

    def serve(self, ids: set[str]) -> None:
        if not self.serving:
            self.pack.deactivate()
            self.pack.activate(strict=True, graphs=True, model=self.lm.model, backend=self.backend)
            self.serving = True
        self.pack.enable_only(ids)

    def stock(self) -> None:
        self.pack.deactivate()
        self.serving = False

    def loop_stats(self) -> dict:
        """The served model's decode loop counters (`serving.Server.stats()["decode_loop"]`)."""
        serving = importlib.import_module(self.pack.__name__ + ".serving")
        server = serving.server(self.lm.model)
        return server.stats()["decode_loop"] if server is not None else {}

    def run(self, logits: bool = False) -> list:
        from forgepack import models

        return [models.generate(self.lm.model, p, BLOCK_TOKENS, logits=logits) for p in self.prompts]


def _blocks_agree(served: Served, ids: set[str]) -> tuple[bool, str]:
    """The served tokens with these kernels are stock's (a divergence only where stock's top two tie)."""
    served.stock()
    stock = served.run(logits=True)
    served.serve(ids)
    got = served.run()
    for ref, seq in zip(stock, got, strict=True):
        logits = [step.double().cpu() for step in ref.logits]
        ok, note = greedy_agree(ref.sequences[:, BLOCK_PROMPT:].tolist(), seq[:, BLOCK_PROMPT:].tolist(), logits,
                                model_rtol(served.lm))
        if not ok:
            return False, f"served generate() at batch {seq.shape[0]}: {note}"
    batches = [p.shape[0] for p in served.prompts]
    return True, f"served generate() gives stock's {BLOCK_TOKENS} tokens at batch {batches}"


def gate_blocks(lm, pack, blocks_: list[str], others: list[str], mode: str, timer: Timer
                ) -> tuple[list[str], dict[str, str], dict[str, tuple], Timing | None, str]:
    """(kept blocks, dropped with reasons, ratios, the timing of blocks against none, the output note):
    correct together (else each kind alone decides), used, each kind paying (the served generate() without
    that kind against with all), and the blocks together paying against none."""
    import torch

    served = Served(lm, pack)
    kinds: dict[str, list[str]] = {}
    for vid in blocks_:
        kinds.setdefault(vid.split("-")[0].removeprefix("fusion_"), []).append(vid)
    dropped: dict[str, str] = {}
    with torch.no_grad():
        ok, note = _blocks_agree(served, set(others) | set(blocks_))
        if not ok:
            for vids in kinds.values():
                alone, why = _blocks_agree(served, set(others) | set(vids))
                if not alone:
                    dropped.update({v: f"changes the served tokens: {why}" for v in vids})
        keep = [v for v in blocks_ if v not in dropped]
        # from stock: a kernel counts its calls as the step is captured, and a step already captured
        # with the same kernels (the check above) would only be replayed, calling none of them
        served.stock()
        before = pack.stats()
        served.serve(set(others) | set(keep))
        served.run()
        after = pack.stats()
        loop = served.loop_stats()
        for vid in keep:
            if after[vid]["hits"] == before[vid]["hits"]:
                dropped[vid] = (f"never placed in the served decode step (its programs: {loop.get('programs')}; "
                                f"failures: {loop.get('failures') or 'none'})")
        keep = [v for v in keep if v not in dropped]
        if not keep or mode != "full":
            served.stock()
            return keep, dropped, {}, None, note
        present = {k: [v for v in vids if v in keep] for k, vids in kinds.items()}
        present = {k: v for k, v in present.items() if v}
        base = set(others)
        configs = {"blocks": base | set(keep), "none": base,
                   **{f"without:{k}": base | (set(keep) - set(v)) for k, v in present.items()}}

        @contextlib.contextmanager
        def switched(name: str):
            served.serve(configs[name])
            yield

        def measure(names: list[str], t: Timer, seed: int) -> Timing:
            forwards = {name: served.run for name in names}
            return Timing(modeltiming.interleaved_ms(forwards, t.rounds, t.reps, modeltiming.device_sync(lm.device),
                                                     seed, switched, clock=t.clock))

        timing = measure(list(configs), timer, 0)
        judged = {k: timing.ratio(f"without:{k}", "blocks") for k in present}
        unsure = [k for k, r in judged.items() if interval(*r[1:]) == "straddles"]
        if unsure:  # measured again, with more rounds, before a kind is judged
            again = measure(["blocks", *(f"without:{k}" for k in unsure)], timer.more(), 2)
            judged.update({k: again.ratio(f"without:{k}", "blocks") for k in unsure})
        served.stock()
    ratios: dict[str, tuple] = {}
    for kind, vids in present.items():
        ratio = judged[kind]
        for v in vids:
            ratios[v] = ratio
        if interval(*ratio[1:]) != "above":
            dropped.update({v: f"the served decode is not faster with the {kind} block: without it "
                               f"{ratio[0]:.3f}x [{ratio[1]:.3f}, {ratio[2]:.3f}] of the time with it" for v in vids})
    keep = [v for v in keep if v not in dropped]
    whole = timing.ratio("none", "blocks")
    if keep and interval(*whole[1:]) != "above":
        dropped.update({v: f"the blocks together do not pay in the served decode: {whole[0]:.3f}x "
                           f"[{whole[1]:.3f}, {whole[2]:.3f}]" for v in keep})
        keep = []
    return keep, dropped, ratios, timing, note


def evaluate(lm, pack, mode: str, rounds: int = ROUNDS, reps: int = REPS,
             clock: Clock = time.perf_counter) -> GateOutcome:
    blocks_ = block_ids(pack)
    ids = [i for i in pack.variant_ids() if i not in blocks_]
    outcome = _evaluate_forward(lm, pack, ids, mode, rounds, reps, clock)
    if not blocks_:
        return outcome
    timer = Timer(rounds, reps, clock)
    kept, dropped, ratios, timing, note = gate_blocks(lm, pack, blocks_, list(outcome.kept), mode, timer)
    summary = outcome.summary
    if timing is not None and not outcome.kept:
        # a pack of blocks alone: its summary is the served decode, with and without them
        ratio, low, high = timing.ratio("none", "blocks")
        summary = dataclasses.replace(summary, stock_ms=timing.median("none"), pack_ms=timing.median("blocks"),
                                      speedup=ratio, ci=(low, high), rounds=len(timing.rounds["blocks"]),
                                      reps=reps, timed_under="served decode", pays=bool(kept),
                                      outputs=note)
    refused = outcome.refused if outcome.kept or not kept else ""
    if not outcome.kept and not kept:
        refused = refused or "no kernel pays end to end"
    return dataclasses.replace(outcome, kept=(*outcome.kept, *kept), dropped={**outcome.dropped, **dropped},
                               ratios={**outcome.ratios, **ratios}, summary=summary, refused=refused,
                               outputs={**outcome.outputs, "blocks": note})


def _evaluate_forward(lm, pack, ids: list[str], mode: str, rounds: int, reps: int, clock: Clock) -> GateOutcome:
    """The gate of every kernel that runs in a forward (steps 1-3 of the module docstring)."""
    tokens = lm.recipe.workload.task == "causal-lm"
    keep, dropped, outputs = _correct(lm, pack, ids, tokens)
    hits = count_hits(lm, pack, ids)
    keep, unused = decide_use(keep, hits)
    dropped.update(unused)
    ratios: dict[str, tuple] = {}
    # On CUDA, kernels are judged under graph replay when the forward is capture-safe with them: that is
    # how a launch-bound model should be served (activate(graphs=True)), and in eager mode launch
    # overhead hides every microsecond of GPU time a kernel saves (MEASUREMENTS.md).
    verdict = check_graphs(lm, pack, set(keep)) if keep and lm.device.type == "cuda" else None
    first = verdict if verdict is not None and not verdict.enabled else None  # the final may be for fewer
    if first is not None and mode == "full":
        # Mode "verify" drops nothing: its verdict goes into the manifest, graph mode off if it failed.
        keep, verdict = _without_graph_breakers(lm, pack, keep, verdict, dropped)
    # generate() is timed eagerly: one graph per configuration replays a forward, not a generate() loop
    timer = Timer(rounds, reps, clock, bool(verdict and verdict.enabled) and not is_generate(lm))
    if mode == "full" and keep:
        kept_now, slow, ratios = _each_pays(lm, pack, keep, timer, "under CUDA graph replay", verdict)
        dropped.update(slow)
        keep = kept_now
    summary, refused = GateSummary(outputs=outputs.get("note", ""), graphs_first=first), ""
    if keep:
        before = list(keep)
        keep, final, graphed = _whole_pack(lm, pack, keep, timer, ratios, mode == "full", dropped)
        if keep != before and verdict is not None:
            verdict = check_graphs(lm, pack, set(keep))
        ratio, low, high = final.ratio("stock", "pack")
        pays = interval(low, high) == "above"
        summary = dataclasses.replace(
            summary, stock_ms=final.median("stock"), pack_ms=final.median("pack"), speedup=ratio, ci=(low, high),
            rounds=len(final.rounds["pack"]), reps=reps, timed_under="graphs" if graphed else "eager", pays=pays)
        if not pays:
            refused = f"the pack does not pay end to end: {pack_text(final)}"
    pack.deactivate()
    return GateOutcome(tuple(keep), dropped, hits, ratios, outputs, summary, verdict, refused)


# --- the subprocess ---------------------------------------------------------------------------------------


def run(recipe, stage_root: Path, package: str, mode: str = "full", rounds: int = ROUNDS, reps: int = REPS,
        timeout: float = TIMEOUT_S) -> GateOutcome:
    """Run the gate on the staged package in a fresh Python process; raises ForgepackError if it fails."""
    from forgepack import recipe as recipe_mod
    from forgepack import tomlwriter

    out = Path(stage_root) / f"gate-{mode}.json"
    out.unlink(missing_ok=True)
    recipe_path = Path(stage_root) / "gate-recipe.toml"  # exactly the recipe being built
    recipe_path.write_text(tomlwriter.dumps(recipe_mod.to_dict(recipe)))
    repo = Path(__file__).resolve().parent.parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH", "")) if p)
    env.pop("FORGEPACK_DISABLE", None)
    cmd = [sys.executable, "-m", "forgepack.pack.gate", "--recipe", str(recipe_path), "--stage", str(stage_root),
           "--package", package, "--mode", mode, "--rounds", str(rounds), "--reps", str(reps), "--out", str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ForgepackError(f"the end-to-end gate did not finish in {timeout:.0f} s") from None
    if proc.returncode != 0 or not out.exists():
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise ForgepackError(f"the end-to-end gate failed (exit {proc.returncode}): {tail}")
    return GateOutcome.from_json(json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m forgepack.pack.gate")
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--stage", required=True)
    parser.add_argument("--package", required=True)
    parser.add_argument("--mode", choices=("full", "verify"), default="full")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--reps", type=int, default=REPS)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from forgepack import models
    from forgepack import recipe as recipe_mod

    sys.path.insert(0, str(Path(args.stage).resolve()))
    pack = importlib.import_module(args.package)
    recipe = recipe_mod.concrete(recipe_mod.load(args.recipe))
    with models.quiet_transformers():
        lm = models.load(recipe)
        outcome = evaluate(lm, pack, args.mode, args.rounds, args.reps)
    Path(args.out).write_text(json.dumps(outcome.to_json(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
