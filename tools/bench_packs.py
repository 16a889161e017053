"""Build a pack for each reference recipe and time it end to end against eager and torch.compile.

Per recipe, in subprocesses (a crash or a GPU fault costs one recipe, not the run):
1. `forgepack build <recipe> --budget N --workspace W --out W/packs --json` (profile, search, gate, wheel);
2. `forgepack bench <recipe> --pack <wheel> --columns ... --json --workspace W`: every column of one
   recipe timed side by side in one process with interleaved rounds.
Results are written after every recipe (kernels kept and dropped, with the gate's reasons, come from
the workspace's pack_report.json). A time limit stops starting new recipes and says which were not run.

    python tools/bench_packs.py llama-1b-prefill llama-1b-decode gpt2 resnet-50 vit-base qwen2-0.5b-prefill \
        --budget 24 --heavy llama-1b-prefill,llama-1b-decode --time-limit 480
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

REPO = Path(__file__).resolve().parent.parent
LIGHT = "eager,pack,pack+graphs,compile"
HEAVY = "eager,pack,graphs,pack+graphs,compile,compile-ro"


def forgepack(*args: str, timeout: float) -> tuple[int, str, str]:
    cmd = [sys.executable, "-m", "forgepack", *args]
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout:.0f} s: {' '.join(args)}"
    return proc.returncode, proc.stdout, proc.stderr


def last_json(text: str) -> dict:
    start = text.find("{")
    return json.loads(text[start:]) if start >= 0 else {}


def one(name: str, args: argparse.Namespace, root: Path) -> dict:
    ws = root / name
    entry: dict = {"recipe": name}
    t0 = time.monotonic()
    rc, stdout, stderr = forgepack("build", name, "--budget", str(args.budget), "--workspace", str(ws),
                                   "--out", str(ws / "packs"), "--json", timeout=args.build_timeout)
    entry["build_s"] = round(time.monotonic() - t0, 1)
    if rc != 0:
        entry["error"] = f"build failed (exit {rc}): {stderr.strip().splitlines()[-1:] or ''}"
        print(stderr[-3000:], flush=True)
        return entry
    built = last_json(stdout)
    report = json.loads((ws / "pack_report.json").read_text()) if (ws / "pack_report.json").exists() else {}
    entry["kept"] = [(d["op"], d.get("speedup")) for d in report.get("kept", [])]
    entry["dropped"] = [(d["op"], d.get("stage"), d.get("reason")) for d in report.get("dropped", [])]
    entry["gate"] = report.get("summary", {})
    entry["calls"] = built.get("calls_spent") or built.get("calls")
    wheel = built.get("wheel")
    columns = (HEAVY if name in args.heavy else LIGHT).split(",")
    if not wheel:  # nothing was kept: time what stock PyTorch can do without a pack
        columns = ["eager", "graphs", *[c for c in columns if c.startswith("compile")]]
    bench_args = ["bench", name, "--columns", ",".join(columns), "--rounds", str(args.rounds), "--reps",
                  str(args.reps), "--json", "--workspace", str(ws), *(["--pack", wheel] if wheel else [])]
    t0 = time.monotonic()
    rc, stdout, stderr = forgepack(*bench_args, timeout=args.bench_timeout)
    entry["bench_s"] = round(time.monotonic() - t0, 1)
    if rc != 0:
        entry["error"] = f"bench failed (exit {rc}): {stderr.strip().splitlines()[-1:] or ''}"
        print(stderr[-3000:], flush=True)
        return entry
    entry["bench"] = last_json(stdout)
    return entry


def cell(entry: dict, column: str) -> str:
    c = entry.get("bench", {}).get("columns", {}).get(column)
    if not c:
        return ""
    if "skipped" in c:
        return "skipped"
    speed = f" ({c['speedup']:.2f}x)" if "speedup" in c else ""
    return f"{c['ms']:.2f}{speed}"


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def render(info: dict, entries: list[dict], not_run: list[str]) -> str:
    cols = ["eager", "pack", "graphs", "pack+graphs", "compile", "compile-ro"]
    rows = [[e["recipe"], *[cell(e, c) for c in cols], len(e.get("kept", [])), len(e.get("dropped", [])),
             e.get("build_s", ""), e.get("error", "")] for e in entries]
    md = benchlib.header_md("Kernel packs end to end: eager vs pack vs CUDA graphs vs torch.compile", info)
    md += ("Each cell: median ms over interleaved rounds (speed-up over eager, paired per round). `pack` = the "
           "pack's guarded kernels in eager mode; `graphs` = stock kernels replayed from CUDA graphs; "
           "`pack+graphs` = `activate(graphs=True)`; `compile` = torch.compile default; `compile-ro` = "
           "torch.compile(mode=\"reduce-overhead\").\n\n")
    md += tabulate(rows, ["recipe", *[f"{c} ms" for c in cols], "kept", "dropped", "build s", "error"],
                   tablefmt="github") + "\n\n"
    for col in ("pack", "graphs", "pack+graphs", "compile", "compile-ro"):
        speeds = [e.get("bench", {}).get("columns", {}).get(col, {}).get("speedup") for e in entries]
        g = geomean([s for s in speeds if s])
        if g:
            md += f"- geomean speed-up over eager, {col}: {g:.2f}x over {sum(1 for s in speeds if s)} recipes\n"
    for e in entries:
        ratio = {}
        cols_e = e.get("bench", {}).get("columns", {})
        for a, b in (("pack+graphs", "compile-ro"), ("pack+graphs", "compile"), ("pack", "compile")):
            if cols_e.get(a, {}).get("ms") and cols_e.get(b, {}).get("ms"):
                ratio[f"{a} vs {b}"] = cols_e[b]["ms"] / cols_e[a]["ms"]
        if ratio:
            md += f"- {e['recipe']} (time of the second over the first): " + ", ".join(
                f"{k}: {v:.2f}x" for k, v in ratio.items()) + "\n"
    if not_run:
        md += f"\nNot run (time limit): {', '.join(not_run)}\n"
    md += "\n## Kernels kept and dropped\n\n"
    for e in entries:
        md += f"### {e['recipe']}\n\nkept: " + ", ".join(f"{op} ({s:.2f}x)" if s else op for op, s in e.get("kept", []))
        md += "\n\n" + "\n".join(f"- dropped {op} at {stage}: {why}" for op, stage, why in e.get("dropped", [])[:20])
        md += "\n\n"
    return md


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipes", nargs="+")
    parser.add_argument("--budget", type=int, default=24)
    parser.add_argument("--heavy", type=lambda s: set(s.split(",")), default=set(),
                        help="recipes that also get the graphs-only and compile-ro columns")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--time-limit", type=float, default=600)
    parser.add_argument("--build-timeout", type=float, default=420)
    parser.add_argument("--bench-timeout", type=float, default=400)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    info = benchlib.meta()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-packs-"))
    start, entries, not_run = time.monotonic(), [], []
    for name in args.recipes:
        if time.monotonic() - start > args.time_limit:
            not_run.append(name)
            continue
        entries.append(one(name, args, root))
        benchlib.write("packs", {"meta": info, "budget": args.budget, "recipes": entries, "not_run": not_run},
                       render(info, entries, not_run))
    benchlib.write("packs", {"meta": info, "budget": args.budget, "recipes": entries, "not_run": not_run},
                   render(info, entries, not_run))


if __name__ == "__main__":
    main()
