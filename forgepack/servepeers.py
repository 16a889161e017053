"""One serving column in its own fresh Python process: the fair peers of the serving benchmark.

    python -m forgepack.servepeers --column compiled-loop --model recipe.toml --trace trace.json

Each column gets a process of its own so no column shares dynamo state with another or is reset by
one. The process loads the model, sets the column up (`ready_s`), runs every request of the trace once
so every shape is compiled or captured before the rounds (`warmup_s`, its first request
`first_request_s`), then prints one JSON line per event and waits on stdin: `round` times the trace
once (`round_s`, real rows x new tokens), `stop` reports the dynamo graphs compiled and the guard
failures seen during the rounds (`recompiles`: 0 for a warmed column) and the greedy tokens of the
last round. The caller (servebench.bench_peers) starts every column, then sends the rounds in a
rotating order.

Columns:
- `eager`: `generate()` as shipped (dynamic cache);
- `static-pinned`: `generate()` with a caller `StaticCache` per batch bucket, its length pinned to the
  longest request of that bucket, and `compile_config` (fullgraph; reduce-overhead on CUDA, Inductor's
  CPU backend otherwise); the trace's batches are forgepack's batch buckets, so no padding is needed;
- `compiled-loop`: a caller `StaticCache` per bucket, eager prefill, then a greedy loop whose whole
  step (forward + argmax) is `torch.compile(mode="reduce-overhead", fullgraph=True)` (gpt-fast);
- `graphs` / `pack+graphs`: forgepack's served `generate()` (emulated backend without CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PEERS = ("eager", "static-pinned", "compiled-loop", "graphs", "pack+graphs")
CACHE_MULTIPLE = 64  # pinned cache lengths round up to this, so near-equal requests share one cache

Generate = Callable[[Any, int], list[list[int]]]  # (ids, new tokens) -> new tokens per row


@dataclass(frozen=True)
class DynamoState:
    """What dynamo has compiled so far: graphs, and guard failures (each one a recompile)."""

    graphs: int
    failures: int
    reasons: tuple[str, ...]

    @classmethod
    def now(cls) -> DynamoState:
        from torch._dynamo.utils import counters, guard_failures

        reasons = tuple(r for rs in guard_failures.values() for r in rs)
        return cls(int(counters["stats"]["unique_graphs"]), len(reasons), reasons)

    def since(self, before: DynamoState) -> dict:
        return {"recompiles": self.graphs - before.graphs, "guard_failures": self.failures - before.failures,
                "reasons": list(self.reasons[before.failures:])[-5:]}


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_lengths(trace: list[dict], cap: int) -> dict[int, int]:
    """Per batch bucket the cache length that holds its longest request (rounded up, at most `cap`)."""
    longest: dict[int, int] = {}
    for r in trace:
        longest[r["batch"]] = max(longest.get(r["batch"], 0), r["prompt"] + r["new"])
    return {b: min(cap, -(-n // CACHE_MULTIPLE) * CACHE_MULTIPLE) for b, n in longest.items()}


def cache_keyword(model) -> str:
    """The name transformers gives the cache argument: `cache` from 5.x on, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def new_tokens(out, ids) -> list[list[int]]:
    sequences = out.sequences if hasattr(out, "sequences") else out
    return sequences[:, ids.shape[1]:].tolist()


def plain_generate(model, **extra) -> Generate:
    import torch

    def run(ids, new):
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(ids), **extra)
        return new_tokens(out, ids)

    return run


class Caches:
    """One caller-owned `StaticCache` per batch bucket, its length pinned for the trace."""

    def __init__(self, model, trace: list[dict]):
        self.model = model
        cap = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.lengths = pinned_lengths(trace, cap)
        self.caches: dict[int, Any] = {}

    def get(self, batch: int):
        from transformers import StaticCache

        if batch not in self.caches:
            self.caches[batch] = StaticCache(config=self.model.config, max_cache_len=self.lengths[batch])
        cache = self.caches[batch]
        cache.reset()  # a fresh request in the same buffers: the same addresses, nothing recompiled
        return cache


def compiled_loop(model, trace: list[dict], cuda: bool) -> Generate:
    """The gpt-fast recipe: eager prefill into the caller's cache, then a compiled greedy step."""
    import torch

    caches, kw = Caches(model, trace), cache_keyword(model)
    steps: dict[int, Any] = {}

    def step_for(batch: int, cache):
        if batch not in steps:
            def step(tok, pos):
                logits = model(input_ids=tok, cache_position=pos, use_cache=True, **{kw: cache}).logits
                return logits[:, -1].argmax(-1, keepdim=True)

            mode = "reduce-overhead" if cuda else "default"
            steps[batch] = torch.compile(step, mode=mode, fullgraph=True, dynamic=False)
        return steps[batch]

    def run(ids, new):
        batch, length = ids.shape
        cache = caches.get(batch)
        pos = torch.arange(length, device=ids.device)
        logits = model(input_ids=ids, cache_position=pos, use_cache=True, **{kw: cache}).logits
        tok = logits[:, -1].argmax(-1, keepdim=True)
        out = [tok]
        step = step_for(batch, cache)
        for i in range(new - 1):
            if cuda:
                torch.compiler.cudagraph_mark_step_begin()
            # a replay overwrites its outputs: the token is kept as a copy
            tok = step(tok, torch.tensor([length + i], device=ids.device)).clone()
            out.append(tok)
        return torch.cat(out, 1).tolist()

    return run


