"""Serving envelopes: capture visits the envelope's corners and odd interior sizes (a real generate() at
each for phase generate), folds the variants into families whose ranges span the envelope, and the
profile weights each family by its time over the envelope; fixed-shape recipes are exactly as before."""

import dataclasses
import itertools
from pathlib import Path

import pytest

from forgepack import capture, families, fusion, models, profile, recipe
from forgepack.devices import facts
from forgepack.workspace import Workspace

TINY = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128}


def _recipe(**workload) -> recipe.Recipe:
    return recipe.from_dict({"name": "tiny-env", "model": {"arch": "LlamaForCausalLM", "config": TINY},
                             "workload": workload, "target": {"device": "cpu"}})


@pytest.mark.parametrize("workload", [
    {"phase": "generate", "batch": {"min": 1, "max": 4}, "seq_len": {"min": 8, "max": 64}},
    {"batch": {"min": 1, "max": 8}, "seq_len": {"min": 16, "max": 2048}},
    {"batch": {"min": 2, "max": 3}, "seq_len": {"min": 2, "max": 3}},
    {"phase": "decode", "batch": {"min": 1, "max": 4}, "seq_len": 1, "cache_len": {"min": 16, "max": 512}},
    {"task": "image-classification", "batch": {"min": 1, "max": 8}},
    {"phase": "generate", "batch": 1, "seq_len": {"min": 4, "max": 9}},
])
def test_envelope_points_visit_every_corner_and_keep_dims_apart(workload):
    w = _recipe(**workload).workload
    points = models.envelope_points(w)
    ranged = [k for k in recipe.RANGE_FIELDS if isinstance(getattr(w, k), recipe.Range)]
    for corner in itertools.product(*[(getattr(w, k).min, getattr(w, k).max) for k in ranged]):
        assert any(all(p[k] == v for k, v in zip(ranged, corner, strict=True)) for p in points)
    for p in points:
        assert all(recipe.low(getattr(w, k)) <= p[k] <= recipe.high(getattr(w, k)) for k in ranged)
    vectors = [tuple(p[k] for p in points) for k in ranged]
    if {"batch", "seq_len"} <= set(ranged):
        vectors.append(tuple(p["batch"] * p["seq_len"] for p in points))
    assert len(set(vectors)) == len(vectors)  # else fold would merge two dims the envelope varies apart
    if len(ranged) == 2 and all(getattr(w, k).max - getattr(w, k).min > 3 for k in ranged):
        assert len(points) >= 6  # four corners and interior odd sizes


def test_generate_cache_max_adds_points_that_reach_it():
    w = _recipe(phase="generate", batch={"min": 1, "max": 2}, seq_len={"min": 4, "max": 8},
                cache_len={"max": 40}, new_tokens=3).workload
    assert {(p["batch"], p["seq_len"]) for p in models.envelope_points(w)} >= {(1, 37), (2, 37)}


@pytest.fixture(scope="module")
def generate_capture():
    r = _recipe(phase="generate", batch={"min": 1, "max": 3}, seq_len={"min": 4, "max": 16}, new_tokens=3)
    with models.quiet_transformers():
        lm = models.load(r)
        return lm, profile.capture_envelope(lm, lambda *_: None)


def test_generate_capture_folds_into_families_spanning_the_envelope(generate_capture):
    lm, cap = generate_capture
    assert lm.inputs["input_ids"].shape == (3, 16) and len(lm.points) >= 6
    fams = [c for c in cap.cards if c.family is not None]
    assert sum(c.calls for c in fams) > 0.6 * cap.total_calls
    sdpa = [c for c in fams if c.op == "aten._scaled_dot_product_flash_attention_for_cpu.default"]
    spans = sorted(tuple((d.min, d.max) for d in c.family.dims) for c in sdpa)
    # prefill: batch 1..3, prompt 4..16; decode steps: one query against 5..18 cached tokens (prompt + 2)
    assert spans == [((1, 3), (4, 16)), ((1, 3), (5, 18))]
    mm = max((c for c in fams if c.op == "aten.mm.default"), key=lambda c: c.calls)
    rows = mm.family.dims[0]
    assert (rows.min, rows.max) == (1, 48)  # a decode step at batch 1 .. batch 3 x prompt 16
    kept = [c for c in fams if cap.samples[c.id]]
    assert len(kept) > len(fams) / 2  # the representative member's samples, under the family's id
    for card in kept:
        spans = [None if t is None else t.span() for t in card.tensor_inputs()]  # samples are storage windows
        for inputs, _ in cap.samples[card.id]:
            assert [None if t is None else t.numel() for t in inputs] == spans


def _envelope_fusion():
    """(recipe, loaded model, per-point captures, fusion result) of a tiny generate envelope."""
    r = _recipe(phase="generate", batch={"min": 1, "max": 3}, seq_len={"min": 4, "max": 16}, new_tokens=3)
    per_point: list = []
    with models.quiet_transformers():
        lm = models.load(r)
        profile.capture_envelope(lm, lambda *_: None, per_point)
        result = fusion.build_points(lm.model, per_point, lm.device, None, [])
    return r, lm, per_point, result


