"""forgepack's one TOML writer (`forgepack.tomlwriter`): what manifests and recipes hold round-trips."""

from __future__ import annotations

import math

import pytest
import tomllib

from forgepack import recipe, tomlwriter


def test_toml_writer_handles_what_manifests_hold():
    doc = {
        "s": 'quote " backslash \\ newline \n tab \t unicode é ✓',
        "floats": [0.1, -0.0, 1e-300, float("inf"), float("-inf")],
        "ints": [0, -1, 2**63 - 1, -(2**63)],
        "bools": [True, False],
        "mixed": [1, "a", 2.5],
        "empty": [],
        "table": {"a": 1, "weird key": 2, "nested": {"deep": {"x": [1, 2]}}},
        "rows": [{"k": 1, "sub": [{"z": 1}]}, {"k": 2, "t": {"y": "v"}}],
    }
    back = tomllib.loads(tomlwriter.dumps(doc))
    assert back == doc
    nan = tomllib.loads(tomlwriter.dumps({"x": float("nan")}))["x"]
    assert math.isnan(nan)
    with pytest.raises(TypeError):
        tomlwriter.dumps({"x": object()})


@pytest.mark.parametrize("name", recipe.builtin_names())
def test_every_builtin_recipe_round_trips_through_the_writer(name):
    r = recipe.load(recipe.BUILTIN_DIR / f"{name}.toml")
    assert recipe.loads(recipe.dumps(r)) == r
    assert tomllib.loads(recipe.dumps(r)) == recipe.to_dict(r)
