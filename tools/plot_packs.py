"""Combine `bench_packs.py` results (one JSON per run) into one table and one bar chart.

Each recipe's columns come from a single run (measured side by side, rounds interleaved); recipes from
different runs are only put next to each other, never divided by one another.

    python tools/plot_packs.py benchmarks/2026-11-30-h200-lanes-graph-mode/packs-*.json \
        --out benchmarks/2026-11-30-h200-lanes-graph-mode/packs-summary
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from tabulate import tabulate

COLUMNS = ("eager", "pack", "graphs", "pack+graphs", "compile", "compile-ro")


def rows(paths: list[Path]) -> list[dict]:
    out = []
    for path in paths:
        data = json.loads(path.read_text())
        for entry in data["recipes"]:
            cols = entry.get("bench", {}).get("columns", {})
            out.append({"recipe": entry["recipe"], "commit": data["meta"]["commit"], "file": path.name,
                        "ms": {c: cols[c]["ms"] for c in COLUMNS if cols.get(c, {}).get("ms")},
                        "speedup": {c: cols[c]["speedup"] for c in COLUMNS if cols.get(c, {}).get("speedup")},
                        "kept": len(entry.get("kept", []))})
    return out


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def markdown(table: list[dict]) -> str:
    body = [[r["recipe"], r["commit"], *(f"{r['ms'][c]:.2f} ({r['speedup'][c]:.2f}x)" if c in r["ms"] else ""
                                        for c in COLUMNS), r["kept"],
             f"{r['ms']['compile-ro'] / r['ms']['pack+graphs']:.2f}x" if {"compile-ro", "pack+graphs"} <= set(r["ms"])
             else "",
             f"{r['ms']['compile'] / r['ms']['pack+graphs']:.2f}x" if {"compile", "pack+graphs"} <= set(r["ms"])
             else ""] for r in table]
    md = tabulate(body, ["recipe", "commit", *(f"{c} ms" for c in COLUMNS), "kept",
                         "compile-ro / pack+graphs", "compile / pack+graphs"], tablefmt="github")
    lines = [md, ""]
    for c in COLUMNS[1:]:
        speeds = [r["speedup"][c] for r in table if c in r["speedup"]]
        if speeds:
            lines.append(f"- geomean speed-up over eager, {c}: {geomean(speeds):.2f}x over {len(speeds)} recipes")
    return "\n".join(lines) + "\n"


def plot(table: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.8))
    width = 0.8 / len(COLUMNS)
    for k, c in enumerate(COLUMNS):
        xs = [i + (k - len(COLUMNS) / 2 + 0.5) * width for i in range(len(table))]
        ax.bar(xs, [r["speedup"].get(c, 0) for r in table], width, label=c)
    names = [r["recipe"] for r in table]
    # a recipe run more than once is told apart by its commit, on a second line
    labels = [f"{r['recipe']}\n{r['commit']}" if names.count(r["recipe"]) > 1 else r["recipe"] for r in table]
    ax.set_xticks(range(len(table)), labels, fontsize=8)
    ax.set_ylabel("speed-up over eager (x)")
    ax.set_title("H200: one run per recipe, columns interleaved")
    ax.legend(ncol=3, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="path without suffix: .md and .png are written")
    args = ap.parse_args()
    table = rows(args.files)
    text = markdown(table)
    args.out.with_suffix(".md").write_text("# Packs end to end, combined\n\n" + text)
    plot(table, args.out)
    print(text)


if __name__ == "__main__":
    main()
