"""The evaluation worker: ``python -m forgepack.worker --target cuda|cpu --device N``.

A kernel that faults, aborts or hangs takes this process down, never the build: the parent
(`forgepack.evaluate.Evaluator`) enforces a timeout per request, notices the death and starts a new
worker. The worker loads each compiled kernel with ctypes and runs `forgepack.verify` on it.

Protocol: one JSON request per line on stdin, one JSON answer per line on the protocol pipe, which is
the original stdout; file descriptor 1 is then pointed at stderr, so a kernel that prints cannot
corrupt the protocol. The first line sent is ``{"ready": true, ...}`` once torch (and CUDA) are up.

Requests (``card`` is `cards.to_json`, ``binary`` a compiled `kernel.so`, ``samples`` a path or null):
    {"cmd": "verify", "card": {...}, "binary": "...", "samples": ..., "seed": N} -> `outcomes.Verified` / `Failure`
    {"cmd": "bench",  "card": {...}, "binary": "...", "samples": ..., "seed": N} -> `outcomes.Timed` / `Failure`
    {"cmd": "exit"}
A failure of the stock op answers ``{"ok": false, "error": "..."}``; any other exception while a kernel
was involved answers a crash verdict and the worker exits (its memory may be corrupted).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m forgepack.worker")
    parser.add_argument("--target", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    _die_with_parent()

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # printf from a kernel goes to stderr, never into the protocol

    def send(message: dict) -> None:
        proto.write(json.dumps(message, default=str) + "\n")
        proto.flush()

    import torch

    from forgepack import cards, verify

    if args.target == "cuda":
        if not torch.cuda.is_available():
            send({"ready": False, "error": "no CUDA GPU is visible to the worker"})
            return 2
        device = torch.device("cuda", args.device)
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # create the context now, not inside the first timed request
        name = torch.cuda.get_device_name(device)
    else:
        device, name = torch.device("cpu"), "cpu"
    verify.strict_precision()
    send({"ready": True, "pid": os.getpid(), "torch": torch.__version__, "device": str(device), "name": name})

    kernels: dict[str, object] = {}
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("cmd") == "exit":
            break
        answer, fatal = handle(request, device, kernels, cards, verify)
        send(answer)
        if fatal:
            return 3
    return 0


def _die_with_parent() -> None:
    """Linux: be killed when the evaluating process goes, even while a kernel hangs (no orphans)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent was gone before the request took effect
        sys.exit(1)


def handle(request: dict, device, kernels: dict, cards, verify) -> tuple[dict, bool]:
    """(answer, whether the worker must exit now)."""
    cmd = request.get("cmd")
    if cmd not in ("verify", "bench"):
        return {"ok": False, "error": f"unknown request {cmd!r}"}, False
    card = cards.from_json(request["card"])
    binary = request["binary"]
    try:
        if binary not in kernels:
            kernels[binary] = verify.load_kernel(binary)
    except OSError as err:
        return verify.fail("crash", f"could not be loaded: {err}", error=str(err)).to_json(), True
    run = verify.verify if cmd == "verify" else verify.bench
    extra = {"reps": int(request["reps"])} if cmd == "bench" and request.get("reps") else {}
    try:
        outcome = run(card, kernels[binary], request.get("samples"), device, int(request["seed"]), **extra)
        return outcome.to_json(), False
    except verify.StockOpError as err:
        return {"ok": False, "error": str(err)}, False
    except Exception as err:  # a kernel error surfacing in torch (illegal address, launch failure, ...)
        tail = traceback.format_exc(limit=4)[-2000:]
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        return verify.fail("crash", f"failed while running: {first}", error=str(err)[:2000],
                           traceback=tail).to_json(), True


if __name__ == "__main__":
    sys.exit(main())
