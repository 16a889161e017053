"""Fusion families: the same module-level chain captured at several points of a serving envelope folds
into one family card (`families.fold`), whose kernel reads the rows at run time, is verified over the
range (`familyeval`), and is served by the pack's fused op for any size its guard binds.

A tiny Llama (float32, cpu) at the capture points of a generate envelope, through the real capture,
fold, templates, verifier, builder and pack loader."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_envelope import TINY, _recipe
from test_pack_fused import _stage

from forgepack import families, familyeval, fusion, models, profile
from forgepack.compile import compile_kernel
from forgepack.evaluate import Evaluator
from forgepack.pack import fusedgen
from forgepack.templates import by_name, templates_for

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = {"phase": "generate", "batch": {"min": 1, "max": 3}, "seq_len": {"min": 4, "max": 16}, "new_tokens": 3}


@pytest.fixture(scope="module")
def envelope():
    """(recipe, the build's fusion cards, every exact card any point found) for the tiny generate envelope."""
    r = _recipe(**WORKLOAD)
    per_point: list = []
    with models.quiet_transformers():
        lm = models.load(r)
        profile.capture_envelope(lm, lambda *_: None, per_point)
        result = fusion.build_points(lm.model, per_point, lm.device, None, [])
        exact = {}
        for cap, run, _ in per_point:
            candidates, _ = fusion.find(cap)
            for card in fusion.check_and_sample(lm.model, run, fusion.group(cap, candidates)).cards:
                exact[card.id] = card
    return r, result.cards, list(exact.values())


@pytest.fixture(scope="module")
def evaluator():
    with Evaluator("cpu", timeout_s=120) as ev:
        yield ev


def _family(cards, pattern: str):
    return next(c for c in cards if c.fusion.pattern == pattern and c.family is not None)


def _decode_rotary(exact):
    """The decode steps' rotary folded alone: a family of the batch axis only (one token each)."""
    steps = [c for c in exact if c.fusion.pattern == "rotary" and c.tensor_inputs()[0].shape[2] == 1]
    (card,) = [c for c in families.fold(steps) if c.family is not None]
    return card


@pytest.mark.parametrize("pattern", ["rmsnorm", "gated_act"])
def test_members_at_the_captured_points_are_the_captured_cards(envelope, pattern):
    """A member is laid out by replaying the chain on the meta device: at every captured point it is the
    card capture made there, chain, digest and id alike; the family's dims bind each captured card."""
    _, cards, exact = envelope
    card = _family(cards, pattern)
    captured = {c.id: c for c in exact if c.fusion.pattern == pattern}
    members = families.members_at_points(card)
    assert len(members) == len(card.family.points) >= 4
    for member in members:
        want = captured[member.id]
        assert member.chain == want.chain
        assert [a.key() for a in member.args] == [a.key() for a in want.args]  # all but the value statistics
        assert families.bind(card, want.tensor_inputs()) is not None
    assert set(captured) == {m.id for m in members}


def test_a_chain_holding_a_size_in_its_values_does_not_fold(envelope):
    """Two points' chains that differ in a non-tensor value (a `view` to the batch's shape, say) are not
    one family: the value would be wrong at every other size. Here one point's mean is made to reduce
    another dim, and the two stay exact."""
    _, _, exact = envelope
    norms = sorted((c for c in exact if c.fusion.pattern == "rmsnorm"), key=lambda c: c.tensor_inputs()[0].shape)
    a, b = norms[0], norms[-1]
    assert len(families.fold([a, b])) == 1 and families.fold([a, b])[0].family is not None
    k = next(i for i, e in enumerate(b.chain) if e.op == "aten.mean.dim")
    entry = b.chain[k]
    args = tuple(dataclasses.replace(x, value=[1]) if x.name == "dim" else x for x in entry.args)
    other = dataclasses.replace(b, chain=(*b.chain[:k], dataclasses.replace(entry, args=args), *b.chain[k + 1:]))
    assert all(c.family is None for c in families.fold([a, other]))


@pytest.mark.parametrize("pattern,template", [("rmsnorm", "fused.rows"), ("gated_act", "fused.pointwise"),
                                              ("rotary", "fused.indexed")])
def test_family_fused_kernels_verify_at_every_check_point(envelope, evaluator, pattern, template):
    _, cards, _ = envelope
    card = _family(cards, pattern)
    t = by_name(template)
    # the first template a search tries (fused.indexed computes an elementwise chain too, with scalar loads)
    assert templates_for(card, "cpu")[0].name == template
    src = t.render(card, "cpu", t.default(card, "cpu"))
    assert "fp_geom" in src  # the sizes are read at run time
    verdict = familyeval.evaluate(evaluator, card, src, bench=False)
    assert verdict.accepted, verdict.reason
    checked = verdict.diagnostics["family"]["checked"]
    assert len(checked) == len(families.check_points(card)) >= 8
    assert {d.name: d.max for d in card.family.dims} in checked


def test_a_bf16_decode_rotary_folds_though_a_size_1_axis_stride_differs_from_its_meta_replay():
    """In bf16 on CPU (and on CUDA) the decode step's rotate_half `neg` keeps its input's stride on the
    size-1 token axis where the meta kernel writes another: no element lies along that axis, so the fold's
    replay check must not tell the two apart (it did, and every rotary stayed exact per batch)."""
    r = _recipe(**{**WORKLOAD, "dtype": "bfloat16"})
    per_point: list = []
    with models.quiet_transformers():
        lm = models.load(r)
        profile.capture_envelope(lm, lambda *_: None, per_point)
        cards = fusion.build_points(lm.model, per_point, lm.device, None, []).cards
    (rotary,) = [c for c in cards if c.fusion.pattern == "rotary"]
    assert [(d.min, d.max) for d in rotary.family.dims] == [(1, 3), (1, 16)]
    assert rotary.args[0].tensor.dtype == "bfloat16"


def test_a_fused_family_covers_the_operator_families_inside_it_at_every_point():
    """The real envelope pipeline: the fused RMSNorm family runs every call of the mean and rsqrt families
    (all their calls are inside its chains, at every captured point), so once its kernel is accepted the
    allocator spends nothing on them (`test_allocator` has the case where only a non-representative point
    matches)."""
    from forgepack.search import allocator

    r = _recipe(**WORKLOAD)
    per_point: list = []
    with models.quiet_transformers():
        lm = models.load(r)
        ops = profile.capture_envelope(lm, lambda *_: None, per_point).cards
        fused = fusion.build_points(lm.model, per_point, lm.device, None, []).cards
    norm = _family(fused, "rmsnorm")
    cover = allocator.coverage([*ops, *fused])
    inside = [c for c in ops if c.family is not None and c.op in ("aten.mean.dim", "aten.rsqrt.default")]
    assert inside and all(dict(cover[c.id]).get(norm.id, 0.0) == pytest.approx(1.0) for c in inside), \
        [(c.signature(), cover.get(c.id)) for c in inside]


def test_a_decode_rotary_family_runs_the_batch_1_kernel_per_batch_index(envelope, evaluator):
    """A decode step's rotary varies only the batch, the outermost axis of every tensor: `fused.indexed`
    renders the batch-1 member's index math (its sizes and strides constants) and moves each pointer by
    its tensor's batch stride."""
    _, _, exact = envelope
    t = by_name("fused.indexed")
    card = _decode_rotary(exact)
    assert [d.name for d in card.family.dims] == ["d0"] and card.tensor_inputs()[0].shape[2] == 1
    src = t.render(card, "cpu", t.default(card, "cpu"))
    assert "bt < nb_" in src and "p.n_d0" not in src
    verdict = familyeval.evaluate(evaluator, card, src, bench=False)
    assert verdict.accepted, verdict.reason


@pytest.mark.parametrize("pattern", ["rotary", "chain"])
def test_a_prefill_rotary_family_reads_batch_and_tokens_at_run_time(envelope, evaluator, pattern):
    """Every point's rotary (and its cos/sin tables' chain) folds into one family over batch and tokens,
    an inner axis: `fused.indexed` knows each chain value's sizes per axis as fixed or one dim's (the
    chain replayed at three points), reads the dims and every stride from the descriptors, and keeps as
    constants only what its index math needs (rotate_half's slices and cat along the fixed head dim). It
    is verified at every check point of the range."""
    _, cards, _ = envelope
    card = _family(cards, pattern)
    assert [d.name for d in card.family.dims] == ["d0", "d1"]
    t = by_name("fused.indexed")
    src = t.render(card, "cpu", t.default(card, "cpu"))
    assert "p.n_d1" in src and "bt < nb_" not in src
    verdict = familyeval.evaluate(evaluator, card, src, bench=False)
    assert verdict.accepted, verdict.reason
    assert {d.name: d.max for d in card.family.dims} in verdict.diagnostics["family"]["checked"]


@pytest.mark.parametrize("cheat", ["captured tokens", "captured strides"])
def test_an_inner_axis_rotary_right_only_at_one_capture_point_is_rejected(envelope, evaluator, cheat):
    """The size-generic rotary with one run-time value baked in as the representative member's: the
    token count it walks, or q's batch stride (which is heads x tokens x head dim). Each is right at the
    member it was taken from and wrong elsewhere in the range, so family verification rejects it."""
    _, cards, _ = envelope
    card = _family(cards, "rotary")
    t = by_name("fused.indexed")
    src = t.render(card, "cpu", t.default(card, "cpu"))
    values = dict(card.family.points[0])
    rep = families.member(card, values)
    if cheat == "captured tokens":
        line = "p.n_d1 = (fp_idx)n_d1_;"
        bad = src.replace(line, f"p.n_d1 = {values['d1']}u;")
    else:
        line = "p.s0_0 = (fp_idx)call->inputs[0].strides[0];"
        bad = src.replace(line, f"p.s0_0 = {rep.tensor_inputs()[0].stride[0]}u;")
    assert line in src and bad != src
    assert evaluator.evaluate(rep, bad, bench=False).accepted  # right where it was taken from
    verdict = familyeval.evaluate(evaluator, card, bad, bench=False)
    assert not verdict.accepted and verdict.category == "mismatch", verdict.reason


def test_the_indexed_render_refuses_a_family_that_varies_an_axis_its_index_math_fixes(envelope):
    """rotate_half's slices and cat split the head dim at constants: were that axis a family dim, the
    split point would move with the sizes. The size-generic emitter refuses such a chain, and says why
    (here the rotary's sizes with the head dim made a dim)."""
    from forgepack.templates import fused

    _, cards, _ = envelope
    card = _family(cards, "rotary")
    sized = fused._sized(card)
    head = card.outputs[0].shape[-1]
    moved = {ref: (*shape[:-1], "d1") if shape and shape[-1] == head else shape for ref, shape in sized.shapes.items()}
    em = fused._FamilyEmitter(card, fused.entries(card), "cpu", dataclasses.replace(sized, shapes=moved))
    with pytest.raises(fused.Refused, match="along a varying axis"):
        em.value(card.fusion.outputs[0], [f"c{d}_" for d in range(4)], [], {})


def test_a_row_kernel_right_only_at_the_captured_rows_is_rejected(envelope, evaluator):
    """The size-generic RMSNorm with its row loop cut to the smallest captured row count: every member of
    that size passes today's checks, the family's verification finds the rows it leaves unwritten."""
    _, cards, _ = envelope
    card = _family(cards, "rmsnorm")
    t = by_name("fused.rows")
    src = t.render(card, "cpu", t.default(card, "cpu"))
    rows = min(m.tensor_inputs()[0].numel // m.tensor_inputs()[0].shape[-1] for m in families.members_at_points(card))
    loop = "row < g.numel;"
    assert src.count(loop) == 1
    cheat = src.replace(loop, f"row < (g.numel < {rows}u ? g.numel : {rows}u);")
    small = next(m for m in families.members_at_points(card)
                 if m.tensor_inputs()[0].numel // m.tensor_inputs()[0].shape[-1] == rows)
    assert evaluator.evaluate(small, cheat, bench=False).accepted  # right where the rows are the captured ones
    verdict = familyeval.evaluate(evaluator, card, cheat, bench=False)
    assert not verdict.accepted and verdict.category == "mismatch", verdict.reason
    failed = verdict.diagnostics["family"]["failed_at"]
    assert failed["d0"] * failed["d1"] > rows  # a member with more rows than the cut loop writes


SERVE = r"""
import json, torch
from transformers import LlamaConfig, LlamaForCausalLM
import forgepack_pack_tiny_env as pack
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
out = {}
for batch, seq in SIZES:
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq))
    with torch.no_grad():
        stock = model(ids).logits
        pack.activate(strict=True)
        before = {k: v["hits"] for k, v in pack.stats().items()}
        served = model(ids).logits
        hits = {k: v["hits"] - before[k] for k, v in pack.stats().items()}
        pack.deactivate()
    scale = float(stock.abs().max())
    out[f"{batch}x{seq}"] = {"hits": hits, "same": bool(torch.equal(stock, served)),
                             "err": float((stock - served).abs().max()) / scale}
print(json.dumps(out))
"""


def test_the_pack_serves_family_fused_kernels_at_sizes_no_capture_saw(envelope, tmp_path):
    """Batch 2 x 11 tokens and 3 x 13 were never captured: inside the families' ranges the fused op binds
    their dims and serves every RMSNorm and gated activation; batch 5 and 40 tokens lie outside, and
    the originals run there, bit for bit."""
    r, cards, _ = envelope
    fams = [c for c in cards if c.family is not None]
    pkg = _stage(tmp_path, r, fams)
    spec = json.loads((pkg / "forgepack_pack_tiny_env" / "modules.json").read_text())
    assert all("shapes" not in v for v in spec["variants"])  # a family lists no sizes: its guard binds them
    sizes = [(2, 11), (3, 13), (5, 7), (1, 40)]
    env = {k: v for k, v in os.environ.items() if k != "FORGEPACK_DISABLE"}
    env["PYTHONPATH"] = os.pathsep.join([str(pkg), str(REPO)])
    code = f"CONFIG = {TINY!r}\nSIZES = {sizes!r}\n" + SERVE
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    layers = TINY["num_hidden_layers"]
    norm, act = _family(fams, "rmsnorm").id, _family(fams, "gated_act").id
    for inside in ("2x11", "3x13"):
        assert res[inside]["hits"][norm] == 2 * layers + 1 and res[inside]["hits"][act] == layers
        assert res[inside]["err"] < 1e-5
    for outside in ("5x7", "1x40"):
        assert not any(res[outside]["hits"].values()) and res[outside]["same"]
    from typer.testing import CliRunner

    from forgepack.cli import app

    shown = CliRunner().invoke(app, ["inspect", str(pkg / "forgepack_pack_tiny_env")], terminal_width=300)
    assert shown.exit_code == 0, shown.output
    assert norm in shown.output and "d0 in 1..3" in shown.output  # the fused family, with its ranges


def test_family_fused_variants_guard_in_cpp_by_binding_dims(envelope):
    """The generated fused op binds a family variant's dims from its inputs (ranges, strides, the kernel's
    alignment need) and allocates its outputs at the bound sizes; exact variants keep their exact specs."""
    _, cards, _ = envelope
    fam = _family(cards, "rmsnorm")
    exact = next(c for c in envelope[2] if c.fusion.pattern == "rmsnorm")
    t = by_name("fused.rows")
    code = fusedgen.generate([fusedgen.FusedVariant(fam, "kernels/a.so", t.needs(fam, "cpu", {})),
                              fusedgen.FusedVariant(exact, "kernels/b.so")], "forgepack_t", "cpu")
    ranges = ", ".join(f"{{{d.min}, {d.max}}}" for d in fam.family.dims)
    assert f"constexpr fpg::DimRange f0_ranges[] = {{{ranges}}};" in code
    assert "constexpr fpg::FamilySpec f0_ins[]" in code and "constexpr fpg::TensorSpec f1_ins[]" in code
    assert "fpg::alloc(kBackend, device, v.fouts[j], dv)" in code


def _cuda_params(t, card) -> list[dict]:
    """The default point, and its scalar-access twin where the template has a vector axis."""
    first = t.default(card, "cuda")
    return [first, {**first, "vec": 1}] if "vec" in first else [first]


def _cuda_family(envelope, pattern: str):
    """The envelope's family of this pattern on cuda; "decode rotary": the decode steps' alone (batch only)."""
    from forgepack.templates import on_device

    _, cards, exact = envelope
    return on_device(_decode_rotary(exact) if pattern == "decode rotary" else _family(cards, pattern), "cuda")


CUDA_CASES = [("rmsnorm", "fused.rows"), ("gated_act", "fused.pointwise"), ("rotary", "fused.indexed"),
              ("chain", "fused.indexed"), ("decode rotary", "fused.indexed")]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("pattern,template", CUDA_CASES)
def test_family_fused_cuda_kernels_compile_for_sm90(envelope, pattern, template):
    card = _cuda_family(envelope, pattern)
    t = by_name(template)
    assert t in templates_for(card, "cuda")
    for params in _cuda_params(t, card):
        src = t.render(card, "cuda", params)
        assert "fp_geom" in src
        res = compile_kernel(src, "cuda", arch="sm_90")
        assert res.ok, res.log


@pytest.mark.gpu
@pytest.mark.parametrize("pattern,template", CUDA_CASES)
def test_family_fused_cuda_kernels_verify_at_every_check_point_on_the_gpu(envelope, pattern, template):
    card = _cuda_family(envelope, pattern)
    t = by_name(template)
    with Evaluator("cuda", timeout_s=120) as ev:
        for params in _cuda_params(t, card):
            verdict = familyeval.evaluate(ev, card, t.render(card, "cuda", params), bench=False)
            assert verdict.accepted, f"{params}: {verdict.reason}"


def test_a_batched_rotary_kernel_that_serves_batch_0_only_is_rejected(envelope, evaluator):
    """The batched indexed kernel with its batch loop cut to the first batch index: the batch-1 member
    passes today's checks, the family's verification finds the other batches' outputs unwritten."""
    card = _decode_rotary(envelope[2])
    t = by_name("fused.indexed")
    src = t.render(card, "cpu", t.default(card, "cpu"))
    assert src.count("bt < nb_") == 1
    cheat = src.replace("bt < nb_", "bt < 1")
    one = families.member(card, {card.family.dims[0].name: 1})
    assert evaluator.evaluate(one, cheat, bench=False).accepted
    verdict = familyeval.evaluate(evaluator, card, cheat, bench=False)
    assert not verdict.accepted and verdict.category == "mismatch", verdict.reason
    assert verdict.diagnostics["family"]["failed_at"][card.family.dims[0].name] > 1


@pytest.mark.parametrize("fault", ["no meta kernel", "wrong layout"])
def test_a_chain_whose_meta_replay_fails_or_differs_stays_exact(envelope, monkeypatch, fault):
    """Folding checks that the meta replay lays out every captured member as capture did; a chain with
    an op that has no meta kernel, or one whose replay gives other layouts, is served exactly instead."""
    from forgepack import opcall

    _, _, exact = envelope
    norms = [c for c in exact if c.fusion.pattern == "rmsnorm"]
    assert any(c.family is not None for c in families.fold(norms))
    real = opcall.chain_layouts

    def faulty(card):
        if fault == "no meta kernel":
            raise NotImplementedError("aten::op has no meta kernel")
        return [[(shape, tuple(s + 1 for s in stride), offset) for shape, stride, offset in outs]
                for outs in real(card)]

    monkeypatch.setattr(opcall, "chain_layouts", faulty)
    folded = families.fold(norms)
    assert all(c.family is None for c in folded) and {c.id for c in folded} == {c.id for c in norms}


HELD_OUT = {
    "gemma2": ("Gemma2ForCausalLM", {"model_type": "gemma2", "head_dim": 8, "query_pre_attn_scalar": 8}),
    "phi3": ("Phi3ForCausalLM", {"model_type": "phi3", "pad_token_id": 0}),  # fused qkv and gate_up buffers
}


@pytest.mark.parametrize("name", sorted(HELD_OUT))
def test_held_out_architectures_fold_their_chains_and_verify_over_the_range(name, evaluator):
    """Gemma-2's RMSNorm scales by (1 + w); Phi-3 takes q, k and v as views of one fused buffer, so a
    batch-1 step's views are contiguous and a batch-3 step's have the buffer's row as stride. Both fold
    RMSNorm and the decode steps' rotary into families, and each verifies at every check point."""
    arch, extra = HELD_OUT[name]
    config = {k: v for k, v in TINY.items() if k != "model_type"} | extra
    r = dataclasses.replace(_recipe(**WORKLOAD), name=f"tiny-{name}")
    r = dataclasses.replace(r, model=dataclasses.replace(r.model, arch=arch, config=config))
    per_point: list = []
    with models.quiet_transformers():
        lm = models.load(r)
        profile.capture_envelope(lm, lambda *_: None, per_point)
        result = fusion.build_points(lm.model, per_point, lm.device, None, [])
    fams = {c.fusion.pattern: c for c in result.cards if c.family is not None}
    assert {"rmsnorm", "rotary"} <= set(fams) and not result.dropped
    for card in fams.values():
        t = templates_for(card, "cpu")[0]
        verdict = familyeval.evaluate(evaluator, card, t.render(card, "cpu", t.default(card, "cpu")), bench=False)
        assert verdict.accepted, f"{card.fusion.pattern}: {verdict.reason}"


def test_fusion_family_cards_round_trip_through_the_workspace_json(envelope):
    """What the build writes and the search, the builder and `forgepack inspect` read back."""
    import json

    from forgepack import cards as cards_mod

    _, cards, _ = envelope
    assert any(c.family is not None for c in cards)
    for card in cards:
        back = cards_mod.from_json(json.loads(json.dumps(cards_mod.to_json(card))))
        assert back == card and back.id == card.id
