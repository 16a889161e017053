"""Size-generic template kernels for family cards, verified over the family's range (`familyeval`).

The families come from a real capture of a tiny Llama at several (batch, seq) points, folded as
`tests/test_families.py` does; each verification runs today's full checks at every
`families.check_points` member."""

import dataclasses
import shutil
import types
from pathlib import Path

import pytest
import torch
from cuda_units import compile_unit
from test_families import _captured, _tiny_llama, phi3_rotary_cats

from forgepack import families, familyeval, needs
from forgepack.capture import card_from_call
from forgepack.compile import compile_kernel
from forgepack.evaluate import Evaluator, Verdict
from forgepack.needs import Align, Needs
from forgepack.templates import by_name, on_device, templates_for

ABI_DIR = Path(__file__).resolve().parent.parent / "forgepack" / "abi"
KERNELS = Path(__file__).resolve().parent / "kernels"


@pytest.fixture(scope="module")
def fams():
    return [c for c in families.fold(_captured(_tiny_llama())) if c.family is not None]


@pytest.fixture(scope="module")
def evaluator():
    with Evaluator("cpu", timeout_s=120) as ev:
        yield ev


def _pick(fams, op, signature_part):
    """The family whose representative (its own args, the most-called member) shows this signature piece."""
    return next(c for c in fams if c.op == op and signature_part in dataclasses.replace(c, family=None).signature())


def _silu(fams):
    return next(c for c in fams if c.op == "aten.silu.default")


# (op, a piece of the representative's signature, template): what LLM serving calls most
CASES = [
    ("aten.mul.Tensor", "f32[64], f32[1,8,64]", "elementwise.binary"),  # RMSNorm weight, broadcast
    ("aten.cat.default", ":(256,8,32,1)", "elementwise.cat"),  # rotary halves, one a strided view
    ("aten._to_copy.default", "int64", "elementwise.copy"),  # a cast
    ("aten.mean.dim", "f32[1,8,64]", "rowreduce.reduce"),  # RMSNorm's mean over the hidden size
]


@pytest.mark.parametrize("case", CASES, ids=[c[2] for c in CASES])
def test_generic_cpu_kernels_verify_at_every_check_point(case, fams, evaluator):
    op, part, name = case
    card = _pick(fams, op, part)
    t = by_name(name)
    assert t in templates_for(card, "cpu")
    src = t.render(card, "cpu", t.default(card, "cpu"))
    assert "fp_geom" in src  # sizes read at run time, not baked in
    verdict = familyeval.evaluate(evaluator, card, src, bench=False)
    assert verdict.accepted, verdict.reason
    checked = verdict.diagnostics["family"]["checked"]
    assert len(checked) == len(families.check_points(card)) - len(verdict.diagnostics["family"]["skipped"])
    assert {d.name: d.max for d in card.family.dims} in checked


def test_a_kernel_correct_only_at_the_captured_sizes_is_rejected_as_mismatch(fams, evaluator):
    card = _silu(fams)
    src = (KERNELS / "family_captured_sizes_only.cpp").read_text()
    for member in families.members_at_points(card):  # right wherever capture looked ...
        verdict = evaluator.evaluate(member, src, bench=False)
        assert verdict.accepted, f"{member.signature()}: {verdict.reason}"
    verdict = familyeval.evaluate(evaluator, card, src, bench=False)  # ... and nowhere else
    assert not verdict.accepted and verdict.category == "mismatch", verdict.reason
    failed = verdict.diagnostics["family"]["failed_at"]
    assert failed not in [dict(p) for p in card.family.points] and "d0=" in verdict.reason
    t = by_name("elementwise.unary")  # the size-generic control passes the same checks
    control = familyeval.evaluate(evaluator, card, t.render(card, "cpu", {}), bench=False)
    assert control.accepted, control.reason


