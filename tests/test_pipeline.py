"""`forgepack.pipeline`: one recipe through profile -> search -> pack, with the device facts gathered
once; `forgepack.modeltiming`: the interleaved model timing the gate and `forgepack bench` share."""

from __future__ import annotations

import contextlib
import itertools

import pytest
from test_anthropic_proposer import MessagesServer, ok

from forgepack import bench, modeltiming, pipeline
from forgepack import profile as profile_mod
from forgepack import recipe as recipe_mod
from forgepack.profile import ModelProfile
from forgepack.workspace import Workspace


def _profile(arch: str | None) -> ModelProfile:
    return ModelProfile(recipe="r", device="NVIDIA H200 (sm_90): copy 4000 GB/s", arch=arch, e2e_ms=1.0,
                        gpu_busy=None, kernel_ms=None, aten_calls=1, variants=1, op_time_ms=1.0, diagnosis="",
                        torch_version="2.13.0", date="2026-12-01")


def test_target_facts_take_the_recipes_arch_then_the_profiled_gpus(monkeypatch):
    from forgepack import compile as compile_mod

    cuda = recipe_mod.resolve("tiny-llama").replace(target={"device": "cuda"})
    monkeypatch.setattr(compile_mod, "default_arch", lambda: pytest.fail("probed the host with a profile at hand"))
    assert pipeline.target_facts(cuda, _profile("sm_90")).arch == "sm_90"
    pinned = cuda.replace(target={"arch": "sm_80"})
    facts = pipeline.target_facts(pinned, _profile("sm_90"))
    assert facts.arch == "sm_80"  # the recipe says what the pack is for
    assert facts.prompt() == {"target": "cuda", "device": "NVIDIA H200 (sm_90): copy 4000 GB/s", "arch": "sm_80",
                              "torch": "2.13.0"}
    assert pipeline.TargetFacts.from_json(facts.to_json()) == facts
    monkeypatch.setattr(compile_mod, "default_arch", lambda: "sm_89")  # not profiled yet: this host's GPU
    assert pipeline.target_facts(cuda, None).arch == "sm_89"
    cpu = pipeline.target_facts(recipe_mod.resolve("tiny-llama").replace(target={"device": "cpu"}), None)
    assert cpu == pipeline.TargetFacts("cpu") and cpu.prompt() == {"target": "cpu"}


def test_interleaved_rounds_shuffle_the_order_and_take_each_rounds_median():
    ticks = itertools.count()
    visits: list[str] = []
    switched: list[tuple[str, str]] = []

    @contextlib.contextmanager
    def switch(name):
        switched.append(("on", name))
        yield
        switched.append(("off", name))

    # Each forward advances a fake clock by its own number of ticks: a's forwards take 1 ms, b's 3 ms.
    def forward(name, ms):
        def run():
            visits.append(name)
            for _ in range(ms - 1):
                next(ticks)
        return run

    clock = lambda: next(ticks) / 1e3  # noqa: E731
    times = modeltiming.interleaved_ms({"a": forward("a", 1), "b": forward("b", 3)}, rounds=6, reps=3,
                                       seed=0, switch=switch, clock=clock)
    assert {k: [round(t, 9) for t in v] for k, v in times.items()} == {"a": [1.0] * 6, "b": [3.0] * 6}
    assert len(visits) == 6 * 2 * (1 + 3)  # one untimed forward per turn, then the timed ones
    firsts = [visits[i] for i in range(0, len(visits), 8)]
    assert set(firsts) == {"a", "b"}  # the order is shuffled per round, not fixed
    assert switched[:2] in ([("on", "a"), ("off", "a")], [("on", "b"), ("off", "b")])
    ticks = itertools.count()  # the same seed and clock: the same times
    again = modeltiming.interleaved_ms({"a": forward("a", 1), "b": forward("b", 3)}, 6, 3, seed=0, clock=clock)
    assert again == times


def test_bench_engine_times_through_the_shared_loop(monkeypatch):
    """`forgepack bench`'s engine runs the real model through `modeltiming.interleaved_ms` (counted)."""
    calls = []
    real = modeltiming.interleaved_ms

    def counted(forwards, *args, **kwargs):
        calls.append(sorted(forwards))
        return real(forwards, *args, **kwargs)

    monkeypatch.setattr(modeltiming, "interleaved_ms", counted)
    r = recipe_mod.resolve("tiny-llama").replace(target={"device": "cpu"})
    result = bench.run(r, ["eager"], rounds=2, reps=1)
    assert calls == [["eager"]]
    rounds = result["columns"]["eager"]["rounds_ms"]
    assert len(rounds) == 2 and all(ms > 0 for ms in rounds)  # eager timed once per round, really run


def test_build_reads_the_profile_once_and_tells_the_proposer_the_device(tmp_path, monkeypatch):
    """A build of a profiled workspace: profile.json read once; the LLM's prompt has the profiled device."""
    r = recipe_mod.resolve("tiny-llama").replace(target={"device": "cpu"},
                                                 build={"budget": 1, "proposer": "anthropic",
                                                        "llm_model": "claude-haiku-4-5", "gate": False})
    ws = Workspace(tmp_path / "ws")
    profiled = pipeline.profile(r, ws)
    assert not profiled.reused and pipeline.profile(r, ws).reused
    reads = []
    real = profile_mod.load_profile
    monkeypatch.setattr(profile_mod, "load_profile", lambda w: reads.append(w) or real(w))
    server = MessagesServer()
    server.script = [ok("no kernel in this reply")] * 4
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
    try:
        built = pipeline.build(r, ws, out_dir=tmp_path / "packs")
    finally:
        server.close()
    assert len(reads) == 1
    assert built.profiled.reused and built.facts == pipeline.TargetFacts("cpu", None, profiled.profile.device,
                                                                          profiled.profile.torch_version)
    prompt = server.requests[0]["body"]["messages"][0]["content"]
    assert f"Device: target=cpu, device={profiled.profile.device}, torch=" in prompt
    assert built.search.calls == 1 and built.pack.gate == "empty" and built.accepted.is_file()


def test_a_missing_api_key_fails_before_profiling(tmp_path, monkeypatch):
    from forgepack.errors import ForgepackError

    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.setattr(profile_mod, "run_profile", lambda *a, **k: pytest.fail("profiled before the key check"))
    r = recipe_mod.resolve("tiny-llama").replace(build={"proposer": "anthropic"})
    with pytest.raises(ForgepackError, match="ANTHROPIC_API_KEY"):
        pipeline.build(r, Workspace(tmp_path / "ws"))
