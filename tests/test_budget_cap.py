"""The budget's guards, on a real tiny-llama search on the cpu: a cost cap that no call can pass (the
first included), no call to a card the pack could never dispatch, and no call to a card whose kernel the
end-to-end gate dropped. The proposer is an LLM stand-in whose cost per call is known: it writes the
templates' kernels where they serve the card and an empty reply elsewhere, and bills a fixed price."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from forgepack import packreport, pipeline
from forgepack import recipe as recipe_mod
from forgepack.search import run
from forgepack.search.executor import LocalExecutor
from forgepack.search.proposers import NothingToPropose, Proposal, make
from forgepack.workspace import Workspace


class Billed:
    """Any card, like an LLM; `cost` dollars a call, `worst` the bound it states before each call."""

    name = "billed"

    def __init__(self, cost: float, paid: bool = True):
        self.cost, self.paid = cost, paid
        self.inner = make("templates", target="cpu")
        self.asked: list[str] = []

    def unsupported(self, card) -> str | None:
        return None

    def propose(self, card, parent, lineage, feedback, tried=frozenset()) -> Proposal:
        self.asked.append(card.id)
        if self.inner.unsupported(card):
            return Proposal(None, cost=self.cost, feedback="the reply held no kernel", label=self.name)
        try:
            got = self.inner.propose(card, parent, lineage, feedback, tried)
        except NothingToPropose:
            return Proposal(None, cost=self.cost, feedback="the reply repeated a kernel", label=self.name)
        return Proposal(got.source, got.params, cost=self.cost, label=self.name)


class Bounded(Billed):
    def __init__(self, cost: float, worst: float):
        super().__init__(cost)
        self.worst = worst

    def worst_case_cost(self, card, parent, lineage, feedback) -> float:
        return self.worst


class Notes(run.Reporter):
    def __init__(self):
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("profiled")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGEPACK_CACHE", str(root / "cache"))
        ws = Workspace(root / "ws")
        pipeline.profile(recipe_mod.resolve("tiny-llama").replace(target={"device": "cpu"}), ws)
    return ws.root


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGEPACK_CACHE", str(tmp_path_factory.mktemp("cache")))
        with LocalExecutor("cpu", devices=[0], compile_workers=1) as executor:
            yield executor


def search(profiled: Path, root: Path, proposer, executor, reporter=None, report=None, **settings):
    ws = Workspace(root)
    shutil.copytree(profiled, ws.root)
    if report is not None:
        ws.write_json(packreport.FILE, report.to_json())
    found = run.Search(ws, ws.load_cards(), proposer, executor, run.Settings(target="cpu", **settings),
                       reporter=reporter)
    try:
        result = found.run()
        calls = found.store.calls()
        spent = found.store.spend()[2]
        states = {s.card_id: s for s in found.states()}
    finally:
        found.store.close()
    return result, calls, spent, states


def test_a_cost_cap_is_never_passed_the_first_call_included(profiled, local, tmp_path):
    # a $0.01 cap and calls that may cost $0.039: no call at all (an average of none let the first through)
    result, calls, spent, _ = search(profiled, tmp_path / "a", Bounded(0.039, 0.039), local, budget=10,
                                     max_cost=0.01)
    assert calls == [] and spent == 0.0
    assert result.stopped.startswith("cost cap") and "$0.0390" in result.stopped
    # $0.03 a call, $0.039 at worst, a $0.10 cap: three calls ($0.09), as a fourth could reach $0.129
    result, calls, spent, _ = search(profiled, tmp_path / "b", Bounded(0.03, 0.039), local, budget=10,
                                     max_cost=0.10)
    assert len(calls) == 3 and spent == pytest.approx(0.09) and spent <= 0.10
    assert result.stopped.startswith("cost cap")


def test_a_paid_proposer_that_states_no_worst_case_makes_no_call_under_a_cap(profiled, local, tmp_path):
    proposer = Billed(0.001)
    result, calls, _, _ = search(profiled, tmp_path / "a", proposer, local, budget=4, max_cost=5.0)
    assert calls == [] and proposer.asked == []
    assert "states no worst-case cost" in result.stopped
    # without a cap it is free to run
    result, calls, _, _ = search(profiled, tmp_path / "b", Billed(0.001), local, budget=2)
    assert len(calls) == 2


def test_no_call_goes_to_a_card_the_pack_cannot_dispatch(profiled, local, tmp_path):
    """`arange` has no tensor input, so no guard can serve it; an LLM would happily write it a kernel.
    The uniform split takes cards in id order, so it reaches cards past `arange` only by skipping it."""
    proposer = Billed(0.0, paid=False)
    result, calls, _, states = search(profiled, tmp_path / "a", proposer, local, budget=10, strategy="uniform")
    arange = next(cid for cid in states if cid.startswith("arange-"))
    assert "the pack cannot dispatch it" in states[arange].unsupported
    called = [c.card_id for c in calls]
    assert len(called) == 10 and arange not in called and arange not in proposer.asked
    assert any(cid > arange for cid in called)
    row = next(r for r in result.plan if r.card_id == arange)
    assert row.planned == 0 and "no tensor input" in row.dropped


def _gate_report(card_id: str, reason: str, refused: str = "") -> packreport.PackReport:
    dropped = packreport.Decision(card_id, "fusion", "sig", False, "gate", reason, 12.0, 0.99)
    return packreport.PackReport.of("tiny-llama", None, "failed" if refused else "passed", 0.05, {}, [dropped],
                                    refused=refused)


def test_a_card_the_gate_dropped_gets_no_more_calls_and_says_why(profiled, local, tmp_path):
    templates = make("templates", target="cpu")
    _, calls, _, states = search(profiled, tmp_path / "first", templates, local, budget=1)
    first = calls[0].card_id  # the card the allocator values most
    why = "does not pay end to end (median time without/with 0.990)"
    notes = Notes()
    _, calls, _, states = search(profiled, tmp_path / "again", make("templates", target="cpu"), local, notes,
                                 report=_gate_report(first, why), budget=1)
    assert first not in [c.card_id for c in calls] and len(calls) == 1
    assert why in states[first].unsupported
    assert any(first in n and "gate dropped" in n for n in notes.notes)
    # a pack refused as a whole drops no card for good: each kernel in it paid alone
    refused = "the pack would be slower than stock"
    _, calls, _, _ = search(profiled, tmp_path / "refused", make("templates", target="cpu"), local,
                            report=_gate_report(first, refused, refused=refused), budget=1)
    assert [c.card_id for c in calls] == [first]


def test_no_call_goes_to_one_op_of_integer_bookkeeping(profiled, local, tmp_path):
    """`generate()`'s cache positions and counters (an int64 `add` of one element): a kernel would trade
    one launch for one launch; a float op beside it keeps its calls, and so does a fusion of such ops."""
    import dataclasses

    cards = Workspace(profiled).load_cards()
    add = next(c for c in cards if c.op == "aten.add.Tensor" and c.kind != "fusion")
    ints = dataclasses.replace(add, args=tuple(
        dataclasses.replace(a, tensor=dataclasses.replace(a.tensor, dtype="int64")) if a.tensor else a
        for a in add.args), outputs=tuple(dataclasses.replace(o, dtype="int64") for o in add.outputs))
    assert run.bookkeeping_reason(ints) == run.BOOKKEEPING
    assert run.bookkeeping_reason(add) is None
    fused = next(c for c in cards if c.kind == "fusion")
    assert run.bookkeeping_reason(dataclasses.replace(fused, outputs=ints.outputs)) is None
