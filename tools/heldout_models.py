"""Held-out architectures as checkpoints on disk: tiny random-weight Mistral, Gemma-2, Phi-3 and Qwen2
models, saved with `save_pretrained`, for benchmarks that load them the way a user's checkpoint loads.

Issue 20 found packs inert on such checkpoints: weights loaded by `from_pretrained` sit at other
offsets than a model built in memory, and every kernel that took one missed. A directory written here
is a model id for every tool (`recipe.resolve` takes a directory), so the envelope benchmark runs on it
unchanged:

    python tools/heldout_models.py /tmp/heldout
    python tools/bench_envelope.py --base /tmp/heldout/tiny-mistral --target cpu --batch 1-4 --seq-len 8-64 \\
        --batches 1,2,4 --prompt 8,64 --new 4,16 --requests 8 --budget 40 --no-gate --margin -0.99
Output: one directory per model under the given root, its name printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# The size of the tiny-llama recipe, with each architecture's own twist kept: Mistral's sliding window,
# Gemma-2's (1 + w) norms, soft-capping and alternating sliding layers, Phi-3's fused qkv and gate_up
# projections, Qwen2's attention biases.
COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
MODELS = {
    "tiny-mistral": ("MistralForCausalLM", {"model_type": "mistral", "sliding_window": 48}),
    "tiny-gemma2": ("Gemma2ForCausalLM", {"model_type": "gemma2", "head_dim": 16, "query_pre_attn_scalar": 16,
                                          "sliding_window": 48}),
    "tiny-phi3": ("Phi3ForCausalLM", {"model_type": "phi3"}),
    "tiny-qwen2": ("Qwen2ForCausalLM", {"model_type": "qwen2"}),
}


def save(root: Path, name: str, seed: int = 0, **overrides) -> Path:
    """The model's checkpoint under `root` (`overrides`: config values over the table's)."""
    import transformers

    arch, extra = MODELS[name]
    values = {**COMMON, **extra, **overrides}
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(seed)
    path = root / name
    getattr(transformers, arch)(config).save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", type=Path, help="directory to write the checkpoints under")
    p.add_argument("--only", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"heldout_models: unknown model {', '.join(unknown)} (known: {', '.join(MODELS)})")
    for name in names:
        print(save(args.root, name, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
