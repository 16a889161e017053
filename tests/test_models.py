"""Model + example inputs from recipes, through the real loading paths."""

from pathlib import Path

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


# --- loading the model the checkpoint is ----------------------------------------------------------------------


def _saved(tmp_path, name: str, cls_name: str, config) -> str:
    import transformers

    torch.manual_seed(0)
    getattr(transformers, cls_name)(config).save_pretrained(tmp_path / name)
    return str(tmp_path / name)


def _image_recipe(path: str) -> recipe.Recipe:
    return recipe.resolve(path).replace(workload={"batch": 1, "image_size": 32}, target={"device": "cpu"})


def test_convnext_and_swin_directories_load_as_image_classifiers(tmp_path):
    """Both failed with the AutoModelForCausalLM error: every directory was loaded as a causal LM."""
    from transformers import ConvNextConfig, SwinConfig

    convnext = _saved(tmp_path, "convnext", "ConvNextForImageClassification",
                      ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=5))
    swin = _saved(tmp_path, "swin", "SwinForImageClassification",
                  SwinConfig(image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=2,
                             num_labels=5))
    for path, cls in ((convnext, "ConvNextForImageClassification"), (swin, "SwinForImageClassification")):
        lm = models.load(_image_recipe(path))
        assert type(lm.model).__name__ == cls and lm.recipe.workload.task == "image-classification"
        assert lm.output_tensor(lm.run()).shape == (1, 5)


def test_a_sequence_classifier_loads_as_itself_with_its_weights(tmp_path):
    """A BertForSequenceClassification directory loaded as BertLMHeadModel: classifier dropped, LM head random."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        vocab_size=128, num_labels=3)
    path = _saved(tmp_path, "bert-cls", "BertForSequenceClassification", config)
    lm = models.load(recipe.resolve(path).replace(workload={"seq_len": 8}, target={"device": "cpu"}))
    assert type(lm.model).__name__ == "BertForSequenceClassification"
    assert lm.recipe.workload.task == "sequence-classification"
    assert lm.output_tensor(lm.run()).shape == (1, 3)
    saved = BertForSequenceClassification.from_pretrained(path)
    assert torch.equal(lm.model.classifier.weight, saved.classifier.weight)  # the checkpoint's, not random


def test_an_explicit_task_that_leaves_weights_missing_or_unused_is_refused_naming_them(tmp_path):
    from transformers import BertConfig

    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        vocab_size=128, num_labels=3)
    path = _saved(tmp_path, "bert-cls", "BertForSequenceClassification", config)
    as_lm = recipe.resolve(path).replace(workload={"task": "causal-lm", "seq_len": 8}, target={"device": "cpu"})
    with pytest.raises(ForgepackError) as err:
        models.load(as_lm)
    text = str(err.value)
    assert "missing from the checkpoint" in text and "cls.predictions" in text
    assert "not used by the model" in text and "classifier.weight" in text and "\n" not in text


def test_a_hub_revision_not_in_the_cache_names_it_and_does_not_suggest_offline_when_offline(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from transformers import LlamaConfig

    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny" / "snapshots" / ("a" * 40)
    _saved(snapshot.parent, "a" * 40, "LlamaForCausalLM",
           LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=64))
    (cache / "models--someone--tiny" / "refs").mkdir()
    (cache / "models--someone--tiny" / "refs" / "main").write_text("a" * 40)
    code = ("import json; from forgepack import models, recipe; from forgepack.errors import ForgepackError\n"
            "r = recipe.resolve('someone/tiny').replace(target={'device': 'cpu'})\n"
            "out = {}\n"
            "for rev in (None, 'v2'):\n"
            "    try:\n"
            "        models.load(r.replace(model={'revision': rev}) if rev else r); out[str(rev)] = 'loaded'\n"
            "    except ForgepackError as err:\n"
            "        out[str(rev)] = str(err)\n"
            "print(json.dumps(out))\n")
    repo = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": repo}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["None"] == "loaded"  # the cached revision loads offline
    assert "'v2'" in out["v2"] and "not in the HF cache" in out["v2"] and "HF_HUB_OFFLINE is set" in out["v2"]
    assert "HF_HUB_OFFLINE=1" not in out["v2"]
