"""A family kernel kept for the sub-range where it pays (issue 20), and its guard carrying that sub-range.

`familyeval.sub_range` picks, from per-point verdicts, the box along the family's free dims with the
most eager time gained at winning points and no losing one; the narrowed verdict records it
(`diagnostics["family"]["served"]`), the search's accepted record carries it, the pack builder narrows
the card (`families.narrow`), and the generated C++ guard admits only the sub-range: a call inside the
verified range but outside the sub-range runs stock and is counted as `outside` in `stats()`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import random
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from test_familyeval import _timed
from test_pack_family import run_staged, stage_family_pack
from test_shim_families import family_card, mul_inputs

from forgepack import accepted, cards, families, familyeval, report
from forgepack import recipe as recipe_mod
from forgepack.capture import card_from_call
from forgepack.cards import Dim, Family, TensorMeta
from forgepack.cli.inspect import read_manifest, variants_table
from forgepack.evaluate import Verdict
from forgepack.familyeval import PointFigure, sub_range
from forgepack.pack import builder
from forgepack.pack import manifest as manifest_mod
from forgepack.search.run import verdict_row
from forgepack.search.store import Store
from forgepack.workspace import Workspace

TESTS = Path(__file__).resolve().parent
PACKAGE = "forgepack_pack_tiny_llama"
SEQ = Family(dims=(Dim("d0", 1, 8), Dim("d1", 16, 2048)), inputs=(), outputs=())


def _fig(b, s, speedup, weight=0.25):
    return PointFigure({"d0": b, "d1": s}, weight, speedup, speedup * 0.97, speedup * 1.03)


# --- the choice --------------------------------------------------------------------------------------------


def test_a_kernel_that_wins_at_long_sequences_only_is_kept_for_the_long_ones():
    figs = [_fig(1, 16, 0.7), _fig(8, 64, 0.9), _fig(1, 512, 1.4), _fig(8, 2048, 2.0)]
    assert sub_range(SEQ, figs, 0.05) == (("d0", 1, 8), ("d1", 512, 2048))


def test_a_loser_between_two_winners_keeps_the_side_that_gains_more_and_never_the_loser():
    def figs(left, right):
        return [_fig(4, 16, left, 0.3), _fig(4, 256, 0.8, 0.3), _fig(4, 2048, right, 0.4)]

    assert sub_range(SEQ, figs(3.0, 1.2), 0.05) == (("d0", 1, 8), ("d1", 16, 16))  # 0.3 x 2/3 > 0.4 x 1/6
    assert sub_range(SEQ, figs(1.2, 3.0), 0.05) == (("d0", 1, 8), ("d1", 2048, 2048))
    # a point merely inside the margin (1.03x) is no loser, but the side beyond the loser saves more
    assert sub_range(SEQ, figs(1.03, 3.0), 0.05) == (("d0", 1, 8), ("d1", 2048, 2048))


def test_a_point_short_of_the_margin_but_not_slower_stays_with_the_kernel():
    """1.03x at short sequences is under the margin, yet faster than stock: giving it to stock would give
    away nothing but time (an envelope build's 3.91x rsqrt family was once kept for a sub-range at 3.68x)."""
    figs = [_fig(1, 16, 1.03, 0.3), _fig(8, 2048, 3.0, 0.7)]
    assert sub_range(SEQ, figs, 0.05) == (("d0", 1, 8), ("d1", 16, 2048))
    # within the noise of stock (0.99x, its interval holding 1): neither slower nor faster, so it stays with
    # the kernel (an H200 build once cut the residual add to batch 1-3 over a 0.968x [0.961, 1.000] point)
    figs = [_fig(1, 16, 0.99, 0.3), _fig(8, 2048, 3.0, 0.7)]
    assert sub_range(SEQ, figs, 0.05) == (("d0", 1, 8), ("d1", 16, 2048))
    # a little slower beyond the noise (0.97x, interval 0.94-0.999): a loser, stock takes it
    figs = [PointFigure({"d0": 1, "d1": 16}, 0.3, 0.97, 0.94, 0.999), _fig(8, 2048, 3.0, 0.7)]
    assert sub_range(SEQ, figs, 0.05) == (("d0", 1, 8), ("d1", 2048, 2048))


def test_no_winner_gives_no_sub_range():
    assert sub_range(SEQ, [_fig(1, 16, 0.7), _fig(8, 2048, 1.02)], 0.05) is None


def test_the_box_never_holds_a_loser_and_stays_inside_the_verified_range():
    rng = random.Random(7)
    for _ in range(200):
        figs = [_fig(rng.randint(1, 8), rng.choice((16, 17, 100, 512, 2047, 2048)), rng.choice((0.6, 0.99, 1.5, 3.0)),
                     rng.random()) for _ in range(6)]
        box = sub_range(SEQ, figs, 0.05)
        won = [f for f in figs if f.wins(0.05)]
        lost = [f for f in figs if f.loses()]
        if box is None:  # no winner, or every winner's point a loser's too
            assert all(any(f.values == g.values for g in lost) for f in won)
            continue
        assert all(d.min <= lo <= hi <= d.max for d, (_, lo, hi) in zip(SEQ.dims, box, strict=True))
        inside = [f for f in figs if familyeval.in_box(box, f.values)]
        assert any(f.wins(0.05) for f in inside) and not any(f.loses() for f in inside)
        # no single winner's own point-box gains more than the chosen one
        best = sum(f.gain() for f in inside)
        for w in won:
            alone = tuple((n, w.values[n], w.values[n]) for n in ("d0", "d1"))
            if not any(familyeval.in_box(alone, f.values) for f in lost):
                assert best >= sum(f.gain() for f in figs if familyeval.in_box(alone, f.values)) - 1e-12


# --- the verdict ---------------------------------------------------------------------------------------------


def _fold(card, speeds):
    points = [dict(p) for p in card.family.points]
    verdicts = [(p, _timed(s, 10.0)) for p, s in zip(points, speeds, strict=True)]
    return familyeval._folded(card, verdicts, points, margin=0.05, bench=True, skipped=[])


def test_a_family_that_loses_at_short_sequences_is_narrowed_and_stock_takes_the_rest():
    card = family_card()  # points (d0, d1) = (2, 3), (4, 5), (1, 7), (3, 2); d0 in 1..4, d1 in 2..7
    verdict = _fold(card, [0.6, 2.0, 3.0, 0.8])
    fam = verdict.diagnostics["family"]
    assert verdict.accepted, verdict.reason
    assert fam["served"] == [["d1", 5, 7]] and "kept for d1 in 5..7" in verdict.reason
    w = [p["weight"] for p in fam["points"]]
    assert fam["served_share"] == pytest.approx(w[1] + w[2])
    assert verdict.speedup == pytest.approx(1 / (w[0] + w[1] / 2.0 + w[2] / 3.0 + w[3]))  # outside at 1.0x
    whole = 1 / (w[0] / 0.6 + w[1] / 2.0 + w[2] / 3.0 + w[3] / 0.8)
    assert verdict.speedup > whole


def test_wins_everywhere_is_not_narrowed_and_loses_everywhere_is_rejected():
    card = family_card()
    everywhere = _fold(card, [1.5, 2.0, 3.0, 1.3])
    assert everywhere.accepted and "served" not in everywhere.diagnostics["family"]
    nowhere = _fold(card, [0.6, 0.9, 0.8, 1.01])
    assert not nowhere.accepted and nowhere.category == "slower"
    assert "served" not in nowhere.diagnostics["family"]
    short = _fold(card, [1.03, 2.0, 3.0, 1.02])  # short of the margin at two points, slower nowhere
    assert short.accepted and "served" not in short.diagnostics["family"]


def test_a_sub_range_too_small_to_pay_over_the_envelope_is_rejected():
    card = family_card()
    weighted = dataclasses.replace(card, family=dataclasses.replace(card.family, point_weights=(0.49, 0.02, 0, 0.49)))
    verdict = _fold(weighted, [0.6, 2.0, 3.0, 0.8])
    assert not verdict.accepted and verdict.category == "slower" and "even kept for d1 in 5..7" in verdict.reason


# --- the data between stages -----------------------------------------------------------------------------------


def test_the_sub_range_round_trips_through_verdict_record_card_and_manifest(tmp_path):
    card = family_card()
    verdict = _fold(card, [0.6, 2.0, 3.0, 0.8])
    stored = json.loads(json.dumps(verdict.to_json()))  # as the store keeps it
    assert accepted.served_of(stored) == (("d1", 5, 7),)
    assert accepted.served_of(Verdict(True, None, "ok").to_json()) == ()
    rec = dataclasses.replace(accepted.AcceptedKernel("x", "cpu", None, "s", "b", "h", 1.2, 1.1, 1.3, 2, 1, "manual"),
                              card_id=card.id, served=accepted.served_of(stored))
    accepted.save_all(tmp_path, [rec])
    assert accepted.load_all(tmp_path) == [rec]
    narrowed = families.narrow(card, rec.served)
    assert narrowed.id == card.id and narrowed.family.served == (("d1", 5, 7),)  # still the family's card
    assert cards.from_json(json.loads(json.dumps(cards.to_json(narrowed)))) == narrowed
    assert "served" not in cards.to_json(card)["family"]  # whole-range cards keep their JSON
    assert "served d1 in 5..7" in narrowed.signature() and families.describe(narrowed).endswith("served d1 in 5..7")


def test_narrow_refuses_a_sub_range_outside_the_verified_range():
    card = family_card()
    for bad in ((("d1", 1, 7),), (("d1", 5, 8),), (("d9", 1, 2),), (("d1", 6, 5),)):
        with pytest.raises(ValueError):
            families.narrow(card, bad)
    rec = accepted.AcceptedKernel(card.id, "cpu", None, "s", "b", "h", 1.2, 1.1, 1.3, 2, 1, "manual",
                                  served=(("d1", 5, 9),))
    kept, reason = builder._served(card, rec)
    assert kept == card and "not inside its verified range 2..7" in reason


def _metas(b, s):
    return [TensorMeta(str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()), t.storage_offset())
            for t in mul_inputs(b, s)]


