"""Kernel templates: registry, refusals, parameter spaces, and correctness through the real verifier.

CPU kernels are verified by `forgepack.evaluate.Evaluator("cpu")` (fresh and edge inputs against stock
PyTorch) on synthetic cards covering each template's claims and on every served variant of tiny
models captured for real. CUDA kernels are rendered at several parameter points and compiled for
sm_90 here (nvcc can build without a GPU); the `gpu` tests verify them on a GPU.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from cuda_units import compile_units

from forgepack import capture, samples
from forgepack.capture import card_from_call
from forgepack.templates import FAMILIES, REGISTRY, by_name, neighbours, on_device, refusals, templates_for
from forgepack.templates.common import CPU_PRELUDE

A = torch.ops.aten
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _x(*shape, dtype=F32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# (expected template, op, args, kwargs): the variants each template claims, several shapes/dtypes/layouts.
def _cases():
    cases = []
    for dt in (F32, BF16, F16):
        keep = len(cases)
        x = _x(4, 6, 40, dtype=dt)
        t = x.transpose(1, 2)
        cases += [
            ("elementwise.unary", A.gelu.default, (x,), {"approximate": "tanh"}),
            ("elementwise.unary", A.gelu.default, (x,), {}),
            ("elementwise.unary", A.silu.default, (t,), {}),
            ("elementwise.unary", A.sigmoid.default, (x,), {}),
            ("elementwise.unary", A.pow.Tensor_Scalar, (x, 2), {}),
            ("elementwise.unary", A.pow.Tensor_Scalar, (x, 3), {}),
            ("elementwise.unary", A.pow.Tensor_Scalar, (x, 0.5), {}),
            ("elementwise.binary", A.add.Tensor, (x, x[:, :1]), {"alpha": 2}),
            ("elementwise.binary", A.mul.Tensor, (x[0, 0], x), {}),
            ("elementwise.binary", A.div.Tensor, (x, 3.0), {}),
            ("elementwise.binary", A.sub.Tensor, (x, t.transpose(1, 2).contiguous()), {}),
            ("elementwise.copy", A._to_copy.default, (x,), {"dtype": F32 if dt != F32 else BF16}),
            ("elementwise.copy", A.clone.default, (t,), {"memory_format": torch.contiguous_format}),
            # A batched transpose whose extents allow 16-byte vectors on both sides of the tile.
            ("elementwise.copy", A.clone.default, (_x(2, 16, 24, dtype=dt).transpose(1, 2),),
             {"memory_format": torch.contiguous_format}),
            ("elementwise.cat", A.cat.default, ([x[..., :8], t.transpose(1, 2)[..., 8:24]], -1), {}),
            ("rowreduce.softmax", A._softmax.default, (x, -1, False), {}),
            ("rowreduce.softmax", A._log_softmax.default, (x.transpose(0, 1), 2, False), {}),
            ("rowreduce.reduce", A.mean.dim, (x, [-1], True), {}),
            ("rowreduce.reduce", A.amax.default, (x, [-1], False), {}),
            ("rowreduce.layer_norm", A.native_layer_norm.default,
             (x, [40], _x(40, dtype=dt), _x(40, dtype=dt), 1e-5), {}),
            ("rowreduce.layer_norm", A._fused_rms_norm.default, (x, [40], _x(40, dtype=dt), 1e-6), {}),
        ]
        img = _x(2, 8, 7, 9, dtype=dt)
        c8 = [_x(8, dtype=dt, seed=s) for s in range(3)] + [torch.rand(8).to(dt) + 0.5]
        cases += [
            ("norm.batch_norm", A.native_batch_norm.default, (img, *c8, False, 0.1, 1e-5), {}),
            ("norm.batch_norm", A._native_batch_norm_legit_no_training.default,
             (img.contiguous(memory_format=torch.channels_last), None, *c8[1:], 0.1, 1e-5), {}),
            ("norm.group_norm", A.native_group_norm.default, (img, c8[0], c8[1], 2, 8, 63, 4, 1e-5), {}),
            ("pool.adaptive_avg", A._adaptive_avg_pool2d.default, (img, [1, 1]), {}),
            ("pool.adaptive_avg", A._adaptive_avg_pool2d.default, (img, [3, 4]), {}),
            ("pool.max2d", A.max_pool2d_with_indices.default, (img, [3, 3], [2, 2], [1, 1]), {}),
            # NCHW with W and OW multiples of 8: vector loads of input rows, vector stores of outputs.
            ("pool.max2d", A.max_pool2d_with_indices.default, (_x(2, 3, 16, 32, dtype=dt), [3, 3], [2, 2], [1, 1]),
             {}),
            ("pool.max2d", A.max_pool2d_with_indices.default,
             (img.contiguous(memory_format=torch.channels_last), [2, 3], [1, 2], [1, 0], [2, 1], True), {}),
        ]
        if dt != F32:  # nn.Linear's mm(x, w.t()) into rows of an odd width (an LM head's vocabulary)
            cases.append(("gemm.mm_unaligned", A.mm.default, (_x(40, 64, dtype=dt), _x(37, 64, dtype=dt, seed=1).t()),
                          {}))
            if dt == BF16:  # one row (a decode step's LM head) and the shallowest K: a single 16-deep slice
                cases.append(("gemm.mm_unaligned", A.mm.default,
                              (_x(1, 16, dtype=dt), _x(300, 16, dtype=dt, seed=2)[:, :].t()[:, :299]), {}))
        if dt == F16:  # float16 shares bfloat16's code paths except for rounding: a sample keeps CI short
            cases[keep:] = cases[keep::3]
    # Channels-last activations (a ResNet served channels-last): walked in memory order, n h w c.
    cl = _x(2, 8, 5, 6, dtype=F16).contiguous(memory_format=torch.channels_last)
    cl2 = _x(2, 8, 5, 6, dtype=F16, seed=1).contiguous(memory_format=torch.channels_last)
    cases += [
        ("elementwise.unary", A.relu.default, (cl,), {}),
        ("elementwise.binary", A.add.Tensor, (cl, cl2), {}),
        ("elementwise.binary", A.mul.Tensor, (cl, _x(8, 1, 1, dtype=F16)), {}),
        ("elementwise.binary", A.add.Tensor, (cl, _x(2, 8, 5, 6, dtype=F16)), {}),  # mixed layouts
        # Other permuted layouts: the output's stride order decides the walk, inputs follow.
        ("elementwise.unary", A.relu.default, (_x(3, 5, 7).permute(2, 0, 1),), {}),
        ("elementwise.binary", A.mul.Tensor, (_x(4, 6, 8).permute(1, 2, 0), _x(6, 8, 4)), {}),
        ("elementwise.binary", A.sub.Tensor, (_x(6, 4, 8).transpose(0, 1), _x(4, 1, 8)), {"alpha": 3}),
    ]
    x = _x(3, 5, 64)
    cases += [
        ("elementwise.unary", A.relu.default, (x,), {}),
        ("elementwise.unary", A.tanh.default, (x,), {}),
        ("elementwise.unary", A.neg.default, (x[..., 8:],), {}),
        ("elementwise.unary", A.rsqrt.default, (x.abs(),), {}),
        ("elementwise.unary", A.exp.default, (x,), {}),
        ("elementwise.unary", A.pow.Tensor_Scalar, (x, 1.7), {}),
        ("elementwise.binary", A.add.Tensor, (x, 1e-6), {}),
        ("elementwise.binary", A.mul.Tensor, (x.bfloat16(), x[0, 0]), {}),
        ("elementwise.copy", A._to_copy.default, (torch.arange(16).view(1, 16, 1),), {"dtype": F32}),
        ("elementwise.cat", A.cat.default, ([torch.empty(0), x, x.bfloat16()], 1), {}),
        ("rowreduce.reduce", A.sum.dim_IntList, (x, [-1], True), {}),
        ("rowreduce.reduce", A.mean.dim, (_x(2, 8, 4, 4), [-1, -2], True), {}),
        ("rowreduce.softmax", A._softmax.default, (_x(3, 5000), -1, False), {}),
        ("rowreduce.layer_norm", A.native_layer_norm.default, (x, [5, 64], None, None, 1e-5), {}),
        ("norm.batch_norm", A.native_batch_norm.default,
         (_x(2, 8, 5, 5).bfloat16(), _x(8), _x(8), _x(8), torch.rand(8) + 0.5, False, 0.1, 1e-5), {}),
        ("norm.group_norm", A.native_group_norm.default, (_x(2, 6, 5, 5), None, None, 2, 6, 25, 3, 1e-6), {}),
    ]
    return cases


CASES = _cases()

# Hopper's GEMM (wgmma) serves the same products on cuda only, where K is a multiple of 64: an odd
# width, and rows of M past a warpgroup's 64.
WGMMA = "gemm.mm_unaligned_wgmma"
WGMMA_CASES = [
    (WGMMA, A.mm.default, (_x(40, 64, dtype=BF16), _x(37, 64, dtype=BF16, seed=1).t()), {}),
    (WGMMA, A.mm.default, (_x(130, 128, dtype=F16), _x(299, 128, dtype=F16, seed=3).t()), {}),
]


# A decode step's products (at most 8 rows), on cuda only: one row and a Llama-like projection (aligned
# output, where cuBLAS's tiles leave the GPU idle), eight rows into an odd width, fp16 and a K that is
# not a multiple of the lanes' 256-element stride.
GEMV = "gemm.mv_rows"
GEMV_CASES = [
    (GEMV, A.mm.default, (_x(1, 512, dtype=BF16), _x(256, 512, dtype=BF16, seed=4).t()), {}),
    (GEMV, A.mm.default, (_x(8, 96, dtype=BF16), _x(37, 96, dtype=BF16, seed=5).t()), {}),
    (GEMV, A.mm.default, (_x(3, 200, dtype=F16), _x(130, 200, dtype=F16, seed=6).t()), {}),
]


def _served_on_cuda(expected: str, card) -> list[str]:
    """What the cuda target should offer for a case: wgmma joins the GEMM where K is a multiple of 64,
    and the decode template where there are at most 8 rows."""
    if not expected.startswith("gemm."):
        return [expected]
    (m, k) = card.tensor_inputs()[0].shape
    return ["gemm.mm_unaligned"] + ([WGMMA] if k % 64 == 0 else []) + ([GEMV] if m <= 8 else [])


def _card(op, args, kwargs):
    return card_from_call(op, args, kwargs)[0]


@pytest.fixture(scope="module")
def evaluator():
    from forgepack.evaluate import Evaluator

    with Evaluator("cpu") as ev:
        yield ev


# --- registry ------------------------------------------------------------------------------------

REQUIRED_OPS = {
    "elementwise": ["aten.gelu.default", "aten.silu.default", "aten.relu.default", "aten.sigmoid.default",
                    "aten.tanh.default", "aten.neg.default", "aten.rsqrt.default", "aten.exp.default",
                    "aten.pow.Tensor_Scalar", "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor",
                    "aten.div.Tensor", "aten._to_copy.default", "aten.clone.default", "aten.cat.default"],
    "rowreduce": ["aten._softmax.default", "aten._log_softmax.default", "aten.native_layer_norm.default",
                  "aten._fused_rms_norm.default", "aten.sum.dim_IntList", "aten.mean.dim", "aten.amax.default"],
    "norm": ["aten.native_group_norm.default", "aten.native_batch_norm.default",
             "aten._native_batch_norm_legit_no_training.default", "aten.cudnn_batch_norm.default"],
    "pool": ["aten._adaptive_avg_pool2d.default", "aten.max_pool2d_with_indices.default"],
    "fused": ["fusion.rmsnorm.default", "fusion.rotary.default", "fusion.gated_act.default",
              "fusion.bn_act.default", "fusion.add_act.default", "fusion.gelu_tanh.default"],
    "gemm": ["aten.mm.default"],
}


def test_registry_is_complete():
    names = [t.name for t in REGISTRY]
    assert len(names) == len(set(names)), "template names must be unique"
    assert set(FAMILIES) >= set(REQUIRED_OPS)
    assert {t.family for t in REGISTRY} >= set(REQUIRED_OPS)
    for t in REGISTRY:
        assert t.ops, f"{t.name} declares no ops"
        assert t.name.startswith(t.family + "."), t.name
        # every template serves both targets, except where the cuda kernel is a vendor instruction's
        # (wgmma) or the remedy for a GPU's idle bandwidth (one row's product streams at memory speed
        # through the CPU's BLAS already)
        assert set(t.targets) == ({"cuda"} if t.name in (WGMMA, GEMV) else {"cuda", "cpu"}), t.name
    for family, ops in REQUIRED_OPS.items():
        served = {op for t in REGISTRY if t.family == family for op in t.ops}
        missing = set(ops) - served
        assert not missing, f"family {family} lacks templates for {sorted(missing)}"
    for op in {op for t in REGISTRY for op in t.ops}:
        ns, name, overload = op.split(".")
        if hasattr(getattr(torch.ops, ns), name):  # ops this torch build lacks are still declared
            assert hasattr(getattr(getattr(torch.ops, ns), name), overload), f"{op} is not a real overload"


def test_every_case_is_claimed_by_its_template():
    for expected, op, args, kwargs in CASES:
        card = _card(op, args, kwargs)
        served = [t.name for t in templates_for(card, "cpu")]
        why = refusals(card, "cpu")
        assert served == [expected], f"{card.op} [{card.signature()}]: served by {served}, refusals {why}"
        cuda = on_device(card, "cuda")
        assert [t.name for t in templates_for(cuda, "cuda")] == _served_on_cuda(expected, cuda)
    for _, op, args, kwargs in WGMMA_CASES:
        card = _card(op, args, kwargs)
        assert [t.name for t in templates_for(card, "cpu")] == ["gemm.mm_unaligned"]
        assert WGMMA in [t.name for t in templates_for(on_device(card, "cuda"), "cuda")]
    for _, op, args, kwargs in GEMV_CASES:
        card = on_device(_card(op, args, kwargs), "cuda")
        assert GEMV in [t.name for t in templates_for(card, "cuda")]
    nine = on_device(_card(A.mm.default, (_x(9, 64, dtype=BF16), _x(64, 64, dtype=BF16).t()), {}), "cuda")
    assert "more than 8 rows" in by_name(GEMV).supports(nine, "cuda")


# --- refusals --------------------------------------------------------------------------------------

REFUSED = [
    (A._softmax.default, (_x(4, 8), 0, False), {}, "other than the last"),
    (A.sum.dim_IntList, (_x(4, 8, 3), [1], False), {}, "trailing"),
    (A.native_batch_norm.default, (_x(2, 4, 3, 3), _x(4), _x(4), _x(4), torch.rand(4) + 1, True, 0.1, 1e-5), {},
     "training"),
    (A.add_.Tensor, (_x(4, 8), _x(4, 8)), {}, "not aten.add_.Tensor"),
    (A.neg.default, (torch.arange(8),), {}, "float"),
    (A._to_copy.default, (_x(4, 8),), {"dtype": torch.int32}, "cast"),
    (A.mean.dim, (_x(4, 8), [-1], False), {"dtype": torch.float64}, "dtype"),
    (A.amax.default, (_x(4, 8), [], False), {}, "full reductions"),
    (A.native_layer_norm.default, (_x(4, 8, 6).transpose(1, 2), [6, 8], None, None, 1e-5), {}, "strided"),
    (A._fused_rms_norm.default, (_x(4, 8), [8], None, None), {}, "eps"),
    (A.native_group_norm.default, (_x(2, 4, 3, 3).contiguous(memory_format=torch.channels_last), None, None,
                                   2, 4, 9, 2, 1e-5), {}, "contiguous"),
    (A.mm.default, (_x(16, 32, dtype=BF16), _x(64, 32, dtype=BF16).t()), {}, "cuBLAS serves"),
    (A.mm.default, (_x(8, 32, dtype=BF16), _x(32, 63, dtype=BF16)), {}, "transposed K-contiguous weight"),
    (A.mm.default, (_x(8, 32), _x(63, 32).t()), {}, "float16/bfloat16"),
]


@pytest.mark.parametrize(("op", "args", "kwargs", "why"), REFUSED, ids=[r[0].__name__ for r in REFUSED])
def test_refuses_what_it_cannot_compute_exactly(op, args, kwargs, why):
    card = _card(op, args, kwargs)
    for target in ("cpu", "cuda"):
        c = card if target == "cpu" else on_device(card, "cuda")
        assert templates_for(c, target) == []
        reasons = [t.supports(c, target) for t in REGISTRY]
        assert all(isinstance(r, str) and r for r in reasons)
        assert any(why in r for r in reasons), reasons


def test_refuses_cpu_gelu_where_aten_is_position_dependent():
    # Some torch builds' CPU GELU returns NaN at +inf on its vectorised path and inf on its scalar one
    # (torch 2.13's gives inf on both): the template asks aten, and refuses a strided layout only there.
    from forgepack.templates import elementwise

    card = _card(A.gelu.default, (_x(8, 6).t(),), {})
    vector_nan = bool(torch.isnan(torch.nn.functional.gelu(torch.full((64,), float("inf")))[:32]).any())
    assert elementwise._aten_cpu_gelu_inf_is_nan() == vector_nan
    refusal = by_name("elementwise.unary").supports(card, "cpu")
    assert ("position-dependent" in refusal) if vector_nan else refusal is None
    assert by_name("elementwise.unary").supports(on_device(card, "cuda"), "cuda") is None


def test_device_and_target_must_agree():
    card = _card(A.relu.default, (_x(4, 8),), {})
    assert "target is cuda" in by_name("elementwise.unary").supports(card, "cuda")
    with pytest.raises(ValueError, match="does not serve"):
        by_name("elementwise.unary").render(card, "cuda", {})


# --- parameter spaces ------------------------------------------------------------------------------


def test_spaces_defaults_and_neighbours():
    for expected, op, args, kwargs in CASES[:30]:
        card = on_device(_card(op, args, kwargs), "cuda")
        t = by_name(expected)
        space, first = t.space(card, "cuda"), t.default(card, "cuda")
        assert space and set(first) == set(space)
        assert all(first[k] in v for k, v in space.items())
        near = neighbours(t, card, "cuda", first)
        assert near, f"{expected}: no neighbours"
        for p in near:
            assert sum(p[k] != first[k] for k in space) == 1
            assert all(p[k] in v for k, v in space.items())
        cpu_card = _card(op, args, kwargs)
        cpu_space, cpu_first = t.space(cpu_card, "cpu"), t.default(cpu_card, "cpu")
        assert set(cpu_first) == set(cpu_space) and all(cpu_first[k] in v for k, v in cpu_space.items())
        for p in neighbours(t, cpu_card, "cpu", cpu_first):  # every cpu point renders, each its own source
            assert t.render(cpu_card, "cpu", p) != t.render(cpu_card, "cpu", cpu_first)
    card = on_device(_card(A.relu.default, (_x(4, 8),), {}), "cuda")
    t = by_name("elementwise.unary")
    with pytest.raises(ValueError, match="not one of"):
        t.render(card, "cuda", {**t.default(card, "cuda"), "block": 3})
    with pytest.raises(ValueError, match="do not match"):
        t.render(card, "cuda", {"block": 256})


def test_channels_last_jobs_walk_memory_order_and_vectorise():
    # A channels-last add with a per-channel operand: walked n, h, w, c it is one contiguous run for
    # the output and the input, and the channel operand is the inner stride-1 dim, so 16-byte vectors
    # apply. Walked n, c, h, w (logical order) every store would be strided by C.
    cl = _x(2, 16, 5, 6, dtype=F16).contiguous(memory_format=torch.channels_last)
    card = _card(A.mul.Tensor, (cl, _x(16, 1, 1, dtype=F16)), {})
    t = by_name("elementwise.binary")
    (job,) = t.plan(card, "cpu")
    assert job.shape == (2 * 5 * 6, 16)
    assert job.out.strides == (16, 1) and job.ins[0].strides == (16, 1) and job.ins[1].strides == (0, 1)
    assert job.best_vec(8) == 8


def test_vector_width_respects_alignment_and_layout():
    t = by_name("elementwise.unary")
    x = _x(4, 64, dtype=BF16)
    assert t.space(on_device(_card(A.neg.default, (x,), {}), "cuda"), "cuda")["vec"] == [1, 2, 4, 8]
    # A view starting 3 elements in (6 bytes) can only be read element by element.
    assert t.space(on_device(_card(A.neg.default, (x[:, 3:35],), {}), "cuda"), "cuda")["vec"] == [1]
    # Row stride 66 elements: 2-element (4-byte) vectors at most.
    padded = on_device(_card(A.neg.default, (_x(4, 66, dtype=BF16)[:, :64],), {}), "cuda")
    assert t.space(padded, "cuda")["vec"] == [1, 2]
    src = t.render(on_device(_card(A.neg.default, (x,), {}), "cuda"), "cuda", {"block": 128, "vec": 8, "unroll": 2})
    assert "% 16u == 0" in src and "fp_pointwise<false>" in src  # run-time alignment check, scalar fallback


# --- correctness through the real verifier (cpu) ---------------------------------------------------


@pytest.mark.parametrize("case", range(len(CASES)))
def test_cpu_kernels_pass_the_verifier(case, evaluator):
    expected, op, args, kwargs = CASES[case]
    card = _card(op, args, kwargs)
    t = by_name(expected)
    verdict = evaluator.evaluate(card, t.render(card, "cpu", t.default(card, "cpu")), bench=False)
    assert verdict.accepted, f"{expected} on {card.op} [{card.signature()}]: {verdict.category}: {verdict.reason}"


# Verification seeds whose structured input made a row of equal values, where the norm kernels used to
# fail: the unshifted mean's rounding times rstd = 1/sqrt(eps), and stock's own folded-affine rounding.
NORM_SEEDS = [("f32[2,8,7,9], f32[8], f32[8], N=2", s) for s in (6, 15851, 126717, 1704675123)] + [
    ("f32[2,6,5,5], N=2", s) for s in (15851, 95041)]


@pytest.mark.parametrize(("signature", "seed"), NORM_SEEDS)
def test_group_norm_kernels_pass_on_rows_of_equal_values(signature, seed, evaluator, monkeypatch):
    from forgepack import evaluate

    (case,) = [c for c in CASES if c[0] == "norm.group_norm" and _card(*c[1:]).signature().startswith(signature)]
    expected, op, args, kwargs = case
    card = _card(op, args, kwargs)
    t = by_name(expected)
    monkeypatch.setattr(evaluate.secrets, "randbelow", lambda n: seed)
    verdict = evaluator.evaluate(card, t.render(card, "cpu", t.default(card, "cpu")), bench=False)
    assert verdict.accepted and verdict.diagnostics["seed"] == seed, verdict.reason


def test_verifier_catches_a_wrong_template_kernel(evaluator):
    """The test above can fail: a subtly wrong kernel (GELU-tanh rendered for an exact-GELU card) is rejected."""
    exact = _card(A.gelu.default, (_x(4, 64),), {})
    tanh = _card(A.gelu.default, (_x(4, 64),), {"approximate": "tanh"})
    t = by_name("elementwise.unary")
    verdict = evaluator.evaluate(exact, t.render(tanh, "cpu", t.default(tanh, "cpu")), bench=False)
    assert not verdict.accepted and verdict.category in ("mismatch", "crash")


@pytest.mark.parametrize("recipe_name", ["tiny-llama", "tiny-resnet", "tiny-bert"])
def test_every_served_variant_of_a_captured_model_verifies(recipe_name, evaluator, tmp_path):
    from forgepack import models
    from forgepack import recipe as recipe_mod

    r = recipe_mod.resolve(recipe_name)
    with models.quiet_transformers():
        lm = models.load(r)
        cap = capture.capture(lm.model, lm.forward)
    served = 0
    for card in cap.cards:
        found = templates_for(card, "cpu")
        if not found:
            continue
        path = tmp_path / f"{card.id}.safetensors"
        card = dataclasses.replace(card, samples=samples.save_samples(path, cap.samples[card.id]))
        for t in found:
            # the default and every point next to it: each cpu point of the space computes the op
            for p in [t.default(card, "cpu"), *neighbours(t, card, "cpu", t.default(card, "cpu"))]:
                verdict = evaluator.evaluate(card, t.render(card, "cpu", p), samples_path=path, bench=False)
                assert verdict.accepted, f"{t.name} {p} on {card.op} [{card.signature()}]: {verdict.reason}"
            served += 1
    assert served >= {"tiny-llama": 15, "tiny-resnet": 4, "tiny-bert": 5}[recipe_name]


def test_an_odd_vocabulary_lm_head_is_served_by_the_gemm(evaluator, tmp_path):
    """GPT-2's LM head as the model really calls it (tied weight, mm(x, w.t()) into vocab-wide rows):
    captured, claimed by the GEMM template on both targets, and verified on its captured inputs."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=1001, n_positions=32)
    model = GPT2LMHeadModel(cfg).eval().to(BF16)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cap = capture.capture(model, lambda: model(input_ids=ids))
    heads = [c for c in cap.cards if c.op == "aten.mm.default" and c.outputs[0].shape == (32, 1001)]
    assert len(heads) == 1, [c.signature() for c in cap.cards if "mm" in c.op]
    card = heads[0]
    assert [t.name for t in templates_for(card, "cpu")] == ["gemm.mm_unaligned"]
    assert [t.name for t in templates_for(on_device(card, "cuda"), "cuda")] == ["gemm.mm_unaligned", WGMMA]
    path = tmp_path / "head.safetensors"
    card = dataclasses.replace(card, samples=samples.save_samples(path, cap.samples[card.id]))
    t = by_name("gemm.mm_unaligned")
    verdict = evaluator.evaluate(card, t.render(card, "cpu", {}), samples_path=path, bench=False)
    assert verdict.accepted, verdict.reason


