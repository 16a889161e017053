"""Without a key the search searches: at budget 16 on tiny-llama (cpu, the templates proposer) the trees
leave their roots, several cards have more than one point of their template's space evaluated, an
accepted kernel is refined rather than its card dropped as if at its ceiling (a 1 us launch floor on the
cpu put cat's headroom at 3.2x under the 5.5x its first kernel reached; an add's 3.3x kernel, past its
1.15x roofline, was dropped the same way), and a kept kernel is not its template's default point.

The cpu spaces hold points that are faster by construction, one step from the defaults the search
starts from: the rotary's nested walk (no index math per element, each half of rotate_half a loop the
compiler vectorises), the cos/sin tables' merged walk (one sincosf an element instead of a sinf and a
cosf), RMSNorm's split accumulators (independent chains of double adds instead of one serial chain).
A kept kernel counts only if it is faster than its template's default point when the two are timed
side by side here, interleaved on the same inputs: a kernel kept on a lucky measurement, its
interval above the default's by chance, does not make the test pass.
"""

from __future__ import annotations

import json

import pytest
import torch

from forgepack import pipeline, samples, timing, verify
from forgepack import recipe as recipe_mod
from forgepack.compile import compile_kernel
from forgepack.search.store import Store
from forgepack.templates import by_name
from forgepack.workspace import Workspace


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    root = tmp_path_factory.mktemp("searched")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGEPACK_CACHE", str(root / "cache"))
        recipe = recipe_mod.resolve("tiny-llama").replace(target={"device": "cpu"}, build={"budget": 16})
        ws = Workspace(root / "ws")
        profiled = pipeline.profile(recipe, ws)
        facts = pipeline.target_facts(recipe, profiled.profile)
        result = pipeline.search(recipe, ws, profiled, facts)
        with Store(ws.store_path) as store:
            candidates = store.candidates()
    return result, candidates, {c.id: c for c in profiled.cards}


def _side_by_side(card, template, default: dict, kept: dict) -> timing.Comparison:
    """The default point's kernel (A) against the kept one's (B), called alone on the same inputs, in
    alternating order: what the machine does meanwhile slows both alike."""
    device = torch.device("cpu")
    inputs = [None if m is None else verify.placed_input(m, t, device).view
              for m, t in zip(card.tensor_inputs(), samples.fresh_inputs(card, 0, device), strict=True)]
    calls = []
    for params in (default, kept):
        compiled = compile_kernel(template.render(card, "cpu", params), "cpu")
        assert compiled.ok, compiled.log
        outputs = [verify.guarded(m, device).view for m in card.outputs]
        calls.append(verify.KernelCall(verify.load_kernel(compiled.binary), inputs, outputs, card.scalars(), None))
    return timing.compare(calls[0], calls[1], device, reps=400, warmup=20)


def test_the_templates_search_refines_under_its_budget(searched):
    result, candidates, cards = searched
    assert result.calls == 16 and result.stopped.startswith("budget spent"), result.stopped
    points: dict[str, set[str]] = {}
    for c in candidates:
        points.setdefault(c.card_id, set()).add(json.dumps(c.params, sort_keys=True))
    assert sum(1 for p in points.values() if len(p) > 1) >= 2, points
    by_id = {c.id: c for c in candidates}
    refined = [c for c in candidates if c.parent_id is not None]
    assert refined, "the trees never left their roots"
    # a card whose kernel was accepted gets more calls (a child of it, or another first point of its
    # space: best-of-k starts several roots), rather than being dropped as if at its ceiling
    first_accepted: dict[str, int] = {}
    for c in sorted(candidates, key=lambda c: c.id):
        if c.accepted:
            first_accepted.setdefault(c.card_id, c.id)
    assert any(c.card_id in first_accepted and c.id > first_accepted[c.card_id] for c in candidates), \
        "no card with an accepted kernel got another call"
    kept = {k.card_id: by_id[k.candidate_id] for k in result.accepted}
    for card_id, cand in kept.items():  # the kept kernel is one of the card's evaluated points
        assert cand.card_id == card_id and cand.accepted
    moved = {cid: cand for cid, cand in kept.items()
             if cand.params["params"] != by_name(cand.params["template"]).default(cards[cid], "cpu")}
    assert moved, "every kept kernel is its template's default point"
    timed = {}
    for cid, cand in moved.items():
        template = by_name(cand.params["template"])
        timed[cid] = _side_by_side(cards[cid], template, template.default(cards[cid], "cpu"), cand.params["params"])
        if timed[cid].ci_low > 1.0:
            return
    pytest.fail("no kept kernel off its template's default point is faster than the default side by side: "
                + "; ".join(f"{cid} {moved[cid].params}: {c.speedup:.3f}x ({c.ci_low:.3f}-{c.ci_high:.3f})"
                            for cid, c in timed.items()))
