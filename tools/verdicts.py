"""Every candidate a build evaluated, from its workspace's search store: card, proposer and parameters,
verdict and reason (what `forgepack build` prints only as counts), as a table or JSON.

    python tools/verdicts.py .forgepack/llama-1b-decode [--json] [--card fusion_qkv]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tabulate import tabulate

from forgepack.search.store import read_snapshot


def rows(workspace: Path, card: str | None) -> list[dict]:
    _, candidates = read_snapshot(workspace / "store.sqlite")
    out = []
    for c in candidates:
        if card and not c.card_id.startswith(card):
            continue
        verdict = c.category or ("accepted" if c.accepted else c.state)
        out.append({"card": c.card_id, "proposer": c.proposer, "params": c.params, "category": verdict,
                    "speedup": c.speedup, "reason": c.reason})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workspace", type=Path)
    p.add_argument("--card", help="only cards whose id starts with this")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    found = rows(args.workspace, args.card)
    if args.json:
        print(json.dumps(found, indent=1))
        return 0
    table = [[r["card"], r["proposer"], json.dumps(r["params"])[:60], r["category"],
              f"{r['speedup']:.3f}" if r["speedup"] else "", (r["reason"] or "")[:160]] for r in found]
    print(tabulate(table, headers=["card", "proposer", "params", "verdict", "speed-up", "reason"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
