"""`RayExecutor`: the search's `Executor` on a Ray cluster (`pip install "forgepack[ray]"`).

Ray does the scheduling; this module only says what runs where:

- Compiling: Ray tasks on CPU workers. One named actor per cluster (`CompileRegistry`) maps
  `forgepack.compile.cache_key` to the object reference of the task that compiled that source, so a
  candidate compiled once is never compiled again anywhere in the cluster, by any build sharing it.
  The task's result, a `CompiledObject`, carries the shared object and its ELF object file as bytes
  with their sha256: it travels through Ray's object store by content, not by a path on some node.
- Evaluating: one `EvaluatorActor` per GPU (per evaluator slot on cpu), holding one `Evaluator`
  (whose worker subprocess and timeout are unchanged: a hanging kernel is killed by the evaluator's
  timeout, never by the cluster). The actor writes the object under its sha256, checks the bytes,
  and reports the hash of the file it verified and timed; the driver writes the same bytes locally,
  checks them against that hash, and the search keeps that file, which the pack builder checks again.
- Matching: an actor whose device differs from the build's target (device name, compute capability,
  torch, CUDA) is refused with the reason, since a pack is built and timed for one device.
- Faults: an actor lost mid-evaluation (its process or node died) costs the candidate one retry,
  then a `crash` verdict; Ray restarts the actor. The driver itself holds nothing the store lacks, so
  a killed build resumes from the store as with the local executor.

Ray is imported only here, and only when a `RayExecutor` is made.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forgepack.cards import Card
from forgepack.compile import CompileResult
from forgepack.errors import ForgepackError
from forgepack.search.executor import (
    Pace,
    PhaseLog,
    Phases,
    compile_candidate,
    supported_options,
    with_object_hash,
)

NAMESPACE = "forgepack"
REGISTRY = "forgepack-compiled"
ACTOR_RESTARTS = 8  # per actor over a build: a node that keeps dying is not worth more
RETRIES = 1  # evaluations a lost actor costs a candidate before it is a crash
START_TIMEOUT_S = 600.0
MAX_WARM = 32  # compile worker processes warmed at start-up (a large cluster warms the rest on first use)
# Ray sets these to an actor's CPU count (1): a cpu evaluator's stock torch ops would then be timed on
# one thread, not as the local executor and the user's process run them. The driver's values are passed.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def import_ray() -> Any:
    try:
        import ray
    except ImportError as err:
        raise ForgepackError('--executor ray needs Ray: pip install "forgepack[ray]"') from err
    return ray


# --- what a device is --------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceIdentity:
    """What must agree between the build's target and an evaluator: timings and objects are per device."""

    target: str  # "cuda" | "cpu"
    name: str | None  # "NVIDIA H200", or the cpu's processor name (None in a target: any)
    arch: str | None  # "sm_90"; None on cpu
    torch: str
    cuda: str | None  # torch's CUDA build; None on cpu

    def describe(self) -> str:
        arch = f" ({self.arch})" if self.arch else ""
        cuda = f", CUDA {self.cuda}" if self.cuda else ""
        return f"{self.name or 'any ' + self.target + ' device'}{arch}, torch {self.torch}{cuda}"

    def mismatch(self, target: DeviceIdentity) -> str | None:
        """Why this device may not evaluate for `target` (None: it may); a target field of None is any."""
        for field in dataclasses.fields(self):
            mine, wanted = getattr(self, field.name), getattr(target, field.name)
            if wanted is not None and mine != wanted:
                return (f"{field.name} {mine} differs from the build's {wanted} "
                        f"({self.describe()} vs {target.describe()})")
        return None


def target_identity(target: str, arch: str | None) -> DeviceIdentity:
    """The build's target as the driver knows it: its own device, or on a driver without a GPU the
    arch the build compiles for and this torch build (any device name)."""
    import torch

    if target == "cuda" and not torch.cuda.is_available():
        return DeviceIdentity("cuda", None, arch, torch.__version__, torch.version.cuda)
    return device_identity(target)