def test_exact_shape_cards_keep_todays_renders_and_needs(fams):
    card = _pick(fams, "aten.mul.Tensor", "f32[64], f32[1,8,64]")
    exact = families.members_at_points(card)[0]
    t = by_name("elementwise.binary")
    src = t.render(exact, "cpu", {})
    shape = exact.outputs[0].shape
    assert "fp_geom" not in src and f"call->outputs[0].sizes[1] != {shape[1]}LL" in src  # sizes baked in
    assert t.needs(exact, "cuda", {}) == needs.default(exact)  # today's captured-offset rule
    assert t.needs(exact, "cpu", {}) == needs.natural(exact)  # a CPU render's plain loops
    assert t.needs(card, "cpu", {}) == Needs((Align(4), Align(4)))  # element alignment of each input
    rows = _pick(fams, "aten.mean.dim", "f32[1,8,64]")
    assert by_name("rowreduce.reduce").needs(rows, "cuda", {}) == Needs((Align(4),))


def test_templates_without_a_generic_kernel_refuse_family_cards(fams):
    mm = next(c for c in fams if c.op == "aten.mm.default")
    names = ("gemm.mm_unaligned", "gemm.mm_unaligned_wgmma")
    reasons = [by_name(n).supports(on_device(mm, "cuda"), "cuda") for n in names]
    assert all(r and "size-generic" in r for r in reasons), reasons


def test_row_reductions_whose_row_length_varies_are_refused(fams):
    rows = _pick(fams, "aten.mean.dim", "f32[1,8,64]")
    x = rows.family.inputs[0]
    varying = dataclasses.replace(rows.family, inputs=(dataclasses.replace(x, shape=(*x.shape[:-1], "d1")),))
    card = dataclasses.replace(rows, family=varying)
    assert "row length varies" in by_name("rowreduce.reduce").supports(card, "cpu")


def _rows_family(op, make_args):
    """One op captured at (batch, seq) = (1, 3), (2, 8), (4, 5) over rows of 48: a family of row counts."""

    calls = [dataclasses.replace(card_from_call(op, make_args(torch.randn(b, s, 48)), {})[0], calls=1)
             for b, s in ((1, 3), (2, 8), (4, 5))]
    (card,) = families.fold(calls)
    return card


ROW_CASES = {
    "softmax": (torch.ops.aten._softmax.default, lambda x: (x, -1, False)),
    "layer_norm": (torch.ops.aten.native_layer_norm.default,
                   lambda x: (x, [48], torch.randn(48), torch.randn(48), 1e-5)),
}


@pytest.mark.parametrize("name", list(ROW_CASES))
def test_generic_softmax_and_layer_norm_verify_at_every_check_point(name, evaluator):
    op, make_args = ROW_CASES[name]
    card = _rows_family(op, make_args)
    assert card.family is not None and len(card.family.dims) == 2
    (t,) = [t for t in templates_for(card, "cpu") if t.name.startswith("rowreduce.")]
    verdict = familyeval.evaluate(evaluator, card, t.render(card, "cpu", {}), bench=False)
    assert verdict.accepted, verdict.reason
    assert compile_kernel(t.render(on_device(card, "cuda"), "cuda", t.default(on_device(card, "cuda"), "cuda")),
                          "cuda", arch="sm_90").ok or shutil.which("nvcc") is None


def _timed(speedup, eager, low=None):
    return Verdict(True, None, "ok", {"verification": {}}, eager_us=eager, kernel_us=eager / speedup,
                   speedup=speedup, ci_low=low or speedup * 0.95, ci_high=speedup * 1.05)


