"""A tiny Llama-config language model trained on CPU on a synthetic grammar.

A randomly initialised model has near-tied logits, so a kernel's rounding can flip a greedy token and a
token check says nothing. This model is trained (a few hundred steps, seconds on one core) on a grammar
whose next token is a fixed function of the previous one, so its top-1 logit leads by a wide margin and
its greedy continuation is checkable: it must walk the grammar.

Grammar: a seeded permutation ``succ`` of the vocabulary; a sentence starts anywhere and every next token
is ``succ[previous]``. Token 0 is reserved (padding) and never appears.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

VOCAB = 64
_MARKER = "forgepack_trainedlm.json"
_SEQ = 32
_BATCH = 32


def grammar_successor(*, seed: int = 0) -> list[int]:
    """``succ[t]`` for every token t >= 1: one seeded cycle over tokens 1..VOCAB-1; ``succ[0] == 0``."""
    gen = torch.Generator().manual_seed(1000 + seed)
    order = (torch.randperm(VOCAB - 1, generator=gen) + 1).tolist()
    succ = [0] * VOCAB
    for i, tok in enumerate(order):
        succ[tok] = order[(i + 1) % len(order)]
    return succ


def follows_grammar(tokens: list[int], *, seed: int = 0) -> bool:
    """True when every token is the grammar's successor of the one before it."""
    succ = grammar_successor(seed=seed)
    return all(succ[a] == b for a, b in itertools.pairwise(tokens))


def _sentences(count: int, length: int, *, seed: int, sample_seed: int) -> list[list[int]]:
    succ = grammar_successor(seed=seed)
    gen = torch.Generator().manual_seed(sample_seed)
    starts = torch.randint(1, VOCAB, (count,), generator=gen).tolist()
    out = []
    for tok in starts:
        row = [tok]
        for _ in range(length - 1):
            row.append(succ[row[-1]])
        out.append(row)
    return out


def grammar_prompts(count: int, *, seed: int = 0, length: int = 12) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens from the grammar the model was trained on (seed selects it)."""
    return _sentences(count, length, seed=seed, sample_seed=2000 + seed)


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )


def _cached(out_dir: Path, steps: int, seed: int) -> bool:
    marker = out_dir / _MARKER
    if not marker.is_file() or not (out_dir / "config.json").is_file():
        return False
    return json.loads(marker.read_text()) == {"steps": steps, "seed": seed, "vocab": VOCAB}


def _train(steps: int, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config()).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(steps):
        batch = torch.tensor(_sentences(_BATCH, _SEQ, seed=seed, sample_seed=step))
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model.eval()


def train_tiny_lm(out_dir: Path, *, steps: int = 300, seed: int = 0) -> Path:
    """Train the grammar model (or reuse the one already in ``out_dir``), save_pretrained there, return it."""
    out_dir = Path(out_dir)
    if _cached(out_dir, steps, seed):
        return out_dir
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same bits on every machine, and fair to a shared box
    try:
        model = _train(steps, seed)
    finally:
        torch.set_num_threads(threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    (out_dir / _MARKER).write_text(json.dumps({"steps": steps, "seed": seed, "vocab": VOCAB}))
    return out_dir
