"""The evaluation worker, started by `forgepack.evaluate` as a plain ``python -c`` (see `BOOTSTRAP`).

A kernel that faults, aborts or hangs takes this process down, never the build: the parent
(`forgepack.evaluate.Evaluator`) enforces a timeout per request, notices the death and starts a new
worker. The worker loads each compiled kernel with ctypes and runs `forgepack.verify` on it.

It looks like a served process (docs/verification.md): its arguments are a generic bootstrap and its
first stdin line says what to run, so nothing in argv or the environment (which is the parent's,
unchanged) names forgepack; it stays in the parent's session and process group with Python's usual
signal settings. Once torch is up, a seccomp filter forbids creating threads or processes and
sleeping (cpu target): a kernel that reaches such calls by any route is killed with SIGSYS.

Protocol: one JSON request per line on stdin, one JSON answer per line on the protocol pipe, which is
the original stdout; file descriptor 1 is then pointed at stderr, so a kernel that prints cannot
corrupt the protocol. The first line sent is ``{"ready": true, ...}`` once torch (and CUDA) are up.

Requests (``card`` is `cards.to_json`, ``binary`` a compiled `kernel.so`, ``samples`` a path or null):
    {"cmd": "verify", "card": {...}, "binary": "...", "samples": ..., "seed": N} -> `outcomes.Verified` / `Failure`
    {"cmd": "bench",  "card": {...}, "binary": "...", "samples": ..., "seed": N} -> `outcomes.Timed` / `Failure`
        (optional "reps": N, "placement": K > 0 to place the buffers elsewhere, "serving_us": X added to
        every timed kernel call: `verify.bench`)
    {"cmd": "serving", "card": {...}, "probe": {"library": ..., "root": ...}} -> `outcomes.ServingCost`
        (what serving the card's kernel through its patch sites costs: `forgepack.servecost.measure`)
    {"cmd": "exit"}
A failure of the stock op answers ``{"ok": false, "error": "..."}``; any other exception while a kernel
was involved answers a crash failure and the worker exits (its memory may be corrupted).

By hand: ``python -m forgepack.worker --target cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback

# argv of the worker: reads its one line of start-up code from stdin (`start_line` writes it)
BOOTSTRAP = "import sys; exec(sys.stdin.readline())"


def start_line(root: str, target: str, device: int, sandbox: bool) -> str:
    """The first stdin line for `BOOTSTRAP`: where forgepack is, and what to serve."""
    return (f"sys.path.insert(0, {root!r}); from forgepack.worker import serve; "
            f"sys.exit(serve({target!r}, {int(device)}, {bool(sandbox)}))\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m forgepack.worker")
    parser.add_argument("--target", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--no-sandbox", action="store_true")
    args = parser.parse_args(argv)
    return serve(args.target, args.device, not args.no_sandbox and args.target == "cpu")


def serve(target: str, device_index: int = 0, sandbox: bool = False) -> int:
    _die_with_parent()

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # printf from a kernel goes to stderr, never into the protocol

    def send(message: dict) -> None:
        proto.write(json.dumps(message, default=str) + "\n")
        proto.flush()

    import torch

    from forgepack import cards, verify

    if target == "cuda":
        if not torch.cuda.is_available():
            send({"ready": False, "error": "no CUDA GPU is visible to the worker"})
            return 2
        device = torch.device("cuda", device_index)
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # create the context now, not inside the first timed request
        name = torch.cuda.get_device_name(device)
    else:
        device, name = torch.device("cpu"), "cpu"
    verify.strict_precision()
    if sandbox:
        torch.ones(1 << 22).sum()  # the intra-op pool's threads exist before thread creation is refused
        sandbox = _forbid_threads_and_sleep()
    send({"ready": True, "pid": os.getpid(), "torch": torch.__version__, "device": str(device), "name": name,
          "sandbox": sandbox})

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


# x86_64 system calls a kernel must never reach: thread and process creation, exec, sleeping
_FORBIDDEN_SYSCALLS = {"clone": 56, "fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "clone3": 435,
                       "nanosleep": 35, "clock_nanosleep": 230, "pause": 34}


def _forbid_threads_and_sleep() -> bool:
    """A seccomp filter killing the process (SIGSYS) on `_FORBIDDEN_SYSCALLS`; False where unavailable.

    The static checks refuse every import that could create a thread or sleep; this catches the same
    calls reached without an import (code found by walking memory, a system call instruction)."""
    import ctypes
    import platform

    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    load, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, kill = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS
    numbers = sorted(_FORBIDDEN_SYSCALLS.values())
    n = len(numbers)
    # [0] arch  [1] not x86_64 -> allow  [2] nr  [3] x32 ABI -> kill  [4..] forbidden -> kill  then allow, kill
    prog = [(load, 0, 0, 4), (jeq, 0, n + 3, 0xC000003E), (load, 0, 0, 0), (jge, n + 1, 0, 0x40000000)]
    prog += [(jeq, n - k, 0, nr) for k, nr in enumerate(numbers)]
    prog += [(ret, 0, 0, allow), (ret, 0, 0, kill)]
    filters = (Filter * len(prog))(*[Filter(*f) for f in prog])
    program = Program(len(prog), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return False
    return libc.prctl(22, 2, ctypes.byref(program), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def handle(request: dict, device, kernels: dict, cards, verify) -> tuple[dict, bool]:
    """(answer, whether the worker must exit now)."""
    cmd = request.get("cmd")
    if cmd not in ("verify", "bench", "serving"):
        return {"ok": False, "error": f"unknown request {cmd!r}"}, False
    card = cards.from_json(request["card"])
    if cmd == "serving":
        return _serving(card, request["probe"]), False
    binary = request["binary"]
    try:
        if binary not in kernels:
            kernels[binary] = verify.load_kernel(binary)
    except OSError as err:
        return verify.fail("crash", f"could not be loaded: {err}", error=str(err)).to_json(), True
    run = verify.verify if cmd == "verify" else verify.bench
    extra = {key: int(request[key]) for key in ("reps", "placement") if cmd == "bench" and request.get(key)}
    if cmd == "bench" and request.get("serving_us"):
        extra["serving_us"] = float(request["serving_us"])
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


def _serving(card, probe: dict) -> dict:
    """The serving probe's answer; its failure is no kernel's (an error: the build stops and says why)."""
    from forgepack import outcomes, servecost

    try:
        measured = servecost.measure(card, probe)
    except Exception as err:
        return {"ok": False, "error": f"the serving probe failed: {type(err).__name__}: {err}"}
    return outcomes.ServingCost(measured["serving_us"], tuple(measured["sites"])).to_json()


if __name__ == "__main__":
    sys.exit(main())
