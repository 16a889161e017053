"""The executor: compiles candidates in parallel, evaluates them on one worker per device.

The search only needs `Executor`: ``submit(card, source, samples_path) -> Future[Verdict]`` and
``slots`` (how many candidates it can usefully have in flight). `LocalExecutor` implements it on this
host; a cluster engine can implement the same members.

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

import inspect
import math
import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from forgepack.cards import Card


class Executor(Protocol):
    slots: int  # candidates worth having in flight at once (compiling + evaluating)

    def submit(self, card: Card, source: str, samples_path: Path | None = None) -> Future: ...

    def close(self) -> None: ...


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


def _compile(source: str, target: str, arch: str | None) -> Any:
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
            threading.Thread(target=self._evaluate_loop, args=(index,), name=f"evaluate-{index}", daemon=True)
            for index in self.devices
        ]
        for thread in self._threads:
            thread.start()
        self.workers = workers
        self._compile_s = 3.0  # running means, seeded with a typical nvcc compile and one evaluation
        self._evaluate_s = 1.0
        self._lock = threading.Lock()

    @property
    def slots(self) -> int:
        """Candidates worth having in flight: enough compiling to keep every device busy, no more.

        Each device needs 1 + compile/evaluate candidates compiling behind the one it evaluates; more
        would only make the search decide further ahead of its results.
        """
        with self._lock:
            ratio = self._compile_s / max(self._evaluate_s, 1e-3)
        per_device = 1 + math.ceil(ratio)
        return max(2, min(self.workers + len(self.devices), per_device * len(self.devices)))

    def _observe(self, which: str, seconds: float) -> None:
        with self._lock:
            name = f"_{which}_s"
            setattr(self, name, 0.8 * getattr(self, name) + 0.2 * seconds)

    def submit(self, card: Card, source: str, samples_path: Path | None = None) -> Future:
        result: Future = Future()
        compiled = self._pool.submit(_compile, source, self.target, self.arch)
        compiled.add_done_callback(lambda done: self._queue.put((card, source, samples_path, done, result)))
        return result

    def map(self, jobs: Iterable[tuple[Card, str, Path | None]]) -> Iterator[Any]:
        """Verdicts of (card, source, samples) jobs, in order."""
        return run_all(self, jobs)

    def _evaluate_loop(self, device_index: int) -> None:
        from forgepack import familyeval
        from forgepack.evaluate import Evaluator

        evaluator, broken = None, None
        try:
            evaluator = Evaluator(self.target, device_index=device_index, timeout_s=self._timeout_s,
                                  **supported_options(Evaluator, self._evaluator_options))
        except BaseException as err:  # every job then fails with it: the search must not wait forever
            broken = err
        try:
            while True:
                job = self._queue.get()
                if job is None:
                    return
                card, source, samples_path, compiled, result = job
                if broken is not None:
                    result.set_exception(broken)
                    continue
                try:
                    built = compiled.result()
                    started = time.monotonic()
                    verdict = familyeval.evaluate_compiled(  # a family card: over its range
                        evaluator, card, built, source, samples_path=samples_path, margin=self.margin, bench=True
                    )
                except BaseException as err:  # reported through the future, never lost in a thread
                    result.set_exception(err)
                else:
                    if not built.cached and built.ok:
                        self._observe("compile", built.seconds)
                    if verdict.category not in ("static", "compile"):
                        self._observe("evaluate", time.monotonic() - started)
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
