"""Profile the reference recipes and check profile's end-to-end time against a plain timing.

For each recipe: `forgepack.profile.run_profile` (what `forgepack profile` prints), then, in the same
process, a plain timing of the same model (device events around the forward, inference mode, median
of 30 after warm-up). The two must agree within 10%. Writes one JSON + markdown per run.

    python tools/bench_profile.py llama-1b-prefill qwen2-0.5b-prefill gpt2 vit-base resnet-50 llama-1b-decode
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

from forgepack import models, profile, recipe, workspace


def plain_ms(lm: models.LoadedModel, reps: int = 30) -> float:
    times = []
    for i in range(reps + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.inference_mode():
            lm.model(**lm.inputs)
        end.record()
        end.synchronize()
        lm.reset()
        if i >= 5:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def one(name: str, top: int) -> tuple[dict, str]:
    r = recipe.resolve(name)
    ws = workspace.Workspace.for_recipe(r, Path(tempfile.mkdtemp()) / r.slug)
    with models.quiet_transformers():
        lm = models.load(r)
    lm.run()
    plain = plain_ms(lm)  # the same model object, just before profile times it
    result, cards = profile.run_profile(r, ws, loaded=lm)
    del lm
    torch.cuda.empty_cache()
    rows = [[c.op_name, c.signature()[:58], c.calls, f"{c.profile.eager_us:.1f}", f"{100 * c.profile.share:.1f}",
             f"{c.profile.roofline_us:.2f}", profile.headroom_text(c), c.profile.baseline]
            for c in profile.top_share(cards, top)]
    table = tabulate(rows, ["op", "signature", "calls", "µs/call", "share %", "roofline µs", "headroom", "class"],
                     tablefmt="github")
    busy = f"{result.gpu_busy:.0%}" if result.gpu_busy is not None else "n/a"
    md = (f"## {name}\n\nend to end (profile): {result.e2e_ms:.2f} ms; plain timing, same run: {plain:.2f} ms "
          f"(ratio {result.e2e_ms / plain:.3f}); aten calls {result.aten_calls}; variants {result.variants}; "
          f"GPU busy {busy}; device kernel time {result.kernel_ms or 0:.2f} ms\n\n"
          f"diagnosis: {result.diagnosis}\n\n{table}\n\n")
    data = {"recipe": name, "profile": result.to_json(), "plain_ms": plain, "ratio": result.e2e_ms / plain,
            "cards": [{"op": c.op, "signature": c.signature(), "calls": c.calls, **c.profile.__dict__}
                      for c in cards]}
    return data, md


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipes", nargs="+")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    info = benchlib.meta()
    docs, sections, summary = [], [], []
    for name in args.recipes:
        try:
            data, text = one(name, args.top)
        except Exception:  # one recipe's failure must not lose the others' results
            traceback.print_exc()
            summary.append([name, "failed", "", "", "", "", ""])
            continue
        docs.append(data)
        sections.append(text)
        p = data["profile"]
        summary.append([name, f"{p['e2e_ms']:.2f}", f"{data['plain_ms']:.2f}", f"{data['ratio']:.3f}", p["aten_calls"],
                        f"{(p['gpu_busy'] or 0):.0%}", "yes" if abs(data["ratio"] - 1) <= 0.10 else "NO"])
        head = tabulate(summary, ["recipe", "profile e2e ms", "plain ms", "ratio", "aten calls", "GPU busy",
                                  "within 10%"], tablefmt="github")
        md = benchlib.header_md("forgepack profile of the reference recipes", info) + head + "\n\n" + "".join(sections)
        benchlib.write("profiles", {"meta": info, "recipes": docs}, md)  # after every recipe: nothing is lost


if __name__ == "__main__":
    main()
