"""The prompt states each card's computation as a PyTorch program: parsed back out of the prompt and run on
the card's captured inputs, it gives the captured eager outputs (operator and fusion cards of tiny-llama)."""

# ruff: noqa: F811  (the `profiled` fixture is shared from the build tests)

from __future__ import annotations

import dataclasses
import re

import torch
from test_build import profiled  # noqa: F401

from forgepack import samples as samples_mod
from forgepack.cards import Dim, Family, Layout
from forgepack.search.proposers.prompt import build_prompt
from forgepack.workspace import Workspace

_BLOCK = re.compile(r"The reference computation .*?```python\n(.*?)```", re.DOTALL)


def reference_from_prompt(prompt: str):
    [source] = _BLOCK.findall(prompt)
    scope: dict = {}
    exec(compile(source, "<prompt reference>", "exec"), scope)
    return scope["reference"]


def test_the_prompts_reference_reproduces_the_captured_outputs(profiled):
    ws = Workspace(profiled)
    checked = {"op": 0, "fusion": 0}
    for card in ws.load_cards():
        sets = samples_mod.load_samples(card, ws.sample_path(card.id), "cpu")
        if not sets or not card.outputs:  # no tensor out (`_local_scalar_dense`): nothing a kernel writes
            continue
        reference = reference_from_prompt(build_prompt(card, "cpu", None, [], []))
        for inputs, outputs in sets:
            with torch.no_grad():
                got = reference(*[t.clone() if t is not None else None for t in inputs])
            assert len(got) == len(outputs), card.id
            for g, want in zip(got, outputs, strict=True):
                assert g.shape == want.shape and g.dtype == want.dtype, card.id
                torch.testing.assert_close(g, want, equal_nan=True, msg=lambda m, c=card: f"{c.id}: {m}")
        checked[card.kind] += 1
    assert checked["op"] >= 5 and checked["fusion"] >= 1, checked


def test_a_family_card_names_its_free_dims_instead_of_one_members_shapes(profiled):
    ws = Workspace(profiled)
    card = next(c for c in ws.load_cards() if c.kind == "op" and len(c.tensor_inputs()) == 1
                and len(c.outputs) == 1 and c.tensor_inputs()[0].is_contiguous())
    meta = card.tensor_inputs()[0]
    shape = ("d0", *meta.shape[1:])
    layout = Layout(shape, tuple((s, ()) for s in meta.stride))  # contiguous: only the outer size varies
    family = Family(dims=(Dim("d0", 1, 257),), inputs=(layout,), outputs=(layout,))
    prompt = build_prompt(dataclasses.replace(card, family=family), "cuda", None, [], [])
    tail = prompt.split("Shape family: d0 in 1..257", 1)[1]
    assert "read every size named by a dim from call->inputs/outputs at run time" in tail
    assert f"in[0]: {layout.signature(meta.dtype)}" in tail and "d0" in layout.signature(meta.dtype)
