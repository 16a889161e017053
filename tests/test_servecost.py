"""A CPU fusion kernel is judged as the model serves it: through its patch site (`forgepack.servecost`).

The probe serves calls through the real `ModulePatches` code and the real generated `fused` op, for
every site kind the tiny Llama and ResNet have; the benchmark adds the measured cost to every timed
kernel call, so the verdict's kernel time, speed-up and interval (and the accept rule) include it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forgepack import cards, fusion, models, outcomes, recipe, servecost, timing, verify
from forgepack import samples as samples_mod
from forgepack.capture import capture
from forgepack.compile import compile_kernel
from forgepack.evaluate import Evaluator, _bench_verdict
from forgepack.runtime import modules as rt
from forgepack.templates import fused


def _fusion_cards(name: str) -> fusion.Checked:
    r = recipe.resolve(name)
    r = dataclasses.replace(r, target=dataclasses.replace(r.target, device="cpu"))
    with models.quiet_transformers():
        lm = models.load(r)
    cap = capture(lm.model, lm.forward, keep_samples=False, functions=fusion.function_sites(lm.model))
    candidates, _ = fusion.find(cap)

    def run():
        out = lm.forward()
        lm.reset()
        return out

    return fusion.check_and_sample(lm.model, run, fusion.group(cap, candidates))


@pytest.fixture(scope="module")
def llama() -> fusion.Checked:
    return _fusion_cards("tiny-llama")


@pytest.fixture(scope="module")
def resnet() -> fusion.Checked:
    return _fusion_cards("tiny-resnet")


def _pattern(found: fusion.Checked, name: str) -> cards.Card:
    return next(c for c in found.cards if c.fusion.pattern == name)


def test_every_site_kind_is_served_by_the_probe_at_a_cost(llama, resnet):
    probe = servecost.probe_library().to_json()
    original = servecost.ProbeModule.forward
    kinds = {}
    for card in [*llama.cards, *resnet.cards]:
        measured = servecost.measure(card, probe, rounds=5, calls=50)  # raises unless every call was served
        for site in measured["sites"]:
            kinds[site["kind"]] = site
    assert set(kinds) == {"module", "function", *rt.GLUE_INPUTS}  # every kind a CPU fusion card can have
    for kind, site in kinds.items():
        # the fused op's boxing from Python alone costs microseconds: a served call is never free
        assert site["us"] > 0.5, (kind, site)
        assert site["served_us"] > site["direct_us"], (kind, site)
    assert servecost.ProbeModule.forward is original  # every probe patch was taken off again


def test_the_cost_applies_to_cpu_fusion_cards_only(llama):
    norm = _pattern(llama, "rmsnorm")
    assert servecost.applies(norm, "cpu")
    assert not servecost.applies(norm, "cuda")  # graph replay: no Python guard runs per call
    op = dataclasses.replace(norm, kind="op", fusion=None, chain=())
    assert not servecost.applies(op, "cpu")


def test_compare_adds_the_serving_cost_to_every_timed_call():
    x = torch.randn(64)
    cmp = timing.compare(lambda: x + 1, lambda: x + 1, "cpu", reps=20, warmup=2, b_added_us=5000.0)
    assert cmp.b_us > 5000.0 and cmp.a_us < 5000.0
    assert cmp.speedup == pytest.approx(cmp.a_us / cmp.b_us)
    assert cmp.ci_high < 1.0  # the interval is taken over the served times, not the kernel's alone


def test_a_kernel_that_loses_once_served_is_rejected(llama):
    gated = _pattern(llama, "gated_act")
    template = next(t for t in fused.TEMPLATES if t.supports(gated, "cpu") is None)
    compiled = compile_kernel(template.render(gated, "cpu", template.default(gated, "cpu")), "cpu")
    fn = verify.load_kernel(compiled.binary)
    timed = verify.bench(gated, fn, None, "cpu", seed=1, reps=20, serving_us=2000.0)
    assert isinstance(timed, outcomes.Timed) and timed.serving_us == 2000.0
    assert timed.kernel_us > 2000.0 and timed.speedup == pytest.approx(timed.eager_us / timed.kernel_us)
    verdict = _bench_verdict(timed, 0.05, {}, {}, 0.0, 0.0)
    assert not verdict.accepted and verdict.category == "slower"
    assert "2000.0 us of it serving through the patch site" in verdict.reason


def test_the_evaluator_counts_the_measured_cost_into_a_fusion_verdict(llama, tmp_path):
    gated = _pattern(llama, "gated_act")
    samples = tmp_path / f"{gated.id}.safetensors"
    gated = dataclasses.replace(gated, samples=samples_mod.save_samples(samples, llama.samples[gated.id]))
    template = next(t for t in fused.TEMPLATES if t.supports(gated, "cpu") is None)
    with Evaluator("cpu", bench_reps=20) as ev:
        verdict = ev.evaluate(gated, template.render(gated, "cpu", template.default(gated, "cpu")),
                              samples_path=samples)
        serving = ev.serving_us(gated)
    assert verdict.category in (None, "slower"), verdict.reason
    assert serving > 0.5
    assert verdict.diagnostics["bench"]["serving_us"] == serving
    assert verdict.kernel_us > serving
    assert verdict.speedup == pytest.approx(verdict.eager_us / verdict.kernel_us)
