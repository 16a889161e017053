"""Capture sees every aten call, whatever Python API produced it, at the level overrides register."""

import torch
import torch.nn.functional as F

from forgepack import cards, opcall, samples
from forgepack.capture import capture, card_from_call, fold_path


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x, w):
        a = x.softmax(-1)  # tensor method
        b = a @ w  # operator
        c = self.norm(self.proj(b))  # modules: linear and layer_norm are composites
        d = F.gelu(c) + torch.sigmoid(x)
        return d.t().contiguous()


def _ops(cap):
    return {c.op for c in cap.cards}


def test_capture_sees_methods_operators_and_modules():
    m = Tiny().eval()
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    cap = capture(m, lambda: m(x, w))
    ops = _ops(cap)
    assert "aten._softmax.default" in ops  # x.softmax(-1)
    assert "aten.mm.default" in ops  # a @ b
    assert "aten.addmm.default" in ops  # nn.Linear, decomposed to the op with a backend kernel
    assert "aten.native_layer_norm.default" in ops  # not the composite aten.layer_norm
    assert "aten.linear.default" not in ops and "aten.layer_norm.default" not in ops
    assert "aten.clone.default" in ops  # .contiguous() of a transposed view
    by_op = {c.op: c for c in cap.cards}
    assert by_op["aten.addmm.default"].modules == ("proj",)
    assert by_op["aten.native_layer_norm.default"].modules == ("norm",)


def test_capture_decomposes_composites_under_inference_mode():
    m = Tiny().eval()
    x, w = torch.randn(4, 8), torch.randn(8, 8)

    def run():
        with torch.inference_mode():
            m(x, w)

    ops = _ops(capture(m, run))
    assert "aten.linear.default" not in ops and "aten.softmax.int" not in ops
    assert "aten._softmax.default" in ops


def test_variants_split_by_shape_dtype_and_stride():
    m = torch.nn.Identity()

    def run():
        a = torch.randn(4, 8)
        a.softmax(-1)
        a.softmax(-1)  # same variant: counted twice
        torch.randn(4, 16).softmax(-1)  # shape
        a.double().softmax(-1)  # dtype
        a.t().softmax(-1)  # stride

    cap = capture(m, run)
    soft = [c for c in cap.cards if c.op == "aten._softmax.default"]
    assert len(soft) == 4
    assert sorted(c.calls for c in soft) == [1, 1, 1, 2]
    assert len({c.id for c in soft}) == 4


def test_samples_keep_real_inputs_in_exact_layout(tmp_path):
    base = torch.randn(6, 8)
    view = base.t()[2:]  # non-contiguous, storage offset
    card, inputs, outputs = card_from_call(torch.ops.aten._softmax.default, (view, -1, False))
    meta = card.tensor_inputs()[0]
    assert meta.stride == (1, 8) and meta.storage_offset == 2
    path = tmp_path / "s.safetensors"
    kept = samples.save_samples(path, [(inputs, outputs)])
    card = cards.Card(**{**card.__dict__, "samples": kept})
    (ins, outs), = samples.load_samples(card, path, "cpu")
    assert ins[0].stride() == view.stride() and ins[0].storage_offset() == view.storage_offset()
    assert torch.equal(ins[0], view) and torch.equal(outs[0], outputs[0])
    assert torch.equal(opcall.run_stock(card, ins, "cpu")[0], outputs[0])


def test_fresh_inputs_are_drawn_like_the_captured_ones():
    ids = torch.randint(5, 9, (64,))
    card, _, _ = card_from_call(torch.ops.aten.embedding.default, (torch.randn(16, 4), ids))
    fresh = samples.fresh_inputs(card, seed=1, device="cpu")
    assert int(fresh[1].min()) >= 5 and int(fresh[1].max()) <= 8  # indices stay in range
    again = samples.fresh_inputs(card, seed=1, device="cpu")
    assert torch.equal(fresh[0], again[0])
    edge = samples.fresh_inputs(card, seed=2, device="cpu", edge=True)
    assert not torch.isfinite(edge[0]).all()


def test_cards_round_trip_through_json(tmp_path):
    m = Tiny().eval()
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    for card in capture(m, lambda: m(x, w)).cards:
        cards.save(card, tmp_path / "c.json")
        assert cards.load(tmp_path / "c.json") == card


def test_fold_path():
    assert fold_path("model.layers.12.mlp.up_proj") == "model.layers.*.mlp.up_proj"
    assert fold_path("") == "<model>"
