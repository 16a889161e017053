"""Envelope benchmark: how much of a mixed-shape `generate()` trace an envelope pack's kernels serve.

A pack built for a serving envelope (`phase = "generate"`, batch and prompt-length ranges: issue 20)
must serve the shapes a deployment runs, not one. This tool builds such a pack from a base recipe and
the envelope given here (`forgepack build` in a subprocess, gate as the recipe says, or `--no-gate`),
or takes a built one (`--pack WHEEL`), then runs a trace of greedy `generate()` requests (batch from
`--batches`, prompt length log-uniform in `--prompt`, new tokens uniform in `--new`, fixed `--seed`;
the trace of `servebench.make_trace`) twice per request: stock (pack deactivated), then the pack
active. From the pack's own `stats()` it reports the share of the calls of the ops the pack has
families for that its kernels served (hits / calls, per op and overall; the issue's target is >= 90%),
the kernels' errors, whether each request's tokens are stock's (else the first step that differs),
and, since random weights have near-tied logits that flip tokens, whether the pack is wrong: both
decodes' logits teacher-forced against eager stock logits of their own tokens (`servebench.Agreement`:
max error over scale, top-1 agreement where eager's top two are not a near-tie), the pack's beside stock's.
Wall seconds per request are printed for orientation only: speed claims come from `bench_serve`.

    # H200, the Llama-1B shape over batch 1-8 and prompts 16-2048: build (inside a device call's time, every
    # verified kernel kept: the trace measures what the guards serve), then the trace on its wheel
    python tools/bench_envelope.py --base llama-1b-decode --batch 1-8 --seq-len 16-2048 --budget 48 \\
        --time-limit 240 --margin -0.99 --no-gate --build-only
    python tools/bench_envelope.py --base llama-1b-decode --batch 1-8 --seq-len 16-2048 \\
        --pack benchmarks/out/packs/forgepack_pack_llama_1b_decode_envelope-*.whl
    # CPU smoke on tiny-llama
    python tools/bench_envelope.py --base tiny-llama --batch 1-4 --seq-len 8-64 --batches 1,2,4 \\
        --prompt 8,64 --new 4,8 --requests 6 --budget 40 --no-gate
Output: `<out>/results/bench_envelope-<name>.json` and `.md` (date, device, commit, command).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

from forgepack import models, recipe, tomlwriter
from forgepack.servebench import make_trace, parse_pair, prompts

REPO = Path(__file__).resolve().parent.parent

TARGET = 0.9  # issue 20: the kernels serve >= 90% of the calls of the ops the pack has families for


def envelope_recipe(base: str, batch: str, seq_len: str, cache_max: int, new_tokens: int, target: str | None,
                    budget: int | None, gate: bool, time_limit: float | None = None,
                    margin: float | None = None) -> recipe.Recipe:
    """`base` (a built-in name or .toml) served over the envelope: phase generate, these ranges, the default
    dynamic cache (generate() with a StaticCache is served by graph mode, not by the kernels' guards)."""
    r = recipe.resolve(base)
    workload = {"phase": "generate", "batch": recipe.parse_size(batch, "batch"),
                "seq_len": recipe.parse_size(seq_len, "seq_len"), "cache_len": recipe.Range(0, cache_max),
                "new_tokens": new_tokens, "static_cache": False}
    build = {"budget": budget, "gate": gate, "proposer": "templates", "time_limit": time_limit, "margin": margin}
    return r.replace(name=f"{r.name}-envelope", workload=workload, target={"device": target}, build=build)


def build(r: recipe.Recipe, root: Path, strategy: str = "allocator") -> tuple[Path, dict[str, Any]]:
    """`forgepack build` of the envelope recipe in a fresh process: (the wheel, what the build said)."""
    path = root / f"{r.name}.toml"
    path.write_text(tomlwriter.dumps(recipe.to_dict(r)))
    cmd = [sys.executable, "-m", "forgepack", "build", str(path), "--workspace", str(root / "ws"), "--out",
           str(root / "packs"), "--json", "--strategy", strategy]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    # The build's progress passes through to our stderr: a build cut by a device call's limit still
    # says how far it got (the 2026-12-01-h200-serving-graphs run lost a 400 s call to a silent one).
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"bench_envelope: the build failed (exit {proc.returncode}); its output is above")
    doc = json.loads(proc.stdout)
    if not doc.get("wheel"):
        sys.exit(f"bench_envelope: the build wrote no wheel (gate {doc.get('gate')}): nothing to serve")
    return Path(doc["wheel"]), {"seconds": seconds, "gate": doc.get("gate"), "recipe": str(path), "strategy": strategy,
                                "stopped": doc.get("stopped")}


