"""How much of the stock model's time a pack replaces: `time_share` in the serving benchmark.

The denominator is not the pack's to choose: every aten call of the trace's stock run (prefills and
decode steps of `generate()`, every op, views included) with its time, GPU time on CUDA (the kernels
each call launched, from the profiler), wall time on one intra-op thread on the CPU. The trace then
runs again with the pack active (eagerly, so that every call is dispatched and seen) and each call is
classified: served (the pack's C++ guard ran one of its kernels: its hit counters moved) or stock. A
fused kernel's chain does not run at all, so its calls are missing from the second run. Per call
signature (op and arguments as `runtime/misses.signature` writes them: dtypes, sizes, strides,
offsets and values):

    replaced(sig) = stock calls(sig) - calls that still ran stock with the pack(sig)   (at least 0)
    time_share    = sum over sig of replaced(sig) x stock time per call(sig) / the stock run's time
    call_share    = sum over sig of replaced(sig) / the stock run's calls

Both runs decode greedily with `min_new_tokens = max_new_tokens`, so their calls have the same
signatures whatever tokens come out (a kernel's outputs have the layouts stock's have: the verifier
checks them). Without a pack both runs are stock, and both shares come out 0.

    python -m forgepack.servedshare --model recipe.toml --trace trace.json [--pack wheel] [--seed N]

prints one JSON line (`servebench.bench_peers` runs it in a fresh process, beside the columns').
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from forgepack import timing
from forgepack.runtime import misses

Key = tuple[str, str]  # (op, signature)


class Calls(TorchDispatchMode):
    """Every aten call inside the block by (op, signature): how many, and (`timed`) their summed time in
    microseconds; with a pack's hit counters (`variants`: per overridden op the indices of its variants'
    counters in `counters()`), also how many went to stock.

    The class carries the miss recorder's mark (`misses.MARK`): a pack's fused sites decline under any
    other dispatch mode, and this one, like the recorder, only looks."""

    __forgepack_miss_recorder__ = True

    def __init__(self, timed: bool = False, cuda: bool = False, variants: dict[str, tuple[int, ...]] | None = None,
                 counters: Callable[[], list[int]] | None = None):
        super().__init__()
        self.timed, self.cuda = timed, cuda
        self.variants, self.counters = variants or {}, counters
        self.calls: Counter[Key] = Counter()
        self.stock: Counter[Key] = Counter()
        self.us: Counter[Key] = Counter()
        self._ranges: dict[Key, str] = {}  # CUDA: each signature's profiler range

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "aten":  # a pack's own fused op: the chain it replaces never reaches here
            return func(*args, **kwargs)
        key = (str(func), misses.signature(args, kwargs))
        indices = self.variants.get(key[0])
        before = self.counters() if indices else None
        if self.timed and self.cuda:
            name = self._ranges.setdefault(key, f"forgepack.call.{len(self._ranges)}")
            with torch.profiler.record_function(name):
                out = func(*args, **kwargs)
        elif self.timed:
            start = time.perf_counter_ns()
            out = func(*args, **kwargs)
            self.us[key] += (time.perf_counter_ns() - start) / 1e3
        else:
            out = func(*args, **kwargs)
        self.calls[key] += 1
        if before is None:
            self.stock[key] += 1
        else:
            after = self.counters()
            if all(after[k] == before[k] for k in indices):  # no variant of the op gained a hit: stock ran
                self.stock[key] += 1
        return out

    def gpu_times(self, prof) -> None:
        """CUDA: each signature's time from the profiler: the device time of the kernels its calls launched."""
        by_name = {e.key: e.device_time_total for e in prof.key_averages()}
        for key, name in self._ranges.items():
            self.us[key] = by_name.get(name, 0.0)


def shares(stock: Calls, served: Calls) -> dict[str, Any]:
    """time_share and call_share of `served` (the pack's run) against `stock` (module docstring), the
    totals they come from, and `kernel_calls`: the calls of overridden ops a kernel served (the calls a
    fused kernel's chain would have made are among `replaced_calls`)."""
    total_us, total_calls = sum(stock.us.values()), sum(stock.calls.values())
    replaced_us, replaced_calls = 0.0, 0
    for key, n in stock.calls.items():
        gone = max(0, n - served.stock[key])
        replaced_calls += gone
        replaced_us += gone * stock.us[key] / n
    return {"time_share": round(min(1.0, replaced_us / total_us), 4) if total_us else 0.0,
            "call_share": round(replaced_calls / total_calls, 4) if total_calls else 0.0,
            "stock_ms": round(total_us / 1e3, 3), "stock_calls": total_calls,
            "replaced_ms": round(replaced_us / 1e3, 3), "replaced_calls": replaced_calls,
            "kernel_calls": sum(served.calls.values()) - sum(served.stock.values())}


def pack_counters(pack: Any) -> tuple[dict[str, tuple[int, ...]], Callable[[], list[int]] | None]:
    """The pack's overridden ops and hit counters, as its own miss recorder reads them."""
    recorder = pack.record_misses()
    return recorder.variants, recorder.counters


def measure(model, trace: list[dict], ids_list: list, pack: Any = None) -> dict[str, Any]:
    """The trace's requests through plain `generate()`, stock then with `pack` active (see the module
    docstring); the pack is left inactive."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"

    def run(mode: Calls) -> None:
        with torch.no_grad(), mode:
            for ids, req in zip(ids_list, trace, strict=True):
                model.generate(ids, max_new_tokens=req["new"], min_new_tokens=req["new"], do_sample=False,
                               pad_token_id=0, attention_mask=torch.ones_like(ids))
        if cuda:
            torch.cuda.synchronize(device)

    run(Calls())  # warm: lazy initialisation is no stock op's time
    stock = Calls(timed=True, cuda=cuda)
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(stock)
        stock.gpu_times(prof)
    else:
        # one intra-op thread, as the build times CPU candidates: on a shared machine a small matmul's
        # wait for the pool's other thread (milliseconds) would otherwise decide the shares
        with timing.one_thread_on_cpu(device):
            run(stock)
    if pack is None:
        served = Calls()
        run(served)
    else:
        pack.activate(strict=True)
        try:
            variants, counters = pack_counters(pack)
            served = Calls(variants=variants, counters=counters)
            run(served)
        finally:
            pack.deactivate()
    return {**shares(stock, served), "time": "GPU (kernels)" if cuda else "wall"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="recipe .toml, built-in name or model directory")
    parser.add_argument("--trace", required=True, help="the trace, a JSON file of requests")
    parser.add_argument("--pack", default=None, help="pack wheel or import name")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grammar", action="store_true", help="prompts from forgepack.trainedlm's grammar")
    args = parser.parse_args(argv)
    from forgepack import models, recipe, servebench, servepeers

    with contextlib.ExitStack() as stack, models.quiet_transformers():
        pack = servebench.load_pack(args.pack, stack)
        lm = models.load(recipe.resolve(args.model))
        trace = json.loads(Path(args.trace).read_text())
        device = next(lm.model.parameters()).device
        ids_list = servepeers.prompts_for(trace, int(lm.model.config.vocab_size), device, args.seed, args.grammar)
        print(json.dumps(measure(lm.model, trace, ids_list, pack)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