# --- CUDA sources compile for sm_90 (no GPU needed) ------------------------------------------------

def _first_dtype(args):
    first = args[0][0] if isinstance(args[0], list) else args[0]
    return first.dtype


CUDA_CASES = [c for c in CASES if _first_dtype(c[2]) == BF16 or c[0] in ("rowreduce.softmax", "norm.group_norm")]
CUDA_CASES += WGMMA_CASES + GEMV_CASES


# Axes whose every value is rendered (from the default point), not only at the corners: the cache
# policies and block order of streaming jobs, max pool's thread tiles and load vectors, the
# transpose's tile, vector width and block order.
SWEPT_AXES = ("ld", "st", "order", "owt", "oht", "lvec", "tile", "group")


def _cuda_points(t, card) -> list[dict]:
    """The default, both corners (smallest and largest on every axis), and every value of SWEPT_AXES
    (with `vec` too where there is a tile) set on the default."""
    space, first = t.space(card, "cuda"), t.default(card, "cuda")
    pts = [first, {k: v[0] for k, v in space.items()}, {k: v[-1] for k, v in space.items()}]
    swept = [k for k in space if k in SWEPT_AXES or (k == "vec" and "tile" in space)]
    pts += [{**first, k: v} for k in swept for v in space[k]]
    unique = []
    for p in pts:
        if p not in unique:
            unique.append(p)
    return unique


