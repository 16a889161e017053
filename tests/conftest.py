"""Shared test setup.

- `gpu` tests are skipped cleanly without a CUDA GPU; `long` tests get a longer timeout than the
  900 s of every other test.
- Every test runs with its own FORGEPACK_HOME and cache directory, and the session fails if a test
  left files behind in the repository. The serving probe's library (`forgepack.servecost`, about 13 s
  to compile) is compiled once per run, into a directory the tests share.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


# `long` tests take 5-12 minutes on 2 cores: more than the 900 s every other test gets (pyproject.toml)
LONG_TIMEOUT_S = 1800


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "long" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUT_S))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def probe_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("probes")


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path_factory, monkeypatch, probe_cache):
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("FORGEPACK_HOME", str(home))
    monkeypatch.setenv("FORGEPACK_CACHE", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.setenv("FORGEPACK_PROBE_CACHE", str(probe_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield home


# Caches that Python and the tools themselves write; anything else new after the run was left by a test.
_TOOL_CACHES = ("__pycache__", ".egg-info", ".pytest_cache", ".ruff_cache")


def _untracked() -> set[str]:
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all", "--ignored=matching"],
        cwd=REPO, capture_output=True, text=True, check=False,
    ).stdout
    paths = {line[3:] for line in out.splitlines()}
    return {p for p in paths if not any(cache in p for cache in _TOOL_CACHES)}


@pytest.fixture(scope="session", autouse=True)
def no_files_left_behind():
    before = _untracked()
    yield
    left = _untracked() - before
    assert not left, f"tests left files behind in the repository: {sorted(left)[:10]}"


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama saved to disk with random weights, loadable through the real loading path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
    )
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def trained_lm_dir(tmp_path_factory) -> Path:
    """The tiny grammar-trained LM, trained once per pytest run: its greedy tokens are decisive (no ties),
    so a serving path that differs from eager shows as different tokens, not as noise."""
    from forgepack.trainedlm import train_tiny_lm

    return train_tiny_lm(tmp_path_factory.mktemp("models") / "trained-lm")