def device_identity(target: str, device_index: int = 0) -> DeviceIdentity:
    """This process's device for `target`, the way an evaluator here would see it."""
    import torch

    if target != "cuda":
        return DeviceIdentity("cpu", cpu_name(), None, torch.__version__, None)
    if not torch.cuda.is_available():
        raise ForgepackError("no CUDA GPU is visible here")
    props = torch.cuda.get_device_properties(device_index)  # CUDA's runtime, no context: nothing is allocated
    return DeviceIdentity("cuda", props.name, f"sm_{props.major}{props.minor}", torch.__version__, torch.version.cuda)


def cpu_name() -> str:
    """The processor's model name (Linux), else what `platform` knows (often only "x86_64")."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --- the compiled object, by content ------------------------------------------------------------


@dataclass(frozen=True)
class CompiledObject:
    """A compile result with its files' bytes: what travels from the compiling node to the others."""

    result: CompileResult  # as on the compiling node (its `binary` path means nothing elsewhere)
    so: bytes | None
    obj: bytes | None  # kernel.o, which the static checks read
    sha256: str  # of `so`; "" when nothing was built
    worker_pid: int = 0  # the process that compiled it (start-up warms these)


def compile_to_object(source: str, target: str, arch: str | None) -> CompiledObject:
    """Compile (cached on this node) and read the object back as bytes."""
    result = compile_candidate(source, target, arch)
    if not result.ok or not result.binary:
        return CompiledObject(result, None, None, "", os.getpid())
    so = Path(result.binary).read_bytes()
    obj = Path(result.binary).with_suffix(".o").read_bytes()
    return CompiledObject(result, so, obj, hashlib.sha256(so).hexdigest(), os.getpid())


def warm_compiler(target: str, arch: str | None) -> int:
    """What a compile task's first run would pay, paid at start-up in this worker process: the imports
    and the compiler probes (version, supported flags) that every cache key includes. Returns the pid."""
    from forgepack import staticcheck  # noqa: F401  (imported for the compile tasks to come)
    from forgepack.compile import cache_key

    cache_key("", target, arch)
    return os.getpid()


def objects_root() -> Path:
    from forgepack.compile import cache_root

    return cache_root().parent / "objects"


def materialize(compiled: CompiledObject, root: Path | None = None) -> CompileResult:
    """Write the object under its sha256 on this node (once) and return the result pointing at it.

    The bytes are hashed again here and the file read back: an object is only ever used under the
    hash of its own content."""
    if compiled.so is None:
        return dataclasses.replace(compiled.result, binary=None)
    if hashlib.sha256(compiled.so).hexdigest() != compiled.sha256:
        raise ForgepackError(f"the compiled object for {compiled.result.key[:16]} arrived corrupted")
    entry = (root or objects_root()) / compiled.sha256
    if not _holds(entry, compiled.sha256):
        _write_entry(entry, compiled)
    if not _holds(entry, compiled.sha256):
        raise ForgepackError(f"the object at {entry} does not have the sha256 it was stored under")
    return dataclasses.replace(compiled.result, binary=str(entry / "kernel.so"))


def _holds(entry: Path, sha256: str) -> bool:
    binary = entry / "kernel.so"
    return binary.is_file() and (entry / "kernel.o").is_file() and file_digest(binary) == sha256


