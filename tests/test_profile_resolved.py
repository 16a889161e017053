"""`forgepack profile <dir>` of a saved checkpoint says what it resolved: task, class, dtype, shapes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")


@pytest.fixture()
def bert_dir(tmp_path):
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, num_labels=3,
                                     architectures=["BertForSequenceClassification"])
    model = transformers.BertForSequenceClassification(config)
    path = tmp_path / "bert-cls"
    model.save_pretrained(path)
    return path


def test_profile_of_a_saved_bert_classifier_names_its_task_and_class(bert_dir, tmp_path, monkeypatch):
    from forgepack.cli import app

    monkeypatch.setenv("FORGEPACK_HOME", str(tmp_path / "home"))
    runner = CliRunner()
    args = ["profile", str(bert_dir), "--target", "cpu", "--seq-len", "8", "--workspace", str(tmp_path / "ws")]
    shown = runner.invoke(app, args)
    assert shown.exit_code == 0, shown.output
    assert "task sequence-classification" in shown.output
    assert "class BertForSequenceClassification" in shown.output
    doc = json.loads((tmp_path / "ws" / "profile.json").read_text())
    assert doc["task"] == "sequence-classification"
    assert doc["model_class"] == "BertForSequenceClassification"
    assert doc["dtype"] == "float32"
    assert "input_ids=1x8" in doc["shapes"]
