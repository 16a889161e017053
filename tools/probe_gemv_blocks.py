"""The GEMV decode blocks of a recorded GPU decode step, swept over their template's axes: each block's
default point, then every other value of one axis at a time (the rest at the default), then the point
that takes each axis's best value. Every point is compiled (in parallel), verified and timed against
stock by the evaluator; the table gives its kernel time and the weight bytes it streams per second.

    python tools/probe_gemv_blocks.py --out DIR [--arch llama] [--rows 1] [--budget-s 200]

Shapes are Llama-3.2-1B's (one layer: the blocks' shapes are a layer's); `--arch qwen2` takes
Qwen2-0.5B's. Results: DIR/probe_gemv_blocks.json (every point) and .md (the table).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SHAPES = {
    "llama": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                  vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "qwen2": dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                  vocab_size=151936, rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def _weight_bytes(card, plan) -> int:
    ins = card.tensor_inputs()
    seen = {lin.w for lin in plan.lins}
    return sum(ins[w].numel * ins[w].itemsize for w in seen)


def _sweep_points(template, card) -> list[dict]:
    """The default, then every other value of one axis at a time (the rest at the default)."""
    default = template.default(card, "cuda")
    points = [default]
    for axis, values in template.space(card, "cuda").items():
        points += [{**default, axis: v} for v in values if v != default[axis]]
    return points


def _best_of_axes(template, card, timed: dict[str, float]) -> dict:
    """Each axis at its fastest verified value in the sweep (`timed`: kernel µs by `_key`); the default's
    value where none verified faster."""
    default = template.default(card, "cuda")
    inf = float("inf")
    return {axis: min(values, key=lambda v: (timed.get(_key({**default, axis: v}), inf), v != default[axis]))
            for axis, values in template.space(card, "cuda").items()}


def _key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--cache", type=int, default=256)
    p.add_argument("--budget-s", type=float, default=200.0, help="no new point is timed past this")
    p.add_argument("--only", help="these blocks only, by kind (gate_up,proj_add,lm_head,qkv), in this order")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import torch
    import transformers
    from tabulate import tabulate

    from forgepack import blocks, evaluate
    from forgepack import compile as compile_mod
    from forgepack.templates import blocks as tblocks

    start = time.monotonic()
    config = transformers.AutoConfig.for_model(args.arch, num_hidden_layers=1, pad_token_id=0,
                                               max_position_embeddings=4096, **SHAPES[args.arch])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().to("cuda", torch.bfloat16)
    with torch.no_grad():
        program = blocks.record_step(model, args.rows, args.cache)
    found, _ = blocks.find(program)
    template = tblocks.GemvBlockTemplate("blocks.gemv", "blocks", ("cuda", "cpu"), tblocks.BLOCK_OPS)
    cards = []
    for b in found:
        card = blocks.make_card(program, b)
        if template.supports(card, "cuda") is None:
            cards.append((f"{b.kind}#{len(cards)}", card))
    if args.only:
        order = args.only.split(",")
        cards = sorted((c for c in cards if c[0].split("#")[0] in order), key=lambda c: order.index(c[0].split("#")[0]))
    todo = [(name, card, params) for name, card in cards for params in _sweep_points(template, card)]
    with ThreadPoolExecutor(max_workers=16) as pool:  # nvcc is single-threaded: one per core
        list(pool.map(lambda t: compile_mod.compile_kernel(template.render(t[1], "cuda", t[2]), "cuda"), todo))
    print(f"compiled {len(todo)} points in {time.monotonic() - start:.0f} s", flush=True)
    rows: list[dict] = []

    def run(ev, name, card, params, weight_bytes) -> dict | None:
        if time.monotonic() - start > args.budget_s:
            return None
        v = ev.evaluate(card, template.render(card, "cuda", params), margin=-1.0)
        row = dict(block=name, params=params, category=v.category, reason=v.reason[:200], kernel_us=v.kernel_us,
                   stock_us=v.eager_us, speedup=v.speedup,
                   tb_s=(weight_bytes / v.kernel_us / 1e6) if v.kernel_us else None)
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    with evaluate.Evaluator("cuda") as ev:
        for name, card in cards:
            weight_bytes = _weight_bytes(card, tblocks.gemv_plan(card))
            timed = {}
            for params in _sweep_points(template, card):
                r = run(ev, name, card, params, weight_bytes)
                if r and r["category"] is None and r["kernel_us"]:
                    timed[_key(params)] = r["kernel_us"]
            best = _best_of_axes(template, card, timed)
            if best != template.default(card, "cuda"):
                r = run(ev, name, card, best, weight_bytes)
                if r:
                    r["combined"] = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(arch=args.arch, rows=args.rows, device=torch.cuda.get_device_name(), torch=torch.__version__)
    (out / "probe_gemv_blocks.json").write_text(json.dumps(dict(meta=meta, points=rows), indent=1))
    table = [[r["block"], json.dumps(r["params"]), r["category"] or "ok", r["kernel_us"] and round(r["kernel_us"], 1),
              r["stock_us"] and round(r["stock_us"], 1), r["tb_s"] and round(r["tb_s"], 2),
              "best of axes" if r.get("combined") else ""] for r in rows]
    md = tabulate(table, ["block", "params", "verdict", "kernel µs", "stock µs", "TB/s", ""], tablefmt="github")
    (out / "probe_gemv_blocks.md").write_text(f"{json.dumps(meta)}\n\n{md}\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
