"""The pack manifest: a typed value that round-trips through its TOML file."""

from __future__ import annotations

import pytest
import torch

from forgepack.capture import card_from_call
from forgepack.pack import manifest as manifest_mod
from forgepack.pack.manifest import GateSummary, Manifest, OutputTolerance, PackFile, PackVariant, Provenance
from forgepack.runtime.packinfo import GraphVerdict


def _variant(func, *args, **kwargs) -> PackVariant:
    card = card_from_call(func, args, kwargs)[0]
    return PackVariant(
        id=card.id, op=card.op, schema=card.schema, signature=card.signature(), args=card.args,
        outputs=card.outputs, kernel=f"kernels/{card.id}.so", source=f"sources/{card.id}.cu",
        tolerance=tuple(OutputTolerance(o.dtype, 1e-5, 1e-5) for o in card.outputs), speedup=1.7, ci_low=1.5,
        ci_high=1.9, eager_us=10.0, kernel_us=5.9, proposer="templates:softmax", calls=12,
        modules=("model.layers.*.self_attn",), e2e_ratio=1.012,
    )


def _manifest() -> Manifest:
    x = torch.randn(4, 8)[:, 1:5]
    variants = (
        _variant(torch.ops.aten._softmax.default, torch.randn(2, 8), -1, False),
        _variant(torch.ops.aten.native_layer_norm.default, torch.randn(2, 8), [8], torch.randn(8), None, 1e-5),
        _variant(torch.ops.aten.add.Tensor, x, 1e-6),
        _variant(torch.ops.aten.cat.default, [torch.randn(2, 3), torch.randn(2, 3)], 1),
        _variant(torch.ops.aten._to_copy.default, torch.randn(3), dtype=torch.bfloat16),
        _variant(torch.ops.aten.gt.Scalar, torch.tensor([1.0, float("inf"), float("nan")]), 0.5),
    )
    return Manifest(
        name="forgepack_pack_demo", slug="demo", version="0.1.0.20261130+torch2.13.cu130", target="cuda",
        arch="sm_90", torch="2.13.0+cu130", cuda="13.0", cxx11_abi=True, platform="linux_x86_64", python="3.12",
        namespace="forgepack_demo", shim="shim/libforgepack_shim.so", shim_source="sources/shim.cpp",
        model={"recipe": "demo", "source": "inline:LlamaForCausalLM", "config": {"hidden_size": 64, "name": 'a "q"'}},
        workload={"task": "causal-lm", "batch": 1, "seq_len": 32, "dtype": "bfloat16"}, gate="passed",
        variants=variants, files=(PackFile("kernels/a.so", "ab" * 32, 1234), PackFile("__init__.py", "cd" * 32, 9)),
        provenance=Provenance("0.1.0", "2026-11-30T10:00:00+00:00", "deadbeef", ("manual", "templates:x"), "H200"),
        gate_summary=GateSummary(13.6, 12.9, 1.054, (1.01, 1.09), rounds=7, reps=3, timed_under="graphs", pays=True,
                                 outputs="outputs within 1e-3", graphs_first=GraphVerdict(False, "host sync")),
        graphs=GraphVerdict(True, "matched"),
    )


def test_manifest_round_trips_through_toml():
    m = _manifest()
    text = manifest_mod.dumps(m)
    assert manifest_mod.loads(text) == m
    assert manifest_mod.loads(manifest_mod.dumps(manifest_mod.loads(text))) == m
    assert "[[variants]]" in text and "[[variants.args]]" in text and "[build]" in text
    # a tensor's guard facts stay on one line (inline table), readable in an audit
    assert any(line.startswith("tensor = {dtype = ") for line in text.splitlines())


def test_unknown_format_is_refused():
    data = manifest_mod.to_dict(_manifest())
    data["format"] = 99
    with pytest.raises(ValueError, match="format"):
        manifest_mod.from_dict(data)


def test_exact_tolerance_for_integer_outputs():
    assert OutputTolerance("int64").exact and not OutputTolerance("float32", 1e-5, 1e-5).exact
