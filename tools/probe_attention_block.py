"""The attention block of a recorded GPU decode step, laid open: its card (JSON, for replaying it on
another machine), its plan, and the verdict of each CUDA render point on it.

    python tools/probe_attention_block.py --out DIR [--arch llama] [--cache 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama")
    p.add_argument("--cache", type=int, default=256)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import torch
    import transformers

    from forgepack import blocks, cards, evaluate
    from forgepack.templates import blocks as tblocks

    dims = dict(pad_token_id=0, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=1024)
    config = transformers.AutoConfig.for_model(args.arch, **dims)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().to("cuda", torch.bfloat16)
    with torch.no_grad():
        program = blocks.record_step(model, 1, args.cache)
    found, _ = blocks.find(program)
    card = next(blocks.make_card(program, b) for b in found if b.kind == "attention")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention-card.json").write_text(json.dumps(cards.to_json(card), indent=1))
    for e in card.chain:
        print(e.op, [(a.kind, a.ref if a.kind == "tensor" else a.value) for a in e.args][:8])
    plan = tblocks.attention_plan(card)
    print(dataclasses.asdict(plan))
    template = tblocks.AttentionBlockTemplate("blocks.attention", "blocks", ("cuda", "cpu"), tblocks.BLOCK_OPS)
    for params in ({"warps": 8, "splits": 1}, {"warps": 4, "splits": 8}):
        verdict = evaluate.evaluate(card, template.render(card, "cuda", params), target="cuda", margin=-1.0)
        print(params, verdict.category, verdict.reason[:400])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
