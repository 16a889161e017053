"""A fusion card's `chain` and `fusion` are small frozen values (`ChainEntry`, `ChainArg`, `Fusion`,
`FusionSite`) that round-trip the card's JSON, and a card that the code before them wrote (dicts,
`data/fusion_cards_dict_chains.json`) loads into them unchanged: same JSON, same id, and it replays."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from forgepack import cards, fusion, opcall
from forgepack.capture import capture
from forgepack.cards import ChainArg, ChainEntry, Fusion, FusionSite

WRITTEN_WITH_DICTS = Path(__file__).parent / "data" / "fusion_cards_dict_chains.json"


class ChainLayerNorm(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.bias = torch.nn.Parameter(torch.zeros(n))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5) * self.weight + self.bias


class Halves(torch.nn.Module):
    """A view (slice) and a list argument (cat) in the chain."""

    def forward(self, x):
        a, b = x[..., :4], x[..., 4:]
        return torch.cat((-b, a), dim=-1) * 2.0


class Model(torch.nn.Module):  # what wrote the data file (as __main__), with this input
    def __init__(self):
        super().__init__()
        self.norm, self.rot = ChainLayerNorm(8), Halves()

    def forward(self, x):
        return self.rot(self.norm(x))


def _input() -> torch.Tensor:
    return torch.arange(16.0).reshape(2, 8) / 7


def _captured() -> list[cards.Card]:
    torch.manual_seed(0)
    m = Model().eval()
    x = _input()
    cap = capture(m, lambda: m(x))
    candidates, _ = fusion.find(cap)
    return fusion.group(cap, candidates)


def _json(card: cards.Card) -> dict:
    return json.loads(json.dumps(cards.to_json(card)))


def test_a_card_written_with_dict_chains_loads_typed_and_writes_the_same_json():
    written = json.loads(WRITTEN_WITH_DICTS.read_text())
    for d in written:
        card = cards.from_json(d)
        assert all(isinstance(e, ChainEntry) and all(isinstance(a, ChainArg) for a in e.args) for e in card.chain)
        assert isinstance(card.fusion, Fusion) and all(isinstance(s, FusionSite) for s in card.fusion.sites)
        assert _json(card) == d
        assert fusion.chain_digest(card.chain, card.fusion.outputs) == card.args[-1].value  # the id holds
    norm, rot = (cards.from_json(d) for d in written)
    assert norm.fusion.pattern == "layernorm" and rot.fusion.pattern == "rotary"
    cat = next(e for e in rot.chain if e.op == "aten.cat.default")
    assert cat.arg("tensors").kind == "tensors" and all(r[0] == "t" for r in cat.arg("tensors").refs)
    assert rot.chain[0].outs[0].storage_offset == 0 and rot.chain[1].outs[0].storage_offset == 4  # the two halves
    # the loaded chains replay what the modules compute
    x, m = _input(), Model().eval()
    with torch.no_grad():
        h = m.norm(x)
        assert torch.equal(opcall.run_chain(norm, [x, m.norm.weight, m.norm.bias])[0], h)
        assert torch.equal(opcall.run_chain(rot, [h])[0], m.rot(h))


def test_fusion_cards_round_trip_and_capture_makes_what_the_dict_code_made():
    written = {d["id"]: d for d in json.loads(WRITTEN_WITH_DICTS.read_text())}
    made = _captured()
    assert sorted(c.id for c in made) == sorted(written)  # same chains, same digests, same ids
    for card in made:
        assert cards.from_json(cards.to_json(card)) == card
        old = written[card.id]
        assert _json(card)["chain"] == old["chain"]
        fused = _json(card)["fusion"]
        assert {k: fused[k] for k in ("pattern", "launches", "outputs")} == {
            k: old["fusion"][k] for k in ("pattern", "launches", "outputs")}
        assert [s["form"] for s in fused["sites"]] == [s["form"] for s in old["fusion"]["sites"]]


def test_chain_values_are_frozen():
    card = cards.from_json(json.loads(WRITTEN_WITH_DICTS.read_text())[0])
    with pytest.raises(dataclasses.FrozenInstanceError):
        card.chain[0].op = "aten.relu.default"
    with pytest.raises(dataclasses.FrozenInstanceError):
        card.fusion.pattern = "chain"
    with pytest.raises(dataclasses.FrozenInstanceError):
        card.fusion.sites[0].digest = ""
