"""Warm per-module timings: each module class a pack patches, called alone, stock against each pack.

A build times a kernel in isolation: the kernel against the stock chain it replaces, warm on the CPU
(`forgepack.timing`). In a running model the call also goes through the module's patched forward (its
Python guard, the children before and after the chain), so a kernel that wins alone can still lose in
the model. This tool takes the first instance of each module class the packs' sites patch, records the
arguments it gets in one forward of the base recipe, and calls it alone: `--calls` calls a round, stock
and each pack in turn, the best of `--rounds` rounds (per call, microseconds). A pack's column counts
only where its site served every call it timed (the hits `stats()` counted); otherwise it says so.

    python tools/bench_modules.py --base benchmarks/2026-12-05-cpu-parity/tq-exact.toml \\
        --pack packs/forgepack_pack_tq_envelope-*.whl --exact packs/forgepack_pack_tq_exact-*.whl
Output: `<out>/results/bench_modules-<name>.json` and `.md` (date, device, commit, command).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

from forgepack import bench, models, recipe
from forgepack.errors import ForgepackError

WARMUP = 200


def patched_classes(pack: Any) -> dict[str, list[str]]:
    """Per module class the pack's sites patch ("module.path:Class"), the variant ids of its sites."""
    spec = json.loads((Path(pack.__path__[0]) / "modules.json").read_text())
    out: dict[str, list[str]] = {}
    for site in spec["sites"]:
        if site["kind"] != "function":
            out.setdefault(site["target"], []).extend(site["variants"])
    return out


def first_calls(model: torch.nn.Module, run, targets: set[str]) -> dict[str, tuple[torch.nn.Module, tuple, dict]]:
    """The first instance of each target class and the arguments its first call got in one `run()`."""
    seen: dict[str, tuple[torch.nn.Module, tuple, dict]] = {}
    handles = []

    def hook(name):
        def record(module, args, kwargs):
            seen.setdefault(name, (module, args, kwargs))
        return record

    for module in model.modules():
        name = f"{type(module).__module__}:{type(module).__qualname__}"
        if name in targets:  # the first instance only
            targets = targets - {name}
            handles.append(module.register_forward_pre_hook(hook(name), with_kwargs=True))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return seen


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def hits(pack: Any, variants: list[str]) -> int:
    stats = pack.stats()
    return sum(stats[v]["hits"] for v in variants if v in stats)


def time_module(module, args, kwargs, packs: dict[str, Any], variants: dict[str, list[str]], calls: int,
                rounds: int, sync) -> dict[str, Any]:
    """Best per-call time over `rounds` rounds, the columns interleaved within each round; per pack, whether
    its site served every timed call."""
    def call():
        module(*args, **kwargs)
        sync()

    best = {name: float("inf") for name in ["stock", *packs]}
    served = {name: True for name in packs}
    with torch.no_grad():
        for _ in range(rounds):
            best["stock"] = min(best["stock"], _timed(call, calls))
            for name, pack in packs.items():
                pack.activate(strict=True)
                try:
                    before = hits(pack, variants[name])
                    best[name] = min(best[name], _timed(call, calls))
                    served[name] &= hits(pack, variants[name]) - before >= WARMUP + calls
                finally:
                    pack.deactivate()
    return {"us": best, "served": served}


def _timed(call, calls: int) -> float:
    for _ in range(WARMUP):
        call()
    return per_call_us(call, calls)


def markdown(info: dict, base: recipe.Recipe, wheels: dict[str, str], rows: list[dict]) -> str:
    md = benchlib.header_md(f"Warm per-module timings, stock against each pack: {base.name}", info)
    md += "".join(f"- {name} pack: {wheel}\n" for name, wheel in wheels.items())
    md += ("- each module class a pack patches, its first instance called alone with the arguments it got in one "
           "forward; best of the rounds, microseconds per call; `stock` where the pack's site did not serve\n\n")
    table = []
    for r in rows:
        line = [r["module"], f"{r['us']['stock']:.1f}"]
        for name in wheels:
            us = f"{r['us'][name]:.1f}"
            line += [us if r["served"][name] else f"{us} (stock)", f"{r['us']['stock'] / r['us'][name]:.2f}x"]
        table.append(line)
    headers = ["module", "stock us"] + [h for n in wheels for h in (f"{n} us", f"{n} speed-up")]
    return md + tabulate(table, headers=headers, tablefmt="github", disable_numparse=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="built-in recipe name or .toml: the model and its shape")
    p.add_argument("--pack", required=True, help="a pack's wheel (the envelope pack)")
    p.add_argument("--exact", default=None, help="a second pack's wheel (the exact-shape pack)")
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)

    base = recipe.resolve(args.base)
    wheels = {"envelope": args.pack, **({"exact": args.exact} if args.exact else {})}
    info = benchlib.meta()
    with contextlib.ExitStack() as stack, models.quiet_transformers():
        packs = {name: bench.load_pack(Path(w), stack) for name, w in wheels.items()}
        lm = models.load(base)
        classes = {name: patched_classes(pack) for name, pack in packs.items()}
        targets = set().union(*classes.values())
        calls = first_calls(lm.model, lm.run, targets)
        sync = torch.cuda.synchronize if lm.device.type == "cuda" else (lambda: None)
        rows = []
        for target in sorted(calls):
            module, a, kw = calls[target]
            variants = {name: classes[name].get(target, []) for name in packs}
            timed = time_module(module, a, kw, packs, variants, args.calls, args.rounds, sync)
            rows.append({"module": target.split(":")[-1], "target": target, **timed})
            print(f"{target}: " + " ".join(f"{n} {us:.1f}us" for n, us in timed["us"].items()), file=sys.stderr)
    data = {**info, "base": recipe.to_dict(base), "wheels": wheels, "calls": args.calls, "rounds": args.rounds,
            "modules": rows}
    benchlib.write(f"bench_modules-{recipe.slugify(base.name)}", data, markdown(info, base, wheels, rows))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ForgepackError as err:
        sys.exit(f"bench_modules: {err}")
