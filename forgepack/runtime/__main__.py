"""`python -m <pack> selftest` re-verifies every kernel on this machine; `info` prints what the pack is."""

from __future__ import annotations

import argparse
import importlib
import sys


def main(argv: list[str] | None = None) -> int:
    package = __spec__.parent if __spec__ else __package__
    pack = importlib.import_module(package)
    from_pack = importlib.import_module(f"{package}.selftest")
    parser = argparse.ArgumentParser(prog=f"python -m {package}")
    sub = parser.add_subparsers(dest="command", required=True)
    test = sub.add_parser("selftest", help="re-verify every kernel on this machine against stock PyTorch")
    test.add_argument("--inputs", type=int, default=from_pack.FRESH_INPUTS, help="fresh random inputs per kernel")
    sub.add_parser("info", help="what this pack was built for, and whether it can run here")
    args = parser.parse_args(argv)
    if args.command == "selftest":
        return from_pack.selftest(pack, seeds=args.inputs)
    m = pack.manifest()
    ops, fused = len(m.variants), len(pack.fused_kernels())
    kinds = f" ({ops} operator, {fused} fused)" if fused else ""
    print(f"{m.name} {m.version}: {ops + fused} kernels{kinds} for {m.recipe}")
    print(f"built for torch {m.torch}, {m.device} {m.arch}".rstrip())
    problem, _ = pack.environment_problem()
    print(f"here: {problem or 'can run'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
