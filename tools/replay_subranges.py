"""Replay a build's family timings through today's sub-range rule (`familyeval.sub_range`).

`tools/bench_envelope.py --build-only` writes each accepted family kernel's timed points (speed-up,
interval, share of the envelope's eager time) to `bench_envelope-<name>-families.json`. When the rule
that cuts a kernel's sub-range changes, this says, without a device, which of those timed points the
rule now serves and what share of each family's eager time lies inside, beside what the build kept.
Only what the build timed can be replayed: a family it rejected is not in the file, and a point it did
not time again at another placement keeps its single run.

    python tools/replay_subranges.py benchmarks/<run>/bench_envelope-<name>-families.json --margin -0.99
Output: `<out>/results/replay_subranges-<name>.json` and `.md` (date, commit, command).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

from forgepack import accepted, familyeval
from forgepack.cards import Dim, Family


def replayed(kernel: dict[str, Any], margin: float) -> dict[str, Any]:
    """One family kernel's timed points under today's rule. The range is the timed points' own (the file
    has no card): it decides which points the box holds, not how far past them it widens."""
    points = kernel["points"]
    names = list(points[0]["values"])
    family = Family(dims=tuple(Dim(n, min(p["values"][n] for p in points), max(p["values"][n] for p in points))
                               for n in names), inputs=(), outputs=())
    figures = [familyeval.PointFigure(p["values"], p["weight"], p["speedup"], p["ci_low"], p["ci_high"])
               for p in points]
    box = familyeval.sub_range(family, figures, margin)
    inside = [f for f in figures if box is not None and familyeval.in_box(box, f.values)]
    whole = len(inside) == len(figures)
    return {"card": kernel["card"], "built": kernel["served"] or "whole range",
            "built_share": 1.0 if kernel["share"] is None else kernel["share"],
            "now": "whole range" if whole else ("none" if box is None else accepted.served_text(box)),
            "now_share": sum(f.weight for f in inside), "points": len(figures), "points_now": len(inside)}


def markdown(info: dict[str, Any], source: Path, rows: list[dict[str, Any]]) -> str:
    table = [[r["card"], r["built"], f"{r['built_share']:.0%}", r["now"], f"{r['now_share']:.0%}",
              f"{r['points_now']}/{r['points']}"] for r in rows]
    return (benchlib.header_md("Sub-ranges replayed under today's rule", info)
            + f"- timings: `{source}` (commit {info['source_commit']})\n\n"
            + tabulate(table, headers=["family", "build kept", "share", "today's rule", "share", "timed points"],
                       tablefmt="github") + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("families", type=Path, help="a bench_envelope-<name>-families.json")
    p.add_argument("--margin", type=float, default=-0.99, help="the build's accept margin")
    args = p.parse_args(argv)
    try:
        data = json.loads(args.families.read_text())
    except (OSError, ValueError) as err:
        p.error(f"cannot read {args.families}: {err}")
    if not isinstance(data, dict) or not isinstance(data.get("families"), list):
        p.error(f"{args.families} is no bench_envelope-<name>-families.json (it has no list of families)")
    rows = [replayed(k, args.margin) for k in data["families"] if k["points"]]
    info = {**benchlib.meta(), "source_commit": data.get("commit")}
    name = args.families.stem.removeprefix("bench_envelope-").removesuffix("-families")
    benchlib.write(f"replay_subranges-{name}", {**info, "source": str(args.families), "families": rows},
                   markdown(info, args.families, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
