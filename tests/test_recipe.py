"""Recipes: built-ins load and round-trip; bad keys and values are named in one-line errors."""

import re

import pytest

from forgepack import recipe
from forgepack.errors import UsageError


@pytest.mark.parametrize("name", recipe.builtin_names())
def test_builtin_recipes_round_trip(name):
    r = recipe.load(recipe.BUILTIN_DIR / f"{name}.toml")
    assert recipe.loads(recipe.dumps(r)) == r
    resolved = recipe.resolve(name)
    assert recipe.loads(recipe.dumps(resolved)) == resolved


def test_six_gpu_reference_recipes_exist():
    gpu = {n for n in recipe.builtin_names() if recipe.resolve(n).target.device == "cuda"}
    assert gpu == {"llama-1b-prefill", "llama-1b-decode", "qwen2-0.5b-prefill", "gpt2", "vit-base", "resnet-50"}


def test_default_recipe_is_tiny_llama_on_this_machines_device():
    import torch

    r = recipe.resolve(None)
    assert r.name == "tiny-llama"
    assert r.target.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert recipe.load(recipe.BUILTIN_DIR / "tiny-llama.toml").target.device == "auto"


BASE = 'name = "x"\n[model]\nconfig = { model_type = "llama" }\n'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (BASE + "[workload]\nbatchsize = 2\n", "unknown key 'workload.batchsize'"),
        (BASE + "[workload]\ndtype = \"int4\"\n", "'workload.dtype' must be one of"),
        (BASE + "[workload]\nbatch = \"two\"\n", "'workload.batch' must be int"),
        (BASE + "[workload]\nbatch = 0\n", "'workload.batch' must be at least 1"),
        (BASE + "[target]\ndevice = \"tpu\"\n", "'target.device' must be one of"),
        (BASE + "[target]\narch = \"hopper\"\n", "'target.arch' must look like"),
        ("colour = 1\n" + BASE, "unknown key 'colour'"),
        ('name = "x"\n[model]\nhub = "a/b"\npath = "/x"\n', "exactly one of"),
        ('name = "x"\n', "a [model] section is required"),
        (BASE + "[workload]\ntask = \"image-classification\"\nphase = \"decode\"\n", "needs task"),
        ("name = \n", "not valid TOML"),
        (BASE + "[workload]\nmemory_format = \"nhwc\"\n", "'workload.memory_format' must be one of"),
        (BASE + "[workload]\nmemory_format = \"channels_last\"\n", "needs task \"image-classification\""),
    ],
)
def test_bad_recipes_name_the_problem(text, message):
    with pytest.raises(UsageError, match=re.escape(message)) as err:
        recipe.loads(text, origin="r.toml")
    assert "\n" not in str(err.value)


def test_cli_overrides_are_validated():
    r = recipe.resolve("tiny-llama")
    assert r.replace(workload={"batch": 3}).workload.batch == 3
    with pytest.raises(UsageError, match=re.escape("'target.device'")):
        r.replace(target={"device": "gpu"})


def test_bare_model_specs():
    assert recipe.resolve("meta-llama/Llama-3.2-1B").model.hub == "meta-llama/Llama-3.2-1B"
    assert recipe.resolve("./some/dir").model.path == "./some/dir"
    with pytest.raises(UsageError, match="is not a recipe file"):
        recipe.resolve("no-such-recipe")
    with pytest.raises(UsageError, match="does not exist"):
        recipe.resolve("missing.toml")