# Per timed point: the times too, so that a kernel at parity can be told from one at the memory ceiling
POINT_FIELDS = ("values", "weight", "speedup", "ci_low", "ci_high", "eager_us", "kernel_us")
# a point that lost by a little was timed again elsewhere in memory: each run's figures (familyeval)
RETIMED_FIELD = "placements"


def family_kernels(ws_root: Path) -> list[dict[str, Any]]:
    """Each accepted family kernel as its build measured it (issue 20's sub-ranges): the speed-up at every
    timed point of its envelope with the point's weight, the sub-range it was kept for (none: its whole
    range), that range's share of the family's eager time, and the envelope figure over the whole range
    beside the one its verdict carries (stock serving outside the sub-range)."""
    from forgepack import accepted
    from forgepack.search.store import Store
    from forgepack.workspace import Workspace

    ws = Workspace(ws_root)
    out = []
    with Store(ws.store_path) as store:
        for k in accepted.load_all(ws_root):
            if "-F" not in k.card_id or k.candidate_id is None:
                continue
            fam = ((store.candidate(k.candidate_id).verdict or {}).get("diagnostics") or {}).get("family") or {}
            whole = fam.get("whole") or {}
            out.append({"card": k.card_id, "served": accepted.served_text(k.served), "share": fam.get("served_share"),
                        "speedup": k.speedup, "whole_speedup": whole.get("speedup", k.speedup),
                        "points": [_point(p) for p in fam.get("points", ())]})
    return out


def _point(p: dict[str, Any]) -> dict[str, Any]:
    out = {f: p.get(f) for f in POINT_FIELDS}
    if RETIMED_FIELD in p:
        out[RETIMED_FIELD] = p[RETIMED_FIELD]
    return out


def _point_text(p: dict[str, Any]) -> str:
    runs = len(p.get(RETIMED_FIELD, ()))
    return (f"{'/'.join(str(v) for v in p['values'].values())}: {p['speedup']:.2f}x"
            + (f" ({runs} placements)" if runs else ""))


def families_md(kernels: list[dict[str, Any]]) -> str:
    rows = [[k["card"], k["served"] or "whole range", "" if k["share"] is None else f"{k['share']:.0%}",
             f"{k['whole_speedup']:.3f}x", f"{k['speedup']:.3f}x",
             ", ".join(_point_text(p) for p in k["points"])]
            for k in kernels]
    return ("Family kernels as the build timed them (a kernel losing on part of its envelope is kept for the "
            "sub-range where it wins; stock serves the rest):\n\n"
            + tabulate(rows, headers=["family", "kept for", "share inside", "whole range", "as kept", "per point"],
                       tablefmt="github") + "\n\n")


def import_pack(wheel: Path, root: Path):
    """The wheel unpacked into a fresh site directory and imported (nothing is compiled at install)."""
    import importlib

    site = root / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    name = next(p.name for p in site.iterdir() if p.name.startswith("forgepack_pack_") and "." not in p.name)
    sys.path.insert(0, str(site))
    return importlib.import_module(name)


