"""Allocator decisions: pure functions of card states, each with its reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forgepack.cards import Arg, Card, ChainEntry, Profile, TensorMeta
from forgepack.search import allocator
from forgepack.search.allocator import CallResult, CardState, Config

CFG = Config(floor_us=2.0)


def state(card_id: str, share: float, eager: float = 20.0, roofline: float = 5.0, baseline: str = "native",
          **kw) -> CardState:
    return CardState(card_id=card_id, op=f"aten.{card_id}.default", share=share, eager_us=eager,
                     roofline_us=roofline, baseline=baseline, **kw)


def test_gain_is_share_times_headroom_times_p():
    # vendor matmul with the largest share loses to a smaller native op: p(beating cuBLAS) is low
    states = [state("mm", 0.5, baseline="vendor"), state("softmax", 0.2), state("add", 0.05)]
    decision = allocator.decide(states, CFG)
    assert decision.card_id == "softmax"
    assert "share 20.0%" in decision.reason and "native" in decision.reason and "next best" in decision.reason
    by_id = {s.card_id: s for s in decision.scores}
    assert by_id["mm"].p < 0.1 < 0.3 < by_id["softmax"].p
    # doubling the native op's headroom-limited gain is what the score follows
    assert by_id["softmax"].score > by_id["add"].score > 0
    assert by_id["softmax"].score == pytest.approx(by_id["softmax"].p * by_id["softmax"].gain)


def test_views_unsupported_and_roofline_cards_are_never_chosen():
    states = [
        state("view", 0.6, baseline="view"),
        state("odd", 0.3, unsupported="no cpu template serves odd"),
        state("copy", 0.1, eager=5.0, roofline=4.9),  # already at its roofline
    ]
    decision = allocator.decide(states, CFG)
    assert decision.card_id is None
    reasons = {s.card_id: s.dropped for s in decision.scores}
    assert "no kernel runs" in reasons["view"]
    assert reasons["odd"] == "no cpu template serves odd"
    assert reasons["copy"].startswith("at roofline")
    assert all(r.planned == 0 for r in allocator.plan(states, 10, CFG))


def test_launch_floor_and_cap_bound_the_headroom():
    tiny = state("tiny", 0.1, eager=6.0, roofline=0.01)  # 600x on paper, launch latency says 3x
    assert allocator.achievable_headroom(tiny, CFG) == pytest.approx(3.0)
    huge = state("huge", 0.1, eager=1000.0, roofline=1.0)
    assert allocator.achievable_headroom(huge, CFG) == CFG.headroom_cap
    unknown = state("unknown", 0.1, eager=0.0, roofline=0.0, headroom=2.5)
    assert allocator.achievable_headroom(unknown, CFG) == 2.5


def test_failures_lower_p_and_move_the_budget():
    a, b = state("a", 0.20), state("b", 0.15)
    assert allocator.decide([a, b], CFG).card_id == "a"
    a_failed = dataclasses.replace(a, best=(1.0, 1.0, 1.0), since_improvement=3)
    decision = allocator.decide([a_failed, b], CFG)
    assert decision.card_id == "b"
    p = {s.card_id: s.p for s in decision.scores}
    # a's own failures count fully; b's prior is shared with a's class, so it moves less
    assert p["a"] < p["b"] < 0.4


def test_class_posterior_learns_from_peers():
    fresh = state("fresh", 0.1)
    peers_won = [state(f"w{i}", 0.1, best=(1.5,), successes=1.0) for i in range(4)]
    peers_lost = [state(f"l{i}", 0.1, best=(1.0, 1.0), since_improvement=2) for i in range(4)]
    p_won = allocator.success_probability(fresh, [fresh, *peers_won], CFG)
    p_lost = allocator.success_probability(fresh, [fresh, *peers_lost], CFG)
    p_alone = allocator.success_probability(fresh, [fresh], CFG)
    assert p_lost < p_alone < p_won
    # other classes do not move it
    vendors = [state(f"v{i}", 0.1, baseline="vendor", best=(1.0,) * 5) for i in range(4)]
    assert allocator.success_probability(fresh, [fresh, *vendors], CFG) == pytest.approx(p_alone)


def test_recent_improvement_rate_counts():
    base = dict(share=0.1, best=(1.0, 1.0, 1.0), since_improvement=3)
    flat = state("flat", **base)
    rising = state("rising", share=0.1, best=(1.0, 1.3, 1.6), successes=2.0, since_improvement=0)
    scores = {s.card_id: s for s in allocator.scores([flat, rising], CFG)}
    assert scores["rising"].backward > 0 == scores["flat"].backward
    assert scores["rising"].score > scores["flat"].score


def test_cards_that_stop_improving_are_dropped():
    stuck = state("stuck", 0.5, best=(1.2,) + (1.2,) * CFG.patience, successes=1.0, since_improvement=CFG.patience)
    other = state("other", 0.01)
    decision = allocator.decide([stuck, other], CFG)
    assert decision.card_id == "other"
    dropped = next(s for s in decision.scores if s.card_id == "stuck").dropped
    assert dropped.startswith("stopped improving")


def test_pending_calls_are_a_virtual_loss_and_can_make_it_wait():
    a = state("a", 0.2)
    busy = dataclasses.replace(a, pending=2)
    assert allocator.success_probability(busy, [busy], CFG) < allocator.success_probability(a, [a], CFG)
    last_chance = state("a", 0.2, best=(1.0,) * (CFG.patience - 1), since_improvement=CFG.patience - 1, pending=1)
    decision = allocator.decide([last_chance], CFG)
    assert decision.card_id is None and "still being evaluated" in decision.reason


def test_reaching_the_ceiling_ends_a_card():
    done = state("done", 0.3, eager=8.0, roofline=2.0, best=(4.0,), successes=1.0)  # headroom 4, best 4
    assert allocator.decide([done], CFG).card_id is None


def test_decisions_are_deterministic_and_ties_go_to_the_larger_share():
    states = [state("b", 0.1), state("a", 0.1), state("c", 0.1)]
    first = allocator.decide(states, CFG)
    assert first == allocator.decide(list(reversed(states)), CFG)
    assert first.card_id == "a"  # equal scores and shares: card id order


def test_plan_spends_the_budget_by_expected_gain():
    states = [state("big", 0.4), state("mid", 0.1), state("small", 0.005), state("mm", 0.45, baseline="vendor"),
              state("v", 0.05, baseline="view")]
    rows = {r.card_id: r for r in allocator.plan(states, 20, CFG)}
    assert sum(r.planned for r in rows.values()) == 20
    assert rows["big"].planned > rows["mid"].planned >= rows["small"].planned
    assert rows["v"].planned == 0 and rows["v"].dropped
    assert rows["big"].planned > rows["mm"].planned  # larger share, but vendor
    uniform = {r.card_id: r.planned for r in allocator.plan(states, 20, CFG, strategy="uniform")}
    assert uniform == {"big": 5, "mid": 5, "small": 5, "mm": 5, "v": 0}


def test_uniform_split_is_round_robin_over_searchable_cards():
    states = [state("a", 0.3, best=(1.0,)), state("b", 0.2), state("c", 0.1, exhausted=True),
              state("v", 0.4, baseline="view")]
    decision = allocator.decide_uniform(states, CFG)
    assert decision.card_id == "b" and decision.reason.startswith("uniform")


def _card(name: str, share: float, baseline: str = "native") -> Card:
    meta = TensorMeta("float32", (4, 8), (8, 1))
    return Card(op=f"aten.{name}.default", schema=f"aten::{name}(Tensor self) -> Tensor",
                args=(Arg("self", "tensor", tensor=meta),), outputs=(meta,),
                profile=Profile(eager_us=10.0, share=share, roofline_us=2.0, headroom=5.0, baseline=baseline))


def test_card_states_from_history():
    relu, neg = _card("relu", 0.3), _card("neg", 0.1)
    history = [
        CallResult(relu.id, accepted=False, speedup=None),
        CallResult(relu.id, accepted=True, speedup=1.4),
        CallResult(relu.id, accepted=True, speedup=1.2),  # accepted but not better: no improvement
        CallResult(relu.id, pending=True),
        CallResult(neg.id, accepted=False),
    ]
    states = {s.card_id: s for s in allocator.card_states([relu, neg], history, exhausted=[neg.id])}
    r = states[relu.id]
    assert r.best == (1.0, 1.4, 1.4) and r.successes == 1 and r.since_improvement == 1 and r.pending == 1
    assert r.calls == 4 and r.best_speedup == 1.4 and r.share == 0.3 and r.baseline == "native"
    assert states[neg.id].exhausted and not r.exhausted
    # a better kernel by less than the noise threshold moves the best but is no success
    noisy = [CallResult(relu.id, accepted=True, speedup=1.40), CallResult(relu.id, accepted=True, speedup=1.41)]
    [n] = allocator.card_states([relu], noisy, improvement=0.02)
    assert n.best == (1.40, 1.41) and n.successes == 1 and n.since_improvement == 1
    with pytest.raises(ValueError, match="no profile"):
        allocator.card_states([dataclasses.replace(relu, profile=None)], [])


def test_decision_json_names_the_top_cards():
    decision = allocator.decide([state("a", 0.2), state("b", 0.1)], CFG)
    data = decision.to_json()
    assert data["card_id"] == "a" and [t["card_id"] for t in data["top"]] == ["a", "b"]


def test_docstring_examples():
    import doctest

    assert doctest.testmod(allocator).failed == 0


def test_max_pending_makes_a_card_wait_for_its_verdict():
    one_at_a_time = dataclasses.replace(CFG, max_pending=1)
    busy, idle = state("busy", 0.5, pending=1), state("idle", 0.01)
    assert allocator.decide([busy, idle], CFG).card_id == "busy"
    decision = allocator.decide([busy, idle], one_at_a_time)
    assert decision.card_id == "idle"
    assert next(s for s in decision.scores if s.card_id == "busy").dropped.startswith("waiting")


def test_reach_is_learned_from_what_successes_reached():
    prior = allocator.learned_reach([state("fresh", 0.1)], CFG)
    assert (prior.first, prior.refine) == (CFG.first_reach, CFG.refine_reach)
    # headroom 4 (20 us eager, 5 us roofline): a first kernel at 4x reached all of it, refinements of +3%
    # reached little of what was left
    full = [state(f"f{i}", 0.1, best=(4.0,), successes=1.0) for i in range(6)]
    small = [state(f"s{i}", 0.1, best=(1.5, 1.55, 1.60), successes=3.0) for i in range(6)]
    learned = allocator.learned_reach(full + small, CFG)
    assert learned.first > prior.first and learned.refine < prior.refine
    # and that moves the expected gain of refining a card
    card = state("c", 0.2, best=(1.5,), successes=1.0)
    before = allocator.score(card, [card], CFG, prior).gain
    after = allocator.score(card, [card], CFG, learned).gain
    assert after < before


def _meta(shape, dtype="float32"):
    stride = torch.empty(shape).stride()
    return TensorMeta(dtype, tuple(shape), stride)


def _op_card(op: str, out_shape, calls: int, share: float) -> Card:
    x = _meta(out_shape)
    return Card(op=op, schema="", args=(Arg("self", "tensor", tensor=x),), outputs=(x,), calls=calls,
                profile=Profile(eager_us=5.0, total_us=5.0 * calls, share=share, roofline_us=1.0, headroom=5.0))


def _fusion_card(ops_and_shapes, calls: int, share: float) -> Card:
    x = _meta(ops_and_shapes[0][1])
    chain = tuple(ChainEntry(op, outs=(_meta(shape),)) for op, shape in ops_and_shapes)
    return Card(op="fusion.rmsnorm.default", schema="", args=(Arg("x", "tensor", tensor=x),), outputs=(x,),
                kind="fusion", calls=calls, chain=chain,
                profile=Profile(eager_us=30.0, total_us=30.0 * calls, share=share, roofline_us=1.0, headroom=30.0,
                                baseline="fusion"))


def test_ops_inside_an_accepted_fusion_kernel_get_no_budget_and_count_once():
    """Llama on the H200: the allocator spent most of 100 calls on the pow/mean/rsqrt/mul calls inside
    RMSNorm after the fused RMSNorm kernel was accepted, and the estimated gain counted both (127%)."""
    pow_ = _op_card("aten.pow.Tensor_Scalar", (4, 64), calls=8, share=0.2)  # 4 of its 8 calls are in RMSNorm
    mean = _op_card("aten.mean.dim", (4, 1), calls=4, share=0.1)  # all inside
    other = _op_card("aten.add.Tensor", (4, 64), calls=4, share=0.05)  # not in the chain
    fusion = _fusion_card([("aten.pow.Tensor_Scalar", (4, 64)), ("aten.mean.dim", (4, 1))], calls=4, share=0.3)
    cards = [pow_, mean, other, fusion]
    cover = allocator.coverage(cards)
    assert cover[pow_.id] == ((fusion.id, 0.5),) and cover[mean.id] == ((fusion.id, 1.0),)
    assert other.id not in cover and fusion.id not in cover

    before = allocator.card_states(cards, [])
    assert allocator.total_gain(before) == 0.0
    assert allocator.accepted_fusions(before) == frozenset()
    assert {s.card_id for s in allocator.scores(before, CFG) if s.dropped} == set()  # a hedge until it wins

    won = allocator.card_states(cards, [CallResult(fusion.id, accepted=True, speedup=4.0)])
    by_id = {s.card_id: s for s in allocator.scores(won, CFG)}
    assert "fused away" in by_id[mean.id].dropped
    assert by_id[pow_.id].dropped is None
    assert by_id[pow_.id].gain == pytest.approx(
        allocator.score(allocator.card_states([pow_], [])[0], won, CFG).gain * 0.5)

    history = [CallResult(fusion.id, accepted=True, speedup=4.0), CallResult(mean.id, accepted=True, speedup=2.0),
               CallResult(pow_.id, accepted=True, speedup=2.0)]
    states = allocator.card_states(cards, history)
    # fusion 0.3 x 3/4, pow's half outside the chain 0.1 x 1/2, mean nothing (all its calls are fused)
    assert allocator.total_gain(states) == pytest.approx(0.3 * 0.75 + 0.1 * 0.5)


def test_a_family_is_covered_at_every_point_not_only_at_its_representative():
    """An envelope's operator family stands for calls at several sizes, its representative being the
    most-called one. A fusion chain met at another size (a decode step's exact rotary at batch 4 beside a
    `neg` family whose representative is batch 1, as an H200 envelope build had) covers that point's
    calls: matched at the representative alone, it covered none."""
    from forgepack import families
    from forgepack.capture import card_from_call

    neg = torch.ops.aten.neg.default
    calls = [dataclasses.replace(card_from_call(neg, (torch.randn(b, 64),), {})[0], calls=n)
             for b, n in ((1, 5), (2, 1), (4, 2))]
    (fam,) = families.fold(calls)
    fam = fam.with_profile(Profile(eager_us=5.0, total_us=40.0, share=0.1, roofline_us=1.0, headroom=5.0))
    assert fam.family is not None and fam.outputs[0].shape == (1, 64)  # the representative: batch 1
    fusion = _fusion_card([("aten.neg.default", (4, 64))], calls=2, share=0.2)  # batch 4's two calls
    cover = allocator.coverage([fam, fusion])
    assert cover[fam.id] == ((fusion.id, pytest.approx(2 / 8)),)


def test_breadth_takes_an_operator_card_a_pending_fusion_would_fuse_away_last_in_its_round():
    """The mean inside RMSNorm (all its calls in the fused chain) waits while the fused RMSNorm is untried
    or still being evaluated; an accepted fusion kernel then drops it, a rejected one gives it its call."""
    fusion = state("norm", 0.3, baseline="fusion", kind="fusion")
    mean = state("mean", 0.2, covered=(("norm", 1.0),))
    add = state("add", 0.05)
    assert allocator.decide_breadth([fusion, mean, add], CFG).card_id == "norm"
    pending = dataclasses.replace(fusion, pending=1)
    assert allocator.awaiting_fusion([pending, mean, add]) == {"mean"}
    assert allocator.decide_breadth([pending, mean, add], CFG).card_id == "add"  # mean's gain is larger
    rejected = dataclasses.replace(fusion, best=(1.0,), since_improvement=1)
    assert allocator.decide_breadth([rejected, mean, dataclasses.replace(add, best=(1.2,))], CFG).card_id == "mean"
    accepted = dataclasses.replace(fusion, best=(4.0,), successes=1.0)
    by_id = {sc.card_id: sc for sc in allocator.scores([accepted, mean, add], CFG)}
    assert "fused away" in by_id["mean"].dropped


def test_the_headroom_cap_is_not_a_ceiling_for_a_card_already_past_it():
    """H200, Llama prefill: the fused rotary reached 18.9x in one call, above the 8x cap, and was dropped
    as if it had reached its ceiling, while three calls reached 20.3x."""
    rotary = state("rotary", 0.5, eager=240.0, roofline=1.0)  # measured headroom 120x (floor 2 us)
    won = dataclasses.replace(rotary, best=(18.9,), successes=1.0, since_improvement=0)
    headroom = allocator.achievable_headroom(won, CFG)
    assert 18.9 < headroom <= 18.9 * (1 + CFG.refine_margin) + 1e-9
    sc = allocator.score(won, [won], CFG)
    assert sc.dropped is None and sc.score > 0
    at_ceiling = dataclasses.replace(state("small", 0.5, eager=20.0, roofline=10.0), best=(2.0,), successes=1.0)
    assert "reached its achievable" in allocator.score(at_ceiling, [at_ceiling], CFG).dropped


def test_a_kernel_well_past_its_roofline_proves_the_estimate_wrong_and_keeps_room():
    """CPU, tiny-llama: an add whose roofline said 1.15x got a 3.31x kernel (its data never left the cache)
    and was dropped as "reached its achievable 1.15x" with its template's other points untried."""
    add = dataclasses.replace(state("add", 0.02, eager=2.3, roofline=2.0), best=(3.31,), successes=1.0)
    headroom = allocator.achievable_headroom(add, CFG)
    assert headroom == pytest.approx(3.31 * (1 + CFG.refine_margin))
    assert allocator.score(add, [add], CFG).dropped is None
    near = dataclasses.replace(add, best=(1.3,))  # past the estimate, but within the refinement margin
    assert "reached its achievable" in allocator.score(near, [near], CFG).dropped


