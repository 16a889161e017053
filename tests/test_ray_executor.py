"""`RayExecutor` against a real local Ray cluster (cpu): compile once per source, evaluation actors,
refused devices, a lost actor, a hanging kernel, the shipped object's hash, and `forgepack build`."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason='the Ray executor tests need the ray extra: pip install "forgepack[ray]"')

from forgepack import accepted as accepted_mod  # noqa: E402
from forgepack import pipeline  # noqa: E402
from forgepack import recipe as recipe_mod  # noqa: E402
from forgepack.capture import card_from_call  # noqa: E402
from forgepack.errors import ForgepackError  # noqa: E402
from forgepack.evaluate import evaluate  # noqa: E402
from forgepack.pack import builder as pack_builder  # noqa: E402
from forgepack.search import run  # noqa: E402
from forgepack.search.proposers import make  # noqa: E402
from forgepack.search.ray_executor import DeviceIdentity, RayExecutor, device_identity  # noqa: E402
from forgepack.workspace import Workspace  # noqa: E402

KERNELS = Path(__file__).parent / "kernels"
RELU = (KERNELS / "relu_cpu.cpp").read_text()
HANG = (KERNELS / "hang.cpp").read_text()
BROKEN = (KERNELS / "compile_error.cpp").read_text()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A real two-CPU local cluster for the module; its workers compile into their own cache."""
    cache = tmp_path_factory.mktemp("ray-cache")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, namespace="forgepack", log_to_driver=False,
             runtime_env={"env_vars": {"FORGEPACK_CACHE": str(cache)}})
    yield cache
    ray.shutdown()


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, cluster) -> Path:
    root = tmp_path_factory.mktemp("profiled")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGEPACK_CACHE", str(root / "cache"))
        ws = Workspace(root / "ws")
        pipeline.profile(recipe_mod.resolve("tiny-llama"), ws)
    return ws.root


def relu_card():
    return card_from_call(torch.ops.aten.relu.default, (torch.randn(4096),))[0]