def served(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict[str, int]]:
    """Per op the pack has families for (a variant id with "-F"): calls, hits by any of its kernels,
    errors, between two `stats()`. An op's calls are one variant's hits + misses (misses count the
    op's calls that variant did not serve, whoever served them)."""
    ops = {v["op"] for k, v in after.items() if "-F" in k}
    out: dict[str, dict[str, int]] = {}
    for k, v in after.items():
        if v.get("op") not in ops:
            continue
        d = {f: v.get(f, 0) - before.get(k, {}).get(f, 0) for f in ("hits", "misses", "errors", "outside")}
        row = out.setdefault(v["op"], {"calls": 0, "hits": 0, "errors": 0, "outside": 0})
        row["calls"] = d["hits"] + d["misses"]
        row["hits"] += d["hits"]
        row["errors"] += d["errors"]
        row["outside"] += d["outside"]  # sent to stock by a kernel's sub-range (it does not pay there)
    return out


def fused_served(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict[str, int]]:
    """Per fused pattern (`fusion.rmsnorm.default`, ...): the calls of its sites, and the hits of its
    kernels, between two `stats()`. A site's calls are counted once however many variants it has."""
    out: dict[str, dict[str, int]] = {}
    sites: dict[str, set] = {}
    for k, v in after.items():
        if not str(v.get("op", "")).startswith("fusion."):
            continue
        b = before.get(k, {})
        hits, misses = v.get("hits", 0) - b.get("hits", 0), v.get("misses", 0) - b.get("misses", 0)
        row = out.setdefault(v["op"], {"calls": 0, "hits": 0, "errors": 0})
        row["hits"] += hits
        row["errors"] += v.get("errors", 0) - b.get("errors", 0)
        key = tuple(v.get("sites", ()))
        if key not in sites.setdefault(v["op"], set()):  # one variant's hits + misses = its sites' calls
            sites[v["op"]].add(key)
            row["calls"] += hits + misses
    return out


def first_difference(a: torch.Tensor, b: torch.Tensor, start: int) -> int | None:
    """The first generated step where any row differs (None: identical)."""
    if a.shape != b.shape:
        return 0
    steps = (a[:, start:] != b[:, start:]).any(dim=0).nonzero()
    return None if steps.numel() == 0 else int(steps[0])


def run_trace(lm, pack, trace: list[dict], seed: int) -> list[dict]:
    """Each request stock (pack off) and with the pack, in turn first: the calls its kernels served, the tokens, and
    both decodes' teacher-forced agreement with eager stock logits of their own sequences. Random-weight
    models have near-tied logits, so tokens alone cannot tell a wrong kernel from a tie broken the other
    way: the pack's error is read beside stock's own (its cached decode against the same no-cache twin)."""
    from forgepack.runtime.graphs import eager_forward
    from forgepack.servebench import Agreement

    vocab = lm.model.config.get_text_config().vocab_size
    twin = eager_forward(lm.model)
    rows = []
    for k, (request, ids) in enumerate(zip(trace, prompts(trace, vocab, lm.device, seed), strict=True)):
        # every other request runs the pack first: whatever a request's first run pays (the allocator
        # growing, caches warming) falls on each side in turn, not on stock's wall column every time
        runs = {side: _generate(lm, pack, ids, request["new"], side == "pack")
                for side in (("stock", "pack") if k % 2 == 0 else ("pack", "stock"))}
        (stock, stock_s, _), (got, pack_s, (before, after)) = runs["stock"], runs["pack"]
        per_op, fused = served(before, after), fused_served(before, after)
        pack.deactivate()
        agree = {}
        with torch.no_grad():
            for side, out in (("stock", stock), ("pack", got)):
                tally = Agreement()
                tally.add(twin, out, request["new"])
                agree[side] = tally.summary()
        diff = first_difference(stock.sequences, got.sequences, ids.shape[1])
        rows.append({**request, "same": diff is None, "first_difference": diff, "stock_s": stock_s,
                     "pack_s": pack_s, "ops": per_op, "fused": fused, "agreement": agree})
        print(f"request {request['id']}: batch {request['batch']} prompt {request['prompt']} new {request['new']}: "
              f"{share(per_op):.1%} served, tokens {'as stock' if diff is None else f'differ from step {diff}'}; "
              f"max error/scale stock {agree['stock']['max_err_over_scale']:.4f} pack "
              f"{agree['pack']['max_err_over_scale']:.4f}", file=sys.stderr)
        del stock, got
    return rows


