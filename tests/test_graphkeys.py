"""Graph mode's keys and output copies (forgepack/runtime/graphkeys.py)."""

from __future__ import annotations

import collections

import torch
from graph_models import Box

from forgepack.runtime import graphkeys

# --- signatures --------------------------------------------------------------------------------------


def test_signature_keys_shapes_dtypes_strides_and_values():
    x = torch.zeros(2, 3)
    key = graphkeys.signature((x,), {"flag": True})
    assert key == graphkeys.signature((torch.ones(2, 3),), {"flag": True})  # values do not matter
    others = [
        ((torch.zeros(3, 3),), {"flag": True}),
        ((torch.zeros(2, 3, dtype=torch.float64),), {"flag": True}),
        ((torch.zeros(3, 2).t(),), {"flag": True}),  # same shape, other strides
        ((x,), {"flag": False}),
        ((x,), {"flag": 1}),  # 1 == True, but another type
        ((x,), {"other": True}),
        ((x, None), {"flag": True}),
        ((x, [x]), {"flag": True}),
        ((torch.zeros(2, 3, requires_grad=True),), {"flag": True}),
    ]
    keys = {graphkeys.signature(a, k) for a, k in others}
    assert key not in keys and len(keys) == len(others)


def test_signature_floats_are_exact():
    x = torch.zeros(1)
    assert graphkeys.signature((x, 0.0), {}) != graphkeys.signature((x, -0.0), {})
    nan = float("nan")
    assert graphkeys.signature((x, nan), {}) == graphkeys.signature((x, nan), {})


def test_unkeyable_arguments_give_none_with_a_reason():
    sparse = torch.eye(3).to_sparse()
    scan = graphkeys.scan_arguments((sparse,), {})
    assert scan.key is None and "sparse" in scan.reason
    assert graphkeys.signature(({(1, 2): torch.zeros(1), object(): 1},), {}) is None
    deep: list = []
    for _ in range(20):
        deep = [deep]
    assert graphkeys.signature((deep,), {}) is None
    assert "deeper" in graphkeys.scan_arguments((deep,), {}).reason


def test_argument_objects_are_keyed_by_identity_and_contents():
    box = Box()
    key = graphkeys.signature((box,), {})
    box.state.add_(1)  # in place: same memory, same graph
    assert graphkeys.signature((box,), {}) == key
    box.steps = 1  # a Python attribute may steer the forward: new key
    assert graphkeys.signature((box,), {}) != key
    box.steps = 0
    assert graphkeys.signature((box,), {}) == key
    box.state = torch.zeros(4)  # rebound: the old graph's address is stale
    assert graphkeys.signature((box,), {}) != key
    a, b = Box(), Box()  # equal contents, other objects: other graphs
    assert graphkeys.signature((a,), {}) != graphkeys.signature((b,), {})


def test_scan_separates_value_tensors_from_state():
    box, x, y = Box(), torch.zeros(2), torch.ones(3)
    scan = graphkeys.scan_arguments((x, [y, 1]), {"box": box, "d": {"k": x}})
    assert [id(t) for t in scan.tensors] == [id(x), id(y), id(x)]
    assert scan.objects == [box]
    assert scan.devices == {torch.device("cpu")}


def test_rebuild_substitutes_value_tensors_in_walk_order():
    point = collections.namedtuple("point", "a b")
    args = (torch.zeros(1), [torch.ones(1), 3], point(torch.zeros(2), "s"))
    kwargs = {"d": {"k": torch.ones(3)}, "box": Box()}
    scan = graphkeys.scan_arguments(args, kwargs)
    new = [torch.full_like(t, 7.0) for t in scan.tensors]
    it = iter(new)
    rebuilt = tuple(graphkeys.rebuild(v, it) for v in args)
    rebuilt_kw = {k: graphkeys.rebuild(v, it) for k, v in kwargs.items()}
    assert rebuilt[0] is new[0] and rebuilt[1][0] is new[1] and rebuilt[1][1] == 3
    assert isinstance(rebuilt[2], point) and rebuilt[2].a is new[2] and rebuilt[2].b == "s"
    assert rebuilt_kw["d"]["k"] is new[3] and rebuilt_kw["box"] is kwargs["box"]


def test_describe_is_short_and_readable():
    text = graphkeys.describe((torch.zeros(1, 2, dtype=torch.int64),), {"use_cache": True, "box": Box()})
    assert text == "int64[1, 2] cpu, use_cache=True, box=Box"


# --- output copies -----------------------------------------------------------------------------------


def test_copy_outputs_copies_every_tensor_and_keeps_the_rest():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    t = torch.arange(4.0)
    kept = Box()
    point = collections.namedtuple("point", "a b")
    out = CausalLMOutputWithPast(logits=t, hidden_states=(t, point(t, "x")), past_key_values=kept)
    new = graphkeys.copy_outputs(out, keep={id(kept)})
    assert type(new) is CausalLMOutputWithPast and new.past_key_values is kept
    assert new.logits is not t and torch.equal(new.logits, t)
    assert new["logits"] is new.logits  # the ModelOutput's dict and attribute agree
    assert new.hidden_states[0] is new.logits  # one tensor, one copy: aliasing kept
    assert isinstance(new.hidden_states[1], point) and new.hidden_states[1].b == "x"
    t.add_(1)
    assert torch.equal(new.logits, torch.arange(4.0))
    assert out.logits is t  # the original is untouched


def test_copy_outputs_rebuilds_objects_holding_tensors():
    from transformers import DynamicCache

    cache = DynamicCache()
    k = torch.randn(1, 2, 3, 4)
    cache.update(k, k.clone(), 0)
    out = (torch.return_types.max((torch.zeros(2), torch.ones(2, dtype=torch.long))), cache, "s", None)
    new = graphkeys.copy_outputs(out)
    assert type(new[0]) is torch.return_types.max and new[0].values is not out[0].values
    assert type(new[1]) is DynamicCache and new[1] is not cache
    assert new[1].layers[0].keys.data_ptr() != cache.layers[0].keys.data_ptr()
    assert torch.equal(new[1].layers[0].keys, cache.layers[0].keys)
    assert new[2:] == ("s", None)
    plain = ("a", 1, [None])
    assert graphkeys.copy_outputs(plain) is plain  # nothing to copy: the same object back


def test_copy_outputs_handles_cycles():
    box = Box()
    box.me = box
    new = graphkeys.copy_outputs(box)
    assert new is not box and new.me is new and new.state is not box.state
