"""Shape benchmark: an envelope pack against stock at every shape of its envelope, and against the
exact-shape pack at the shape that pack was built for.

Issue 20's speed targets: at the old fixed shape the family pack is within 3% of the exact-shape pack,
and at no shape of the envelope is the pack slower than stock beyond noise. Per shape, one process
times stock, the envelope pack and (`--exact`) the exact-shape pack side by side in interleaved rounds
(`forgepack.modeltiming`, each round the median of `--reps` forwards, eager as the guards serve it); the
speed-ups are paired by round, with a bootstrap interval (`forgepack.intervals`). The shapes:

- `base`: the base recipe's own workload as it is (its phase, batch, length and cache: the exact pack's);
- `prefill bB sS`: a prompt of S tokens at batch B, no cache;
- `decode bB cC`: one token at batch B over a dynamic KV cache of C tokens (what `generate()` runs).

Verdicts: `slower` where the pack's interval lies wholly below 1 (slower than stock beyond noise), and at
`base` whether the envelope pack is within `--tolerance` (3%) of the exact one (median paired ratio).

    python tools/bench_shapes.py --base llama-1b-decode --pack packs/forgepack_pack_llama_1b_decode_envelope-*.whl \\
        --exact packs/forgepack_pack_llama_1b_decode-*.whl --batches 1,2,4,8 --prompts 16,256,2048 \\
        --caches 16,512,2048
Output: `<out>/results/bench_shapes-<name>.json` and `.md` (date, device, commit, command).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

from forgepack import bench, intervals, models, modeltiming, recipe
from forgepack.errors import ForgepackError

TOLERANCE = 0.03  # issue 20: the family pack within 3% of the exact-shape pack at its shape


@dataclasses.dataclass(frozen=True)
class Shape:
    label: str
    recipe: recipe.Recipe


def shapes(base: recipe.Recipe, batches: list[int], prompts: list[int], caches: list[int]) -> list[Shape]:
    """The base recipe's own shape first, then prefill and decode steps over the grid, in the envelope's
    form (the default dynamic cache)."""
    out = [Shape("base", base)]
    for b in batches:
        out += [Shape(f"prefill b{b} s{s}", base.replace(workload={"phase": "prefill", "batch": b, "seq_len": s,
                                                                   "cache_len": 0, "static_cache": False}))
                for s in prompts]
        out += [Shape(f"decode b{b} c{c}", base.replace(workload={"phase": "decode", "batch": b, "seq_len": 1,
                                                                  "cache_len": c, "static_cache": False}))
                for c in caches]
    return out


def switch_for(packs: dict[str, Any]):
    """The interleaved loop's switch: a pack's column runs with that pack active (strictly) and only it."""
    @contextlib.contextmanager
    def switched(name: str):
        pack = packs.get(name)
        if pack is not None:
            pack.activate(strict=True)
        try:
            yield
        finally:
            if pack is not None:
                pack.deactivate()
    return switched


def hits(packs: dict[str, Any]) -> dict[str, int]:
    return {name: sum(s["hits"] for s in pack.stats().values()) for name, pack in packs.items()}


def time_shape(lm: models.LoadedModel, packs: dict[str, Any], rounds: int, reps: int, seed: int) -> dict[str, Any]:
    """Stock and each pack at this shape, interleaved: per column its median ms, and per pack the speed-up
    over stock (paired by round) with its interval, and the kernel calls it served per forward."""
    columns = ["stock", *packs]
    forwards = {name: lm.run for name in columns}
    before = hits(packs)
    times = modeltiming.interleaved_ms(forwards, rounds, reps, modeltiming.device_sync(lm.device), seed,
                                       switch_for(packs))
    after = hits(packs)
    forwards_run = rounds * (reps + 1)
    row: dict[str, Any] = {"ms": {name: statistics.median(times[name]) for name in columns}, "rounds_ms": times}
    for name in packs:
        row[name] = {"speedup": statistics.median(a / b for a, b in zip(times["stock"], times[name], strict=True)),
                     "ci": intervals.bootstrap_ratio_ci(times["stock"], times[name], paired=True),
                     "served_per_forward": (after[name] - before[name]) / forwards_run}
    if "exact" in packs:
        ratios = [e / p for e, p in zip(times["exact"], times["envelope"], strict=True)]
        row["envelope_vs_exact"] = {"ratio": statistics.median(ratios),
                                    "ci": intervals.bootstrap_ratio_ci(times["exact"], times["envelope"], paired=True)}
    return row


def verdict(row: dict[str, Any], tolerance: float = TOLERANCE) -> str:
    """`slower` where a pack loses to stock beyond noise; at the exact pack's own shape (`base`), whether
    the envelope pack is within `tolerance` of it."""
    words = [f"{name} slower than stock" for name in ("envelope", "exact") if name in row and row[name]["ci"][1] < 1]
    versus = row.get("envelope_vs_exact")
    if versus is not None and row["shape"] == "base":
        words.append(f"within {tolerance:.0%} of exact" if versus["ratio"] >= 1 - tolerance
                     else f"{1 - versus['ratio']:.1%} behind exact")
    return "; ".join(words)


def markdown(info: dict, base: recipe.Recipe, wheels: dict[str, str], rows: list[dict], skipped: list[str],
             rounds: int, reps: int) -> str:
    md = benchlib.header_md(f"Envelope pack against stock, shape by shape: {base.name}", info)
    md += "".join(f"- {name} pack: {wheel}\n" for name, wheel in wheels.items())
    slower = [r["shape"] for r in rows if "slower" in r["verdict"]]
    md += (f"- {len(rows)} shapes, {rounds} interleaved rounds of {reps} forwards each (eager, as the guards serve "
           f"it); speed-up = stock / pack per round, median [95% interval]\n"
           f"- shapes where a pack is slower than stock beyond noise: **{len(slower)}**"
           f"{' (' + ', '.join(slower) + ')' if slower else ''}\n")
    md += f"- not timed (time limit): {', '.join(skipped)}\n\n" if skipped else "\n"
    packs = [n for n in ("envelope", "exact") if n in wheels]
    headers = ["shape", "stock ms"] + [h for n in packs for h in (f"{n} ms", f"{n} speed-up", f"{n} kernels/fwd")]
    headers += ["envelope / exact", "verdict"] if "exact" in packs else ["verdict"]
    table = []
    for r in rows:
        line = [r["shape"], f"{r['ms']['stock']:.3f}"]
        for n in packs:
            p = r[n]
            line += [f"{r['ms'][n]:.3f}", f"{p['speedup']:.3f}x [{p['ci'][0]:.3f}, {p['ci'][1]:.3f}]",
                     f"{p['served_per_forward']:.0f}"]
        if "exact" in packs:
            v = r["envelope_vs_exact"]
            line.append(f"{v['ratio']:.3f} [{v['ci'][0]:.3f}, {v['ci'][1]:.3f}]")
        table.append([*line, r["verdict"]])
    return md + tabulate(table, headers=headers, tablefmt="github") + "\n"


def parse_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def add_grid_args(p: argparse.ArgumentParser, batches: str, prompts: str, caches: str) -> None:
    """The base recipe, the target and the grid of shapes (`shapes`), as this tool and probe_overhead take them."""
    p.add_argument("--base", default="llama-1b-decode", help="built-in recipe name or .toml: the model and its shape")
    p.add_argument("--target", default=None, help="cpu or cuda (default: the base recipe's)")
    p.add_argument("--batches", default=batches)
    p.add_argument("--prompts", default=prompts, help="prefill shapes' prompt lengths")
    p.add_argument("--caches", default=caches, help="decode shapes' KV cache lengths")


def grid_of(args: argparse.Namespace) -> tuple[recipe.Recipe, list[Shape]]:
    base = recipe.resolve(args.base)
    if args.target:
        base = base.replace(target={"device": args.target})
    return base, shapes(base, parse_ints(args.batches), parse_ints(args.prompts), parse_ints(args.caches))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_grid_args(p, "1,2,4,8", "16,256,2048", "16,512,2048")
    p.add_argument("--pack", required=True, help="the envelope pack's wheel")
    p.add_argument("--exact", default=None, help="the exact-shape pack's wheel (built for --base's own shape)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    p.add_argument("--time-limit", type=float, default=None, help="seconds after which no new shape starts")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    base, grid = grid_of(args)
    wheels = {"envelope": args.pack, **({"exact": args.exact} if args.exact else {})}
    info = benchlib.meta()
    start, rows, skipped = time.perf_counter(), [], []
    with contextlib.ExitStack() as stack, models.quiet_transformers():
        packs = {name: bench.load_pack(Path(w), stack) for name, w in wheels.items()}
        model = models.load(base).model
        for shape in grid:
            if args.time_limit is not None and time.perf_counter() - start > args.time_limit:
                skipped.append(shape.label)
                continue
            lm = models.with_inputs(shape.recipe, model)
            row = {"shape": shape.label, **time_shape(lm, packs, args.rounds, args.reps, args.seed)}
            row["verdict"] = verdict(row, args.tolerance)
            rows.append(row)
            print(f"{shape.label}: " + ", ".join(f"{n} {row[n]['speedup']:.3f}x" for n in packs)
                  + (f" ({row['verdict']})" if row["verdict"] else ""), file=sys.stderr)
            del lm
    data = {**info, "base": recipe.to_dict(base), "wheels": wheels, "rounds": args.rounds, "reps": args.reps,
            "rows": rows, "skipped": skipped,
            "slower": [r["shape"] for r in rows if "slower" in r["verdict"]]}
    benchlib.write(f"bench_shapes-{recipe.slugify(base.name)}", data,
                   markdown(info, base, wheels, rows, skipped, args.rounds, args.reps))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ForgepackError as err:  # a missing or corrupt wheel, an unknown recipe: one line, not a traceback
        sys.exit(f"bench_shapes: {err}")
