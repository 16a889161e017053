"""The trained grammar model: greedy tokens walk the grammar and the top-1 logit leads by a wide margin."""

from __future__ import annotations

import pytest
import torch

from forgepack.trainedlm import follows_grammar, grammar_prompts, grammar_successor, train_tiny_lm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return train_tiny_lm(tmp_path_factory.mktemp("tinylm") / "model")


def _load(path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path).eval()


def test_grammar_is_one_cycle_over_the_vocabulary():
    succ = grammar_successor()
    seen, tok = [], 1
    for _ in range(len(succ) - 1):
        seen.append(tok)
        tok = succ[tok]
    assert tok == 1 and sorted(seen) == list(range(1, len(succ)))
    assert all(follows_grammar(p) for p in grammar_prompts(8, length=12))


def test_greedy_continuation_follows_the_grammar(model_dir):
    model = _load(model_dir)
    prompts = torch.tensor(grammar_prompts(6, seed=0, length=12))
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=48,
                             do_sample=False, pad_token_id=0)
    assert out.shape[1] == 60
    for row in out.tolist():
        assert follows_grammar(row), row
    # An untrained model of the same config does not: the check can fail.
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    raw = LlamaForCausalLM(model.config).eval()
    with torch.no_grad():
        raw_out = raw.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=8,
                               do_sample=False, pad_token_id=0)
    assert not all(follows_grammar(r) for r in raw_out.tolist())


def test_top1_logit_margin_is_large(model_dir):
    model = _load(model_dir)
    prompts = torch.tensor(grammar_prompts(8, seed=0, length=12))
    with torch.no_grad():
        logits = model(prompts).logits[:, 4:]
    top = logits.topk(2, dim=-1).values
    assert float((top[..., 0] - top[..., 1]).min()) > 3.0


def test_reuses_the_cached_model(model_dir):
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert train_tiny_lm(model_dir) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before
