"""The same search on the local executor and on the Ray executor: candidates evaluated per minute.

One recipe is profiled once; each arm then runs the same search (templates proposer, same budget)
from a copy of that workspace, with its own store and its own empty compile cache (so every arm
compiles what it evaluates), and, for Ray, its own local Ray session. An arm is `kind:evaluators`:
`local:1`, `local:2` (two evaluation workers on this host; on cuda one per GPU, `local:all` = every
visible GPU), `ray:1`, `ray:2`, `ray:all` (one actor per GPU in the cluster). Reported per arm:
evaluated candidates, search wall time (executor start-up apart), candidates per minute, seconds per
candidate, and the accepted kernels (card and source hash); then Ray's overhead per candidate against
`local:1` at one evaluator, the 1 -> 2 evaluator scaling of each executor, and whether every arm
accepted the same kernels (timing noise can flip a near-threshold verdict, which then steers the
search elsewhere: a difference is listed, not hidden). The machine's load (`uptime`) is recorded
before and after each arm, because on a shared host it bounds what scaling can show.

    python tools/bench_executor.py --target cpu --budget 16 --arms local:1,ray:1,ray:2
    python tools/bench_executor.py --recipe llama-1b-prefill --budget 96 --arms local:1,local:all,ray:all  # GPUs

Arms whose executor cannot run here (no `ray` installed) are reported as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

from forgepack import intervals, pipeline, recipe, workspace
from forgepack.search import run
from forgepack.search.executor import LocalExecutor, visible_devices
from forgepack.search.proposers import make


def load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def parse_arm(text: str, target: str) -> tuple[str, int | None]:
    kind, _, count = text.partition(":")
    if kind not in ("local", "ray"):
        raise SystemExit(f"bad arm {text!r}: expected local:N or ray:N")
    if count in ("", "all"):
        return kind, None
    return kind, int(count)


def make_arm_executor(kind: str, count: int | None, target: str, arch: str | None, margin: float,
                      options: dict, cache: Path) -> Any:
    if kind == "local":
        devices = visible_devices(target)
        if count is not None:
            devices = devices[:count] if target == "cuda" else [0] * count
        executor = LocalExecutor(target, arch=arch, margin=margin, devices=devices, evaluator_options=options)
        executor.wait_ready()  # start-up apart, as the Ray executor's constructor waits for its actors
        return executor
    import ray

    from forgepack.search.ray_executor import RayExecutor

    evaluators = count if count is not None or target == "cuda" else 1
    cpus = max(os.cpu_count() or 1, (evaluators or 1) + 1)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=cpus, include_dashboard=False, namespace="forgepack", log_to_driver=False,
             runtime_env={"env_vars": {"FORGEPACK_CACHE": str(cache)}})
    return RayExecutor(target, arch=arch, margin=margin, evaluators=evaluators, evaluator_options=options)


STATIC_REJECT = (Path(__file__).resolve().parent.parent / "tests" / "kernels" / "cache_static.cpp")


def dispatch_latency(executor: Any, card: Any, probes: int) -> float | None:
    """Median seconds from submit to verdict of a source the static checks reject (nothing compiled,
    no worker run): what the executor itself adds to each candidate, one candidate in flight."""
    if probes <= 0 or not STATIC_REJECT.exists():
        return None
    source = STATIC_REJECT.read_text()
    times = []
    for k in range(probes):
        started = time.perf_counter()
        verdict = executor.submit(card, f"{source}\n// probe {k} {time.time_ns()}\n").result()
        times.append(time.perf_counter() - started)
        assert verdict.category == "static", verdict.reason
    return sorted(times)[len(times) // 2]


def one_arm(arm: str, r: recipe.Recipe, profiled: Path, root: Path, args: argparse.Namespace, arch: str | None,
            cards_count: int) -> dict:
    kind, count = parse_arm(arm, r.target.device)
    if kind == "ray":
        try:
            import ray
        except ImportError:
            return {"arm": arm, "skipped": 'ray is not installed here (pip install "forgepack[ray]")'}
    ws_root = root / arm.replace(":", "-")
    shutil.copytree(profiled, ws_root)
    ws = workspace.Workspace(ws_root)
    cache = root / f"cache-{arm.replace(':', '-')}"
    os.environ["FORGEPACK_CACHE"] = str(cache)  # the local arm's compiles and the driver's copies
    options = {"bench_reps": args.bench_reps} if args.bench_reps else {}
    before = load()
    t0 = time.monotonic()
    executor = make_arm_executor(kind, count, r.target.device, arch, r.build.margin, options, cache)
    startup_s = time.monotonic() - t0
    settings = run.Settings(budget=args.budget, target=r.target.device, arch=arch, margin=r.build.margin,
                            strategy=args.strategy)
    search = run.Search(ws, ws.load_cards(), make("templates", target=r.target.device), executor, settings)
    try:
        began = time.time()
        result = search.run()
        done = sorted((c for c in search.store.candidates() if c.state == "evaluated"), key=lambda c: c.id)
        ends = [began] + [c.evaluated for c in done]
        slots = [b - a for a, b in itertools.pairwise(ends)]  # each candidate's share of the wall time
        sources = [c.source_hash[:16] for c in done]
        summary = executor.summary()
        evaluators = executor.evaluators
        phases = [ph.to_json() for ph in executor.phases.items()]
        probe_s = dispatch_latency(executor, ws.load_cards()[0], args.probes)
    finally:
        search.store.close()
        executor.close()
        if kind == "ray":
            import ray

            ray.shutdown()
    after = load()
    per_min = 60.0 * result.evaluated / result.wall_s if result.wall_s else 0.0
    accepted = sorted((k.card_id, k.source_hash[:16]) for k in result.accepted)
    probe = f", dispatch {1e3 * probe_s:.1f} ms" if probe_s is not None else ""
    print(f"{arm}: {result.evaluated} evaluated in {result.wall_s:.1f} s ({per_min:.1f}/min), start-up "
          f"{startup_s:.1f} s{probe}, {len(accepted)} accepted; {summary}", flush=True)
    return {"arm": arm, "kind": kind, "evaluators": evaluators, "summary": summary, "startup_s": startup_s,
            "wall_s": result.wall_s, "evaluated": result.evaluated, "per_minute": per_min,
            "s_per_candidate": result.wall_s / max(1, result.evaluated), "accepted": accepted,
            "stopped": result.stopped, "load_before": before, "load_after": after, "dispatch_s": probe_s,
            "phases": phases, "slots_s": slots, "sources": sources}


def median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def aggregate(arms: list[dict]) -> dict[str, dict]:
    """Per arm name over its repeats: median s/candidate, candidates/minute and dispatch latency."""
    out: dict[str, dict] = {}
    for a in arms:
        if "skipped" not in a:
            out.setdefault(a["arm"], {"runs": []})["runs"].append(a)
    for entry in out.values():
        runs = entry["runs"]
        entry["s_per_candidate"] = median([r["s_per_candidate"] for r in runs])
        entry["per_minute"] = median([r["per_minute"] for r in runs])
        probes = [r["dispatch_s"] for r in runs if r.get("dispatch_s") is not None]
        entry["dispatch_s"] = median(probes) if probes else None
        entry["accepted"] = runs[0]["accepted"]
        entry["accepted_runs"] = [r["accepted"] for r in runs]
    return out


def per_candidate_ratio(num: dict, den: dict) -> dict:
    """mean s/candidate of `num` over `den`'s, with a 95% bootstrap interval over candidates, pooled
    over repeats: paired (candidate k against candidate k) when both evaluated the same sources in the
    same order, repeat by repeat (the search is deterministic: it should), else unpaired."""
    pairs = list(zip(num["runs"], den["runs"], strict=False))
    paired = all(a.get("sources") and a.get("sources") == b.get("sources") for a, b in pairs)
    a = [x for run_a, _ in pairs for x in run_a.get("slots_s", [])]
    b = [x for _, run_b in pairs for x in run_b.get("slots_s", [])]
    if not a or not b:
        return {}
    ratio = statistics.fmean(a) / statistics.fmean(b)
    low, high = intervals.bootstrap_ratio_ci(a, b, paired=paired, statistic=statistics.fmean)
    return {"ratio": ratio, "ci": (low, high), "paired": paired, "candidates": (len(a), len(b))}


def comparisons(arms: list[dict]) -> dict:
    ran = aggregate(arms)
    out: dict[str, Any] = {}
    local1, ray1 = ran.get("local:1"), ran.get("ray:1")
    if local1 and ray1:
        out["ray_overhead_per_candidate"] = ray1["s_per_candidate"] / local1["s_per_candidate"] - 1.0
        out["ray_per_candidate_ratio"] = per_candidate_ratio(ray1, local1)
        if local1["dispatch_s"] is not None and ray1["dispatch_s"] is not None:
            out["ray_dispatch_overhead_s"] = ray1["dispatch_s"] - local1["dispatch_s"]
            out["ray_dispatch_overhead_fraction"] = out["ray_dispatch_overhead_s"] / local1["s_per_candidate"]
    for kind in ("local", "ray"):
        one, two = ran.get(f"{kind}:1"), ran.get(f"{kind}:2")
        if one and two and one["per_minute"]:
            out[f"{kind}_scaling_1_to_2"] = two["per_minute"] / one["per_minute"]
            out[f"{kind}_scaling_ratio"] = per_candidate_ratio(one, two)
    kernels = {name: tuple(map(tuple, a["accepted"])) for name, a in ran.items()}
    first = next(iter(kernels.values()), ())
    out["same_accepted"] = all(k == first for k in kernels.values())
    # The same candidates, in the same order, on every arm: the executor did not change the search. A
    # differing accepted set is then the verdicts' timing (a candidate near the margin), not the executor.
    sources = [r.get("sources") for a in ran.values() for r in a["runs"]]
    out["same_candidates"] = bool(sources) and all(s and s == sources[0] for s in sources)
    for count in ("1", "2", "all"):  # the executors against each other at the same evaluator count, run by run
        pair = [ran.get(f"{kind}:{count}") for kind in ("local", "ray")]
        if None not in pair:
            runs = list(zip(pair[0]["accepted_runs"], pair[1]["accepted_runs"], strict=False))
            out[f"same_accepted_at_{count}"] = [a == b for a, b in runs]
    if not out["same_accepted"]:
        union = set().union(*map(set, kernels.values()))
        out["accepted_differences"] = {name: sorted(union - set(k)) for name, k in kernels.items()
                                       if set(k) != union}
    return out


PHASES = ("compile_s", "compiler_s", "wait_s", "call_s", "evaluate_s", "finish_s")


def phase_table(arms: list[dict]) -> str:
    """Per arm, the mean of each phase per candidate (the search's search s / candidate beside it): what
    an executor adds is the call beyond the evaluator's own time, and the evaluators' idle time."""
    rows = []
    for a in arms:
        phases = a.get("phases") or []
        if not phases:
            continue
        n = len(phases)
        mean = {k: sum(p[k] for p in phases) / n for k in PHASES}
        idle = max(0.0, a["wall_s"] * a["evaluators"] - sum(p["call_s"] for p in phases)) / n
        rows.append([a["arm"], a["repeat"], n, *(f"{1e3 * mean[k]:.0f}" for k in PHASES),
                     f"{1e3 * (mean['call_s'] - mean['evaluate_s']):.0f}", f"{1e3 * idle:.0f}"])
    headers = ["arm", "repeat", "n", "compile ms", "compiler ms", "wait ms", "call ms", "evaluate ms",
               "finish ms", "call - evaluate ms", "evaluator idle ms"]
    return "mean phases per candidate (driver's clock):\n\n" + tabulate(rows, headers=headers, tablefmt="github")


def markdown(info: dict, data: dict) -> str:
    rows = []
    for a in data["arms"]:
        if "skipped" in a:
            rows.append([a["arm"], "-", "-", "-", "-", "-", "-", "-", "-", f"skipped: {a['skipped']}"])
            continue
        dispatch = f"{1e3 * a['dispatch_s']:.1f}" if a.get("dispatch_s") is not None else "-"
        rows.append([a["arm"], a["repeat"], a["evaluators"], a["evaluated"], f"{a['wall_s']:.1f}",
                     f"{a['per_minute']:.1f}", f"{a['s_per_candidate']:.2f}", dispatch, f"{a['startup_s']:.1f}",
                     len(a["accepted"])])
    text = benchlib.header_md("Executors: the same search on the local executor and on Ray", info)
    text += (f"recipe {data['recipe']} on {data['target']}, budget {data['budget']} templates calls "
             f"({data.get('strategy', 'allocator')} strategy), "
             f"bench reps {data['bench_reps'] or 'default'}; machine: {data['machine']}\n\n")
    text += tabulate(rows, headers=["arm", "repeat", "evaluators", "evaluated", "search s", "cand./min", "s/cand.",
                                    "dispatch ms", "start-up s", "accepted"], tablefmt="github") + "\n\n"
    medians = [[name, len(e["runs"]), f"{e['per_minute']:.1f}", f"{e['s_per_candidate']:.2f}"]
               for name, e in aggregate(data["arms"]).items()]
    text += tabulate(medians, headers=["arm", "runs", "median cand./min", "median s/cand."],
                     tablefmt="github") + "\n\n"
    c = data["comparisons"]
    if "ray_overhead_per_candidate" in c:
        text += f"- Ray overhead per candidate at one evaluator (median s/candidate over repeats): " \
                f"{100 * c['ray_overhead_per_candidate']:+.1f}% of the local executor's time (target <= 5%)\n"
    ratio = c.get("ray_per_candidate_ratio")
    if ratio:
        low, high = ratio["ci"]
        text += f"- Ray overhead per candidate, mean over {ratio['candidates'][0]} candidates " \
                f"({'paired with the same candidates on local:1' if ratio['paired'] else 'unpaired'}): " \
                f"{100 * (ratio['ratio'] - 1):+.1f}% (95% interval {100 * (low - 1):+.1f}% to " \
                f"{100 * (high - 1):+.1f}%; target <= 5%)\n"
    if "ray_dispatch_overhead_s" in c:
        text += f"- Ray's own dispatch cost per candidate (static-rejected probes, submit to verdict, one in " \
                f"flight): {1e3 * c['ray_dispatch_overhead_s']:+.1f} ms over the local executor's, " \
                f"{100 * c['ray_dispatch_overhead_fraction']:.1f}% of a local candidate's time\n"
    for kind in ("local", "ray"):
        if f"{kind}_scaling_1_to_2" in c:
            text += f"- {kind} scaling 1 -> 2 evaluators: {c[f'{kind}_scaling_1_to_2']:.2f}x (target >= 1.8x)"
            scaling = c.get(f"{kind}_scaling_ratio")
            if scaling:
                low, high = scaling["ci"]
                text += f"; mean s/candidate ratio {scaling['ratio']:.2f}x (95% interval {low:.2f}-{high:.2f}, " \
                        f"{'paired' if scaling['paired'] else 'unpaired'})"
            text += "\n"
    for count in ("1", "2", "all"):
        if f"same_accepted_at_{count}" in c:
            same = c[f"same_accepted_at_{count}"]
            text += f"- local:{count} and ray:{count} accepted the same kernels, run by run: " \
                    f"{', '.join('yes' if x else 'NO' for x in same)}\n"
    if "same_candidates" in c:
        text += f"- the same candidates evaluated, in the same order, on every arm: " \
                f"{'yes' if c['same_candidates'] else 'NO'}\n"
    text += f"- same accepted kernels on every arm: {'yes' if c['same_accepted'] else 'NO'}\n"
    if not c["same_accepted"]:
        for name, missing in c["accepted_differences"].items():
            text += f"  - {name} lacks {missing}\n"
    text += "\n" + phase_table(data["arms"]) + "\n"
    text += "\nload (uptime) before / after each arm:\n\n"
    for a in data["arms"]:
        if "skipped" not in a:
            text += f"- {a['arm']} (repeat {a['repeat']}): `{a['load_before']}` / `{a['load_after']}`\n"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny-llama")
    parser.add_argument("--target", default=None, help="cpu or cuda (default: the recipe's)")
    parser.add_argument("--budget", type=int, default=60)
    parser.add_argument("--strategy", default="uniform", choices=("uniform", "allocator"),
                        help="uniform (default): one call per searchable card in turn, so the budget buys as many "
                             "distinct candidates (the allocator stops tiny-llama's search after ~7)")
    parser.add_argument("--arms", default="local:1,ray:1,ray:2")
    parser.add_argument("--bench-reps", type=int, default=None, help="interleaved pairs per benchmark")
    parser.add_argument("--name", default="bench_executor")
    parser.add_argument("--repeat", type=int, default=1, help="runs of the arm list, every other one reversed")
    parser.add_argument("--probes", type=int, default=15, help="static-rejected submissions timed per arm")
    args = parser.parse_args()
    r = recipe.resolve(args.recipe)
    if args.target:
        r = r.replace(target={"device": args.target})
    info = benchlib.meta()
    with tempfile.TemporaryDirectory(prefix="bench-executor-") as tmp:
        root = Path(tmp)
        os.environ["FORGEPACK_CACHE"] = str(root / "cache-profile")
        profiled = workspace.Workspace.for_recipe(r, root / "profiled").root
        t0 = time.monotonic()
        done = pipeline.profile(r, workspace.Workspace(profiled))
        cards = list(done.cards)
        print(f"profiled {r.name} on {r.target.device} in {time.monotonic() - t0:.0f} s: {len(cards)} cards",
              flush=True)
        arch = pipeline.target_facts(r, done.profile).arch
        names = args.arms.split(",")
        arms = []
        for repeat in range(args.repeat):  # ABBA: an arm's place in the order (warm caches, load) evens out
            for arm in names if repeat % 2 == 0 else names[::-1]:
                arms.append({**one_arm(arm, r, profiled, root / f"run{repeat}", args, arch, len(cards)),
                             "repeat": repeat})
    import platform

    data = {"recipe": r.name, "target": r.target.device, "budget": args.budget, "bench_reps": args.bench_reps,
            "repeat": args.repeat, "strategy": args.strategy,
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, {benchlib.device_name()}",
            "arms": arms, "comparisons": comparisons(arms), **info}
    benchlib.write(args.name, data, markdown(info, data))


if __name__ == "__main__":
    main()