def _cuda_sources() -> list[tuple[str, str]]:
    """Every CUDA case at the points `_cuda_points` picks."""
    out = []
    for expected, op, args, kwargs in CUDA_CASES:
        card = on_device(_card(op, args, kwargs), "cuda")
        t = by_name(expected)
        for params in _cuda_points(t, card):
            out.append((f"{expected} {card.op} {params}", t.render(card, "cuda", params)))
    return out


def test_new_axes_are_rendered_at_every_value():
    """The sources compiled below include every value of each swept axis (so a broken variant fails here)."""
    seen: dict[str, set] = {}
    for expected, op, args, kwargs in CUDA_CASES:
        card = on_device(_card(op, args, kwargs), "cuda")
        for p in _cuda_points(by_name(expected), card):
            for k in SWEPT_AXES:
                if k in p:
                    seen.setdefault(k, set()).add(p[k])
    assert seen["ld"] == {"plain", "nc", "cs"} and seen["st"] == {"plain", "cs"}
    assert seen["order"] == {"split", "interleave"}
    assert seen["owt"] >= {1, 2, 4, 8} and seen["oht"] >= {1, 2} and seen["lvec"] >= {1, 2, 4, 8}
    assert seen["tile"] >= {0, 32, 64, 128} and seen["group"] == {1, 8, 32}


