"""Recipes: built-ins load and round-trip; bad keys and values are named in one-line errors."""

import dataclasses
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


def test_gpu_reference_recipes_exist():
    gpu = {n for n in recipe.builtin_names() if recipe.resolve(n).target.device == "cuda"}
    assert gpu == {"llama-1b-prefill", "llama-1b-decode", "qwen2-0.5b-prefill", "qwen2-0.5b-decode", "gpt2",
                   "vit-base", "resnet-50"}


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


ENVELOPE = BASE + ('[workload]\nphase = "generate"\nbatch = { min = 1, max = 8 }\n'
                   'seq_len = { min = 16, max = 2048 }\ncache_len = { max = 4096 }\n')


def test_envelope_ranges_round_trip_and_single_ints_stay_one_shape():
    r = recipe.loads(ENVELOPE)
    w = r.workload
    assert (w.phase, w.batch, w.seq_len, w.cache_len) == ("generate", recipe.Range(1, 8), recipe.Range(16, 2048),
                                                           recipe.Range(0, 4096))
    assert w.is_envelope and recipe.loads(recipe.dumps(r)) == r
    assert w.at(batch=3, seq_len=17) == dataclasses.replace(w, batch=3, seq_len=17, cache_len=0)
    fixed = recipe.load(recipe.BUILTIN_DIR / "tiny-llama.toml")
    assert not fixed.workload.is_envelope and isinstance(fixed.workload.batch, int)
    assert "new_tokens" not in recipe.dumps(fixed)  # fixed-shape recipes (and their fingerprints) as before


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (BASE + "[workload]\nbatch = { min = 4, max = 2 }\n", "'workload.batch' has max 2 below min 4"),
        (BASE + "[workload]\nbatch = { min = 1 }\n", "'workload.batch' range needs a 'max'"),
        (BASE + "[workload]\nbatch = { min = 1, max = 2, step = 1 }\n", "unknown key 'workload.batch.step'"),
        (BASE + "[workload]\nseq_len = { min = 1, max = \"x\" }\n", "'workload.seq_len.max' must be int"),
        (BASE + "[workload]\nbatch = { min = 0, max = 2 }\n", "'workload.batch' must be at least 1"),
        (BASE + "[workload]\ntask = \"image-classification\"\nphase = \"generate\"\n", "needs task"),
        (BASE + "[workload]\ntask = \"image-classification\"\nseq_len = { max = 8 }\n", "envelope is 'workload.batch'"),
        (BASE + "[workload]\nphase = \"generate\"\nseq_len = { max = 64 }\ncache_len = { max = 32 }\n",
         "'workload.cache_len' max 32 is below the longest prompt"),
    ],
)
def test_bad_envelopes_name_the_problem(text, message):
    with pytest.raises(UsageError, match=re.escape(message)) as err:
        recipe.loads(text, origin="r.toml")
    assert "\n" not in str(err.value)


def test_image_batch_range():
    r = recipe.loads(BASE + '[workload]\ntask = "image-classification"\nbatch = { min = 1, max = 4 }\n')
    assert r.workload.batch == recipe.Range(1, 4) and recipe.loads(recipe.dumps(r)) == r


def test_cli_sizes_parse_as_one_size_or_a_range():
    assert recipe.parse_size("8") == 8 and recipe.parse_size("1-8") == recipe.Range(1, 8)
    assert recipe.parse_size(" 16 - 2048 ") == recipe.Range(16, 2048) and recipe.parse_size("4-4") == 4
    for bad in ("", "a", "1-", "8-1", "1-2-3"):
        with pytest.raises(UsageError, match="--batch"):
            recipe.parse_size(bad, "batch")
    r = recipe.resolve("tiny-llama").replace(workload={"batch": "1-4", "seq_len": "8-64", "phase": "generate"})
    assert (r.workload.batch, r.workload.seq_len, r.workload.phase) == (recipe.Range(1, 4), recipe.Range(8, 64),
                                                                        "generate")
    assert r.replace(workload={"batch": "2"}).workload.batch == 2


def test_profile_command_refuses_a_bad_range_in_one_line(tmp_path):
    import subprocess
    import sys

    for args, message in ((["--batch", "8-1"], "--batch range '8-1' has its max below its min"),
                          (["--seq-len", "x"], "--seq-len must be a size like 8 or a range like 1-8"),
                          (["--phase", "serve"], "'workload.phase' must be one of prefill, decode, generate")):
        proc = subprocess.run([sys.executable, "-m", "forgepack", "profile", "tiny-llama", *args, "--workspace",
                               str(tmp_path / "ws")], capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not (tmp_path / "ws").exists()
