"""The allocator against a uniform split of the same budget, on the reference recipes (H200).

For each recipe: profile once, then run the search twice with the templates proposer and the same
budget, each with its own store: `allocator` (expected end-to-end gain per call, DESIGN.md) and
`uniform` (the budget split evenly over every card a template serves). Reported per recipe: per-card
results and the allocation of both arms, wall time, and the estimated end-to-end gain (sum over cards
of share x (1 - 1/speedup), as a fraction of the summed operator time). The allocator must come out ahead.

Noise: a candidate that both arms propose (same card, same source) is evaluated once and its verdict
reused by the other arm (`--no-share-verdicts` turns this off), so the comparison measures where the
budget went, not timing noise; the second arm's wall time is then shorter, and the reuse is reported.

    python tools/bench_search.py                        # llama-1b-prefill and resnet-50, budget 100
    python tools/bench_search.py --recipes tiny-llama --target cpu --budget 12 --bench-reps 10
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

from forgepack import pipeline, recipe, workspace
from forgepack.search import allocator, run
from forgepack.search.store import Store

ARMS = ("allocator", "uniform")
CHECKPOINTS = (5, 10, 20, 30, 50, 75, 100, 150, 200)


def gain_curve(store: Store, cards: list, budget: int) -> dict[int, float]:
    """Estimated gain (each call counted once) after the first k calls, replayed from the store: how
    fast each arm gets there matters as much as where it ends (a budget is often cut short)."""
    candidates = {c.id: c for c in store.candidates()}
    history = []
    for call in sorted(store.calls(), key=lambda c: c.id):
        cand = candidates.get(call.candidate_id) if call.candidate_id else None
        history.append(run.call_result(cand) if call.outcome == "new" and cand is not None
                       else allocator.CallResult(call.card_id))
    points = sorted({k for k in CHECKPOINTS if k < min(budget, len(history))} | {len(history)})
    return {k: allocator.total_gain(allocator.card_states(cards, history[:k])) for k in points}


class SharedVerdicts:
    """An `Executor` that answers from another arm's store when it already evaluated the same source."""

    def __init__(self, inner, stores: list[Store]):
        self.inner, self.stores = inner, stores
        self.slots = inner.slots
        self.reused = 0

    def submit(self, card, source, samples_path=None) -> Future:
        from forgepack.evaluate import Verdict

        digest = run.source_hash(source)
        for store in self.stores:
            found = store.find_candidate(card.id, digest)
            if found is not None and found.state == "evaluated" and found.verdict:
                self.reused += 1
                done: Future = Future()
                done.set_result(Verdict.from_json(found.verdict))
                return done
        return self.inner.submit(card, source, samples_path)

    def close(self) -> None:
        self.inner.close()


def one_recipe(name: str, args: argparse.Namespace, root: Path) -> tuple[dict, str]:
    r = recipe.resolve(name)
    if args.target:
        r = r.replace(target={"device": args.target})
    ws = workspace.Workspace.for_recipe(r, root / r.slug)
    t0 = time.monotonic()
    profiled = pipeline.profile(r, ws)
    cards = list(profiled.cards)
    profile_s = time.monotonic() - t0
    facts = pipeline.target_facts(r, profiled.profile)
    options = {"bench_reps": args.bench_reps} if args.bench_reps else {}
    from forgepack.evaluate import Evaluator
    from forgepack.search.executor import supported_options

    if options and not supported_options(Evaluator, options):
        print("note: this Evaluator has no bench_reps option; the evaluator's own repetitions are used", flush=True)
    arms: dict[str, dict] = {}
    stores: list[Store] = []
    for arm in ARMS:
        path = ws.root / f"store-{arm}.sqlite"
        for stale in ws.root.glob(f"store-{arm}.sqlite*"):
            stale.unlink()
        store = Store(path)
        proposer = pipeline.make_proposer(r.replace(build={"proposer": "templates"}), facts)
        settings = run.Settings(budget=args.budget, target=facts.target, arch=facts.arch, strategy=arm,
                                margin=r.build.margin)
        local = pipeline.make_executor("local", r, facts, {"evaluator_options": options})
        executor = SharedVerdicts(local, [] if args.no_share_verdicts else list(stores))
        try:
            result = run.Search(ws, cards, proposer, executor, settings, store=store).run()
        finally:
            executor.close()
        arms[arm] = {**run.result_json(result), "reused_verdicts": executor.reused,
                     "curve": gain_curve(store, cards, args.budget)}
        stores.append(store)
        print(f"{name} {arm}: gain {100 * result.estimated_gain:.2f}% in {result.wall_s:.0f} s "
              f"({result.evaluated} evaluated, {executor.reused} reused)", flush=True)
    for store in stores:
        store.close()
    data = {"recipe": name, "budget": args.budget, "profile_s": profile_s, "cards": len(cards), "arms": arms}
    return data, markdown(name, data, {c.id: c for c in cards})


