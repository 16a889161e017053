"""The CLI a newcomer meets: `--help` shows defaults, `forgepack recipes`, build's workload flags reach
the recipe, `--llm-model` (and the deprecated `--model`), the last lines say how to use the pack, and a
log that is not a terminal still shows which stage runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from forgepack import recipe as recipe_mod
from forgepack.cli import app
from forgepack.cli.build import last_lines
from forgepack.workspace import Workspace

runner = CliRunner()


def _cli(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forgepack", *args], cwd=cwd, env=env or dict(os.environ),
                          capture_output=True, text=True, timeout=600)


def _plain(text: str) -> str:
    """Help text without rich's box drawing and line wrapping, for phrase checks."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def test_build_help_shows_the_defaults_and_the_new_flags():
    result = runner.invoke(app, ["build", "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    text = _plain(result.output)
    for phrase in ("the recipe's build.budget, else 16", "the recipe's build.proposer, else templates",
                   "--llm-model", "the recipe's build.llm_model, else claude-sonnet-4-6", "--task", "--dtype",
                   "--batch", "--seq-len", "default: (tiny-llama)"):
        assert phrase in text, phrase
    assert "--model " not in text  # the deprecated alias is hidden


def test_recipes_lists_every_builtin_recipe_with_its_task_and_shapes():
    result = runner.invoke(app, ["recipes", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.output)}
    assert sorted(rows) == recipe_mod.builtin_names()
    assert rows["llama-1b-decode"]["shapes"] == "batch 1 x 1 tokens, cache 512 (static)"
    assert rows["resnet-50"]["task"] == "image-classification" and rows["resnet-50"]["phase"] == "-"
    assert rows["resnet-50"]["shapes"] == "batch 16 x 224x224, channels-last"
    assert rows["tiny-llama"]["model"] == "LlamaForCausalLM, random weights"
    table = runner.invoke(app, ["recipes"], env={"COLUMNS": "250"})
    assert table.exit_code == 0 and all(name in table.output for name in rows)


def test_the_workload_flags_are_validated_as_recipe_fields(tmp_path):
    for command in ("build", "profile"):
        for args, needle in ((["--task", "translation"], "'workload.task' must be one of"),
                             (["--dtype", "int8"], "'workload.dtype' must be one of")):
            result = _cli([command, "tiny-llama", "--target", "cpu", *args], cwd=tmp_path)
            assert result.returncode == 2, result.stderr
            assert needle in result.stderr and "Traceback" not in result.stderr


def test_the_deprecated_model_flag_still_names_the_claude_model(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ANTHROPIC_API_KEY"}
    result = _cli(["build", "tiny-llama", "--proposer", "anthropic", "--model", "claude-unknown-9"], tmp_path, env)
    assert result.returncode != 0
    assert "--model is deprecated" in result.stderr and "use --llm-model" in result.stderr
    assert "no price for model 'claude-unknown-9'" in result.stderr  # it reached the recipe's llm_model
    new = _cli(["build", "tiny-llama", "--proposer", "anthropic", "--llm-model", "claude-unknown-9"], tmp_path, env)
    assert "no price for model 'claude-unknown-9'" in new.stderr and "deprecated" not in new.stderr


def test_build_passes_the_workload_flags_and_logs_each_stage_when_not_a_terminal(tmp_path):
    ws = tmp_path / "ws"
    result = _cli(["build", "tiny-llama", "--target", "cpu", "--batch", "2", "--seq-len", "8", "--dtype", "float32",
                   "--task", "causal-lm", "--budget", "0", "--no-gate", "--workspace", str(ws)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = recipe_mod.load(Workspace(ws).recipe_path)
    assert (saved.workload.batch, saved.workload.seq_len, saved.workload.dtype, saved.workload.task) == (
        2, 8, "float32", "causal-lm")
    stamp = r"^\d\d:\d\d:\d\d "
    assert re.search(stamp + r"profiling tiny-llama: loading model", result.stderr, re.M), result.stderr
    assert re.search(stamp + r"profiling tiny-llama: timing .* \(\d+/\d+\)", result.stderr, re.M)
    assert re.search(stamp + r"profiling tiny-llama: done in \d+\.\d s", result.stderr, re.M)
    assert "no pack written (empty)" in result.stderr


def test_the_last_lines_say_how_to_install_import_and_activate():
    text = last_lines(Path("packs/forgepack_pack_tiny_llama-0.1.0-py3-none-any.whl"), "forgepack_pack_tiny_llama",
                      "passed")
    lines = text.splitlines()
    assert lines[-3:] == ["install:  pip install packs/forgepack_pack_tiny_llama-0.1.0-py3-none-any.whl",
                          "import:   forgepack_pack_tiny_llama",
                          "activate: import forgepack_pack_tiny_llama as pack; pack.activate()"]


def test_the_readmes_recipe_for_ones_own_model_is_a_valid_recipe():
    import tomllib

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Your own model", 1)[1]
    block = section.split("```toml\n", 1)[1].split("```", 1)[0]
    r = recipe_mod.from_dict(tomllib.loads(block), origin="README.md")
    assert (r.model.hub, r.workload.task, r.workload.batch, r.workload.seq_len) == ("Qwen/Qwen2.5-0.5B",
                                                                                   "causal-lm", 4, 256)
    assert recipe_mod.from_dict(recipe_mod.to_dict(r)) == r


def test_the_documented_envelope_is_a_valid_workload_with_its_ranges():
    import tomllib

    doc = (Path(__file__).resolve().parent.parent / "docs" / "envelopes.md").read_text()
    block = tomllib.loads(doc.split("```toml\n", 1)[1].split("```", 1)[0])
    data = recipe_mod.to_dict(recipe_mod.resolve("tiny-llama"))
    data["workload"].update(block["workload"])
    w = recipe_mod.from_dict(data, origin="README.md").workload
    assert w.is_envelope and w.phase == "generate"
    assert (w.batch.min, w.batch.max, w.seq_len.min, w.seq_len.max, w.cache_len.max) == (1, 8, 16, 2048, 4096)


def test_pack_steps_say_which_step_runs_and_how_long_it_took(monkeypatch):
    """The shim's compilation and the gate report no fraction done: a spinner with the elapsed time on
    a terminal, a timestamped line as each starts in a log; either way a line when each ends."""
    import io

    from rich.console import Console

    from forgepack.cli import common

    for terminal in (False, True):
        buf = io.StringIO()
        monkeypatch.setattr(common, "console", Console(file=buf, force_terminal=terminal, width=200))
        with common.steps("pack") as note:
            note("staging 2 kernels and compiling the guarded dispatch shim")
            note("end-to-end gate: outputs, use and pay of every kernel in the model")
        text = buf.getvalue()
        ended = re.findall(r"\d\d:\d\d:\d\d pack: (staging|end-to-end)[^\n]*: done in \d+\.\d s", text)
        assert ended == ["staging", "end-to-end"], text
        started = re.findall(r"^\d\d:\d\d:\d\d pack: (staging 2 kernels|end-to-end gate)[^:\n]*(?:: outputs[^:\n]*)?$",
                             text, re.M)
        if terminal:  # drawn live: the spinner line names the step
            assert "\x1b[" in text and text.count("compiling the guarded dispatch shim") >= 2, text
        else:  # a log says when each step starts, too
            assert started == ["staging 2 kernels", "end-to-end gate"], text