def test_new_variants_render_what_they_claim():
    card = on_device(_card(A.max_pool2d_with_indices.default, (_x(2, 3, 16, 32, dtype=BF16), [3, 3], [2, 2], [1, 1]),
                           {}), "cuda")
    t = by_name("pool.max2d")
    src = t.render(card, "cuda", {"block": 128, "owt": 4, "oht": 2, "lvec": 8})
    assert "fp_vec<__nv_bfloat16, 8>" in src and "fp_vec<int64_t, 4>" in src and "fp_maxpool<false>" in src
    tr = on_device(_card(A.clone.default, (_x(2, 16, 24, dtype=BF16).transpose(1, 2),),
                         {"memory_format": torch.contiguous_format}), "cuda")
    c = by_name("elementwise.copy")
    assert c.space(tr, "cuda")["vec"] == [1, 2, 4, 8]
    src = c.render(tr, "cuda", {**c.default(tr, "cuda"), "tile": 64, "vec": 8})
    assert "fp_transpose<8, 256>" in src and "fp_transpose<1, 256>" in src
    x = _x(64, 256, dtype=BF16)
    cat = on_device(_card(A.cat.default, ([x[:, :128].contiguous(), x[:, :64].contiguous()], -1), {}), "cuda")
    k = by_name("elementwise.cat")
    src = k.render(cat, "cuda", {**k.default(cat, "cuda"), "ld": "nc", "st": "cs", "order": "interleave"})
    assert "ld.global.nc.L1::no_allocate.L2::256B.v4.u32" in src and "st.global.cs.v4.u32" in src
    assert "switch (b % 2u)" in src
    assert "asm" not in k.render(cat, "cuda", k.default(cat, "cuda"))  # the default stays plain C++


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_sources_compile_for_sm90():
    sources = _cuda_sources()
    assert len(sources) >= 60
    batches = [sources[i:i + 12] for i in range(0, len(sources), 12)]
    results = compile_units([[s for _, s in batch] for batch in batches], workers=max(1, min(4, os.cpu_count() or 1)))
    for batch, (rc, log) in zip(batches, results, strict=True):
        assert rc == 0, f"nvcc failed on one of {[n for n, _ in batch]}:\n{log}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_sources_pass_static_checks_and_the_real_compile():
    from forgepack import staticcheck
    from forgepack.compile import compile_kernel

    picks = ["elementwise.cat", "rowreduce.layer_norm", "norm.group_norm", "pool.max2d", WGMMA, GEMV]
    sources = []
    for name in picks:
        _expected, op, args, kwargs = next(c for c in CUDA_CASES if c[0] == name)
        card = on_device(_card(op, args, kwargs), "cuda")
        t = by_name(name)
        sources.append(t.render(card, "cuda", t.default(card, "cuda")))
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda s: compile_kernel(s, "cuda", arch="sm_90"), sources))
    for name, src, res in zip(picks, sources, results, strict=True):
        assert staticcheck.check_source(src, "cuda") == [], name
        assert res.ok, f"{name}: {res.log}"
        assert staticcheck.check_object(res.binary, "cuda", src) == [], name


