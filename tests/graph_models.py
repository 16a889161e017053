"""Small real modules for the graph-mode tests (tests/test_graph*.py, test_replaycheck.py)."""

from __future__ import annotations

import torch
from torch import nn

EMU = {"backend": "emulate"}  # the emulated backend: a recorded aten trace, any device


# --- small real modules ------------------------------------------------------------------------------


class Mlp(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.a = nn.Linear(width, 16)
        self.b = nn.Linear(16, width)

    def forward(self, x, scale=1.0, extra=None):
        y = self.b(torch.relu(self.a(x))) * scale
        return {"y": y, "pair": (y.sum(-1), extra), "note": "kept"}


class Syncs(nn.Module):
    """Reads a device value on the host: not capturable."""

    def forward(self, x):
        return x * float(x.abs().max().item())


class Scaled(nn.Module):
    """Its output depends on a Python float: eager sees the new value, a replay keeps the captured one."""

    def __init__(self):
        super().__init__()
        self.scale = 1.0

    def forward(self, x):
        return x * self.scale


class Counter(nn.Module):
    """A Python-side counter: eager calls disagree with each other."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.calls


class Accumulates(nn.Module):
    """Writes into its argument and into a persistent buffer, in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        self.total.add_(x)
        x.mul_(2)
        return self.total * 1


class Box:
    """A by-reference argument object (like a static cache): tensors updated in place."""

    def __init__(self, n=4):
        self.state = torch.zeros(n)
        self.steps = 0


class UsesBox(nn.Module):
    def forward(self, x, box):
        box.state.add_(x)
        return box.state * 2, box


def tiny_llama(layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def static_cache(model, length=64):
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=length)