def test_the_python_twin_admits_only_the_sub_range():
    card = families.narrow(family_card(), (("d1", 5, 7),))
    assert families.bind(card, _metas(2, 6)) == {"d0": 2, "d1": 6}
    assert families.bind(card, _metas(2, 3)) is None
    assert families.bind(family_card(), _metas(2, 3)) == {"d0": 2, "d1": 3}


# --- the compiled guard --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    return stage_family_pack(tmp_path_factory.mktemp("subpack"), served=(("d1", 5, 7),))


CALLS = r"""
import json, sys
import torch
sys.path.insert(0, TESTS)
from test_shim_families import mul_inputs
import forgepack_pack_tiny_llama as pack
pack.activate(strict=True)
out = {}
for b, s in ((2, 6), (4, 5), (2, 3), (5, 6)):  # inside the sub-range twice, outside it, outside the family
    a, t = mul_inputs(b, s)
    got = torch.mul(a, t)
    pack.deactivate()
    same = torch.equal(got, torch.mul(a, t))
    pack.activate(strict=True)
    out[f"{b}x{s}"] = same
print(json.dumps({"same": out, "stats": pack.stats()}))
"""


def test_the_compiled_guard_serves_the_sub_range_and_sends_the_rest_to_stock(staged, tmp_path):
    stage, manifest, fam = staged
    (variant,) = manifest.variants
    assert variant.id == fam.id and variant.served == "d1 in 5..7 of 2..7"
    assert read_manifest(stage / PACKAGE) == manifest
    shim = (stage / PACKAGE / "sources" / "shim.cpp").read_text()
    assert "v0_ranges[] = {{1, 4}, {5, 7}};" in shim and "v0_verified[] = {{1, 4}, {2, 7}};" in shim
    result = run_staged(stage, CALLS, tmp_path)
    assert all(result["same"].values()), result
    assert result["stats"] == {fam.id: {"op": "aten.mul.Tensor", "hits": 2, "misses": 2, "errors": 0, "outside": 1,
                                        "served": "d1 in 5..7 of 2..7"}}
    text = io.StringIO()
    Console(file=text, width=250).print(variants_table(manifest))
    assert "served d1 in 5..7" in text.getvalue()
    assert manifest_mod.loads(manifest_mod.dumps(manifest)) == manifest