def test_envelope_speedup_weights_points_by_their_eager_time(fams):
    card = _silu(fams)
    points = [dict(p) for p in card.family.points]
    calls = card.family.point_calls
    speeds = [2.0, 0.5, 1.0, 1.5, 3.0]
    eager = [10.0, 20.0, 15.0, 40.0, 100.0]
    verdicts = [(p, _timed(s, e)) for p, s, e in zip(points, speeds, eager, strict=True)]
    verdicts.append(({d.name: d.min + 1 for d in card.family.dims}, Verdict(True, None, "verified")))  # untimed
    folded = familyeval._folded(card, verdicts, points, margin=0.05, bench=True, skipped=[])
    eager_total = sum(c * e for c, e in zip(calls, eager, strict=True))
    kernel_total = sum(c * e / s for c, e, s in zip(calls, eager, speeds, strict=True))
    # it loses at some points: kept for a sub-range (tests/test_subrange.py); the whole range's figure stays
    assert folded.diagnostics["family"]["whole"]["speedup"] == pytest.approx(eager_total / kernel_total)
    per_point = folded.diagnostics["family"]["points"]
    assert [p["speedup"] for p in per_point] == speeds and len(folded.diagnostics["family"]["checked"]) == 6
    # profile's weights, when set, are the eager-time shares: all the weight on the 0.5x point
    weighted = dataclasses.replace(card, family=dataclasses.replace(card.family, point_weights=(0, 1, 0, 0, 0)))
    slow = familyeval._folded(weighted, verdicts, points, margin=0.05, bench=True, skipped=[])
    assert slow.diagnostics["family"]["whole"]["speedup"] == pytest.approx(0.5)
    assert slow.speedup == pytest.approx(0.5) and not slow.accepted and slow.category == "slower"  # no sub-range pays
    # winning everywhere, the figure is the whole range's
    fast = [(p, _timed(s, e)) for p, s, e in zip(points, [2.0, 1.5, 1.2, 1.5, 3.0], eager, strict=True)]
    folded = familyeval._folded(card, fast, points, margin=0.05, bench=True, skipped=[])
    kernel_total = sum(c * e / s for c, e, s in zip(calls, eager, [2.0, 1.5, 1.2, 1.5, 3.0], strict=True))
    assert folded.speedup == pytest.approx(eager_total / kernel_total) and "served" not in folded.diagnostics["family"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_generic_cuda_kernels_compile_for_sm90(fams):
    sources = []
    for card in (on_device(c, "cuda") for c in fams):
        for t in templates_for(card, "cuda"):
            params = t.default(card, "cuda")
            sources.append(t.render(card, "cuda", params))
            assert "fp_geom" in sources[-1]
            needs.validate(t.needs(card, "cuda", params), card)  # every generic template states valid needs
            far = _far_point(t.space(card, "cuda"), params)
            if far != params:  # the searched corners compile too: several vectors per thread, cache hints
                sources.append(t.render(card, "cuda", far))
    assert len(sources) >= 30
    rc, log = compile_unit(sources)
    assert rc == 0, log
    res = compile_kernel(sources[0], "cuda", arch="sm_90")  # the real compile path and its static checks
    assert res.ok, res.log


def _far_point(axes: dict, params: dict) -> dict:
    """`params` with the most vectors per thread and the last cache hints the template searches."""
    return {**params, **{k: axes[k][-1] for k in ("unroll", "ld", "st") if k in axes}}


def _decode_family():
    """mm(x, w.t()) at batch 1..8 of a bf16 decode step: the row count is the family's one dim."""

    w = torch.randn(200, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    calls = [card_from_call(torch.ops.aten.mm.default, (torch.randn(m, 96).to(torch.bfloat16), w.t()), {})[0]
             for m in (1, 2, 5, 8)]
    calls = [dataclasses.replace(c, calls=1) for c in calls]
    (card,) = families.fold(calls)
    return on_device(card, "cuda")


def test_decode_products_of_any_row_count_render_one_kernel_per_row_count():
    card = _decode_family()
    assert [(d.min, d.max) for d in card.family.dims] == [(1, 8)]
    t = by_name("gemm.mv_rows")
    src = t.render(card, "cuda", t.default(card, "cuda"))
    assert "template <int M>" in src and "case 8: fp_gemv<8>" in src and "call->inputs[0].sizes[0] != " not in src
    assert t.needs(card, "cuda", {}) == Needs((Align(16), Align(16)))
    wide = dataclasses.replace(card, family=dataclasses.replace(
        card.family, dims=(dataclasses.replace(card.family.dims[0], max=16),)))
    assert "more than 8 rows" in t.supports(wide, "cuda")
    if shutil.which("nvcc"):
        res = compile_kernel(src, "cuda", arch="sm_90")
        assert res.ok, res.log


@pytest.mark.gpu
def test_generic_cuda_kernels_verify_at_every_check_point_on_the_gpu(fams):
    picks = [("aten.mul.Tensor", "f32[64], f32[1,8,64]", "elementwise.binary"),
             ("aten.cat.default", ":(256,8,32,1)", "elementwise.cat"),
             ("aten.silu.default", "f32", "elementwise.unary"),
             ("aten.mean.dim", "f32[1,8,64]", "rowreduce.reduce")]
    with Evaluator("cuda", timeout_s=120) as ev:
        for op, part, name in picks:
            card = on_device(_pick(fams, op, part), "cuda")
            t = by_name(name)
            default = t.default(card, "cuda")
            for params in (default, {**default, "vec": 1}, _far_point(t.space(card, "cuda"), default)):
                verdict = familyeval.evaluate(ev, card, t.render(card, "cuda", params), bench=False)
                assert verdict.accepted, f"{name} {params}: {verdict.reason}"
        card = _decode_family()
        t = by_name("gemm.mv_rows")
        verdict = familyeval.evaluate(ev, card, t.render(card, "cuda", t.default(card, "cuda")), bench=True)
        assert verdict.category in (None, "slower"), verdict.reason
        assert len(verdict.diagnostics["family"]["points"]) == 4  # a speed-up per captured row count


def test_the_decode_cache_cat_family_verifies_at_every_check_point(evaluator):
    """The decode cache's cat folds into one family whose output length is derived (past + 1); the
    size-generic cat kernel serves it at every check point, output length computed from the inputs."""
    cat = torch.ops.aten.cat.default
    calls = [card_from_call(cat, ([torch.randn(b, 2, n, 8), torch.randn(b, 2, 1, 8)], -2), {})[0]
             for b in (1, 2, 4) for n in (8, 9, 29, 64)]
    (card,) = families.fold(calls)
    assert any(d.derived for d in card.family.dims)
    t = by_name("elementwise.cat")
    assert t in templates_for(card, "cpu")
    verdict = familyeval.evaluate(evaluator, card, t.render(card, "cpu", t.default(card, "cpu")), bench=False)
    assert verdict.accepted, verdict.reason
    assert len(verdict.diagnostics["family"]["checked"]) == len(families.check_points(card))


def _integer_families():
    """generate()'s integer bookkeeping at batch 1..4: the last position + 1 (a slice of the growing
    position buffer, free row stride), `unfinished * next`, a 0-dim pad times a row, `x + 1`."""
    long = torch.long
    add, mul = torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor
    g = torch.Generator().manual_seed(0)

    def ints(*shape):
        return torch.randint(-(2**40), 2**40, shape, generator=g)

    calls = []
    for b, n in ((1, 8), (2, 9), (4, 29), (3, 17)):
        calls.append(card_from_call(add, (torch.ones(1, 1, dtype=long), ints(b, n)[:, -1:]), {})[0])
        calls.append(card_from_call(mul, (ints(b), ints(b)), {})[0])
        calls.append(card_from_call(mul, (torch.tensor(7, dtype=long), ints(b)), {})[0])
        calls.append(card_from_call(add, (ints(b, 1), 1), {})[0])
    return families.fold(calls)


def test_integer_add_and_mul_families_are_exact_at_every_check_point(evaluator):
    """Integer results are computed in integers (wrapping as aten's), never through float: a float path
    would round values past 2**24 and fail the exact comparison."""
    fams = _integer_families()
    assert len(fams) == 4 and all(c.family is not None for c in fams)
    t = by_name("elementwise.binary")
    for card in fams:
        assert t in templates_for(card, "cpu"), t.supports(card, "cpu")
        src = t.render(card, "cpu", t.default(card, "cpu"))
        assert "const int64_t a0 = (int64_t)" in src and "(uint64_t)a0" in src  # loaded and computed as integers
        verdict = familyeval.evaluate(evaluator, card, src, bench=False)
        assert verdict.accepted, f"{card.signature()}: {verdict.reason}"
    exact = card_from_call(torch.ops.aten.add.Tensor, (torch.ones(2, 3, dtype=torch.long), 1), {})[0]
    assert "family kernels only" in t.supports(exact, "cpu")
    if shutil.which("nvcc"):
        card = on_device(fams[1], "cuda")
        res = compile_kernel(t.render(card, "cuda", t.default(card, "cuda")), "cuda", arch="sm_90")
        assert res.ok, res.log


def test_a_cast_to_bool_family_is_exact_at_every_check_point(evaluator):
    """generate()'s attention mask, `mask.to(torch.bool)` of the growing int64 mask (and a float's too):
    the bool is the value != 0, through float (a NaN is true, -0.0 false), so any int64 keeps its answer;
    a kernel that kept only the low byte would make 256 false."""
    src_dtypes = {"int64": lambda b, n: torch.randint(-3, 300, (b, n)), "float32": lambda b, n: torch.randn(b, n)}
    t = by_name("elementwise.copy")
    for dtype, make in src_dtypes.items():
        calls = [card_from_call(torch.ops.aten._to_copy.default, (make(b, n),), {"dtype": torch.bool})[0]
                 for b, n in ((1, 9), (2, 17), (4, 30), (3, 12))]
        (card,) = families.fold(calls)
        assert card.family is not None and card.outputs[0].dtype == "bool"
        src = t.render(card, "cpu", t.default(card, "cpu"))
        verdict = familyeval.evaluate(evaluator, card, src, bench=False)
        assert verdict.accepted, f"{dtype}: {verdict.reason}"
        if dtype == "int64":  # the cheat: the low byte's truth
            low_byte = src.replace("fp_ld(x0_[", "fp_ld((uint8_t)x0_[")
            assert low_byte != src
            assert familyeval.evaluate(evaluator, card, low_byte, bench=False).category == "mismatch"
        if shutil.which("nvcc"):
            cuda = on_device(card, "cuda")
            res = compile_kernel(t.render(cuda, "cuda", t.default(cuda, "cuda")), "cuda", arch="sm_90")
            assert res.ok, res.log


def test_a_family_of_many_points_is_timed_at_a_spread_and_weighs_every_point():
    """A decode family has a captured point per (batch, cache length): timing each made a build's
    evaluation scale with the steps generate() ran. A spread of `MAX_TIMED_POINTS` by bytes is timed,
    every captured point still verified, and each untimed point's eager time (scaled by bytes from the
    nearest timed one) weighs on that one's speed-up."""
    cat = torch.ops.aten.cat.default
    calls = [card_from_call(cat, ([torch.randn(b, 2, n, 8), torch.randn(b, 2, 1, 8)], -2), {})[0]
             for b in (1, 2, 4) for n in (8, 9, 29, 64)]
    (card,) = families.fold(calls)
    points = [dict(p) for p in card.family.points]
    timed = familyeval.timed_points(card)
    assert len(points) == 12 and len(timed) == familyeval.MAX_TIMED_POINTS
    sizes = sorted(familyeval._bytes(card, p) for p in points)
    assert familyeval._bytes(card, timed[0]) == sizes[0] and familyeval._bytes(card, timed[-1]) == sizes[-1]
    assert all(p in families.check_points(card) for p in points)  # verified at every captured point
    verdicts = [(p, _timed(2.0 if k == len(timed) - 1 else 1.0, 10.0)) for k, p in enumerate(timed)]
    folded = familyeval._folded(card, verdicts, timed, margin=0.05, bench=True, skipped=[])
    weights = [p["weight"] for p in folded.diagnostics["family"]["points"]]
    assert sum(weights) == pytest.approx(1.0) and len(weights) == len(timed)
    assert min(weights) > 0 and max(weights) > 1.5 * min(weights)  # some stand for untimed neighbours too
    assert folded.speedup == pytest.approx(1 / (1 - weights[-1] + weights[-1] / 2.0))


def test_a_family_member_stock_computes_otherwise_rejects_the_card_and_not_the_build(evaluator):
    """A family no op computes (Phi-3's two rotary cats as one, which the fold no longer makes): at the
    check point where stock's output has other sizes than the family's, the candidate is rejected with
    the reason, where the verifier's error used to end the whole build."""
    calls = phi3_rotary_cats()
    family = families.explain(calls)
    assert family is not None and len(family.dims) == 4
    card = families._family_card(calls, family)
    t = by_name("elementwise.cat")
    verdict = familyeval.evaluate(evaluator, card, t.render(card, "cpu", t.default(card, "cpu")), bench=False)
    assert not verdict.accepted and verdict.category == "mismatch"
    assert "the family does not describe the op here: the stock op gave" in verdict.reason


def test_a_kernel_right_only_at_16_byte_aligned_pointers_keeps_its_inputs_at_their_verified_offsets(fams, evaluator):
    """A family template states that its kernel needs each input at element alignment only, so the guard
    would admit a checkpoint's weight at 8 mod 16. Every check point is laid out at its captured offset;
    the member moved one element along (`shifted_member`) is what holds the statement to account. A
    kernel that rounds its input pointer down to 16 bytes is right at every check point and wrong there:
    it is accepted, but not as element-aligned (the guard then keeps today's rule)."""
    card = _pick(fams, "aten.mul.Tensor", "f32[64], f32[1,8,64]")
    t = by_name("elementwise.binary")
    honest = t.render(card, "cpu", t.default(card, "cpu"))
    line = "p.in1 = (const float*)call->inputs[1].data;"
    rounded = honest.replace(line, "p.in1 = (const float*)((uintptr_t)call->inputs[1].data & ~(uintptr_t)15);")
    assert line in honest and rounded != honest
    moved = familyeval.shifted_member(families.member(card, dict(card.family.points[0])))
    assert all(m.storage_offset == 1 for m in moved.tensor_inputs())
    for source, aligned_only in ((honest, True), (rounded, False)):
        verdict = familyeval.evaluate(evaluator, card, source, bench=False)
        assert verdict.accepted, verdict.reason
        stored = {"diagnostics": verdict.diagnostics}
        assert familyeval.element_aligned(stored) is aligned_only, verdict.diagnostics["element_aligned"]


def test_an_exact_cpu_kernel_serves_a_weight_at_8_mod_16_only_once_checked_there(fams, evaluator):
    """A CPU render is plain loops, so its template states element alignment for an exact card too, and a
    checkpoint's weight that `from_pretrained` leaves at 8 mod 16 hits the kernel captured from it. The
    statement is held to account as a family's is: the accepted kernel is verified again with every input
    one element along. The rounding kernel is right at the captured offsets only: accepted, and kept
    there (`element_aligned` false, so the search gives the guard today's rule)."""
    exact = families.members_at_points(_pick(fams, "aten.mul.Tensor", "f32[64], f32[1,8,64]"))[0]
    t = by_name("elementwise.binary")
    assert t.needs(exact, "cpu", {}) == needs.natural(exact) != needs.default(exact)
    honest = t.render(exact, "cpu", t.default(exact, "cpu"))
    line = "p.in1 = (const float*)call->inputs[1].data;"
    rounded = honest.replace(line, "p.in1 = (const float*)((uintptr_t)call->inputs[1].data & ~(uintptr_t)15);")
    assert line in honest and rounded != honest
    for source, aligned_only in ((honest, True), (rounded, False)):
        verdict = familyeval.evaluate(evaluator, exact, source, bench=False)
        assert verdict.accepted, verdict.reason
        assert familyeval.element_aligned({"diagnostics": verdict.diagnostics}) is aligned_only, verdict.diagnostics
    # a CUDA render's vectors are laid out for the captured offsets: its verdict is left as it is
    cuda = types.SimpleNamespace(target="cuda")
    assert familyeval._exact_element_aligned(cuda, exact, None, rounded, 0.05, verdict) is verdict
