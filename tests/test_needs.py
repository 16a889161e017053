"""Kernel needs travel from the template's render through `accepted.json` and the manifest to the
guard: round trips, the default, and what the search records for a templates candidate."""

from __future__ import annotations

import dataclasses

import torch
from test_pack_manifest import _manifest

from forgepack import accepted, needs, templates
from forgepack.accepted import AcceptedKernel
from forgepack.capture import card_from_call
from forgepack.needs import Align, Needs
from forgepack.pack import manifest as manifest_mod

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


def test_a_template_states_todays_rule_unless_it_says_otherwise():
    x = torch.randn(65)[1:].view(8, 8)  # captured at 4 mod 16
    card = card_from_call(torch.ops.aten.silu.default, (x,), {})[0]
    template = templates.templates_for(card, "cpu")[0]
    params = template.default(card, "cpu")
    assert template.needs(card, "cpu", params) == needs.default(card) == Needs((Align(16, 4),))
    key = {"template": template.name, "params": params}
    assert templates.needs_of(card, "cpu", key) == needs.default(card)
    assert templates.needs_of(card, "cpu", {"model": "claude"}) is None  # another proposer: the default applies
    assert templates.needs_of(card, "cpu", {"template": "gone", "params": {}}) is None
