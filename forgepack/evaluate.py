"""Evaluate a candidate kernel: static checks -> compile -> verify in a worker -> benchmark -> Verdict.

Parent side of DESIGN.md "Evaluation". The `Evaluator` owns one persistent worker subprocess
(`python -m forgepack.worker`) bound to one device; each request to it has a timeout. A kernel that
faults, aborts or hangs kills only that worker: the verdict is `crash` or `timeout` and a new worker
is started in the background (also after a mismatch, a changed input or a nondeterministic result,
because such a kernel may have written anywhere in the worker's memory).

Verdict categories, in the order they are checked:
    static            the source or object breaks a kernel rule (`forgepack.staticcheck`)
    compile           the compiler failed (diagnostics["compile_log"] has its output)
    crash             the worker died (signal, CUDA error), the kernel returned nonzero, or CUDA graph
                      capture failed
    timeout           no answer within `timeout_s` (hung, or far too slow)
    mismatch          an output differs from stock PyTorch, an element was left unwritten, or the kernel
                      wrote outside its outputs
    mutates-input     an input (or memory around it) changed
    nondeterministic  two runs on the same inputs gave different bits
    slower            verified, but the speed-up is below 1 + margin or its interval does not lie above 1

Acceptance (bench=True): median speed-up (eager / kernel) >= 1 + margin and the bootstrap interval's
low end > 1. A negative margin is a test mode (forcing packs on noisy cpu machines): the low end must
then exceed 1 + margin. bench=False verifies only: accepted iff verified, speed-up None.

The kernel's time is what the model will see: a CPU fusion kernel's includes what serving it through
its patch site costs (the Python guard, the fused op's dispatch and its allocations), measured once per
card with a do-nothing kernel (`forgepack.servecost`) and added to every timed call, so the accept
rule, a family's folded figure, the allocator and the report all read one number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forgepack import cards as cards_mod
from forgepack import outcomes, servecost, staticcheck
from forgepack import worker as worker_mod
from forgepack.cards import Card
from forgepack.compile import TARGETS, CompileResult, compile_kernel
from forgepack.errors import ForgepackError

CATEGORIES = ("static", "compile", "crash", "timeout", "mismatch", "nondeterministic", "mutates-input", "slower")
RESTART_AFTER = ("crash", "timeout", "mismatch", "mutates-input", "nondeterministic")
STARTUP_TIMEOUT_S = 300.0
RECYCLE_AFTER = 64  # kernels loaded into one worker before it is replaced (loaded objects never unload)
MAX_DIMS = 8

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Verdict:
    """What happened to one candidate.

    accepted: verified and (unless bench=False) fast enough; category: None when accepted, else one of
    `CATEGORIES`; reason: one line for people and proposers; diagnostics: details (compiler log,
    first mismatching index with expected/got values, findings, stderr tail, seeds, ...);
    source_hash: sha256 of the source; binary: the compiled object that was verified and timed (None
    if it did not compile); eager_us / kernel_us / speedup / ci_low / ci_high: from the interleaved
    benchmark (None when not benchmarked); compile_s / verify_s / bench_s: wall time of each stage.
    """

    accepted: bool
    category: str | None
    reason: str
    diagnostics: dict = field(default_factory=dict)
    source_hash: str = ""
    binary: str | None = None
    eager_us: float | None = None
    kernel_us: float | None = None
    speedup: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    compile_s: float = 0.0
    verify_s: float = 0.0
    bench_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Verdict:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def accept_rule(speedup: float, ci_low: float, margin: float) -> bool:
    """Median speed-up of at least 1 + margin, with the interval above 1 (above 1 + margin if margin < 0)."""
    floor = 1.0 + margin if margin < 0 else 1.0
    return speedup >= 1.0 + margin and ci_low > floor


class WorkerDied(Exception):
    pass


class WorkerTimeout(Exception):
    pass


class _Worker:
    """One `python -m forgepack.worker` process and its line protocol."""

    def __init__(self, target: str, device_index: int):
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the worker; closed in close()
        root = str(Path(__file__).resolve().parent.parent)
        # like a served process: a generic argv, the parent's environment and session (docs/verification.md)
        self.proc = subprocess.Popen([sys.executable, "-c", worker_mod.BOOTSTRAP], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr)
        self.proc.stdin.write(worker_mod.start_line(root, target, device_index, sandbox=target == "cpu").encode())
        self.proc.stdin.flush()
        self.buffer = b""
        self.info: dict | None = None
        self.loaded: set[str] = set()

    def ready(self, timeout: float) -> dict:
        if self.info is None:
            info = self._read(timeout)
            if not info.get("ready"):
                raise ForgepackError(f"the evaluation worker could not start: {info.get('error', info)}")
            self.info = info
        return self.info

    def request(self, message: dict, timeout: float) -> dict:
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            raise WorkerDied(str(err)) from err
        return self._read(timeout)

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerTimeout()
                if not sel.select(min(left, 1.0)):
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    raise WorkerDied("the worker exited")
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def death(self) -> str:
        """How the process ended, e.g. 'killed by SIGSEGV' (waits briefly for it)."""
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return "did not exit"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
            return f"killed by signal {-code}"
        return f"exited with status {code}"

    def stderr_tail(self, since: int | None = None, chars: int = 3000) -> str:
        end = self.stderr.seek(0, os.SEEK_END)
        start = max(since if since is not None else 0, end - chars)
        self.stderr.seek(start)
        return self.stderr.read(end - start).decode(errors="replace").strip()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"cmd": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
            self.proc.stdout.close()
        self.stderr.close()


class Evaluator:
    """Evaluates candidates on one device through one persistent worker subprocess; a context manager.

    `timeout_s` bounds each worker request (verification, benchmark); starting a worker (importing
    torch, creating the CUDA context) has its own, longer limit. Not thread-safe: use one per thread.
    Raises `ForgepackError` for problems that are not the candidate's: no GPU, a missing compiler, a
    card whose stock op fails on its own inputs.
    """

    def __init__(self, target: str, device_index: int = 0, timeout_s: float = 60.0, bench_reps: int | None = None):
        """`bench_reps`: interleaved pairs per benchmark (default `verify.BENCH_REPS`); fewer for quick sweeps."""
        if target not in TARGETS:
            raise ForgepackError(f"unknown target {target!r}: expected one of {', '.join(TARGETS)}")
        self.target = target
        self.bench_reps = bench_reps
        self.device_index = device_index
        self.timeout_s = timeout_s
        self._worker: _Worker | None = _Worker(target, device_index)  # starts now, overlapping the first compile
        self._serving: dict[str, float] = {}  # `servecost.key` -> microseconds a call

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    # --- the stages ----------------------------------------------------------------------------

    def evaluate(self, card: Card, source: str, samples_path: Path | None = None, margin: float = 0.05,
                 bench: bool = True, arch: str | None = None, *, progress: Progress | None = None) -> Verdict:
        """Static checks, compile (cached), then `evaluate_compiled`."""
        say = progress or (lambda _stage: None)
        say("static checks")
        findings = staticcheck.check_source(source, self.target)
        if findings:
            return _static_verdict(findings, source)
        say("compiling")
        compiled = compile_kernel(source, self.target, arch=arch)
        return self.evaluate_compiled(card, compiled, source, samples_path, margin, bench, progress=progress)

    def evaluate_compiled(self, card: Card, compiled: CompileResult, source: str, samples_path: Path | None = None,
                          margin: float = 0.05, bench: bool = True, *, progress: Progress | None = None) -> Verdict:
        """For an executor that compiled `source` elsewhere (a process pool): static checks on the source
        and the object, then verification and benchmark in the worker."""
        findings = staticcheck.check_source(source, self.target)
        if findings:
            return _static_verdict(findings, source, compiled)
        if not compiled.ok:
            return Verdict(False, "compile", _compile_reason(compiled.log), {"compile_log": compiled.log},
                           source_hash(source), None, compile_s=compiled.seconds)
        findings = staticcheck.check_object(compiled.binary, self.target, source)
        if findings:
            return _static_verdict(findings, source, compiled)
        return self.run_worker(card, compiled, source, samples_path, margin, bench, progress=progress)

    def run_worker(self, card: Card, compiled: CompileResult, source: str, samples_path: Path | None = None,
                   margin: float = 0.05, bench: bool = True, *, progress: Progress | None = None) -> Verdict:
        """Verification and benchmark only, without the static checks: for kernels already checked, and
        for tests proving the run-time checks catch what the static ones would (defence in depth)."""
        say = progress or (lambda _stage: None)
        _check_card(card)
        base = {"source_hash": source_hash(source), "binary": compiled.binary, "compile_s": compiled.seconds}
        seed = secrets.randbelow(1 << 31)  # unknown to the kernel's author: fresh inputs cannot be special-cased
        request = {"card": cards_mod.to_json(card), "binary": compiled.binary,
                   "samples": str(samples_path) if samples_path else None, "seed": seed}
        self._ready()  # starting a worker (importing torch) is not verification time
        say("verifying")
        start = time.perf_counter()
        answer = self._ask({"cmd": "verify", **request})
        verify_s = time.perf_counter() - start
        if not answer.ok:
            return self._rejected(answer, base, seed, verify_s=verify_s)
        verified = {"input_sets": list(answer.input_sets), "max_abs_err": answer.max_abs_err,
                    "tolerances": answer.tolerances, "calls": answer.calls}
        if answer.skipped_sets:
            verified["skipped_sets"] = list(answer.skipped_sets)
        if not bench:
            return Verdict(True, None, f"verified on {len(answer.input_sets)} input sets (not benchmarked)",
                           {"verification": verified, "seed": seed}, verify_s=verify_s, **base)
        serving = self.serving_us(card, progress=say)
        say("benchmarking")
        start = time.perf_counter()
        reps = {"reps": self.bench_reps} if self.bench_reps else {}
        timed = self._ask({"cmd": "bench", **request, **reps, "serving_us": serving})
        bench_s = time.perf_counter() - start
        if not timed.ok:
            return self._rejected(timed, base, seed, verify_s=verify_s, bench_s=bench_s)
        return _bench_verdict(timed, margin, base, {"verification": verified, "seed": seed}, verify_s, bench_s)

    def bench_again(self, card: Card, compiled: CompileResult, source: str, margin: float = 0.05,
                    placement: int = 1) -> Verdict:
        """The benchmark alone, once more, on fresh inputs at another placement in memory (`verify.bench`):
        for a kernel `run_worker` has verified and timed, whose time at one placement may mislead."""
        base = {"source_hash": source_hash(source), "binary": compiled.binary, "compile_s": compiled.seconds}
        seed = secrets.randbelow(1 << 31)
        reps = {"reps": self.bench_reps} if self.bench_reps else {}
        start = time.perf_counter()
        timed = self._ask({"cmd": "bench", "card": cards_mod.to_json(card), "binary": compiled.binary,
                           "samples": None, "seed": seed, "placement": placement, **reps,
                           "serving_us": self.serving_us(card)})
        bench_s = time.perf_counter() - start
        if not timed.ok:
            return self._rejected(timed, base, seed, verify_s=0.0, bench_s=bench_s)
        return _bench_verdict(timed, margin, base, {"seed": seed, "placement": placement}, 0.0, bench_s)

    def serving_us(self, card: Card, *, progress: Progress | None = None) -> float:
        """What serving a kernel for this card costs in the model beyond the timed kernel call, in
        microseconds a call: measured once per card (`servecost.key`) in the worker, with the probe.

        0 for CUDA: the benchmark times GPU work with events, and the pack serves a model from CUDA
        graphs (the gate times graph replay wherever the forward replays), where no Python guard or op
        dispatch runs per call. 0 for an operator card: the shim's C++ override at the op's backend key
        sits behind the same Python and dispatcher path stock takes."""
        if not servecost.applies(card, self.target):
            return 0.0
        key = servecost.key(card)
        if key not in self._serving:
            (progress or (lambda _stage: None))("measuring what serving through the patch site costs")
            probe = servecost.probe_library()
            answer = self._ask({"cmd": "serving", "card": cards_mod.to_json(card), "probe": probe.to_json()})
            if not isinstance(answer, outcomes.ServingCost):
                raise ForgepackError(f"the serving probe failed on {card.id}: {answer.reason}")
            self._serving[key] = answer.serving_us
        return self._serving[key]

    # --- the worker ----------------------------------------------------------------------------

    def start(self) -> dict:
        """Wait until the worker is up (torch imported, CUDA context made); returns what it reported."""
        return self._ready().info

    def _ready(self) -> _Worker:
        worker = self._ensure_worker()
        try:
            worker.ready(STARTUP_TIMEOUT_S)
        except (WorkerDied, WorkerTimeout) as err:
            tail = _last_line(worker.stderr_tail())
            self._worker = None
            worker.kill()
            worker.close()
            raise ForgepackError(f"the evaluation worker could not start ({type(err).__name__}): {tail}") from err
        return worker

    def _ask(self, message: dict) -> outcomes.Outcome:
        """One request to the worker; a death or a timeout becomes a crash/timeout failure."""
        worker = self._ready()
        mark = worker.stderr.seek(0, os.SEEK_END)
        try:
            answer = worker.request(message, self.timeout_s)
        except WorkerTimeout:
            worker.kill()
            tail = worker.stderr_tail(mark)
            return outcomes.Failure("timeout", f"did not finish within {self.timeout_s:g} s (hung, or far too slow); "
                                    "the worker was killed", _tail(tail))
        except WorkerDied:
            how = worker.death()
            tail = worker.stderr_tail(mark)
            return outcomes.Failure("crash", f"the worker {how} while running the kernel"
                                    + _death_hint(how) + (f": {_last_line(tail)}" if tail else ""),
                                    {"exit": how, **_tail(tail)})
        if answer.get("error"):
            self._restart()
            raise ForgepackError(answer["error"])
        if message.get("binary"):
            worker.loaded.add(message["binary"])
        return outcomes.from_json(answer)

    def _ensure_worker(self) -> _Worker:
        if self._worker is None or self._worker.proc.poll() is not None or len(self._worker.loaded) >= RECYCLE_AFTER:
            self._restart()
        return self._worker

    def _restart(self) -> None:
        """Replace the worker; the new one starts importing torch at once, in the background."""
        if self._worker is not None:
            self._worker.kill()
            self._worker.close()
        self._worker = _Worker(self.target, self.device_index)

    def _rejected(self, answer: outcomes.Failure, base: dict, seed: int, verify_s: float,
                  bench_s: float = 0.0) -> Verdict:
        if answer.category in RESTART_AFTER:
            self._restart()
        diagnostics = {**answer.diagnostics, "seed": seed}
        return Verdict(False, answer.category, answer.reason, diagnostics, verify_s=verify_s, bench_s=bench_s, **base)


def evaluate(card: Card, source: str, *, target: str, samples_path: Path | None = None, margin: float = 0.05,
             bench: bool = True) -> Verdict:
    """One-shot convenience: a fresh `Evaluator` for one candidate."""
    with Evaluator(target) as evaluator:
        return evaluator.evaluate(card, source, samples_path=samples_path, margin=margin, bench=bench)


# --- verdict helpers -----------------------------------------------------------------------------


def _check_card(card: Card) -> None:
    for meta in [*card.tensor_inputs(), *card.outputs]:
        if meta is not None and len(meta.shape) > MAX_DIMS:
            raise ForgepackError(f"card {card.id} has a {len(meta.shape)}-dimensional tensor; the kernel ABI "
                                 f"supports at most {MAX_DIMS}")


def _static_verdict(findings: list, source: str, compiled: CompileResult | None = None) -> Verdict:
    return Verdict(False, "static", str(findings[0]), {"findings": [str(f) for f in findings]}, source_hash(source),
                   compiled.binary if compiled else None, compile_s=compiled.seconds if compiled else 0.0)


def _compile_reason(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower():
            return f"does not compile: {line[:300]}"
    return f"does not compile: {lines[-1][:300]}" if lines else "does not compile"


def _bench_verdict(timed: outcomes.Timed, margin: float, base: dict, diagnostics: dict, verify_s: float,
                   bench_s: float) -> Verdict:
    speedup, low, high = timed.speedup, timed.ci_low, timed.ci_high
    bench = {"reps": timed.reps, "input": timed.input, "checked": timed.checked, "calls": timed.calls}
    if timed.serving_us:
        bench["serving_us"] = timed.serving_us
    diagnostics = {**diagnostics, "bench": bench, "margin": margin}
    if speedup > 10:
        diagnostics["suspicious"] = "speed-up above 10x: worth a look at the kernel (it passed every check)"
    timing = dict(eager_us=timed.eager_us, kernel_us=timed.kernel_us, speedup=speedup, ci_low=low, ci_high=high,
                  verify_s=verify_s, bench_s=bench_s)
    serving = f", {timed.serving_us:.1f} us of it serving through the patch site" if timed.serving_us else ""
    summary = f"{speedup:.3f}x (95% interval {low:.3f}-{high:.3f}; eager {timed.eager_us:.1f} us, " \
              f"kernel {timed.kernel_us:.1f} us{serving})"
    if accept_rule(speedup, low, margin):
        return Verdict(True, None, f"verified; {summary}", diagnostics, **timing, **base)
    floor = 1 + margin if margin < 0 else 1.0
    return Verdict(False, "slower", f"verified but not fast enough: {summary}; needs >= {1 + margin:.3f}x with the "
                                    f"interval above {floor:.3f}", diagnostics, **timing, **base)


def _death_hint(how: str) -> str:
    """What a death signal says about the kernel, where it says something."""
    if "SIGSYS" in how:
        return " (a forbidden system call: the worker's sandbox refuses thread creation and sleeping)"
    return ""


def _tail(text: str) -> dict:
    return {"stderr": text[-3000:]} if text else {}


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""
