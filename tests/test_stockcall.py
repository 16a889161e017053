"""Calling a stock op from recorded arguments: one decoder (`forgepack.runtime.stockcall`) for the
build side (`forgepack.opcall`, cards) and the pack's self-test (manifest variants)."""

from __future__ import annotations

import torch

from forgepack import opcall
from forgepack.cards import Arg, Card, TensorMeta
from forgepack.runtime import selftest, stockcall
from forgepack.runtime.packinfo import VariantInfo

TO_COPY = "aten._to_copy.default"
# aten::_to_copy(Tensor self, *, ScalarType? dtype, Layout? layout, Device? device, bool? pin_memory,
#                bool non_blocking, MemoryFormat? memory_format): schema `.type` spells ScalarType,
# Layout and MemoryFormat as int; the recorded values are their names.
RECORDED = ("float16", "strided", "cpu", None, False, "contiguous_format")


def _variant() -> VariantInfo:
    """As the pack reads it from its manifest."""
    meta = {"dtype": "float32", "shape": [2, 3], "stride": [3, 1], "storage_offset": 0}
    return VariantInfo.from_dict({"id": "v", "op": TO_COPY, "args": [
        {"name": "self", "kind": "tensor", "tensor": meta}, *({"kind": "value", "value": v} for v in RECORDED)]})


def test_the_self_test_decodes_a_dtype_argument_to_a_torch_dtype():
    func = stockcall.resolve(TO_COPY)
    x = torch.randn(2, 3)
    args, kwargs = selftest.call_args(_variant(), func, [x], torch.device("cpu"))
    assert kwargs["dtype"] is torch.float16
    assert kwargs["layout"] is torch.strided and kwargs["memory_format"] is torch.contiguous_format
    assert kwargs["device"] == torch.device("cpu")
    out = func(*args, **kwargs)  # a string dtype made this raise "Expected ... 'Optional[int]'"
    assert out.dtype == torch.float16 and torch.equal(out, x.half())


def test_cards_and_manifest_variants_decode_alike():
    meta = TensorMeta("float32", (2, 3), (3, 1))
    names = ("dtype", "layout", "device", "pin_memory", "non_blocking", "memory_format")
    values = [Arg(n, "value", value=v) for n, v in zip(names, RECORDED, strict=True)]
    card = Card(op=TO_COPY, schema="", args=(Arg("self", "tensor", tensor=meta), *values), outputs=())
    x = torch.randn(2, 3)
    from_card = opcall.call_args(card, [x], "cpu")
    from_manifest = selftest.call_args(_variant(), stockcall.resolve(TO_COPY), [x], torch.device("cpu"))
    assert from_card == from_manifest
    assert opcall.run_stock(card, [x], "cpu")[0].dtype == torch.float16