def test_the_report_says_where_a_kernel_was_kept_for_a_sub_range(tmp_path):
    ws = Workspace(tmp_path / "ws").create()
    ws.save_recipe(recipe_mod.resolve("tiny-llama"))
    card = family_card()
    verdict = _fold(card, [0.6, 2.0, 3.0, 0.8])
    with Store(ws.store_path) as store:  # the verdict as the search records it, read back as the report does
        _, cand = store.record_call(card_id=card.id, parent_id=None, proposer="manual", reason="test",
                                    source_hash="h", source_path="s.cpp", params={})
        best = store.record_verdict(cand.id, verdict_row(verdict, 0.05, "k.so"))
    assert accepted.served_of(best.verdict) == (("d1", 5, 7),)
    row = report.CardSearch(card.id, card, (), (best,), best, best, None, None)
    text = str(report.section_results(report.gather(ws.root), [row], None))
    assert "kept for d1 in 5..7; stock serves the rest of the range" in text
    assert report.served_note(dataclasses.replace(best, verdict=Verdict(True, None, "ok").to_json())) == ""
    # and the envelope benchmark's summary of the build (tools/bench_envelope.py)
    accepted.save_all(ws.root, [accepted.AcceptedKernel(card.id, "cpu", None, "s.cpp", "k.so", "h", verdict.speedup,
                                                        verdict.ci_low, verdict.ci_high, 10.0, 5.0, "manual",
                                                        candidate_id=best.id, served=(("d1", 5, 7),))])
    sys.path.insert(0, str(TESTS.parent / "tools"))
    try:
        import bench_envelope
    finally:
        sys.path.remove(str(TESTS.parent / "tools"))
    (kernel,) = bench_envelope.family_kernels(ws.root)
    assert kernel["served"] == "d1 in 5..7" and kernel["speedup"] > kernel["whole_speedup"]
    assert [p["speedup"] for p in kernel["points"]] == [0.6, 2.0, 3.0, 0.8]
    assert "| d1 in 5..7 |" in bench_envelope.families_md([kernel])