def test_cpu_prelude_is_shared():
    card = _card(A.relu.default, (_x(4, 8),), {})
    assert by_name("elementwise.unary").render(card, "cpu", {}).startswith(CPU_PRELUDE)


# --- on a GPU: the CUDA kernels pass the verifier at several parameter points -----------------------


def _to_cuda(args):
    def move(a):
        if isinstance(a, torch.Tensor):
            return a.cuda()
        if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            return [t.cuda() for t in a]
        return a

    return tuple(move(a) for a in args)


@pytest.mark.gpu
def test_cuda_kernels_pass_the_verifier():
    """Every case on the GPU at the `_cuda_points` points, compiled in parallel, then verified.
    Batch norm offers two formulas (aten's CUDA and CPU ones): the CUDA one must pass everywhere."""
    from forgepack.compile import compile_kernel
    from forgepack.evaluate import Evaluator

    cases = [(e, op, _to_cuda(args), kw) for e, op, args, kw in CASES + WGMMA_CASES + GEMV_CASES]
    img = torch.randn(2, 8, 7, 9, device="cuda", dtype=F16)
    stats = [torch.randn(8, device="cuda") for _ in range(3)] + [torch.rand(8, device="cuda") + 0.5]  # cuDNN: fp32
    cases.append(("norm.batch_norm", A.cudnn_batch_norm.default, (img, *stats, False, 0.1, 1e-5), {}))
    jobs, failures = [], []
    for expected, op, args, kwargs in cases:
        card = _card(op, args, kwargs)
        t = by_name(expected)
        reason = t.supports(card, "cuda")
        if reason is not None and expected == "norm.batch_norm" and "saved statistics" in reason:
            # aten's CUDA eval batch norm returns uninitialised [C] tensors as saved statistics on some
            # builds (torch 2.11: `at::empty`, never written): no kernel can match garbage, so the
            # template refuses and BN is served through the fused bn_act cards instead
            print(f"note: {card.op} refused here: {reason}")
            continue
        if reason is not None:
            failures.append(f"{expected} refuses {card.op} [{card.signature()}]: {reason}")
            continue
        space = t.space(card, "cuda")
        tried = _cuda_points(t, card)
        for form in space.get("form", [None]):
            for params in tried:
                params = {**params, "form": form} if form else params
                jobs.append((expected, card, form, params, t.render(card, "cuda", params)))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objects = list(pool.map(lambda j: compile_kernel(j[4], "cuda"), jobs))
    by_form: dict[tuple[str, str], list[str]] = {}  # (card id, batch-norm formula) -> failures
    with Evaluator("cuda") as ev:
        for (expected, card, form, params, source), obj in zip(jobs, objects, strict=True):
            verdict = ev.evaluate_compiled(card, obj, source, bench=False)
            lines = by_form.setdefault((card.id, form), []) if form else failures
            if not verdict.accepted:
                lines.append(f"{expected} {card.op} [{card.signature()}] {params}: {verdict.reason}")
    for (card_id, form), lines in by_form.items():
        other = by_form.get((card_id, "scale_shift" if form == "sub_mul" else "sub_mul"), [])
        cudnn = "cudnn_batch_norm" in card_id
        if lines and ((form == "sub_mul" and not cudnn) or (cudnn and other)):
            failures += lines
        elif lines:
            print(f"note: formula {form} does not match aten here: {lines[0]}")
    assert not failures, "\n".join(failures)


