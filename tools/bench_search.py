"""The allocator against a uniform split of the same budget, on the reference recipes (H200).

For each recipe: profile once, then run the search twice with the templates proposer and the same
budget, each with its own store: `allocator` (expected end-to-end gain per call, DESIGN.md) and
`uniform` (the budget split evenly over every card a template serves). Reported per recipe: per-card
results and the allocation of both arms, wall time, and the estimated end-to-end gain (sum over cards
of share x (1 - 1/speedup), as a fraction of the summed operator time). The allocator must come out ahead.

Noise: a candidate that both arms propose (same card, same source) in one round is evaluated once and
its verdict reused by the other arm (`--no-share-verdicts` turns this off), so the comparison measures
where the budget went, not timing noise; the second arm's wall time is then shorter, and the reuse is
reported. `--rounds R` repeats both arms R times on the same profile, each round with fresh stores and
fresh measurements (the arm that goes first alternates), and reports per arm the median over rounds
with a percentile bootstrap interval, and the same for the paired difference allocator - uniform.

    python tools/bench_search.py                        # llama-1b-prefill and resnet-50, budget 100
    python tools/bench_search.py --recipes tiny-llama --target cpu --budget 8 16 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
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


def median_ci(values: list[float], n: int = 2000, alpha: float = 0.05, seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): the median and its percentile bootstrap interval (seeded)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return statistics.median(values), meds[int(n * alpha / 2)], meds[int(n * (1 - alpha / 2)) - 1]


ROUND_KEYS = ("calls", "new_calls", "evaluated", "tokens", "cost", "wall_s", "stopped", "estimated_gain")
CARD_KEYS = ("card_id", "calls", "counts", "best_speedup", "gain")


def compact(result: dict) -> dict:
    """What the results keep of one arm's search in one round: its totals, why it stopped, its estimated
    gain, and its accepted kernels as (card, speed-up); the per-card rows of the cards it called (the
    markdown's last-round table reads them; `trim` drops them from the other rounds). No plan, no
    per-candidate dump: the JSON of a 7-round, two-budget run stays a few tens of KB."""
    return {**{k: result[k] for k in ROUND_KEYS if k in result},
            "accepted": [[a["card_id"], round(a["speedup"], 4)] for a in result["accepted"]],
            "cards": [{k: c[k] for k in CARD_KEYS if k in c} for c in result["cards"] if c["calls"]]}


def trim(rounds: list[dict[str, dict]]) -> list[dict[str, dict]]:
    """Every round but the last without its per-card rows."""
    return [{arm: {k: v for k, v in rd[arm].items() if k != "cards"} for arm in rd} for rd in rounds[:-1]] + rounds[-1:]


def one_arm(arm: str, r, ws, cards, facts, options: dict, args, stores: list[Store], tag: str,
            budget: int) -> tuple[dict, Store]:
    path = ws.root / f"store-{arm}-{tag}.sqlite"
    for stale in ws.root.glob(f"store-{arm}-{tag}.sqlite*"):
        stale.unlink()
    store = Store(path)
    proposer = pipeline.make_proposer(r.replace(build={"proposer": "templates"}), facts)
    settings = run.Settings(budget=budget, target=facts.target, arch=facts.arch, strategy=arm,
                            margin=r.build.margin)
    local = pipeline.make_executor("local", r, facts, {"evaluator_options": options})
    executor = SharedVerdicts(local, [] if args.no_share_verdicts else list(stores))
    try:
        result = run.Search(ws, cards, proposer, executor, settings, store=store).run()
    finally:
        executor.close()
    data = {**compact(run.result_json(result)), "reused_verdicts": executor.reused,
            "curve": gain_curve(store, cards, budget)}
    return data, store


def one_recipe(name: str, args: argparse.Namespace, root: Path) -> tuple[list[dict], str]:
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
    results, text = [], ""
    for budget in args.budget:
        rounds: list[dict[str, dict]] = []
        for k in range(args.rounds):
            arms: dict[str, dict] = {}
            stores: list[Store] = []
            for arm in (ARMS if k % 2 == 0 else ARMS[::-1]):  # who measures first alternates
                arms[arm], store = one_arm(arm, r, ws, cards, facts, options, args, stores, f"b{budget}r{k}", budget)
                stores.append(store)
                print(f"{name} budget {budget} round {k + 1}/{args.rounds} {arm}: gain "
                      f"{100 * arms[arm]['estimated_gain']:.2f}% in {arms[arm]['wall_s']:.0f} s "
                      f"({arms[arm]['calls']} calls, {arms[arm]['evaluated']} evaluated, "
                      f"{arms[arm]['reused_verdicts']} reused)", flush=True)
            for store in stores:
                store.close()
            rounds.append(arms)
        data = {"recipe": name, "budget": budget, "profile_s": profile_s, "cards": len(cards), "rounds": trim(rounds),
                "summary": summary(rounds)}
        results.append(data)
        text += markdown(name, data, {c.id: c for c in cards})
    return results, text


def summary(rounds: list[dict[str, dict]]) -> dict:
    """Per arm, and for the paired difference, the median over rounds with its bootstrap interval."""
    out: dict = {}
    for arm in ARMS:
        gains = [100 * rd[arm]["estimated_gain"] for rd in rounds]
        out[arm] = {"gain_pct": median_ci(gains), "calls": statistics.median(rd[arm]["calls"] for rd in rounds),
                    "accepted": statistics.median(len(rd[arm]["accepted"]) for rd in rounds),
                    "wall_s": statistics.median(rd[arm]["wall_s"] for rd in rounds), "gains_pct": gains}
    diff = [100 * (rd["allocator"]["estimated_gain"] - rd["uniform"]["estimated_gain"]) for rd in rounds]
    out["difference"] = {"gain_pct": median_ci(diff), "gains_pct": diff,
                         "allocator_ahead_in": sum(d > 0 for d in diff)}
    return out


def _mci(t: tuple[float, float, float]) -> str:
    return f"{t[0]:.2f} [{t[1]:.2f}, {t[2]:.2f}]"


def markdown(name: str, data: dict, cards: dict) -> str:
    rounds, summ = data["rounds"], data["summary"]
    n = len(rounds)
    lines = [f"## {name} (budget {data['budget']}, {data['cards']} cards, profile {data['profile_s']:.0f} s, "
             f"{n} round{'s' if n != 1 else ''})\n"]
    rows = [[arm, _mci(summ[arm]["gain_pct"]), f"{summ[arm]['calls']:g}", f"{summ[arm]['accepted']:g}",
             f"{summ[arm]['wall_s']:.0f}", " ".join(f"{g:.2f}" for g in summ[arm]["gains_pct"])] for arm in ARMS]
    diff = summ["difference"]
    rows.append(["allocator - uniform", _mci(diff["gain_pct"]), "", "", "",
                 " ".join(f"{g:+.2f}" for g in diff["gains_pct"])])
    lines.append("estimated end-to-end gain (% of summed operator time): median over rounds [95% bootstrap "
                 "interval of the median]\n")
    lines.append(tabulate(rows, ["arm", "gain % median [CI]", "calls (median)", "accepted (median)",
                                 "wall s (median)", "per round"], tablefmt="github") + "\n")
    lines.append(f"allocator ahead in {diff['allocator_ahead_in']} of {n} rounds\n")
    curves = {arm: [{int(k): v for k, v in rd[arm].get("curve", {}).items()} for rd in rounds] for arm in ARMS}
    ks = sorted({k for arm in ARMS for c in curves[arm] for k in c})
    if ks:
        def at(curve: dict[int, float], k: int) -> float:
            done = [j for j in curve if j <= k]
            return 100 * curve[max(done)] if done else 0.0

        lines.append("estimated gain (%) after the first k calls, median over rounds:\n")
        lines.append(tabulate([[arm, *(f"{statistics.median(at(c, k) for c in curves[arm]):.2f}" for k in ks)]
                               for arm in ARMS], ["k", *map(str, ks)], tablefmt="github") + "\n")
    last = rounds[-1]
    alloc, uni = last["allocator"], last["uniform"]
    lines.append(f"last round, per card: allocator stopped: {alloc['stopped']}; uniform stopped: {uni['stopped']}\n")
    rows = []
    by_card = {arm: {c["card_id"]: c for c in last[arm]["cards"]} for arm in ARMS}
    ids = {cid for arm in ARMS for cid, c in by_card[arm].items() if c["calls"]}
    for cid in sorted(ids, key=lambda c: -cards[c].profile.share):
        none = {"calls": 0, "best_speedup": None, "gain": 0.0}
        a, u = by_card["allocator"].get(cid, none), by_card["uniform"].get(cid, none)
        rows.append([
            cards[cid].op_name, cards[cid].signature()[:48], f"{100 * cards[cid].profile.share:.1f}",
            cards[cid].profile.baseline, f"{cards[cid].profile.headroom:.1f}",
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
    parser.add_argument("--budget", type=int, nargs="+", default=[100], help="one comparison per budget")
    parser.add_argument("--target", choices=("cuda", "cpu"), default=None, help="override the recipes' target")
    parser.add_argument("--bench-reps", type=int, default=15,
                        help="cap on timed repetitions per candidate (0: the evaluator's default)")
    parser.add_argument("--no-share-verdicts", action="store_true", help="evaluate every candidate in both arms")
    parser.add_argument("--rounds", type=int, default=1, help="repeat both arms, fresh stores and measurements")
    parser.add_argument("--keep", action="store_true", help="keep the workspaces (printed at the end)")
    args = parser.parse_args()
    root = Path(os.environ.get("FORGEPACK_HOME", tempfile.gettempdir())) / "search-work"  # not in $OUT: big
    info = benchlib.meta()
    started = time.monotonic()
    results, md = [], benchlib.header_md("Search: allocator vs uniform split", info)
    ahead = False
    for finished, name in enumerate(args.recipes, 1):  # written after every recipe: a time limit keeps what is done
        data, text = one_recipe(name, args, root)
        results.extend(data)
        md += text
        wall = time.monotonic() - started
        ahead = all(d["summary"]["difference"]["gain_pct"][0] > 0 for d in results)
        done = f"{finished} of {len(args.recipes)} recipes"
        benchlib.write("search", {**info, "wall_s": wall, "allocator_ahead": ahead, "results": results,
                                  "args": vars(args)},
                       md + f"total wall time: {wall:.0f} s ({done}); allocator ahead on every recipe: {ahead}\n",
                       indent=None)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"workspaces: {root}")
    return 0 if ahead else 1


if __name__ == "__main__":
    sys.exit(main())