def _generate(lm, pack, ids, new: int, with_pack: bool) -> tuple[Any, float, tuple[dict, dict]]:
    """One greedy generate() with logits, the pack on or off: its output, wall seconds, and the pack's
    stats() before and after."""
    (pack.activate if with_pack else pack.deactivate)()
    before = pack.stats()
    start = time.perf_counter()
    out = models.generate(lm.model, ids, new, logits=True)
    seconds = time.perf_counter() - start
    return out, seconds, (before, pack.stats())


def record_misses(lm, pack, request: dict, seed: int, top: int) -> list[dict]:
    """The trace's first request once more with the pack active, inside `pack.record_misses()`: per op, its
    `top` most frequent signatures no kernel served (one request: the shapes a pack misses repeat per step),
    folded (`misses.folded`: a view's place in a growing tensor as `*`, one row for all of a decode's steps)."""
    ids = prompts([request], lm.model.config.get_text_config().vocab_size, lm.device, seed)[0]  # run_trace's
    pack.activate()
    try:
        with pack.record_misses() as rec:
            models.generate(lm.model, ids, request["new"])
    finally:
        pack.deactivate()
    ops = dict.fromkeys(op for op, _, _ in rec.top(None, fold=True))  # the op of the most frequent miss first
    return [{"op": op, "signature": sig, "count": n} for op in ops for _, sig, n in rec.top(top, op=op, fold=True)]


def misses_md(misses: list[dict], request: dict) -> str:
    head = (f"Calls no kernel served, by signature: the first request (batch {request['batch']}, prompt "
            f"{request['prompt']}, new {request['new']}) re-run once with the pack under `pack.record_misses()`, "
            "the most frequent per op (`*`: a stride or offset that says where a view lies in a larger tensor, "
            "folded over the steps):\n\n")
    if not misses:
        return head + "none missed.\n\n"
    return head + tabulate([[m["op"], m["signature"], m["count"]] for m in misses],
                           headers=["op", "signature", "calls"], tablefmt="github") + "\n\n"


def worst(rows: list[dict], side: str) -> dict[str, float]:
    """Over the requests: the largest error over scale and the lowest top-1 agreement where eager's top
    two logits are not a near-tie (servebench.CLEAR_GAP)."""
    errs = [r["agreement"][side]["max_err_over_scale"] for r in rows]
    clear = [r["agreement"][side]["top1_clear"] for r in rows if r["agreement"][side]["top1_clear"] is not None]
    return {"max_err_over_scale": max(errs, default=0.0), "top1_clear": min(clear, default=1.0)}


def total(rows: list[dict], field: str = "ops") -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        for op, d in row.get(field, {}).items():
            t = out.setdefault(op, {"calls": 0, "hits": 0, "errors": 0, "outside": 0})
            for f in t:
                t[f] += d.get(f, 0)
    return out


def share(per_op: dict[str, dict[str, int]], field: str = "hits") -> float:
    calls = sum(d["calls"] for d in per_op.values())
    return sum(d.get(field, 0) for d in per_op.values()) / calls if calls else 0.0


def by_sub_range(per_op: dict[str, dict[str, int]]) -> float:
    """The share of the calls a kernel's guard admitted to its verified range but sent to stock, outside the
    sub-range it was kept for."""
    return share(per_op, "outside")


NOTE = ("\n\nerr: the largest |decode logit - eager teacher-forced logit| over the largest |logit| (first two "
        "rows); top-1 clear: top-1 as eager's where eager's top two are not a near-tie (the share of such steps). "
        "Wall seconds are for orientation only (no warm-up, one run each, logits kept; stock runs first in "
        "requests 0, 2, 4, ..., the pack in the others).\n")


def clear_text(a: dict) -> str:
    return "-" if a["top1_clear"] is None else f"{a['top1_clear']:.2%} ({a['clear_share']:.0%})"


