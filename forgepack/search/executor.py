"""The executor: compiles candidates in parallel, evaluates them on one worker per device.

The search only needs `Executor`: ``submit(card, source, samples_path) -> Future[Verdict]`` and
``slots`` (how many candidates it can usefully have in flight). `LocalExecutor` implements it on this
host; `forgepack.search.ray_executor.RayExecutor` implements the same members on a Ray cluster
(`forgepack.pipeline.make_executor` picks one by name). Either way a verdict names the object that was verified and
timed and carries its sha256 (``diagnostics["binary_sha256"]``): the search keeps that exact file,
and the pack builder refuses a file whose hash differs.

`LocalExecutor`: each source is compiled by a pool of compiler processes (nvcc / g++, several at
once), then queued to the evaluation workers, one thread per visible GPU (one for cpu), each owning
an `Evaluator` bound to its device. The pool's workers are threads that each drive one compiler
subprocess (`forgepack.compile` spends its time waiting on nvcc/g++, outside the GIL), so the
compilers run as parallel processes without a Python process pool, whose `spawn` start would re-run
the caller's `__main__` (the `forgepack` command itself) and whose `fork` would copy a threaded
parent. The evaluator runs every candidate in a worker subprocess with a timeout, so a kernel that
faults or hangs costs a verdict, not the build. Several GPUs therefore verify and time different
candidates at the same time; one GPU never times two at once.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from forgepack.cards import Card
from forgepack.runtime.packinfo import file_sha256


class Executor(Protocol):
    slots: int  # candidates worth having in flight at once (compiling + evaluating)

    def submit(self, card: Card, source: str, samples_path: Path | None = None) -> Future: ...

    def close(self) -> None: ...

    def summary(self) -> str: ...  # one line: how many evaluators, and any refused


def run_all(executor: Executor, jobs: Iterable[tuple[Card, str, Path | None]]) -> Iterator[Any]:
    """Verdicts of `jobs` in order (the `map` of the interface, for any implementation)."""
    futures = [executor.submit(card, source, samples) for card, source, samples in jobs]
    for future in futures:
        yield future.result()


def visible_devices(target: str) -> list[int]:
    """Device indices to evaluate on: every visible GPU for cuda, one worker for cpu."""
    if target != "cuda":
        return [0]
    import torch

    return list(range(torch.cuda.device_count())) or [0]


def default_compile_workers(target: str) -> int:
    cores = os.cpu_count() or 1
    # On cpu the evaluation times kernels on the same cores: leave it half of them.
    return max(1, cores - 1 if target == "cuda" else cores // 2)


def compile_candidate(source: str, target: str, arch: str | None) -> Any:
    """Compile, unless the source already breaks a static rule: the evaluator then rejects it as
    `static` from the source alone, and nvcc's seconds are saved."""
    from forgepack import staticcheck
    from forgepack.compile import CompileResult, compile_kernel

    if staticcheck.check_source(source, target):
        return CompileResult(ok=False, binary=None, log="not compiled: static checks failed", seconds=0.0,
                             cached=False, key="")
    return compile_kernel(source, target, arch=arch)


