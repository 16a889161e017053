"""Without a key the search searches: at budget 16 on tiny-llama (cpu, the templates proposer) the trees
leave their roots, several cards have more than one point of their template's space evaluated, and an
accepted kernel is refined rather than its card dropped as if at its ceiling (a 1 us launch floor on the
cpu put cat's headroom at 3.2x under the 5.5x its first kernel reached)."""

from __future__ import annotations

import json

import pytest

from forgepack import pipeline
from forgepack import recipe as recipe_mod
from forgepack.search.store import Store
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
    return result, candidates


def test_the_templates_search_refines_under_its_budget(searched):
    result, candidates = searched
    assert result.calls == 16 and result.stopped.startswith("budget spent")
    points: dict[str, set[str]] = {}
    for c in candidates:
        points.setdefault(c.card_id, set()).add(json.dumps(c.params, sort_keys=True))
    assert sum(1 for p in points.values() if len(p) > 1) >= 2, points
    by_id = {c.id: c for c in candidates}
    refined = [c for c in candidates if c.parent_id is not None]
    assert refined, "the trees never left their roots"
    assert any(by_id[c.parent_id].accepted for c in refined), "no accepted kernel was refined"
    kept = {k.card_id: k.candidate_id for k in result.accepted}
    for card_id, candidate_id in kept.items():  # the kept kernel is one of the card's evaluated points
        assert by_id[candidate_id].card_id == card_id and by_id[candidate_id].accepted
