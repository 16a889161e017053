"""Kernel needs travel from the template's render through `accepted.json` and the manifest to the
guard: round trips, the default, and what the search records for a templates candidate."""

from __future__ import annotations

import dataclasses
import types

import torch
from test_pack_manifest import _manifest

from forgepack import accepted, needs, templates
from forgepack.accepted import AcceptedKernel
from forgepack.capture import card_from_call
from forgepack.needs import Align, Needs
from forgepack.pack import manifest as manifest_mod
from forgepack.search.run import Search

STATED = Needs(align=(Align(4), Align(16, 8)), dim_multiple=(("d1", 8),), numel_multiple=((0, 4),))


def test_needs_round_trip_through_the_manifest_toml():
    m = _manifest()
    first = dataclasses.replace(m.variants[0], needs=Needs((Align(4),)))
    m = dataclasses.replace(m, variants=(first, *m.variants[1:]))
    text = manifest_mod.dumps(m)
    assert manifest_mod.loads(text) == m
    assert manifest_mod.loads(text).variants[1].needs is None  # a kernel that stated nothing


def test_needs_round_trip_through_accepted_json(tmp_path):
    kernel = AcceptedKernel("silu-0123456789", "cpu", None, "src.cpp", "k.so", "ab", 1.5, 1.4, 1.6, 2.0, 1.3,
                            "templates:elementwise.unary")
    accepted.save_all(tmp_path, [kernel, dataclasses.replace(kernel, card_id="b", needs=STATED)])
    assert accepted.load_all(tmp_path) == [kernel, dataclasses.replace(kernel, card_id="b", needs=STATED)]


def test_a_template_states_todays_rule_for_cuda_and_element_alignment_for_the_cpu():
    """A CUDA render lays its vectors out for the captured offsets; a CPU render is plain loops."""
    x = torch.randn(65)[1:].view(8, 8)  # captured at 4 mod 16
    card = card_from_call(torch.ops.aten.silu.default, (x,), {})[0]
    template = templates.templates_for(card, "cpu")[0]
    params = template.default(card, "cpu")
    assert template.needs(card, "cuda", params) == needs.default(card) == Needs((Align(16, 4),))
    assert template.needs(card, "cpu", params) == needs.natural(card) == Needs((Align(4),))
    key = {"template": template.name, "params": params}
    assert templates.needs_of(card, "cuda", key) == needs.default(card)
    assert templates.needs_of(card, "cpu", key) == needs.natural(card)
    assert templates.needs_of(card, "cpu", {"model": "claude"}) is None  # another proposer: the default applies
    assert templates.needs_of(card, "cpu", {"template": "gone", "params": {}}) is None


def test_the_search_hands_the_guard_a_looser_statement_only_where_the_kernel_was_verified_moved():
    """`Search._needs`: element alignment for an exact CPU kernel only once it passed the check with its
    inputs moved one element along (`familyeval.element_aligned`); otherwise, and on CUDA, today's rule."""
    x = torch.randn(65)[1:].view(8, 8)
    card = card_from_call(torch.ops.aten.silu.default, (x,), {})[0]
    template = templates.templates_for(card, "cpu")[0]
    params = {"template": template.name, "params": template.default(card, "cpu")}

    def guard_needs(target: str, element_aligned: dict | None):
        search = types.SimpleNamespace(settings=types.SimpleNamespace(target=target))
        rec = types.SimpleNamespace(params=params, verdict={"diagnostics": {"element_aligned": element_aligned}})
        return Search._needs(search, card, rec, templates.needs_of)

    assert guard_needs("cpu", {"ok": True}) == needs.natural(card)
    assert guard_needs("cpu", {"ok": False, "reason": "mismatch"}) is None  # the guard keeps today's rule
    assert guard_needs("cpu", None) is None  # a verdict from before the check
    assert guard_needs("cuda", None) == needs.default(card)