def supported_options(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """The options `cls` accepts (e.g. a bench-repetition cap that an older Evaluator lacks)."""
    params = inspect.signature(cls).parameters
    return {k: v for k, v in options.items() if k in params}


def with_object_hash(verdict: Any, sha256: str | None = None) -> Any:
    """`verdict` with the sha256 of the object it verified in its diagnostics (hashed here unless given)."""
    if not verdict.binary:
        return verdict
    digest = sha256 or file_sha256(verdict.binary)
    return dataclasses.replace(verdict, diagnostics={**verdict.diagnostics, "binary_sha256": digest})


@dataclass(frozen=True)
class Phases:
    """Where one candidate's time went, on the driver's clock (seconds): what an executor adds is
    everything but `compiler_s` and `evaluate_s`."""

    compile_s: float  # submit -> compiled object ready (queueing, scheduling, transfer, the compiler)
    compiler_s: float  # the compiler's own time (0 for a cache hit or a static reject)
    wait_s: float  # compiled -> an evaluator took it (its evaluator was busy with earlier ones)
    call_s: float  # taken -> verdict back (Ray: the actor call, argument transfer, writing the object)
    evaluate_s: float  # the evaluator's own verify-and-time, inside `call_s`
    finish_s: float  # verdict -> future done (hashing; Ray: the accepted object fetched to the driver)

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class PhaseLog:
    """Each evaluated candidate's `Phases`, in the order verdicts came back (for benchmarks)."""

    def __init__(self) -> None:
        self._items: list[Phases] = []
        self._lock = threading.Lock()

    def add(self, phases: Phases) -> None:
        with self._lock:
            self._items.append(phases)

    def items(self) -> list[Phases]:
        with self._lock:
            return list(self._items)


class Pace:
    """Running mean compile and evaluation times, and the in-flight count they call for.

    Each evaluator needs 1 + compile/evaluate candidates compiling behind the one it evaluates; more
    would only make the search decide further ahead of its results.
    """

    def __init__(self, compilers: int, evaluators: int):
        self.compilers, self.evaluators = compilers, evaluators
        self._compile_s = 3.0  # seeded with a typical nvcc compile and one evaluation
        self._evaluate_s = 1.0
        self._lock = threading.Lock()

    @property
    def slots(self) -> int:
        with self._lock:
            ratio = self._compile_s / max(self._evaluate_s, 1e-3)
        per_device = 1 + math.ceil(ratio)
        return max(2, min(self.compilers + self.evaluators, per_device * self.evaluators))

    def observe(self, verdict: Any, compiled: Any, evaluate_s: float) -> None:
        """Learn from one evaluated candidate (a cache hit or a rejected source says nothing of either)."""
        with self._lock:
            if not compiled.cached and compiled.ok:
                self._compile_s = 0.8 * self._compile_s + 0.2 * compiled.seconds
            if verdict.category not in ("static", "compile"):
                self._evaluate_s = 0.8 * self._evaluate_s + 0.2 * evaluate_s


class LocalExecutor:
    """Compile pool + one evaluation worker per device, on this host."""

    def __init__(
        self,
        target: str,
        arch: str | None = None,
        margin: float = 0.05,
        devices: list[int] | None = None,
        compile_workers: int | None = None,
        timeout_s: float = 60.0,
        evaluator_options: dict[str, Any] | None = None,
    ):
        self.target, self.arch, self.margin = target, arch, margin
        self.devices = devices if devices is not None else visible_devices(target)
        workers = compile_workers or default_compile_workers(target)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="compile")
        self._queue: queue.Queue = queue.Queue()
        self._timeout_s = timeout_s
        self._evaluator_options = dict(evaluator_options or {})
        self._threads = [
            threading.Thread(target=self._evaluate_loop, args=(index, slot), name=f"evaluate-{slot}", daemon=True)
            for slot, index in enumerate(self.devices)
        ]
        self._started = [threading.Event() for _ in self._threads]
        for thread in self._threads:
            thread.start()
        self.workers = workers
        self.evaluators = len(self.devices)
        self._pace = Pace(workers, len(self.devices))
        self.phases = PhaseLog()

    @property
    def slots(self) -> int:
        """Candidates worth having in flight: enough compiling to keep every device busy, no more."""
        return self._pace.slots

    def summary(self) -> str:
        """One line for the build: how many evaluators it has."""
        where = f"{self.target} devices {', '.join(map(str, self.devices))}" if self.target == "cuda" else "cpu"
        return f"local executor: {self.evaluators} evaluator{'s' if self.evaluators != 1 else ''} ({where}), " \
               f"{self.workers} compilers"

    def submit(self, card: Card, source: str, samples_path: Path | None = None) -> Future:
        result: Future = Future()
        submitted = time.monotonic()
        compiled = self._pool.submit(compile_candidate, source, self.target, self.arch)
        compiled.add_done_callback(lambda done: self._queue.put(
            (card, source, samples_path, done, result, (submitted, time.monotonic()))))
        return result

    def map(self, jobs: Iterable[tuple[Card, str, Path | None]]) -> Iterator[Any]:
        """Verdicts of (card, source, samples) jobs, in order."""
        return run_all(self, jobs)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every evaluator has its worker up (for benchmarks that time evaluation alone)."""
        for started in self._started:
            started.wait(timeout)

    def _evaluate_loop(self, device_index: int, slot: int) -> None:
        from forgepack import familyeval
        from forgepack.evaluate import Evaluator

        evaluator, broken = None, None
        try:
            evaluator = Evaluator(self.target, device_index=device_index, timeout_s=self._timeout_s,
                                  **supported_options(Evaluator, self._evaluator_options))
            evaluator.start()  # the worker would start anyway before the first job; now it says when
        except BaseException as err:  # every job then fails with it: the search must not wait forever
            broken = err
        finally:
            self._started[slot].set()
        try:
            while True:
                job = self._queue.get()
                if job is None:
                    return
                card, source, samples_path, compiled, result, (submitted, ready) = job
                if broken is not None:
                    result.set_exception(broken)
                    continue
                try:
                    built = compiled.result()
                    started = time.monotonic()
                    verdict = familyeval.evaluate_compiled(  # a family card: over its range
                        evaluator, card, built, source, samples_path=samples_path, margin=self.margin, bench=True
                    )
                    back = time.monotonic()
                    verdict = with_object_hash(verdict)
                except BaseException as err:  # reported through the future, never lost in a thread
                    result.set_exception(err)
                else:
                    self._pace.observe(verdict, built, back - started)
                    self.phases.add(Phases(ready - submitted, built.seconds if not built.cached else 0.0,
                                           started - ready, back - started, back - started,
                                           time.monotonic() - back))
                    result.set_result(verdict)
        finally:
            if evaluator is not None:
                evaluator.close()

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