def test_breadth_gives_every_live_card_one_call_before_any_gets_a_second():
    """Biggest estimated gain first among the cards with the fewest calls; what the allocator drops (a
    view, a card at its roofline) gets none."""
    states = [state("big", 0.8, best=(1.1,), successes=1.0), state("mid", 0.02), state("small", 0.01),
              state("v", 0.3, baseline="view"), state("flat", 0.3, eager=1.0, roofline=1.0)]
    decision = allocator.decide_breadth(states, CFG)
    assert decision.card_id == "mid" and decision.reason.startswith("breadth")
    assert allocator.decide(states, CFG).card_id == "big"  # the allocator would refine the big one
    rows = {r.card_id: r.planned for r in allocator.plan(states, 3, CFG, strategy="breadth")}
    assert rows == {"big": 1, "mid": 1, "small": 1, "v": 0, "flat": 0}
    assert allocator.decide_breadth([state("v", 0.3, baseline="view")], CFG).card_id is None


def test_a_paid_call_must_be_expected_to_save_enough_per_dollar():
    """With calls at $0.20, a card whose expected gain per call is under the minimum per dollar gets none
    (the plan and `--explain` say why); the reason of a call that is made states its gain per dollar.
    Free calls (cost 0) are never held to it."""
    states = [state("big", 0.30), state("tiny", 0.0004)]
    paid = dataclasses.replace(CFG, min_gain_per_dollar=1e-3, cost_per_call=0.20)
    by_id = {s.card_id: s for s in allocator.scores(states, paid)}
    assert by_id["big"].dropped is None and by_id["big"].per_dollar == pytest.approx(by_id["big"].score / 0.20)
    assert by_id["tiny"].per_dollar < 1e-3
    assert by_id["tiny"].dropped.startswith("est. gain/$") and "$0.2000" in by_id["tiny"].dropped
    decision = allocator.decide(states, paid)
    assert decision.card_id == "big" and "est. gain/$" in decision.reason and "$0.2000 a call" in decision.reason
    rows = {r.card_id: r for r in allocator.plan(states, 20, paid)}
    assert rows["tiny"].planned == 0 and rows["tiny"].dropped.startswith("est. gain/$")
    # alone, the tiny card still gets no paid call; free, it does
    assert allocator.decide([states[1]], paid).card_id is None
    free = dataclasses.replace(paid, cost_per_call=0.0)
    assert allocator.decide([states[1]], free).card_id == "tiny"
    assert "gain/$" not in allocator.decide(states, free).reason
