"""The first write of a growing cache: a `cat` whose first input is empty, verified and folded.

transformers' DynamicCache starts each layer's keys and values as `torch.tensor([])` and concatenates
every step onto them, so `generate()`'s first write is `cat([f32[0], keys f32[b,2,s,16]], -2)`. The
ABI passes NULL for an empty tensor (as the pack's guard does), so the verifier runs a kernel exactly as
it will be called: the size-generic cat (it copies only the keys) is accepted at every check point; a
kernel that loads from the empty input faults, one that sizes the keys' place from the past's shape
leaves the output wrong. A chunked cache whose past length ranges down to 0 folds into one family
whose check points include the empty past, and it round-trips through the workspace.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forgepack import families, familyeval
from forgepack.capture import card_from_call
from forgepack.compile import compile_kernel, nvcc_path
from forgepack.evaluate import Evaluator
from forgepack.pack import shimgen
from forgepack.templates import by_name, on_device, templates_for
from forgepack.workspace import Workspace

KERNELS = Path(__file__).resolve().parent / "kernels"
CAT = torch.ops.aten.cat.default


def _keys(b: int, s: int) -> torch.Tensor:
    return torch.randn(b, s, 2, 16).transpose(1, 2)  # DynamicLayer gets the projection viewed per head


def first_write_card():
    calls = [card_from_call(CAT, ([torch.tensor([]), _keys(b, s)], -2), {})[0] for b, s in ((1, 8), (2, 13), (3, 5))]
    (card,) = families.fold(calls)
    return card


def chunked_cache_card():
    """cat([past f32[b,2,L,16], chunk f32[b,2,4,16]], -2) with L from 0 (the first chunk) to 12."""
    calls = [card_from_call(CAT, ([torch.randn(b, 2, n, 16), torch.randn(b, 2, 4, 16)], -2), {})[0]
             for b, n in ((2, 5), (1, 0), (2, 12), (3, 0), (3, 7))]
    (card,) = families.fold(calls)
    return card


@pytest.fixture(scope="module")
def evaluator():
    with Evaluator("cpu", timeout_s=120) as ev:
        yield ev


def test_the_size_generic_cat_is_verified_at_every_check_point(evaluator):
    card = first_write_card()
    t = by_name("elementwise.cat")
    assert t in templates_for(card, "cpu")
    verdict = familyeval.evaluate(evaluator, card, t.render(card, "cpu", t.default(card, "cpu")), bench=False)
    assert verdict.accepted, verdict.reason
    assert len(verdict.diagnostics["family"]["checked"]) == len(families.check_points(card))


@pytest.mark.parametrize(("kernel", "category", "words"), [
    ("cat_reads_empty.cpp", "crash", "SIGSEGV"),  # the verifier passes NULL, as PyTorch has it
    ("cat_sized_past.cpp", "mismatch", ""),
])
def test_a_cat_kernel_that_misuses_the_empty_input_is_rejected(evaluator, kernel, category, words):
    card = first_write_card()
    verdict = familyeval.evaluate(evaluator, card, (KERNELS / kernel).read_text(), bench=False)
    assert not verdict.accepted and verdict.category == category, verdict.reason
    assert words in verdict.reason


def test_a_past_length_ranging_down_to_0_folds_verifies_and_round_trips(evaluator, tmp_path):
    card = chunked_cache_card()
    past, out = card.family.inputs[0], card.family.outputs[0]
    length = card.family.dim(past.shape[2])
    assert (length.min, length.max) == (0, 12)
    assert out.shape[2] != past.shape[2] and card.family.dim(out.shape[2]).derived
    # the empty past's strides (PyTorch's own for a size-0 axis) do not stop its layout following a rule
    assert past.stride[0] == (32, (past.shape[2],))
    assert any(p[past.shape[2]] == 0 for p in families.check_points(card))  # the empty past is checked
    assert shimgen.unsupported_reason(card, "cpu") is None  # the output never is empty
    empty = torch.randn(3, 2, 9, 16)[:, :, 4:4]  # an empty past anywhere in memory, with its own strides
    assert families.bind(card, [_meta(empty), _meta(torch.randn(3, 2, 4, 16))]) == {**{
        d.name: v for d, v in zip(families.free_dims(card.family), (3, 0), strict=True)}, out.shape[2]: 4}
    ws = Workspace(tmp_path / "ws").create()
    ws.save_card(card)
    assert ws.load_card(card.id) == card
    t = by_name("elementwise.cat")
    verdict = familyeval.evaluate(evaluator, card, t.render(card, "cpu", t.default(card, "cpu")), bench=False)
    assert verdict.accepted, verdict.reason
    assert any(v[past.shape[2]] == 0 for v in verdict.diagnostics["family"]["checked"])


def _meta(t: torch.Tensor):
    from forgepack.cards import TensorMeta

    return TensorMeta("float32", tuple(t.shape), tuple(t.stride()), t.storage_offset())


@pytest.mark.skipif(nvcc_path() is None, reason="no nvcc")
def test_the_cuda_render_of_the_first_write_compiles_for_sm_90():
    for card in (first_write_card(), chunked_cache_card()):
        cuda = on_device(card, "cuda")
        t = by_name("elementwise.cat")
        compiled = compile_kernel(t.render(cuda, "cuda", t.default(cuda, "cuda")), "cuda", arch="sm_90")
        assert compiled.ok, compiled.log[-2000:]
