"""Every point of the cpu parameter spaces computes its op.

Without a key the templates proposer searches these spaces (issue 37): the row program's accumulators,
unroll hints and staged rows (`rowreduce.cpu_row_axes`), the index-math program's merged outputs,
nested walks and unroll hints (`fused._cpu_walks`), the pointwise loops' unroll hints and strips
(`elementwise.CPU_VECS`, and `generic` for a family's rows). Each point is another kernel, so each is
verified against stock PyTorch (fresh and edge inputs): every value of every axis on synthetic cards in
the default run; every point of every space on the tiny Llama's fused chains and the synthetic cards,
and every axis value on fused families, in the slow ones. The default point renders what the cpu renders
were before the axes, so an existing build's kernels keep their sources.
"""

from __future__ import annotations

import pytest
import torch
from test_fusion import _find, _load, _saved
from test_templates import CASES, _card, _x

from forgepack import familyeval, recipe
from forgepack.evaluate import Evaluator
from forgepack.templates import by_name, points, templates_for

A = torch.ops.aten
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# Rows and runs of 37 leave a tail past every accumulator count and strip width; bf16 and f16 rows are
# decoded per pass unless staged; the transposed rows are gathered.
SYNTHETIC = [
    ("rowreduce.softmax", A._softmax.default, (_x(6, 37, dtype=BF16), -1, False), {}),
    ("rowreduce.layer_norm", A.native_layer_norm.default, (_x(5, 37), [37], _x(37, seed=1), _x(37, seed=2), 1e-5),
     {}),
    ("rowreduce.reduce", A.amax.default, (_x(5, 37, 6, dtype=F16).transpose(1, 2), [-1], False), {}),
    ("rowreduce.reduce", A.sum.dim_IntList, (_x(4, 3, 37), [-1, -2], True), {}),
    ("elementwise.binary", A.sub.Tensor, (_x(6, 4, 37, dtype=F16).transpose(0, 1), _x(4, 1, 37, dtype=F16)),
     {"alpha": 3}),
    ("elementwise.cat", A.cat.default, ([_x(3, 5, 8, dtype=BF16), _x(3, 5, 24, dtype=BF16, seed=1)], -1), {}),
    ("elementwise.copy", A.clone.default, (_x(3, 37, 5).transpose(1, 2),), {"memory_format": torch.contiguous_format}),
    ("elementwise.copy", A._to_copy.default, (torch.arange(74).view(2, 37),), {"dtype": F32}),
    ("elementwise.unary", A.silu.default, (_x(2, 37, dtype=BF16),), {}),
]


def _ids(cases) -> list[str]:
    return [f"{name}-{op.__name__}" for name, op, _, _ in cases]


def _each_value(t, card) -> list[dict]:
    """The default, then every value of each axis with the others at the default."""
    space, first = t.space(card, "cpu"), t.default(card, "cpu")
    out = [first]
    for axis, values in space.items():
        out += [p for p in ({**first, axis: v} for v in values) if p not in out]
    return out


@pytest.fixture(scope="module")
def evaluator():
    with Evaluator("cpu", timeout_s=120) as ev:
        yield ev


@pytest.fixture(scope="module")
def llama():
    return _find(_load(recipe.resolve("tiny-llama"), "bfloat16"))


def _verify(evaluator, t, card, params_list, samples_path=None, family=False) -> int:
    sources = set()
    for params in params_list:
        src = t.render(card, "cpu", params)
        assert src not in sources, f"{t.name} {params}: the same source as another point"
        sources.add(src)
        if family:
            verdict = familyeval.evaluate(evaluator, card, src, bench=False)
        else:
            verdict = evaluator.evaluate(card, src, samples_path=samples_path, bench=False)
        assert verdict.accepted, f"{t.name} {params} on {card.op} [{card.signature()}]: {verdict.reason}"
    return len(sources)


@pytest.mark.parametrize("case", SYNTHETIC, ids=_ids(SYNTHETIC))
def test_every_axis_value_verifies(case, evaluator):
    expected, op, args, kwargs = case
    card = _card(op, args, kwargs)
    t = by_name(expected)
    assert t.supports(card, "cpu") is None, t.supports(card, "cpu")
    assert _verify(evaluator, t, card, _each_value(t, card)) >= 6


def test_the_default_point_renders_the_plain_loops():
    """No hint, strip, staged row, split accumulator or nested walk at the default: the sources the cpu
    renders gave before their axes existed."""
    for _expected, op, args, kwargs in [*CASES, *SYNTHETIC]:
        card = _card(op, args, kwargs)
        for t in templates_for(card, "cpu"):
            src = t.render(card, "cpu", t.default(card, "cpu"))
            assert src == t.render(card, "cpu", {})
            for marker in ("#pragma GCC unroll", "b_ +=", "xf_[", "fp_walk"):
                assert marker not in src, (t.name, card.signature(), marker)