def wait_until(predicate, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_two_evaluators_share_the_work_and_a_source_compiles_once(cluster):
    card = relu_card()
    with RayExecutor("cpu", evaluators=2, evaluator_cpus=0.5, compile_cpus=0.5, timeout_s=60) as executor:
        assert executor.evaluators == 2 and "2 evaluators" in executor.summary()
        # the evaluators time stock ops with the driver's threads, not the one Ray gives an actor
        assert all(i["thread_env"]["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS")
                   for i in executor.actor_info())
        futures = [executor.submit(card, src) for src in (RELU, RELU, RELU + "\n// same kernel, new source\n",
                                                          BROKEN)]
        verdicts = [f.result(timeout=300) for f in futures]
        counts = executor.compile_counts()
        info = executor.actor_info()
    assert [v.category in (None, "slower") for v in verdicts] == [True, True, True, False]
    assert verdicts[3].category == "compile" and verdicts[3].binary is None
    # three distinct sources were asked for four times: compiled three times in the whole cluster
    assert counts == {"requests": 4, "compiled": 3}
    assert sum(i["evaluated"] for i in info) == 4 and all(i["evaluated"] >= 1 for i in info)
    for v in verdicts[:3]:
        assert v.diagnostics["binary_sha256"] == hashlib.sha256(Path(v.binary).read_bytes()).hexdigest()
    assert verdicts[0].diagnostics["binary_sha256"] == verdicts[1].diagnostics["binary_sha256"]
    # the object travelled by content: the evaluator's copy lives under its sha256, not in the compile cache
    assert Path(verdicts[0].binary).parent.name == verdicts[0].diagnostics["binary_sha256"]


def test_start_up_warms_the_compile_workers_so_the_first_candidate_does_not_pay_their_imports(cluster):
    """Measured before: the first two candidates' compiles took ~1.5 s more than the compiler itself,
    a fresh worker process importing forgepack and probing g++; start-up now pays that."""
    with RayExecutor("cpu", evaluators=1, timeout_s=60) as executor:
        assert executor.warmed  # one process per compile slot (one CPU left over here)
        verdict = executor.submit(relu_card(), RELU + "\n// warm-up test\n").result(timeout=300)
        (ref,) = ray.get(executor.registry.compiled.remote(RELU + "\n// warm-up test\n", "cpu", None, 1.0))
        assert ray.get(ref).worker_pid in executor.warmed
        (phases,) = executor.phases.items()
    assert verdict.category in (None, "slower")
    assert phases.evaluate_s > 0 and phases.call_s >= phases.evaluate_s and phases.compile_s >= phases.compiler_s


def test_a_hanging_kernel_is_killed_by_the_evaluator_timeout_not_the_cluster(cluster):
    with RayExecutor("cpu", evaluators=1, timeout_s=5) as executor:
        pid = executor.actor_info()[0]["pid"]
        started = time.monotonic()
        verdict = executor.submit(relu_card(), HANG).result(timeout=300)
        assert verdict.category == "timeout" and "within 5 s" in verdict.reason
        assert time.monotonic() - started < 120
        after = executor.actor_info()[0]
        assert after["pid"] == pid and after["evaluated"] == 1  # the same actor, still serving
        assert executor.submit(relu_card(), RELU).result(timeout=300).category in (None, "slower")


def test_a_device_unlike_the_target_is_refused_with_the_reason(cluster):
    mine = device_identity("cpu")
    other = dataclasses.replace(mine, name="Some Other CPU")
    with pytest.raises(ForgepackError, match=r"no evaluator .* matches .*name .* differs from the build.s Some Other"):
        RayExecutor("cpu", evaluators=1, expected=other)
    h200 = DeviceIdentity("cuda", "NVIDIA H200", "sm_90", "2.13.0", "13.0")
    a100 = DeviceIdentity("cuda", "NVIDIA A100-SXM4-80GB", "sm_80", "2.13.0", "13.0")
    assert "name NVIDIA A100-SXM4-80GB differs" in a100.mismatch(h200)
    assert "arch sm_80 differs from the build's sm_90" in dataclasses.replace(a100, name=h200.name).mismatch(h200)
    assert "cuda 12.8 differs" in dataclasses.replace(h200, cuda="12.8").mismatch(h200)
    assert h200.mismatch(h200) is None
    any_sm90 = dataclasses.replace(h200, name=None)  # a driver without a GPU: the arch it compiles for
    assert dataclasses.replace(h200, name="NVIDIA H100").mismatch(any_sm90) is None
    assert "arch sm_80" in a100.mismatch(any_sm90)


def kill_when_busy(executor: RayExecutor, old_pid: int | None = None) -> int:
    """SIGKILL the (only) evaluator actor's process while it evaluates; returns the pid killed."""
    info: dict = {}

    def busy() -> bool:
        try:
            info.update(executor.actor_info()[0])
        except ray.exceptions.RayActorError:  # still restarting after the last kill
            return False
        return info["busy"] and info["pid"] != old_pid

    wait_until(busy, what="the evaluator to start evaluating")
    os.kill(info["pid"], signal.SIGKILL)
    return info["pid"]


def test_an_evaluator_lost_mid_evaluation_costs_a_retry_then_a_crash(cluster):
    with RayExecutor("cpu", evaluators=1, timeout_s=120) as executor:
        # lost once: the candidate is evaluated again on the restarted actor
        future = executor.submit(relu_card(), RELU)
        first = kill_when_busy(executor)
        verdict = future.result(timeout=300)
        assert verdict.category in (None, "slower") and len(verdict.diagnostics["lost"]) == 1
        assert executor.actor_info()[0]["pid"] != first
        # lost twice: a crash verdict, and the executor goes on serving
        future = executor.submit(relu_card(), HANG)
        second = kill_when_busy(executor, old_pid=first)
        kill_when_busy(executor, old_pid=second)
        verdict = future.result(timeout=300)
        assert verdict.category == "crash" and "lost 2 times" in verdict.reason
        assert executor.submit(relu_card(), RELU).result(timeout=300).category in (None, "slower")


class SwapObject:
    """An executor whose accepted verdicts name another file than the one that was verified."""

    def __init__(self, inner, other: Path):
        self.inner, self.other = inner, other
        self.slots = inner.slots

    def submit(self, card, source, samples_path=None) -> Future:
        swapped: Future = Future()

        def swap(done: Future) -> None:
            verdict = done.result()
            swapped.set_result(dataclasses.replace(verdict, binary=str(self.other)) if verdict.binary else verdict)

        self.inner.submit(card, source, samples_path).add_done_callback(swap)
        return swapped

    def summary(self) -> str:
        return self.inner.summary()

    def close(self) -> None:
        self.inner.close()


def search_tiny(ws: Workspace, executor, budget: int = 2) -> run.SearchResult:
    cards = ws.load_cards()
    settings = run.Settings(budget=budget, target="cpu", margin=-0.9)  # cpu timings are noisy: accept all
    search = run.Search(ws, cards, make("templates", target="cpu"), executor, settings)
    try:
        return search.run()
    finally:
        search.store.close()


def test_the_pack_ships_only_the_object_that_was_verified(profiled, tmp_path):
    ws = Workspace(tmp_path / "ws")
    shutil.copytree(profiled, ws.root)
    recipe = recipe_mod.resolve("tiny-llama").replace(target={"device": "cpu"})
    with RayExecutor("cpu", evaluators=1) as executor:
        result = search_tiny(ws, executor)
        assert result.accepted, result.stopped
        run.save_accepted(ws, result.accepted)
        kept = accepted_mod.load_all(ws.root)
        for k in kept:
            assert k.binary_sha256 == hashlib.sha256((ws.root / k.binary).read_bytes()).hexdigest()
        chosen, _ = pack_builder.select(ws, recipe, margin=-0.9)
        assert {c.kernel.card_id for c in chosen} == {k.card_id for k in kept}
        # another valid kernel object put in place of the verified one is refused
        victim = kept[0]
        impostor = executor.submit(relu_card(), RELU).result(timeout=300)
        shutil.copyfile(impostor.binary, ws.root / victim.binary)
        chosen, decisions = pack_builder.select(ws, recipe, margin=-0.9)
        assert victim.card_id not in {c.kernel.card_id for c in chosen}
        refused = next(d for d in decisions if d.card_id == victim.card_id)
        assert "is not the object that was verified and timed" in refused.reason

        # and the search itself refuses a verdict whose object is not the one it verified
        fresh = Workspace(tmp_path / "ws2")
        shutil.copytree(profiled, fresh.root)
        with pytest.raises(ForgepackError, match="is not the object that was verified"):
            search_tiny(fresh, SwapObject(executor, Path(impostor.binary)), budget=1)


@pytest.mark.long  # 80 s on 2 cores: the Ray executor's search runs in the default run (the tests above)
def test_build_two_recipes_through_ray_with_a_shared_cluster(tmp_path):
    second = tmp_path / "tiny-b.toml"
    second.write_text((recipe_mod.BUILTIN_DIR / "tiny-llama.toml").read_text().replace('name = "tiny-llama"',
                                                                               'name = "tiny-llama-b"'))
    env = {**os.environ, "FORGEPACK_CACHE": str(tmp_path / "cache"), "FORGEPACK_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "forgepack", "build", "tiny-llama", str(second), "--executor", "ray",
                           "--budget", "2", "--target", "cpu", "--no-gate", "--margin", "-0.9"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout + done.stderr
    assert text.count("Ray executor: 1 evaluator on") == 2
    # one Ray session for both recipes: started (or joined) once
    assert text.count("Started a local Ray instance") + text.count("Connecting to existing Ray cluster") == 1
    for slug in ("tiny_llama", "tiny_llama_b"):
        kept = accepted_mod.load_all(tmp_path / ".forgepack" / slug)
        assert kept and all(k.binary_sha256 for k in kept)
        assert list((tmp_path / "packs").glob(f"forgepack_pack_{slug}-*.whl"))


def store_states(ws: Path) -> list[tuple[int, str, float | None]]:
    """(candidate id, state, evaluated time), read as another process would."""
    import sqlite3

    path = ws / "store.sqlite"
    if not path.exists():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        return list(db.execute("SELECT id, state, evaluated FROM candidates ORDER BY id"))
    except sqlite3.OperationalError:  # tables not created yet
        return []
    finally:
        db.close()


@pytest.mark.long  # 50-80 s: CI's 30 minutes; the local executor's resume (test_build) stays in the default run
def test_a_killed_ray_driver_resumes_from_the_store(profiled, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(profiled, ws)
    env = {**os.environ, "FORGEPACK_CACHE": str(tmp_path / "cache")}
    args = [sys.executable, "-m", "forgepack", "build", "tiny-llama", "--executor", "ray", "--budget", "6",
            "--target", "cpu", "--no-gate", "--margin", "-0.9", "--workspace", str(ws)]
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        def mid_build() -> bool:
            states = {s for _, s, _ in store_states(ws)}
            return states == {"evaluated", "pending"} or proc.poll() is not None

        wait_until(mid_build, timeout=300, what="a build with evaluated and pending candidates")
        assert proc.poll() is None, "the build finished before it could be killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local cluster it started
        proc.wait()
    before = store_states(ws)
    assert any(s == "pending" for _, s, _ in before)
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming:" in done.stdout + done.stderr
    after = store_states(ws)
    assert len(after) >= len(before) and all(s == "evaluated" for _, s, _ in after)
    # what was evaluated before the kill was not evaluated again
    evaluated_before = {cid: t for cid, s, t in before if s == "evaluated"}
    assert {cid: t for cid, _, t in after if cid in evaluated_before} == evaluated_before


@pytest.mark.gpu
def test_one_actor_per_gpu_evaluates_a_cuda_search(cluster, tmp_path):
    """On a GPU host (needs ray there): one evaluator actor per GPU, each on its own device."""
    r = recipe_mod.resolve("tiny-llama").replace(target={"device": "cuda"})
    ws = Workspace(tmp_path / "ws")
    profiled = pipeline.profile(r, ws)
    cards, arch = list(profiled.cards), profiled.profile.arch
    with RayExecutor("cuda", arch=arch) as executor:
        assert executor.evaluators == torch.cuda.device_count() and not executor.refused
        assert {i["identity"].arch for i in executor.actor_info()} == {arch}
        # any verified kernel is accepted (speed is the benchmarks' business): an acceptance is required
        settings = run.Settings(budget=4, target="cuda", arch=arch, margin=-0.9)
        search = run.Search(ws, cards, make("templates", target="cuda"), executor, settings)
        try:
            result = search.run()
            evaluated = [c for c in search.store.candidates() if c.state == "evaluated"]
        finally:
            search.store.close()
    assert result.evaluated == len(evaluated) >= 1
    assert result.accepted, [(c.card_id, c.category, c.reason) for c in evaluated]
    for k in result.accepted:
        assert k.binary_sha256 == hashlib.sha256((ws.root / k.binary).read_bytes()).hexdigest()
        # what an actor accepted, run again here by a fresh evaluator, still matches eager
        again = evaluate(ws.load_card(k.card_id), (ws.root / k.source).read_text(), target="cuda",
                         samples_path=ws.sample_path(k.card_id), bench=False)
        assert again.accepted and again.source_hash == k.source_hash, (k.card_id, again.reason)
