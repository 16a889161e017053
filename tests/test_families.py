"""Shape families: variants captured at several sizes fold into one card whose members are exactly the
captured variants, and whose guard twin (`families.bind`) accepts members and refuses non-members."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from forgepack import cards, families
from forgepack.capture import capture

POINTS = ((1, 8), (2, 8), (1, 13), (3, 21), (4, 64))


def _tiny_llama():
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _captured(model):
    inputs = [torch.randint(0, 128, (b, s)) for b, s in POINTS]
    return capture(model, lambda: [model(input_ids=ids) for ids in inputs], keep_samples=False).cards


def _sizes(card):
    return tuple(t.shape if t is not None else None for t in [*card.tensor_inputs(), *card.outputs])


def _layouts(card):
    """Sizes, strides (a size-1 axis's stride is never read) and offsets of every tensor, values too."""
    def one(t):
        kept = None if t is None else tuple(s for n, s in zip(t.shape, t.stride, strict=True) if n != 1)
        return None if t is None else (t.dtype, t.shape, kept,
                                       t.storage_offset)
    values = tuple(a.key() for a in card.args if a.kind in ("value", "none"))
    return tuple(one(t) for t in [*card.tensor_inputs(), *card.outputs]), values


def test_llama_prefill_variants_fold_into_families_whose_members_are_the_captured_variants():
    model = _tiny_llama()
    captured = _captured(model)
    folded = families.fold(captured)
    fams = [c for c in folded if c.family is not None]
    assert len(folded) < len(captured) / 3
    assert {"aten.mm.default", "aten.mul.Tensor", "aten._to_copy.default"} <= {c.op for c in fams}
    by_sizes = {}
    for c in captured:
        by_sizes.setdefault((c.op, _sizes(c)), []).append(c)
    covered = 0
    for fam in fams:
        for m in families.members_at_points(fam):
            origs = [o for o in by_sizes[(m.op, _sizes(m))] if _layouts(o) == _layouts(m)]
            assert len(origs) == 1, m.signature()
            assert families.bind(fam, m.tensor_inputs()) is not None
            covered += origs[0].calls
        assert fam.calls == sum(fam.family.point_calls)
    assert covered == sum(f.calls for f in fams)


def test_family_card_round_trips_json_and_has_its_own_id():
    fam = next(c for c in families.fold(_captured(_tiny_llama())) if c.family is not None)
    again = cards.from_json(cards.to_json(fam))
    assert again == fam and again.id == fam.id and "-F" in fam.id


def test_bind_refuses_sizes_out_of_range_unequal_dims_and_broken_strides():
    mm = next(c for c in families.fold(_captured(_tiny_llama())) if c.family and c.op == "aten.mm.default")
    d = {x.name: x for x in mm.family.dims}
    inside = families.member(mm, {n: x.max for n, x in d.items()})
    assert families.bind(mm, inside.tensor_inputs()) is not None
    outside = families.member(mm, {n: x.max + 1 for n, x in d.items()})
    assert families.bind(mm, outside.tensor_inputs()) is None
    x, w = inside.tensor_inputs()
    transposed = dataclasses.replace(x, stride=tuple(reversed(x.stride)))
    assert families.bind(mm, [transposed, w]) is None


def test_check_points_cover_corners_primes_and_captured_points():
    mm = next(c for c in families.fold(_captured(_tiny_llama())) if c.family and c.op == "aten.mm.default")
    pts = families.check_points(mm, seed=1)
    dims = mm.family.dims
    assert {d.name: d.min for d in dims} in pts and {d.name: d.max for d in dims} in pts
    assert all(dict(p) in pts for p in mm.family.points)
    assert any(v in (7, 13, 31, 61, 127) for p in pts for v in p.values())
    for p in pts:
        assert all(d.min <= p[d.name] <= d.max for d in dims)


def test_a_broadcast_axis_is_not_folded_into_a_real_one():
    """RMSNorm's x * rsqrt(var) (f32[b,s,64] x f32[b,s,1]) and the MLP's silu(g) * u (f32[b,s,128] x
    f32[b,s,128]) are one op with the same ranks: folding them into one family would make the broadcast
    axis a dim in 1..128 (a kernel would be verified as if 1 and 128 were sizes of one axis)."""
    from forgepack.capture import card_from_call

    mul = torch.ops.aten.mul.Tensor
    calls = []
    for b, s in POINTS:
        calls.append(card_from_call(mul, (torch.randn(b, s, 64), torch.randn(b, s, 1)), {})[0])
        calls.append(card_from_call(mul, (torch.randn(b, s, 128), torch.randn(b, s, 128)), {})[0])
    fams = families.fold(calls)
    assert len(fams) == 2 and all(c.family is not None for c in fams)
    norm, mlp = sorted(fams, key=lambda c: c.family.inputs[1].shape[-1] != 1)
    assert norm.family.inputs[1].shape[-1] == 1 and mlp.family.inputs[1].shape[-1] == 128
    for fam in fams:
        assert [(d.min, d.max) for d in fam.family.dims] == [(1, 4), (8, 64)]
        assert len(families.members_at_points(fam)) == len(POINTS)


def test_a_dim_that_is_1_at_some_points_is_kept_where_its_axes_agree():
    """The batch axis is 1 at some points and shared by every tensor: still one dim (decode at batch 1..4)."""
    from forgepack.capture import card_from_call

    calls = [card_from_call(torch.ops.aten.mul.Tensor, (torch.randn(b, 1, 64), torch.randn(b, 1, 64)), {})[0]
             for b in (1, 2, 4)]
    (fam,) = families.fold(calls)
    assert [(d.min, d.max) for d in fam.family.dims] == [(1, 4)]
    assert fam.family.inputs[0].shape == ("d0", 1, 64)


def test_a_dynamic_cache_cat_folds_into_one_family_whose_output_length_is_derived():
    """DynamicCache appends one step's keys: cat([f32[b,2,L,8], f32[b,2,1,8]], -2) -> f32[b,2,L+1,8]. The
    output's length is no input's size; folded as a derived dim (L + 1) the steps of every cache length
    are one family, whose members (and the guard twin) compute the output length from the inputs."""
    from forgepack.capture import card_from_call

    cat = torch.ops.aten.cat.default
    steps = [(b, n) for b in (1, 2, 4) for n in (8, 9, 10, 29, 64)]
    calls = [card_from_call(cat, ([torch.randn(b, 2, n, 8), torch.randn(b, 2, 1, 8)], -2), {})[0] for b, n in steps]
    (fam,) = families.fold(calls)
    dims = {d.name: d for d in fam.family.dims}
    (derived,) = [d for d in dims.values() if d.derived]
    (past,) = derived.base
    assert derived.offset == 1 and (derived.min, derived.max) == (dims[past].min + 1, dims[past].max + 1)
    assert fam.family.outputs[0].shape[2] == derived.name and f"{derived.name}={past}+1" in fam.signature()
    unseen = {d.name: 3 for d in dims.values() if not d.derived} | {past: 40}
    m = families.member(fam, unseen)
    assert m.outputs[0].shape == (3, 2, 41, 8) and m.outputs[0].stride == (656, 328, 8, 1)
    assert families.bind(fam, m.tensor_inputs()) == {**unseen, derived.name: 41}
    assert all(p[derived.name] == p[past] + 1 for p in families.check_points(fam))
    again = cards.from_json(cards.to_json(fam))
    assert again == fam and again.id == fam.id


def test_a_slice_of_a_growing_buffer_folds_with_a_free_stride_and_batch_1_steps_join_it():
    """generate()'s last-token slice of the ids, ids[:, -1:], is int64[b,1] with the row stride L of a
    buffer that grows each step (L is no size of the slice) at offset L - 1. Its row stride follows no
    rule over dims, so it is free (any non-negative stride, the kernel reads it); and the batch-1 steps,
    which differ only in storage offset (no dim varies between two of them), join the family too."""
    from forgepack.capture import card_from_call

    add = torch.ops.aten.add.Tensor
    steps = [(1, n) for n in (8, 9, 10)] + [(b, n) for b in (2, 4) for n in (8, 9, 29)]
    calls = [card_from_call(add, (torch.ones(1, 1, dtype=torch.long), torch.zeros(b, n, dtype=torch.long)[:, -1:]),
                            {})[0] for b, n in steps]
    (fam,) = families.fold(calls)
    assert fam.family.inputs[1].stride[0] == cards.FREE_STRIDE and ":(*,1)" in fam.signature()
    assert len(fam.family.points) == len(steps)
    unseen = torch.zeros(3, 40, dtype=torch.long)[:, -1:]
    m = card_from_call(add, (torch.ones(1, 1, dtype=torch.long), unseen), {})[0]
    assert families.bind(fam, m.tensor_inputs()) == {"d0": 3}
    assert families.member(fam, {"d0": 3}).tensor_inputs()[1].shape == (3, 1)
    again = cards.from_json(cards.to_json(fam))
    assert again == fam and again.id == fam.id


def test_a_size_1_axis_s_stride_does_not_count_toward_its_rule():
    """A batch-1 slice of a wider buffer is contiguous (PyTorch gives the size-1 axis whatever stride),
    its batch-3 twin has the buffer's row length as stride: one family whose rule is the buffer's, and
    both still bind (a size-1 axis's stride is never read)."""
    from forgepack.capture import card_from_call

    neg = torch.ops.aten.neg.default
    calls = [card_from_call(neg, (torch.randn(1, 32),), {})[0]]
    calls += [card_from_call(neg, (torch.randn(b, 64)[:, :32],), {})[0] for b in (2, 3)]
    assert calls[0].tensor_inputs()[0].stride == (32, 1) and calls[1].tensor_inputs()[0].stride == (64, 1)
    (card,) = families.fold(calls)
    assert card.family is not None and card.family.inputs[0].stride[0] == (64, ())
    assert all(families.bind(card, c.tensor_inputs()) == {"d0": c.tensor_inputs()[0].shape[0]} for c in calls)


def test_an_ambiguous_stride_follows_the_inner_axes_so_every_check_point_is_dense():
    """Eager attention adds the mask: f32[b,4,q,k] + f32[b,1,q,k]. In a generate() envelope q == k at every
    prefill and q is 1 at every decode step (where that axis's stride is never read), so the q axis's
    stride k fits the rule `q` as well as `k`. Taken as `q`, a check point with q != k (Gemma-2's tiny
    envelope drew q=72, k=8) is an output whose rows overlap, and a correct kernel fails there; the rule
    must be the one a dense tensor has, `k`, the inner axis's size."""
    from forgepack.capture import card_from_call

    add = torch.ops.aten.add.Tensor
    points = [(b, n, n) for b in (1, 4) for n in (8, 29)] + [(b, 1, k) for b in (1, 4) for k in (9, 10, 30, 31)]
    calls = [card_from_call(add, (torch.randn(b, 4, q, k), torch.randn(b, 1, q, k)), {})[0] for b, q, k in points]
    (fam,) = families.fold(calls)
    q, k = fam.family.inputs[0].shape[2:]
    assert fam.family.inputs[0].stride[2] == (1, (k,)) and fam.family.outputs[0].stride[2] == (1, (k,))
    for values in families.check_points(fam):
        m = families.member(fam, values)
        for t in [*m.tensor_inputs(), *m.outputs]:  # a size-1 axis's stride is never read
            dense = torch.empty(t.shape).stride()
            assert all(s == d for n, s, d in zip(t.shape, t.stride, dense, strict=True) if n != 1), (values, t)
    real = card_from_call(add, (torch.randn(2, 4, 5, 13), torch.randn(2, 1, 5, 13)), {})[0]  # a chunked prefill
    assert families.bind(fam, real.tensor_inputs()) == {fam.family.dims[0].name: 2, q: 5, k: 13}


def phi3_rotary_cats() -> list:
    """Phi-3's rotary cats at batch x tokens points, 8 + 8 lanes and 16 + 0, in capture order."""
    from forgepack.capture import card_from_call

    cat = torch.ops.aten.cat.default
    calls = []
    for b, s in ((1, 8), (2, 13), (4, 29), (3, 1), (1, 1), (4, 1)):
        q = torch.randn(b, s, 8 * 16).view(b, s, 8, 16).transpose(1, 2)[:, :4]  # q of a fused qkv buffer
        for lanes in (8, 16):
            rotated = torch.randn(b, s, 4, lanes).transpose(1, 2)
            calls.append(card_from_call(cat, ([rotated, q[..., lanes:] if lanes == 16 else q[..., :8]], -1), {})[0])
    return calls


def test_two_call_sites_no_one_op_computes_do_not_fold_into_one_family():
    """Phi-3's rotary cats 8 + 8 lanes (rotate_half) and 16 + 0 lanes (the rotated head beside its empty
    pass-through), both into 16, from views of one fused qkv buffer. Their layouts fit one family with
    the lanes as two dims, whose check point 8 + 0 stock answers with 8 lanes, not the family's 16: the
    verifier's reference then failed and took the whole build down. Each site is its own family, and at
    every check point the op (on the meta device) gives the outputs the family says."""
    from forgepack import opcall

    fams = families.fold(phi3_rotary_cats())
    assert sorted(len(c.family.points) for c in fams if c.family is not None) == [6, 6]
    for fam in fams:
        for values in families.check_points(fam):
            m = families.member(fam, values)
            layouts, _ = opcall.output_layouts(m)
            assert [shape for shape, _, _ in layouts] == [o.shape for o in m.outputs], values


def test_a_family_card_draws_from_the_value_range_of_all_its_members():
    """The verifier draws a family member's inputs from the card's value stats. Taken from one member
    (a batch-1 mask whose nine values stayed below 256) they would hide what the others held."""
    from forgepack.capture import card_from_call

    calls = []
    for b, n, high in ((1, 9, 200), (2, 17, 300), (4, 30, 1000)):
        ids = torch.arange(b * n).reshape(b, n) % high
        calls.append(card_from_call(torch.ops.aten._to_copy.default, (ids,), {"dtype": torch.bool})[0])
    (card,) = families.fold(calls)
    stats = card.tensor_inputs()[0].stats
    assert (stats.min, stats.max) == (0, 119)
    values = torch.cat([(torch.arange(b * n) % h).double() for b, n, h in ((1, 9, 200), (2, 17, 300), (4, 30, 1000))])
    assert stats.mean == pytest.approx(float(values.mean()))
    assert stats.std == pytest.approx(float(values.std()), rel=0.02)