def test_untimed_points_count_where_the_guard_puts_them_not_where_their_timed_neighbour_is():
    """Past MAX_TIMED_POINTS a timed point stands for its untimed neighbours by bytes; narrowed, each
    captured point's weight is inside or outside by its own sizes (the guard's view), not its stand-in's."""
    cat = torch.ops.aten.cat.default
    calls = [card_from_call(cat, ([torch.randn(b, 2, n, 8), torch.randn(b, 2, 1, 8)], -2), {})[0]
             for b in (1, 2, 4) for n in (8, 9, 29, 64)]
    (card,) = families.fold(calls)
    card = dataclasses.replace(card, family=dataclasses.replace(card.family, point_weights=(1.0,) * 12))
    timed = familyeval.timed_points(card)
    past = next(d.name for d in families.free_dims(card.family) if {p[d.name] for p in timed} >= {8, 64})
    speeds = [3.0 if p[past] >= 29 else 0.8 for p in timed]
    verdict = familyeval._folded(card, [(p, _timed(s, 10.0)) for p, s in zip(timed, speeds, strict=True)], timed,
                                 margin=0.05, bench=True, skipped=[])
    served = dict((n, (lo, hi)) for n, lo, hi in verdict.diagnostics["family"]["served"])
    lo, hi = served[past]
    inside = [p for p in card.family.points if lo <= dict(p)[past] <= hi]
    assert lo >= 29 and verdict.diagnostics["family"]["served_share"] == pytest.approx(len(inside) / 12)
    share = len(inside) / 12
    assert verdict.speedup <= 1 / (share / 3.0 + (1 - share)) + 1e-9


def test_a_call_a_later_variant_serves_is_not_counted_outside_the_first_ones_sub_range():
    """`outside` counts the calls stock serves because a kernel does not pay there: a call outside the
    first variant's sub-range that the next variant serves is that variant's hit, not also an `outside`
    (the count waits until every variant has missed)."""
    from forgepack.pack import shimgen

    narrowed = families.narrow(family_card(), (("d1", 5, 7),))
    whole = family_card()
    code = shimgen.generate([shimgen.ShimVariant(narrowed, "a.so"), shimgen.ShimVariant(whole, "b.so")],
                            "forgepack_x", "cpu")
    body = code[code.index("override_0("):]
    counted = body.index("fpg::count(variants[0].outside)")
    assert body.index("outside0 = ") < body.index("// variant 1:") < counted < body.index("fpg::call_original")
    assert "variants[1].outside" not in code