def _write_entry(entry: Path, compiled: CompiledObject) -> None:
    """Write to a temporary directory and rename it into place; an entry another process put there
    first is kept when it holds the right bytes (it is read by then), replaced only when damaged."""
    import shutil

    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".{entry.name[:16]}.{os.getpid()}.{threading.get_ident()}"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        (tmp / "kernel.so").write_bytes(compiled.so or b"")
        (tmp / "kernel.o").write_bytes(compiled.obj or b"")
        try:
            tmp.rename(entry)
        except OSError:
            if not _holds(entry, compiled.sha256):
                shutil.rmtree(entry, ignore_errors=True)
                tmp.rename(entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def materialize_samples(data: bytes, digest: str, root: Path | None = None) -> Path:
    path = (root or objects_root()) / "samples" / f"{digest}.safetensors"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return path


# --- the actors (made Ray classes lazily) --------------------------------------------------------


class CompileRegistry:
    """source cache key -> the reference of the one task that compiled it, for the whole cluster."""

    def __init__(self) -> None:
        self.refs: dict[str, Any] = {}
        self.requests = 0

    def compiled(self, source: str, target: str, arch: str | None, num_cpus: float) -> list:
        """[reference] (in a list so that Ray hands the reference over instead of waiting for it)."""
        from forgepack.compile import cache_key

        self.requests += 1
        key = cache_key(source, target, arch)
        if key not in self.refs:
            task = _ray_compile_task()
            self.refs[key] = task.options(num_cpus=num_cpus).remote(source, target, arch)
        return [self.refs[key]]

    def counts(self) -> dict[str, int]:
        return {"requests": self.requests, "compiled": len(self.refs)}

    def warm(self, target: str, arch: str | None) -> int:
        """Import and probe the compiler before the first candidate's cache key is asked for."""
        return warm_compiler(target, arch)


class EvaluatorActor:
    """One device's `Evaluator`; refuses to evaluate when its device is not the build's target."""

    def __init__(self, target: str, timeout_s: float, options: dict, expected: DeviceIdentity | None,
                 thread_env: dict[str, str | None] | None = None):
        from forgepack.evaluate import Evaluator

        for name, value in (thread_env or {}).items():  # inherited by the Evaluator's worker subprocess
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        from forgepack import familyeval  # noqa: F401  (at start-up, not in the first candidate's time)

        self.identity = device_identity(target)
        self.refusal = self.identity.mismatch(expected) if expected is not None else None
        self.evaluator = None
        self.busy = False
        self.evaluated = 0
        if self.refusal is None:
            # Ray shows the actor only its own GPU(s): index 0 is the one it was given.
            self.evaluator = Evaluator(target, device_index=0, timeout_s=timeout_s,
                                       **supported_options(Evaluator, options))
            self.evaluator.start()

    def describe(self) -> dict:
        return {"identity": self.identity, "refusal": self.refusal, "pid": os.getpid(),
                "node": _node_id(), "busy": self.busy, "evaluated": self.evaluated,
                "thread_env": {name: os.environ.get(name) for name in THREAD_VARS}}

    def evaluate(self, card: Card, compiled: CompiledObject, source: str, samples: tuple | None,
                 margin: float) -> tuple[Any, CompileResult, float]:
        """(verdict, the compile result without its bytes: the driver's pace needs its time only, and
        the seconds the evaluator itself took)."""
        from forgepack import familyeval  # lazily, as the local executor does

        if self.evaluator is None:
            raise ForgepackError(f"this evaluator was refused: {self.refusal}")
        self.busy = True
        try:
            built = materialize(compiled)
            path = materialize_samples(*samples) if samples else None
            started = time.monotonic()
            verdict = familyeval.evaluate_compiled(self.evaluator, card, built, source, samples_path=path,
                                                   margin=margin, bench=True)  # a family card: over its range
            seconds = time.monotonic() - started
            self.evaluated += 1
            return with_object_hash(verdict), built, seconds  # hashed from the file verified and timed
        finally:
            self.busy = False


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


_RAY_CLASSES: dict[str, Any] = {}


def _ray_compile_task() -> Any:
    if "compile" not in _RAY_CLASSES:
        _RAY_CLASSES["compile"] = import_ray().remote(compile_to_object)
    return _RAY_CLASSES["compile"]


def _ray_warm_task() -> Any:
    if "warm" not in _RAY_CLASSES:
        _RAY_CLASSES["warm"] = import_ray().remote(warm_compiler)
    return _RAY_CLASSES["warm"]


def _ray_class(name: str) -> Any:
    if name not in _RAY_CLASSES:
        _RAY_CLASSES[name] = import_ray().remote({"registry": CompileRegistry, "evaluator": EvaluatorActor}[name])
    return _RAY_CLASSES[name]


def connect(address: str | None = None, min_cpus: int = 1) -> Any:
    """The Ray session: the one already open, the cluster at `address`, or a new local one."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a build sends nothing anywhere unless asked
    options: dict[str, Any] = {"namespace": NAMESPACE, "log_to_driver": False}
    if address:
        options["address"] = address
    else:  # a local cluster: logical CPUs for the evaluators plus at least one compiler
        options.update(num_cpus=max(os.cpu_count() or 1, min_cpus), include_dashboard=False)
    try:
        ray.init(**options)
    except (ConnectionError, ValueError, RuntimeError) as err:
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        raise ForgepackError(f"cannot reach {where}: {str(err).splitlines()[0] if str(err) else err}") from err
    return ray


def registry(ray: Any) -> Any:
    return _ray_class("registry").options(name=REGISTRY, namespace=NAMESPACE, get_if_exists=True,
                                          num_cpus=0, max_concurrency=1).remote()


# --- the driver side -----------------------------------------------------------------------------


@dataclass
class _Job:
    card: Card
    source: str
    samples: Any  # object reference of (bytes, sha256), or None
    compiled: Any  # object reference of the CompiledObject
    result: Future
    submitted: float  # time.monotonic() on the driver
    ready: float = 0.0  # when the compiled object was
    lost: list[str] = dataclasses.field(default_factory=list)  # how each lost attempt ended


@dataclass(frozen=True)
class Refused:
    actor: str
    reason: str


class RayExecutor:
    """Compiles as Ray tasks (once per source in the cluster), evaluates on one actor per device."""

    def __init__(
        self,
        target: str,
        arch: str | None = None,
        margin: float = 0.05,
        address: str | None = None,
        evaluators: int | None = None,
        timeout_s: float = 60.0,
        evaluator_options: dict[str, Any] | None = None,
        expected: DeviceIdentity | None = None,
        evaluator_cpus: float = 1.0,
        compile_cpus: float = 1.0,
        retries: int = RETRIES,
    ):
        """`evaluators`: actors to start (default: one per GPU in the cluster for cuda, 1 for cpu);
        `expected`: the device the build targets (default: this host's, as `device_identity` sees it)."""
        self.target, self.arch, self.margin, self.retries = target, arch, margin, retries
        count = evaluators or 1
        self.ray = ray = connect(address, min_cpus=int(count * evaluator_cpus + compile_cpus + 0.999))
        if evaluators is None and target == "cuda":
            count = int(ray.cluster_resources().get("GPU", 0))
            if count == 0:
                raise ForgepackError("the Ray cluster has no GPU: a cuda build needs at least one")
        self._check_cpus(count, evaluator_cpus, compile_cpus)
        self.expected = expected or target_identity(target, arch)
        self.compile_cpus = compile_cpus
        self.registry = registry(ray)
        self._samples: dict[Path, tuple[float, Any]] = {}
        resources = {"num_gpus": 1, "num_cpus": evaluator_cpus} if target == "cuda" else {"num_cpus": evaluator_cpus}
        actor_class = _ray_class("evaluator").options(
            **resources, max_restarts=ACTOR_RESTARTS, max_task_retries=0, max_concurrency=2,
        )
        options = dict(evaluator_options or {})
        threads = {name: os.environ.get(name) for name in THREAD_VARS}
        started = [actor_class.remote(target, timeout_s, options, self.expected, threads) for _ in range(count)]
        self.actors, self.refused = self._admit(started)
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._alive = len(self.actors)
        self._lock = threading.Lock()
        compilers = max(1, int(ray.cluster_resources().get("CPU", 1) - count * evaluator_cpus))
        self._pace = Pace(compilers, len(self.actors))
        self.phases = PhaseLog()
        self.warmed = self._warm(min(compilers, MAX_WARM))
        self._threads = [threading.Thread(target=self._evaluate_loop, args=(actor,), daemon=True,
                                          name=f"ray-evaluate-{i}") for i, actor in enumerate(self.actors)]
        for thread in self._threads:
            thread.start()

    def _warm(self, compilers: int) -> set[int]:
        """Start fresh processes' imports and compiler probes now, in start-up, rather than in the first
        candidates' compile time (measured: ~1.5 s each for the first two on cpu, a third of a candidate
        in a short build). One warm task per compile slot, so that each worker process Ray starts for
        them is warm; returns their pids."""
        task = _ray_warm_task().options(num_cpus=self.compile_cpus)
        refs = [task.remote(self.target, self.arch) for _ in range(compilers)]
        refs.append(self.registry.warm.remote(self.target, self.arch))
        pids = self.ray.get(refs, timeout=START_TIMEOUT_S)
        return set(pids[:-1])

    def _check_cpus(self, count: int, evaluator_cpus: float, compile_cpus: float) -> None:
        total = self.ray.cluster_resources().get("CPU", 0)
        if total - count * evaluator_cpus < compile_cpus:
            raise ForgepackError(f"the Ray cluster has {total:g} CPUs: {count} evaluators of {evaluator_cpus:g} "
                                 f"CPU leave none for a compile task of {compile_cpus:g}; start fewer evaluators")

    def _admit(self, started: list) -> tuple[list, list[Refused]]:
        """The actors whose device matches the target; the others are refused, with the reason."""
        ray = self.ray
        admitted, refused = [], []
        for index, actor in enumerate(started):
            try:
                info = ray.get(actor.describe.remote(), timeout=START_TIMEOUT_S)
            except Exception as err:  # an actor that cannot start (no GPU, a broken torch) evaluates nothing
                refused.append(Refused(f"evaluator {index}", f"did not start: {_first_line(err)}"))
                ray.kill(actor, no_restart=True)
                continue
            if info["refusal"]:
                refused.append(Refused(f"evaluator {index} on node {info['node'][:12]}", info["refusal"]))
                ray.kill(actor, no_restart=True)
            else:
                admitted.append(actor)
        if not admitted:
            reasons = "; ".join(f"{r.actor}: {r.reason}" for r in refused) or "none started"
            raise ForgepackError(f"no evaluator in the Ray cluster matches the build's target "
                                 f"{self.expected.describe()}: {reasons}")
        return admitted, refused

    @property
    def evaluators(self) -> int:
        return len(self.actors)

    @property
    def slots(self) -> int:
        return self._pace.slots

    def summary(self) -> str:
        """One line for the build: how many evaluators it has, and which were refused and why."""
        text = f"Ray executor: {self.evaluators} evaluator{'s' if self.evaluators != 1 else ''} on " \
               f"{self.expected.describe()}"
        if self.refused:
            text += f"; {len(self.refused)} refused: " + "; ".join(f"{r.actor}: {r.reason}" for r in self.refused)
        return text

    def submit(self, card: Card, source: str, samples_path: Path | None = None) -> Future:
        result: Future = Future()
        if self._closed:
            result.set_exception(ForgepackError("the Ray executor is closed"))
            return result
        submitted = time.monotonic()
        samples = self._samples_ref(samples_path) if samples_path else None
        handle = self.registry.compiled.remote(source, self.target, self.arch, self.compile_cpus)

        def compiled(done: Future) -> None:
            try:
                (ref,) = done.result()
            except Exception as err:
                result.set_exception(err)
                return
            job = _Job(card, source, samples, ref, result, submitted)

            def ready(_: Any) -> None:
                job.ready = time.monotonic()
                self._queue.put(job)

            ref.future().add_done_callback(ready)

        handle.future().add_done_callback(compiled)
        return result

    def _samples_ref(self, path: Path) -> Any:
        """A card's captured inputs, put into the object store once (again only if the file changed)."""
        mtime = path.stat().st_mtime
        known = self._samples.get(path)
        if known is None or known[0] != mtime:
            data = path.read_bytes()
            known = (mtime, self.ray.put((data, hashlib.sha256(data).hexdigest())))
            self._samples[path] = known
        return known[1]

    def _evaluate_loop(self, actor: Any) -> None:
        ray = self.ray
        from ray.exceptions import RayActorError

        while True:
            job = self._queue.get()
            if job is None:
                return
            started = time.monotonic()
            try:
                verdict, built, evaluate_s = ray.get(actor.evaluate.remote(job.card, job.compiled, job.source,
                                                                           job.samples, self.margin))
                back = time.monotonic()
                verdict = self._local_object(verdict, job)
            except RayActorError as err:  # the actor's process or node died under the candidate
                back = self._restarts(actor)  # before a retry: one sent to a restarting actor is lost too
                if self._lost(job, err):
                    self._queue.put(job)
                if not back:
                    self._retire()
                    return
                continue
            except BaseException as err:  # reported through the future, never lost in a thread
                job.result.set_exception(_cause(err))
                continue
            self._pace.observe(verdict, built, back - started)
            self.phases.add(Phases(job.ready - job.submitted, built.seconds if not built.cached else 0.0,
                                   started - job.ready, back - started, evaluate_s, time.monotonic() - back))
            if job.lost:  # evaluated on a retry: say what the lost attempts cost
                verdict = dataclasses.replace(verdict, diagnostics={**verdict.diagnostics, "lost": list(job.lost)})
            job.result.set_result(verdict)

    def _lost(self, job: _Job, err: Exception) -> bool:
        """Count a lost evaluation against the candidate: True to try it again, else it is a crash."""
        from forgepack.evaluate import Verdict, source_hash

        job.lost.append(_first_line(err))
        if len(job.lost) <= self.retries:
            return True
        job.result.set_result(Verdict(
            False, "crash", f"the evaluator was lost {len(job.lost)} times while evaluating it "
                            f"(its process or node died): {job.lost[-1]}",
            {"lost": list(job.lost)}, source_hash(job.source)))
        return False

    def _restarts(self, actor: Any) -> bool:
        """Wait until Ray has brought the actor back; False once its restarts are spent or its node is gone."""
        from ray.exceptions import ActorDiedError, GetTimeoutError

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                self.ray.get(actor.describe.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return True
            except (ActorDiedError, GetTimeoutError):
                return False
            except Exception:  # unavailable while it restarts: ask again
                time.sleep(0.5)
        return False

    def _retire(self) -> None:
        """An actor is gone for good; when none is left, the waiting candidates fail the build (resumable)."""
        with self._lock:
            self._alive -= 1
            last = self._alive == 0
        if not last:
            return
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.result.set_exception(ForgepackError("every Ray evaluator is gone; run the build again to resume"))

    def _local_object(self, verdict: Any, job: _Job) -> Any:
        """An accepted verdict names the object on the driver, written from the bytes that were verified."""
        if not verdict.accepted or not verdict.binary:
            return verdict
        compiled = self.ray.get(job.compiled)
        verified = verdict.diagnostics.get("binary_sha256")
        if compiled.sha256 != verified:
            raise ForgepackError(f"the evaluator verified an object with sha256 {verified}, but the compiled "
                                 f"object is {compiled.sha256}")
        built = materialize(compiled)
        return dataclasses.replace(verdict, binary=built.binary)

    def compile_counts(self) -> dict[str, int]:
        return self.ray.get(self.registry.counts.remote())

    def actor_info(self) -> list[dict]:
        return self.ray.get([a.describe.remote() for a in self.actors])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout=5)
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)  # its Evaluator's worker dies with it (PDEATHSIG)
            except Exception:
                continue

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cause(err: BaseException) -> BaseException:
    """A task's own exception (a ForgepackError raised on a worker) rather than Ray's wrapper."""
    as_cause = getattr(err, "as_instanceof_cause", None)
    return as_cause() if as_cause else err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:300]