def markdown(info: dict, r: recipe.Recipe, built: dict, rows: list[dict], ops: dict,
             misses: list[dict] | None = None) -> str:
    w = r.workload
    md = benchlib.header_md(f"Envelope pack over a mixed generate() trace: {r.name}", info)
    ws, wp = worst(rows, "stock"), worst(rows, "pack")
    md += (f"- envelope: batch {w.batch}, prompts {w.seq_len}, cache {w.cache_len}, dtype {w.dtype}\n"
           f"- pack: {built.get('wheel')} (gate {built.get('gate')}, built in {built.get('seconds', 0):.0f} s)\n"
           f"- served: **{share(ops):.1%}** of {sum(d['calls'] for d in ops.values())} calls of the ops the pack "
           f"has families for (target {TARGET:.0%}), and {by_sub_range(ops):.1%} more sent to stock by the kernels' "
           f"own sub-ranges (stock is as fast or faster there, as the build timed it); kernel errors "
           f"{sum(d['errors'] for d in ops.values())}; "
           f"tokens as stock in {sum(r_['same'] for r_ in rows)} of {len(rows)} requests\n"
           f"- teacher-forced against eager stock logits of the same tokens (worst request; near-ties "
           f"flip tokens, so these say whether the pack is wrong): max error over scale stock "
           f"{ws['max_err_over_scale']:.4f}, pack {wp['max_err_over_scale']:.4f}; top-1 where not a near-tie "
           f"stock {ws['top1_clear']:.2%}, pack {wp['top1_clear']:.2%}\n\n")
    md += families_md(built["families"]) if built.get("families") else ""
    fused = total(rows, "fused")
    if fused:
        md += ("Fused kernels (module-level chains: a family over the envelope where the same chain folds, else "
               "exact sizes per capture point): their sites' calls and the calls the kernels served; a served "
               "call replaces the chain's operator calls, which then do not count above.\n\n")
        md += tabulate([[op, d["calls"], d["hits"], f"{d['hits'] / d['calls']:.1%}" if d["calls"] else "-",
                         d["errors"]] for op, d in sorted(fused.items())],
                       headers=["fused op", "calls", "served", "share", "errors"], tablefmt="github") + "\n\n"
    md += tabulate([[op, d["calls"], d["hits"], f"{d['hits'] / d['calls']:.1%}" if d["calls"] else "-", d["errors"],
                     d.get("outside", 0)] for op, d in sorted(ops.items(), key=lambda kv: -kv[1]["calls"])],
                   headers=["op", "calls", "served", "share", "errors", "stock by sub-range"],
                   tablefmt="github") + "\n\n"
    md += misses_md(misses, rows[0]) if misses is not None else ""
    md += tabulate([[x["id"], x["batch"], x["prompt"], x["new"], f"{share(x['ops']):.1%}",
                     "yes" if x["same"] else f"no (step {x['first_difference']})",
                     f"{x['agreement']['stock']['max_err_over_scale']:.4f}",
                     f"{x['agreement']['pack']['max_err_over_scale']:.4f}", clear_text(x["agreement"]["stock"]),
                     clear_text(x["agreement"]["pack"]), f"{x['stock_s']:.2f}", f"{x['pack_s']:.2f}"] for x in rows],
                   headers=["request", "batch", "prompt", "new", "served", "tokens as stock", "err stock",
                            "err pack", "top-1 clear stock", "top-1 clear pack", "stock s", "pack s"],
                   tablefmt="github") + NOTE
    return md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="llama-1b-decode", help="built-in recipe name or .toml: the model")
    p.add_argument("--batch", default="1-8", help="the envelope's batch range")
    p.add_argument("--seq-len", default="16-2048", help="the envelope's prompt lengths")
    p.add_argument("--cache-max", type=int, default=None, help="KV cache bound (default: longest prompt + new)")
    p.add_argument("--capture-new", type=int, default=8, help="tokens generated at each capture point")
    p.add_argument("--target", default=None, help="cpu or cuda (default: the base recipe's)")
    p.add_argument("--budget", type=int, default=24)
    p.add_argument("--no-gate", action="store_true", help="build without the end-to-end gate")
    p.add_argument("--time-limit", type=float, default=None,
                   help="the build's build.time_limit: seconds of profile + search, then it packs what it has")
    p.add_argument("--margin", type=float, default=None,
                   help="the build's accept margin (the recipe's by default); -0.99 keeps every verified kernel, "
                        "as the CPU target's test does, so that the trace measures what the guards serve, "
                        "not which kernels beat stock")
    p.add_argument("--strategy", default="allocator",
                   help="the build's --strategy: breadth gives every card worth a call one before any gets a "
                        "second (a wide envelope under a time limit)")
    p.add_argument("--pack", default=None, help="a built envelope pack's wheel (skips the build)")
    p.add_argument("--build-only", action="store_true",
                   help="build, copy the wheel to <out>/packs/ (for a later --pack run), and stop")
    p.add_argument("--batches", default="1,2,4,8", help="trace: batch sizes drawn from")
    p.add_argument("--prompt", default="16,2048", help="trace: prompt lengths, low,high (log-uniform)")
    p.add_argument("--new", default="64,256", help="trace: new tokens, low,high")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--misses", type=int, default=0,
                   help="after the trace, re-run its first request under pack.record_misses() and report each "
                        "op's N most frequent missed signatures (0: off)")
    args = p.parse_args(argv)
    if args.misses < 0:
        p.error(f"--misses takes a count of signatures per op, 0 or more (got {args.misses})")

    new = parse_pair(args.new)
    cache_max = args.cache_max or recipe.high(recipe.parse_size(args.seq_len, "seq_len")) + new[1]
    r = envelope_recipe(args.base, args.batch, args.seq_len, cache_max, args.capture_new, args.target, args.budget,
                        not args.no_gate, args.time_limit, args.margin)
    trace = make_trace(args.requests, [int(b) for b in args.batches.split(",")], parse_pair(args.prompt), new,
                       args.seed)
    info = benchlib.meta()
    with tempfile.TemporaryDirectory(prefix="bench_envelope-") as tmp:
        root = Path(tmp)
        if args.pack:
            wheel, built = Path(args.pack), {"seconds": 0.0, "gate": "given"}
        else:
            wheel, built = build(r, root, args.strategy)
            if args.build_only:  # first of all: a stage cut short after the build still leaves the wheel
                kept = Path(os.environ.get("OUT", "benchmarks/out")) / "packs"
                kept.mkdir(parents=True, exist_ok=True)
                shutil.copy2(wheel, kept / wheel.name)
                built["kept"] = str(kept / wheel.name)
            built["families"] = family_kernels(root / "ws")
        built["wheel"] = wheel.name
        if args.build_only:
            print(json.dumps(built))
            benchlib.write(f"bench_envelope-{recipe.slugify(r.name)}-families", {**info, **built},
                           benchlib.header_md(f"Envelope pack's family kernels: {r.name}", info)
                           + families_md(built["families"]))
            return 0
        pack = import_pack(wheel, root)
        with models.quiet_transformers():
            lm = models.load(recipe.concrete(r))
            rows = run_trace(lm, pack, trace, args.seed)
            misses = record_misses(lm, pack, trace[0], args.seed, args.misses) if args.misses else None
    ops = total(rows)
    data = {**info, "recipe": recipe.to_dict(r), "build": built, "trace": trace, "requests": rows, "ops": ops,
            "served": share(ops), "stock_by_sub_range": by_sub_range(ops), "target": TARGET,
            "same_tokens": all(x["same"] for x in rows),
            "agreement": {"stock": worst(rows, "stock"), "pack": worst(rows, "pack")},
            "fused": total(rows, "fused")}
    if misses is not None:
        data["misses"] = misses
    benchlib.write(f"bench_envelope-{recipe.slugify(r.name)}", data, markdown(info, r, built, rows, ops, misses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
