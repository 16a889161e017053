"""Decode-step coverage: how much of a served decode step an envelope pack's kernels replace, by time.

For each held-out architecture (`heldout_models`: tiny random-weight Mistral, Gemma-2, Phi-3, ... saved
and loaded as checkpoints) this builds an envelope pack (`bench_envelope.envelope_recipe`: phase
generate over the batch and prompt ranges given; every verified kernel kept, `--no-gate` by default:
the question is what the kernels can replace, not whether each pays on this machine), then in a fresh
process serves greedy `generate()` requests from the wheel with graph mode on (the decode loop; the
emulated backend on a CPU) beside stock, and weighs each bucket's recorded step
(`forgepack.stepcoverage`): the stock time of the calls the pack's kernels took over, over the stock
time of every call in the step (all ops). Issue 41's target: at least 90%, with tokens equal to stock.

    python tools/bench_step_coverage.py --models tiny-mistral,tiny-gemma2,tiny-phi3
Output: `<out>/results/bench_step_coverage.json` and `.md` (date, device, commit, command).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_envelope
import benchlib
import heldout_models

REPO = Path(__file__).resolve().parent.parent
TARGET = 0.9

SERVE = r"""
import importlib, json, sys
import torch
sys.path.insert(0, REPO)
from transformers import AutoModelForCausalLM
from forgepack import stepcoverage
import PACKAGE as pack
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
twin = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
def gen(m, b, s):
    ids = torch.randint(3, m.config.vocab_size, (b, s), generator=torch.Generator().manual_seed(b * 100 + s))
    with torch.no_grad():
        out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False, pad_token_id=0)
    return out[:, s:].tolist()
stock = {f"{b}x{s}": gen(twin, b, s) for b, s in POINTS}
assert pack.activate(graphs=True, model=model, backend="emulate")
served = {f"{b}x{s}": gen(model, b, s) for b, s in POINTS}
server = importlib.import_module("PACKAGE.serving").server(model)
rows = []
for bucket, program in sorted(server.loop.step_programs().items()):
    c = stepcoverage.measure(bucket, program, pack)
    rows.append({"bucket": bucket, "stock_us": c.stock_us, "covered_us": c.covered_us, "share": c.share,
                 "launches_stock": c.launches_stock, "launches_pack": c.launches_pack, "blocks": list(c.blocks),
                 "uncovered": [[o.name, o.calls, round(o.us - o.covered_us, 2)] for o in c.uncovered(6)],
                 "ops": [[o.name, o.calls, round(o.us, 2), round(o.covered_us, 2)] for o in c.ops]})
print(json.dumps({"equal": {k: stock[k] == served[k] for k in stock}, "steps": rows,
                  "loop": server.stats()["decode_loop"]}))
"""


def serve(site: Path, package: str, model: Path, points: list[tuple[int, int]], new: int) -> dict[str, Any]:
    code = (SERVE.replace("PACKAGE", package).replace("REPO", repr(str(REPO))).replace("MODEL", repr(str(model)))
            .replace("POINTS", repr(points)).replace("NEW", str(new)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def unpack(wheel: Path, root: Path) -> tuple[Path, str]:
    site = root / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    return site, next(p.name for p in site.iterdir() if p.name.startswith("forgepack_pack_") and "." not in p.name)


def run_model(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    # windows as the released models have them (4096), beyond every cache here: the decode loop serves a
    # window shorter than its cache eagerly (its mask is the cache's length), which no block can change
    overrides = {"sliding_window": args.window} if "sliding_window" in heldout_models.MODELS[name][1] else {}
    model = heldout_models.save(root, name, **overrides)
    r = bench_envelope.envelope_recipe(str(model), args.batch, args.seq_len, args.cache_max, args.new, "cpu",
                                       args.budget, args.gate, args.time_limit, args.margin)
    r = r.replace(name=f"{name}-envelope")
    print(f"== {name}: building the envelope pack", file=sys.stderr, flush=True)
    wheel, built = bench_envelope.build(r, root)
    site, package = unpack(wheel, root)
    print(f"== {name}: serving generate() from {wheel.name}", file=sys.stderr, flush=True)
    served = serve(site, package, model, args.points, args.new)
    return {"model": name, "build": built, "wheel": wheel.name, **served}


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["model"], "", "", "", "", "", r["error"].strip().splitlines()[-1][:100]])
            continue
        equal = sum(r["equal"].values())
        for s in r["steps"]:
            left = ", ".join(f"{n} {us:.0f} µs" for n, _, us in s["uncovered"][:3])
            rows.append([r["model"], s["bucket"], f"{s['stock_us']:.0f}", f"{s['share']:.1%}",
                         f"{s['launches_stock']} -> {s['launches_pack']}", f"{equal}/{len(r['equal'])}", left])
    return tabulate(rows, headers=["model", "bucket", "stock µs/step", "replaced (time)", "launches stock -> pack",
                                   "tokens equal", "most stock time left"], tablefmt="github")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny-mistral,tiny-gemma2,tiny-phi3")
    p.add_argument("--batch", default="1-2")
    p.add_argument("--seq-len", default="8-16")
    p.add_argument("--cache-max", type=int, default=64)
    p.add_argument("--new", type=int, default=24, help="new tokens a request (past the loop's eager warm-up steps)")
    p.add_argument("--budget", type=int, default=48)
    p.add_argument("--window", type=int, default=4096, help="sliding window of the models that have one")
    p.add_argument("--time-limit", type=float, default=None)
    p.add_argument("--margin", type=float, default=-0.99)
    p.add_argument("--gate", action="store_true", help="gate the pack as a build does by default")
    p.add_argument("--points", default="1x8,2x16,1x13", help="generate() requests, BATCHxPROMPT")
    args = p.parse_args(argv)
    args.points = [tuple(int(x) for x in pt.split("x")) for pt in args.points.split(",")]
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in heldout_models.MODELS]
    if unknown:
        sys.exit(f"bench_step_coverage: unknown model {', '.join(unknown)} (known: {', '.join(heldout_models.MODELS)})")
    info = benchlib.meta()
    results = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"coverage-{name}-") as tmp:
            results.append(run_model(name, args, Path(tmp)))
    lowest = min((s["share"] for r in results for s in r.get("steps", ())), default=0.0)
    md = benchlib.header_md("Decode-step coverage of envelope packs", info) + (
        f"Envelope: batch {args.batch}, prompts {args.seq_len}, cache up to {args.cache_max}, {args.new} new tokens; "
        f"budget {args.budget}, gate {'on' if args.gate else 'off'}. Replaced: the stock time of the calls the pack's "
        f"kernels took over, over the stock time of every call of the served step (each call timed alone). "
        f"Target {TARGET:.0%}; lowest {lowest:.1%}.\n\n" + table(results) + "\n")
    benchlib.write("bench_step_coverage", {"meta": info, "args": {k: v for k, v in vars(args).items()},
                                           "results": results}, md)
    return 0 if lowest >= TARGET and all(all(r.get("equal", {0: False}).values()) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
