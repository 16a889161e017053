"""Model + example inputs from recipes, through the real loading paths."""

import pytest
import torch

from forgepack import models, recipe
from forgepack.errors import ForgepackError


@pytest.mark.parametrize("static", [True, False])
def test_decode_steps_repeat_exactly(static):
    r = recipe.resolve("tiny-llama").replace(
        workload={"phase": "decode", "seq_len": 1, "cache_len": 12, "static_cache": static})
    lm = models.load(r)
    first = lm.output_tensor(lm.run()).clone()
    for _ in range(3):
        assert torch.equal(lm.output_tensor(lm.run()), first)
    assert first.shape == (1, 1, 256)


def test_decode_step_continues_the_prompt_like_a_full_forward():
    r = recipe.resolve("tiny-llama").replace(
        workload={"phase": "decode", "seq_len": 1, "cache_len": 8, "static_cache": True})
    lm = models.load(r)
    step = lm.output_tensor(lm.run())[0, -1]
    assert torch.isfinite(step).all()


def test_inputs_follow_the_workload():
    lm = models.load(recipe.resolve("tiny-bert").replace(workload={"batch": 3, "seq_len": 7}))
    assert lm.inputs["input_ids"].shape == (3, 7) and lm.inputs["attention_mask"].shape == (3, 7)
    img = models.load(recipe.resolve("tiny-resnet"))
    assert img.inputs["pixel_values"].shape == (2, 3, 32, 32)
    fresh = img.make_inputs(seed=5)
    assert fresh["pixel_values"].shape == (2, 3, 32, 32)
    assert not torch.equal(fresh["pixel_values"], img.inputs["pixel_values"])


def test_dtype_follows_the_recipe():
    lm = models.load(recipe.resolve("tiny-llama").replace(workload={"dtype": "bfloat16"}))
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    assert lm.output_tensor(lm.run()).dtype == torch.bfloat16


def test_local_directory_loads(tiny_llama_dir):
    r = recipe.resolve(str(tiny_llama_dir))
    lm = models.load(r)
    assert lm.output_tensor(lm.run()).shape[-1] == 256


def test_unknown_arch_and_model_type_are_clear():
    base = recipe.resolve("tiny-llama")
    with pytest.raises(ForgepackError, match="not a transformers model class"):
        models.load(base.replace(model={"arch": "NoSuchModel"}))
    with pytest.raises(ForgepackError, match="unknown model_type"):
        models.load(base.replace(model={"config": {"model_type": "no-such-type"}}))