def test_fusion_chains_fold_into_families_over_the_capture_points():
    """Chains come from one shape's dataflow: an envelope build finds them at each capture point, then
    folds the same chain at different sizes into a family (`families.fold`). RMSNorm, the gated
    activation, the rotary embedding and the rotary tables become one family each, over decode steps and
    prefills alike (batch x tokens), their calls every forward's."""
    r, lm, per_point, result = _envelope_fusion()
    assert len(per_point) == len(lm.points) and not result.dropped
    hidden = lm.model.config.hidden_size
    layers = lm.model.config.num_hidden_layers
    batches = sorted({dict(p.sizes)["batch"] for p in lm.points})
    prompts = sorted({dict(p.sizes)["seq_len"] for p in lm.points})
    spans = [(min(batches), max(batches)), (1, max(prompts))]
    (norm,) = [c for c in result.cards if c.fusion.pattern == "rmsnorm"]
    assert norm.family is not None
    assert [(d.min, d.max) for d in norm.family.dims] == spans
    assert norm.family.inputs[0].shape == ("d0", "d1", hidden)
    # every norm of every forward of every point: the prefill and each decode step
    assert norm.calls == len(lm.points) * (2 * layers + 1) * r.workload.new_tokens
    points = norm.family.points
    assert len(points) == len(norm.family.point_calls) == len({(p[0][1], p[1][1]) for p in points})
    (act,) = [c for c in result.cards if c.fusion.pattern == "gated_act"]
    assert act.family is not None and act.family.inputs[0].shape[-1] == lm.model.config.intermediate_size
    # the rotary and its tables vary the tokens, an inner axis: fused.indexed reads them at run time
    (rotary,) = [c for c in result.cards if c.fusion.pattern == "rotary"]
    assert [(d.min, d.max) for d in rotary.family.dims] == spans
    assert rotary.calls == len(lm.points) * layers * r.workload.new_tokens
    (tables,) = [c for c in result.cards if c.fusion.pattern == "chain"]
    assert [(d.min, d.max) for d in tables.family.dims] == spans
    assert tables.calls == len(lm.points) * r.workload.new_tokens  # one per forward
    assert all(result.samples[c.id] for c in result.cards)


def test_a_chain_no_template_serves_as_a_family_keeps_its_decode_steps_and_leaves_prefills_out(monkeypatch):
    """Where no template renders a family size-generic (here the indexed render's inner-axis path turned
    off), the decode steps' members may still fold into one that is (the rotary over the batch, the
    batch-1 member's kernel per batch index); else each stays exact, one card per decode batch (a
    prefill's would serve only its own prompt length and is left out), its calls summed over the points
    that share it."""
    from forgepack.templates import fused

    monkeypatch.setattr(fused, "_sized", lambda card: "the inner-axis render is off in this test")
    r, lm, _, result = _envelope_fusion()
    layers = lm.model.config.num_hidden_layers
    batches = sorted({dict(p.sizes)["batch"] for p in lm.points})
    (rotary,) = [c for c in result.cards if c.fusion.pattern == "rotary"]
    assert [(d.min, d.max) for d in rotary.family.dims] == [(min(batches), max(batches))]
    assert rotary.tensor_inputs()[0].shape[2] == 1
    assert rotary.calls == len(lm.points) * layers * (r.workload.new_tokens - 1)
    # the rotary tables' chain reads a [head_dim / 2] input with no batch axis: exact per batch
    tables = [c for c in result.cards if c.fusion.pattern == "chain"]
    assert tables and all(c.family is None and c.tensor_inputs()[0].shape[1] == 1 for c in tables)
    assert sorted(c.tensor_inputs()[0].shape[0] for c in tables) == batches
    shared = next(c for c in tables if c.tensor_inputs()[0].shape[0] == 1)  # batch 1: several prompt lengths
    points_at_1 = sum(1 for p in lm.points if dict(p.sizes)["batch"] == 1)
    assert points_at_1 > 1 and shared.calls == points_at_1 * (r.workload.new_tokens - 1)  # one per decode step


def test_family_profile_is_weighted_over_the_envelope(generate_capture, monkeypatch):
    lm, cap = generate_capture
    mm = max((c for c in cap.cards if c.family and c.op == "aten.mm.default"), key=lambda c: len(c.family.points))
    monkeypatch.setattr(profile, "MAX_TIMED_POINTS", 2)
    f = facts(lm.device)
    card = profile.measure_family(mm, cap.samples, lm.device, f)
    weights, calls = card.family.point_weights, card.family.point_calls
    assert len(weights) == len(card.family.points) and sum(weights) == pytest.approx(1.0)
    p = card.profile
    assert p.total_us == pytest.approx(p.eager_us * card.calls) and p.total_us > 0
    members = families.members_at_points(card)
    per_call = [w * p.total_us / n for w, n in zip(weights, calls, strict=True)]  # each point's time per call
    # untimed points are scaled by bytes: time per byte equal to a timed point's
    rates = sorted(t / profile.roofline.roofline(m, f).bytes for t, m in zip(per_call, members, strict=True))
    # distinct up to float rounding: neighbours within 1e-6 of each other are one rate (rounding to a fixed
    # number of digits split one rate in two when it sat on a digit's boundary)
    distinct = 1 + sum(1 for a, b in itertools.pairwise(rates) if b > a * (1 + 1e-6))
    assert distinct <= 3
    single = mm.with_profile(profile.measure_card(mm, cap.samples[mm.id], lm.device, f))
    shares = profile._with_shares([card, single])  # the allocator's share: the family's envelope total
    assert shares[0].profile.share == pytest.approx(p.total_us / (p.total_us + single.profile.total_us))