def markdown(name: str, data: dict, cards: dict) -> str:
    alloc, uni = data["arms"]["allocator"], data["arms"]["uniform"]
    verdict = "ahead" if alloc["estimated_gain"] > uni["estimated_gain"] else "NOT ahead"
    lines = [
        f"## {name} (budget {data['budget']}, {data['cards']} cards, profile {data['profile_s']:.0f} s)\n",
        f"estimated end-to-end gain (fraction of summed operator time): allocator "
        f"**{100 * alloc['estimated_gain']:.2f}%** vs uniform **{100 * uni['estimated_gain']:.2f}%** -> "
        f"allocator {verdict}\n",
        f"calls spent: allocator {alloc['calls']} ({alloc['stopped']}), uniform {uni['calls']} ({uni['stopped']})\n",
        f"wall: allocator {alloc['wall_s']:.0f} s, uniform {uni['wall_s']:.0f} s "
        f"(uniform reused {uni['reused_verdicts']} verdicts); "
        f"accepted kernels: allocator {len(alloc['accepted'])}, uniform {len(uni['accepted'])}\n",
    ]
    curves = {arm: {int(k): v for k, v in data["arms"][arm].get("curve", {}).items()} for arm in ARMS}
    ks = sorted(set(curves["allocator"]) | set(curves["uniform"]))
    if ks:
        def at(arm: str, k: int) -> str:
            done = [j for j in curves[arm] if j <= k]
            return f"{100 * curves[arm][max(done)]:.2f}" if done else "-"

        lines.append("estimated gain (%) after the first k calls:\n")
        lines.append(tabulate([["allocator", *(at("allocator", k) for k in ks)],
                               ["uniform", *(at("uniform", k) for k in ks)]],
                              ["k", *map(str, ks)], tablefmt="github") + "\n")
    rows = []
    by_card = {arm: {c["card_id"]: c for c in data["arms"][arm]["cards"]} for arm in ARMS}
    ids = {cid for arm in ARMS for cid, c in by_card[arm].items() if c["calls"]}
    for cid in sorted(ids, key=lambda c: -cards[c].profile.share):
        a, u = by_card["allocator"][cid], by_card["uniform"][cid]
        rows.append([
            cards[cid].op_name, cards[cid].signature()[:48], f"{100 * a['share']:.1f}", cards[cid].profile.baseline,
            f"{cards[cid].profile.headroom:.1f}",
            a["calls"], _speed(a), f"{100 * a['gain']:.2f}",
            u["calls"], _speed(u), f"{100 * u['gain']:.2f}",
        ])
    lines.append(tabulate(rows, ["op", "signature", "share %", "class", "headroom", "alloc calls", "alloc best",
                                 "alloc gain %", "unif calls", "unif best", "unif gain %"], tablefmt="github"))
    return "\n".join(lines) + "\n\n"


def _speed(c: dict) -> str:
    return f"{c['best_speedup']:.3f}x" if c["best_speedup"] else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["llama-1b-prefill", "resnet-50"])
    parser.add_argument("--budget", type=int, default=100)
    parser.add_argument("--target", choices=("cuda", "cpu"), default=None, help="override the recipes' target")
    parser.add_argument("--bench-reps", type=int, default=15,
                        help="cap on timed repetitions per candidate (0: the evaluator's default)")
    parser.add_argument("--no-share-verdicts", action="store_true", help="evaluate every candidate in both arms")
    parser.add_argument("--keep", action="store_true", help="keep the workspaces (printed at the end)")
    args = parser.parse_args()
    root = Path(os.environ.get("FORGEPACK_HOME", tempfile.gettempdir())) / "search-work"  # not in $OUT: big
    info = benchlib.meta()
    started = time.monotonic()
    results, md = [], benchlib.header_md("Search: allocator vs uniform split", info)
    ahead = False
    for name in args.recipes:  # results are written after every recipe: a time limit keeps what is done
        data, text = one_recipe(name, args, root)
        results.append(data)
        md += text
        wall = time.monotonic() - started
        ahead = all(d["arms"]["allocator"]["estimated_gain"] > d["arms"]["uniform"]["estimated_gain"]
                    for d in results)
        done = f"{len(results)} of {len(args.recipes)} recipes"
        benchlib.write("search", {**info, "wall_s": wall, "allocator_ahead": ahead, "results": results,
                                  "args": vars(args)},
                       md + f"total wall time: {wall:.0f} s ({done}); allocator ahead on every recipe: {ahead}\n")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"workspaces: {root}")
    return 0 if ahead else 1


if __name__ == "__main__":
    sys.exit(main())