def test_the_spaces_hold_what_the_cards_allow():
    """Accumulators no more than the row's length, strips no longer than the longest run, rows staged up
    to 4096 elements, one nest level per dim a walk can loop over, `merge` only where outputs share a walk."""
    rows = by_name("rowreduce.softmax")
    assert rows.space(_card(A._softmax.default, (_x(4, 3), -1, False), {}), "cpu") == {
        "acc": [1, 2], "unroll": [1, 2, 4, 8], "stage": [0, 1]}
    assert rows.space(_card(A._softmax.default, (_x(2, 5000), -1, False), {}), "cpu")["stage"] == [0]
    binary = by_name("elementwise.binary")
    rows_of_6 = _card(A.mul.Tensor, (_x(3, 6), _x(3, 1)), {})  # the broadcast keeps the dims apart
    assert binary.space(rows_of_6, "cpu") == {"unroll": [1, 2, 4, 8], "vec": [1, 4]}
    assert binary.default(rows_of_6, "cpu") == {"unroll": 1, "vec": 1}
    assert binary.space(_card(A.mul.Tensor, (_x(3, 6), _x(3, 6)), {}), "cpu")["vec"] == [1, 4, 8, 16]  # one run


def test_the_nested_walks_split_at_the_cat_and_merge_shared_walks(llama):
    """Rotary's rotate_half is a cat along the head dim: a nested walk loops over each half on its own
    (no branch left inside); the cos and sin tables walk one shape and merge into one function (values
    first, then the stores)."""
    (rot,) = llama.by_pattern("rotary")
    t = by_name("fused.indexed")
    space = t.space(rot, "cpu")
    assert "merge" not in space and space["nest"] == [0, 3, 2, 1] and space["unroll"] == [0, 2, 4, 8]
    src = t.render(rot, "cpu", {"nest": 3, "unroll": 0})  # the halves stay loops: the vectoriser takes them
    assert "c3_ = 0u; c3_ < 8u" in src and "c3_ = 8u; c3_ < 16u" in src and src.count("#pragma GCC unroll 1") == 4
    (tables,) = [c for c in llama.by_pattern("chain") if len(c.outputs) == 2]
    assert t.space(tables, "cpu")["merge"] == [0, 1]
    merged = t.render(tables, "cpu", {**t.default(tables, "cpu"), "merge": 1})
    assert "fp_walk0(p, e_)" in merged and "fp_walk1" not in merged
    assert merged.index("r1_ = ") < merged.index("p.out0[")  # every value before any store


@pytest.mark.slow
@pytest.mark.parametrize("case", SYNTHETIC, ids=_ids(SYNTHETIC))
def test_every_point_verifies(case, evaluator):
    expected, op, args, kwargs = case
    card = _card(op, args, kwargs)
    t = by_name(expected)
    assert _verify(evaluator, t, card, points(t, card, "cpu")) == len(points(t, card, "cpu"))


@pytest.mark.long  # 60 s of CI: the default points are verified by test_templates, every axis value below
def test_every_point_of_the_llama_fusions_verifies(llama, evaluator, tmp_path):
    """RMSNorm (rows), rotary and the cos/sin tables (index math), act(gate) * up (pointwise and index
    math) of the bf16 tiny Llama: every point, on the captured samples."""
    served = set()
    for card in llama.checked.cards:
        card, path = _saved(card, llama.checked.samples[card.id], tmp_path)
        for t in templates_for(card, "cpu"):
            _verify(evaluator, t, card, points(t, card, "cpu"), samples_path=path)
            served.add(t.name)
    assert served == {"fused.rows", "fused.indexed", "fused.pointwise"}


@pytest.mark.slow
def test_every_axis_value_of_fused_families_verifies(evaluator):
    """Families (the row program with its rows read at run time, the decode rotary's batch loop, the
    prefill rotary's and tables' run-time sizes, a pointwise family's rows): every value of every axis,
    verified over the family's range."""
    from test_fusion_families import WORKLOAD, _decode_rotary, _family, _recipe

    from forgepack import fusion, models, profile

    per_point: list = []
    with models.quiet_transformers():
        lm = models.load(_recipe(**WORKLOAD))
        profile.capture_envelope(lm, lambda *_: None, per_point)
        cards = fusion.build_points(lm.model, per_point, lm.device, None, []).cards
        exact = {}
        for cap, run, _ in per_point:
            candidates, _ = fusion.find(cap)
            for card in fusion.check_and_sample(lm.model, run, fusion.group(cap, candidates)).cards:
                exact[card.id] = card
    picks = [(_family(cards, "rmsnorm"), "fused.rows"), (_decode_rotary(list(exact.values())), "fused.indexed"),
             (_family(cards, "rotary"), "fused.indexed"), (_family(cards, "chain"), "fused.indexed"),
             (_family(cards, "gated_act"), "fused.pointwise")]
    for card, name in picks:
        t = by_name(name)
        assert t.space(card, "cpu"), name
        _verify(evaluator, t, card, _each_value(t, card), family=True)