def test_fixed_shape_recipe_takes_todays_path_and_produces_todays_cards(tmp_path: Path):
    r = _recipe(batch=2, seq_len=8)
    assert not r.workload.is_envelope
    with models.quiet_transformers():
        lm = models.load(r)
        assert lm.points == [] and lm.inputs["input_ids"].shape == (2, 8)
        today = capture.capture(lm.model, lm.forward, keep_samples=False).cards
        lm.reset()
        _, cards = profile.run_profile(r, Workspace(tmp_path / "ws"), loaded=lm)
    ops = [c for c in cards if c.kind == "op"]
    assert all(c.family is None for c in cards)
    assert [(c.id, c.calls) for c in ops] == [(c.id, c.calls) for c in today]


def test_merge_sums_calls_of_a_variant_seen_at_several_points():
    r = _recipe(batch={"min": 1, "max": 2}, seq_len=4)
    with models.quiet_transformers():
        lm = models.load(r)
        caps = [capture.capture(lm.model, p.prepare()) for p in lm.points]
    merged = capture.merge([caps[0], caps[0], caps[1]])
    counts = {c.id: c.calls for c in merged.cards}
    for c in caps[0].cards:
        assert counts[c.id] >= 2 * c.calls
    assert merged.total_calls == 2 * caps[0].total_calls + caps[1].total_calls
    assert all(len(s) <= 2 for s in merged.samples.values())
    assert dataclasses.replace(merged.cards[0]).calls == merged.cards[0].calls


def test_family_signature_names_dims_and_ranges_and_inspect_shows_them(generate_capture):
    import io

    from rich.console import Console

    from forgepack.cli import inspect as inspect_cmd
    from forgepack.pack import manifest as manifest_mod

    _, cap = generate_capture
    sdpa = next(c for c in cap.cards if c.family and c.op.startswith("aten._scaled_dot_product")
                and c.family.dims[1].min == 4)
    sig = sdpa.signature()
    assert sig.startswith("f32[d0,4,d1,8]:(32*d1,8,32,1), f32[d0,2,d1,8], f32[d0,2,d1,8]")
    assert sig.endswith("| d0 in 1..3, d1 in 4..16")
    plain = dataclasses.replace(sdpa, family=None).signature()
    assert "d0" not in plain and plain.startswith("f32[")  # concrete cards: today's form
    variant = manifest_mod.PackVariant(
        id=sdpa.id, op=sdpa.op, schema=sdpa.schema, signature=sig, args=sdpa.args, outputs=sdpa.outputs,
        kernel="k.so", source="k.cpp", tolerance=(), speedup=1.5, ci_low=1.4, ci_high=1.6, eager_us=2.0,
        kernel_us=1.3, proposer="templates:x", calls=sdpa.calls)
    m = manifest_mod.Manifest(
        name="p", slug="p", version="0", target="cpu", arch=None, torch="2", cuda=None, cxx11_abi=True,
        platform="linux", python="3.12", namespace="ns", shim="s.so", shim_source="s.cpp", model={},
        workload=dataclasses.asdict(_recipe(phase="generate", batch={"min": 1, "max": 3},
                                            seq_len={"min": 4, "max": 16}).workload),
        gate="passed", variants=(variant,))
    m = manifest_mod.loads(manifest_mod.dumps(m))
    text = io.StringIO()
    console = Console(file=text, width=300)
    console.print(inspect_cmd.overview(m))
    console.print(inspect_cmd.variants_table(m))
    shown = text.getvalue()
    assert "batch 1-3, seq 4-16" in shown and "generate" in shown
    assert "d0 in 1..3, d1 in 4..16" in shown


def test_report_profile_table_shows_families_with_ranges_and_envelope_figures(generate_capture, tmp_path):
    from forgepack import report

    lm, cap = generate_capture
    mm = max((c for c in cap.cards if c.family and c.op == "aten.mm.default"), key=lambda c: c.calls)
    card = profile.measure_family(mm, cap.samples, lm.device, facts(lm.device))
    data = report.ReportData(root=tmp_path, recipe=None, profile=None, cards=(card,), store=None, accepted=(),
                             pack=None, bench=None)
    html = str(report.section_profile(data, None))
    assert families.describe(card) in html and card.id in html
    assert f"{card.profile.eager_us:.1f}" in html or report._us(card.profile.eager_us) in html