def test_wgmma_follows_the_target_arch_not_this_host(monkeypatch):
    """The arch comes from the recipe or the profiled GPU (passed in), never from probing this host."""
    from forgepack import compile as compile_mod
    from forgepack.search.proposers import NothingToPropose, make
    from forgepack.search.tree import params_key

    monkeypatch.setattr(compile_mod, "default_arch", lambda: pytest.fail("a template probed this host's GPU"))
    _, op, args, kwargs = WGMMA_CASES[0]
    card = on_device(_card(op, args, kwargs), "cuda")
    for arch in ("sm_90", "sm_90a"):
        assert WGMMA in [t.name for t in templates_for(card, "cuda", arch)]
    assert [t.name for t in templates_for(card, "cuda", "sm_80")] == ["gemm.mm_unaligned"]
    assert "needs sm_90; the target is sm_80" in refusals(card, "cuda", "sm_80")[WGMMA]
    offered = set()
    for arch in ("sm_80", "sm_90"):
        proposer, tried = make("templates", target="cuda", arch=arch), set()
        while True:
            try:
                p = proposer.propose(card, None, [], [], frozenset(tried))
            except NothingToPropose:
                break
            tried.add(params_key(p.params))
            offered.add((arch, p.params["template"]))
    assert ("sm_90", WGMMA) in offered and ("sm_80", WGMMA) not in offered
