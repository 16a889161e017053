"""forgepack.stepcoverage: the stock time of a recorded decode step its blocks replace (CPU, tiny Llama).

The blocks' "kernels" are the chains replayed with stock ops (tests/test_blocks.stock_kernel), placed by
the real matcher into a step recorded from the real model; a kernel that refuses (a guard miss) or
was never run covers nothing.
"""

from __future__ import annotations

import torch
from test_blocks import cards_of, chain_of, program_of, stock_kernel, tiny

from forgepack import stepcoverage
from forgepack.runtime import stepprogram


def test_the_blocks_placed_in_a_step_cover_most_of_its_stock_time():
    model = tiny("llama")
    program = program_of(model, rows=1)
    cards = cards_of(program)
    rewritten, placed = stepprogram.rewrite(program, [(chain_of(c), stock_kernel(c)) for c in cards])
    with torch.no_grad():
        rewritten.run()
    c = stepcoverage.measure("b1", rewritten)
    assert len(c.blocks) == len(placed) == len(cards)
    assert c.launches_pack < c.launches_stock == program.launches()
    assert abs(sum(o.us for o in c.ops) - c.stock_us) < 1e-6 * c.stock_us
    assert 0.5 < c.share < 1.0, c  # the step's edges (embedding, rotary tables, the pick) stay stock
    left = {o.name for o in c.uncovered(50)}
    assert "aten::mm" not in left and "aten::embedding" in left


def test_a_kernel_that_refused_or_never_ran_covers_nothing():
    model = tiny("llama")
    program = program_of(model, rows=1)
    cards = cards_of(program)
    refusing = [(chain_of(c), lambda tensors: None) for c in cards]
    rewritten, _ = stepprogram.rewrite(program, refusing)
    assert stepcoverage.measure("b1", rewritten).covered_us == 0.0  # never run: no hits
    with torch.no_grad():
        rewritten.run()  # every kernel misses, its calls run instead
    c = stepcoverage.measure("b1", rewritten)
    assert c.covered_us == 0.0 and c.stock_us > 0
