"""tools/bench_modules.py: which module instance is timed, with what arguments, and how a column reads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from forgepack import recipe

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def test_the_first_instance_of_each_patched_class_is_recorded_with_its_first_calls_arguments(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import bench_modules

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2), torch.nn.ReLU())
    x = torch.randn(3, 4)
    relu = f"{torch.nn.ReLU.__module__}:{torch.nn.ReLU.__qualname__}"
    seen = bench_modules.first_calls(model, lambda: [model(x), model(2 * x)], {relu})
    module, args, kwargs = seen[relu]
    assert set(seen) == {relu} and module is model[1] and kwargs == {}
    assert torch.equal(args[0], model[0](x))  # the first call's input, not the second's
    assert not model._forward_pre_hooks and not model[1]._forward_pre_hooks  # the hooks are gone


def test_a_pack_column_says_where_its_site_did_not_serve(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import bench_modules

    base = dataclasses.replace(recipe.resolve("tiny-llama"), name="tiny")
    rows = [{"module": "Norm", "us": {"stock": 10.0, "envelope": 5.0, "exact": 12.0},
             "served": {"envelope": True, "exact": False}}]
    info = {"date": "d", "gpu": "cpu", "commit": "c", "torch": "t", "cuda": None, "command": "python x"}
    md = bench_modules.markdown(info, base, {"envelope": "a.whl", "exact": "b.whl"}, rows)
    line = next(row for row in md.splitlines() if row.startswith("| Norm"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells == ["Norm", "10.0", "5.0", "2.00x", "12.0 (stock)", "0.83x"]
