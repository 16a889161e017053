"""The manifest as the pack runtime reads it (`forgepack.runtime.packinfo`): small frozen values, from
what the build side writes."""

from __future__ import annotations

import dataclasses

import pytest
import tomllib
import torch
from test_pack_manifest import _manifest

from forgepack import samples
from forgepack.cards import Card
from forgepack.pack import manifest as manifest_mod
from forgepack.runtime import selftest
from forgepack.runtime.packinfo import GraphVerdict, OutputTolerance, PackInfo


def _read(m: manifest_mod.Manifest) -> PackInfo:
    return PackInfo.from_dict(tomllib.loads(manifest_mod.dumps(m)))


def test_the_runtime_reads_what_the_builder_writes():
    m = _manifest()
    info = _read(m)
    assert (info.name, info.version, info.device, info.arch) == (m.name, m.version, "cuda", "sm_90")
    assert (info.torch, info.cuda, info.cxx11_abi) == (m.torch, m.cuda, True)
    assert (info.namespace, info.library, info.recipe) == (m.namespace, m.shim, "demo")
    assert info.model_arch == "" and info.memory_format == ""
    assert info.graphs == m.graphs == GraphVerdict(True, "matched")
    assert info.digest and info.digest == info.content_digest  # the manifest's digest is its content's
    assert [(f.path, f.sha256) for f in info.files] == [(f.path, f.sha256) for f in m.files]
    for got, want in zip(info.variants, m.variants, strict=True):
        assert (got.id, got.op, got.signature) == (want.id, want.op, want.signature)
        assert got.tolerance == tuple(OutputTolerance(t.dtype, t.rtol, t.atol) for t in want.tolerance)
        assert [(a.name, a.kind, a.value) for a in got.args] == [(a.name, a.kind, a.value) for a in want.args]
        for a, b in zip(got.args, want.args, strict=True):
            if b.kind == "tensor":
                assert (a.tensor.dtype, a.tensor.shape, a.tensor.stride, a.tensor.storage_offset) == (
                    b.tensor.dtype, b.tensor.shape, b.tensor.stride, b.tensor.storage_offset)
            assert len(a.tensors) == len(b.tensors)
            assert a.recorded() == (b.kind, len(b.tensors), b.value)


def test_graph_mode_verdict_and_layout_are_read():
    m = dataclasses.replace(_manifest(), graphs=GraphVerdict(False, "a host sync"),
                            model={"recipe": "r", "arch": "LlamaForCausalLM"},
                            workload={"memory_format": "channels_last"})
    info = _read(m)
    assert info.graphs == GraphVerdict(False, "a host sync")
    assert (info.model_arch, info.recipe, info.memory_format) == ("LlamaForCausalLM", "r", "channels_last")


def test_an_edited_manifest_reads_with_a_digest_that_is_not_its_content_s():
    data = tomllib.loads(manifest_mod.dumps(_manifest()))
    data["variants"][0]["tolerance"] = [{"dtype": "float32", "rtol": 1.0, "atol": 1.0}]
    info = PackInfo.from_dict(data)
    assert info.digest != info.content_digest


def test_values_are_frozen_and_unknown_keys_ignored():
    data = tomllib.loads(manifest_mod.dumps(_manifest()))
    data["from_a_newer_build"] = {"x": 1}
    data["variants"][0]["new_field"] = 2
    info = PackInfo.from_dict(data)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.name = "other"
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.variants[0].op = "aten.relu.default"


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:  # an absent optional tensor (layer norm's bias)
        return a is b
    layout = (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset())
    return layout and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_the_self_test_draws_from_the_manifest_what_the_verifier_draws_from_the_card():
    """One drawing (`runtime.fresh`): the build's verifier and the pack's self-test meet the same values."""
    m = _manifest()
    for built, read in zip(m.variants, _read(m).variants, strict=True):
        card = Card(op=built.op, schema=built.schema, args=built.args, outputs=built.outputs)
        for edge in (False, True):
            verifier = samples.fresh_inputs(card, 7, "cpu", edge)
            self_test = selftest.inputs(read, 7, torch.device("cpu"), edge)
            assert len(verifier) == len(self_test) == len(card.tensor_inputs())
            assert all(_same(a, b) for a, b in zip(verifier, self_test, strict=True)), (built.op, edge)
            if edge and built.op == "aten._softmax.default":  # 16 floats: the edge values are planted
                assert not torch.isfinite(verifier[0]).all()
