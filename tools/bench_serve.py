"""Serving benchmark: real `model.generate()` over a mixed trace of requests, columns side by side.

The engine is `forgepack/servebench.py` (columns, trace, what is reported; `forgepack bench --serve`
runs the same engine); this script keeps its command line and writes its results where every tool does.

    python tools/bench_serve.py                                 # CUDA: llama-1b and qwen2-0.5b shapes
    python tools/bench_serve.py --models tiny-llama --requests 4 --prompt 16,64 --new 8,16   # CPU smoke
    python tools/bench_serve.py --peers --models llama-1b-decode --rounds 5   # fair peers, a process each
Output: `<out>/results/bench_serve-<models>.json` and `.md` (date, device, commit, command).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

from forgepack import recipe, servebench
from forgepack.errors import UsageError
from forgepack.servebench import CUDA_MODELS, ServeSettings


def settings_of(args: argparse.Namespace) -> ServeSettings:
    return ServeSettings(requests=args.requests, batches=tuple(args.batches), prompt=args.prompt, new=args.new,
                         seed=args.seed, rounds=args.rounds, agree=args.agree, no_compile=args.no_compile,
                         budget_s=args.budget_s, cold=not args.no_cold, loop_column=not args.no_loop_column)


def say(text: str, done: int, total: int) -> None:
    print(text, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="recipes, comma-separated (default: the 1B/0.5B shapes on "
                                                       "CUDA, tiny-llama on CPU)")
    defaults = ServeSettings()  # the engine's defaults, which `forgepack bench --serve` has too
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--batches", default=",".join(map(str, defaults.batches)))
    parser.add_argument("--prompt", default="{},{}".format(*defaults.prompt),
                        help="prompt lengths, low,high (log-uniform)")
    parser.add_argument("--new", default="{},{}".format(*defaults.new), help="new tokens, low,high")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--agree", type=int, default=defaults.agree,
                        help="requests checked teacher-forced against eager")
    parser.add_argument("--pack", default=None, help="a pack wheel or import name (pack and pack+graphs columns)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile columns")
    parser.add_argument("--no-cold", action="store_true", help="leave out the cold-process first request")
    parser.add_argument("--no-loop-column", action="store_true",
                        help="leave out the graphs column served through generate()'s own loop (decode_loop=False)")
    parser.add_argument("--peers", action="store_true",
                        help="the fair peers: each column (eager, static-pinned, compiled-loop, graphs, pack+graphs) "
                             "in a fresh process of its own, rounds in a rotating order")
    parser.add_argument("--budget-s", type=float, default=defaults.budget_s,
                        help="per model: compiled columns' turns are skipped (and say so) after this many seconds")
    parser.add_argument("--out", default=None, help="output folder (default ${OUT:-benchmarks/out}/results)")
    args = parser.parse_args()
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
        args.prompt, args.new = servebench.parse_pair(args.prompt), servebench.parse_pair(args.new)
        settings = settings_of(args)
    except ValueError:
        parser.error("--batches is a comma-separated list; --prompt and --new are low,high")
    except UsageError as err:
        parser.error(str(err))
    names = args.models.split(",") if args.models else (CUDA_MODELS if torch.cuda.is_available() else ["tiny-llama"])
    if args.out:
        os.environ["OUT"] = args.out
    with contextlib.ExitStack() as stack:
        info = benchlib.meta()
        if args.peers:
            results = {name: servebench.bench_peers(recipe.resolve(name), settings, args.pack, say, label=name)
                       for name in names}
        else:
            pack = servebench.load_pack(args.pack, stack)
            results = {name: servebench.bench_model(recipe.resolve(name), settings, pack, say, label=name,
                                                    pack_spec=args.pack) for name in names}
    name = "bench_serve-" + "-".join(names)  # one run per model can share an --out folder
    header = benchlib.header_md(servebench.TITLE, info)
    markdown = servebench.markdown(header, results, settings, torch.cuda.is_available())
    folder = benchlib.write(name, {**info, "args": dict(vars(args)), "results": results}, markdown)
    print(f"wrote {folder}/{name}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