def graphs(model, trace: list[dict], cuda: bool, pack: Any) -> Generate:
    from forgepack import servebench

    backend = {} if cuda else {"backend": "emulate"}
    if pack is not None:
        pack.activate(graphs=True, model=model, **backend)
    else:
        servebench.serving_of(None).serve(model, **backend)
    servebench.serving_of(pack).warmup(model, shapes=[(r["batch"], r["prompt"], r["new"]) for r in trace])
    return plain_generate(model)


def column(name: str, model, trace: list[dict], cuda: bool, pack: Any) -> Generate:
    if name == "eager":
        return plain_generate(model)
    if name == "static-pinned":
        return static_pinned_generate(model, trace, cuda)
    if name == "compiled-loop":
        return compiled_loop(model, trace, cuda)
    if name in ("graphs", "pack+graphs"):
        return graphs(model, trace, cuda, pack if name == "pack+graphs" else None)
    raise SystemExit(f"unknown column {name!r} (from {', '.join(PEERS)})")


def static_pinned_generate(model, trace: list[dict], cuda: bool) -> Generate:
    """`static-pinned`: see the module docstring; the cache is passed, so transformers compiles it."""
    import torch
    from transformers.generation import CompileConfig

    config = CompileConfig(fullgraph=True, mode="reduce-overhead" if cuda else "default")
    config._compile_all_devices = not cuda  # transformers compiles on CUDA only unless asked
    model.generation_config.compile_config = config
    model.generation_config.disable_compile = False
    caches, kw = Caches(model, trace), cache_keyword(model)

    def run(ids, new):
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(ids), **{kw: caches.get(ids.shape[0])})
        return new_tokens(out, ids)

    return run


def prompts_for(trace: list[dict], vocab: int, device, seed: int, grammar: bool) -> list:
    """The trace's prompts: the grammar a trained model learnt (checkable greedy tokens), or random ids."""
    import torch

    if not grammar:
        from forgepack import servebench

        return servebench.prompts(trace, vocab, device, seed)
    from forgepack import trainedlm

    out = []
    for i, r in enumerate(trace):
        rows = trainedlm.grammar_prompts(r["batch"], seed=seed, length=r["prompt"])
        out.append(torch.tensor(rows, device=device).roll(i, 0))  # rows differ between requests too
    return out


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def run_trace(gen: Generate, ids_list: list, trace: list[dict], device) -> tuple[list[float], int, list]:
    times, tokens, outs = [], 0, []
    for ids, req in zip(ids_list, trace, strict=True):
        sync(device)
        start = time.perf_counter()
        out = gen(ids, req["new"])
        sync(device)
        times.append(time.perf_counter() - start)
        tokens += ids.shape[0] * req["new"]
        outs.append(out)
    return times, tokens, outs


def loop_launches(model: Any, pack: Any) -> dict[str, dict[str, int]]:
    """Per bucket the decode loop captured: launches of one step, stock and with the pack's blocks (empty
    for a column that does not serve through forgepack's decode loop)."""
    from forgepack import servebench

    served = servebench.serving_of(pack).server(model)
    return served.stats()["decode_loop"]["programs"] if served is not None else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--column", required=True, choices=PEERS)
    parser.add_argument("--model", required=True, help="recipe .toml, built-in name or model directory")
    parser.add_argument("--trace", required=True, help="the trace, a JSON file of requests")
    parser.add_argument("--pack", default=None, help="pack wheel or import name (pack+graphs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grammar", action="store_true", help="prompts from forgepack.trainedlm's grammar")
    args = parser.parse_args(argv)
    import torch

    from forgepack import models, recipe, servebench

    with contextlib.ExitStack() as stack, models.quiet_transformers(), torch.no_grad():
        start = time.perf_counter()
        pack = servebench.load_pack(args.pack, stack)
        lm = models.load(recipe.resolve(args.model))
        model, device = lm.model, next(lm.model.parameters()).device
        trace = json.loads(Path(args.trace).read_text())
        ids_list = prompts_for(trace, int(model.config.vocab_size), device, args.seed, args.grammar)
        load_s = time.perf_counter() - start
        cuda = device.type == "cuda"
        ready = time.perf_counter()
        gen = column(args.column, model, trace, cuda, pack)
        ready_s = time.perf_counter() - ready
        times, _, _ = run_trace(gen, ids_list, trace, device)  # every shape compiled or captured here
        run_trace(gen, ids_list, trace, device)  # and once more: the rounds start from the steady state
        emit("ready", column=args.column, device=str(device), load_s=round(load_s, 3), ready_s=round(ready_s, 3),
             first_request_s=round(times[0], 4), warmup_s=round(sum(times), 3))
        before, outs = DynamoState.now(), []
        for line in sys.stdin:
            if line.strip() != "round":
                break
            times, tokens, outs = run_trace(gen, ids_list, trace, device)
            emit("round", round_s=round(sum(times), 5), request_s=[round(t, 5) for t in times], tokens=tokens)
        emit("done", **DynamoState.now().since(before), tokens=outs, launches=loop_launches(model, pack))
    return 0


if __name__ == "__main__":
    sys.exit(main())
