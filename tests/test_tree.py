"""Tree search per card: UCT on normalised reward, progressive widening, failed children kept."""

from __future__ import annotations

import doctest
import math

import pytest

from forgepack.search import tree as tree_mod
from forgepack.search.tree import Tree, TreeConfig, normalised_reward


def grow(tree: Tree, parent, cid: int, speedup: float | None, category: str | None = None, accepted=None):
    tree.add(cid, parent, "templates:t", {"i": cid})
    ok = speedup is not None and speedup >= 1.05 if accepted is None else accepted
    return tree.record(cid, accepted=ok, category=None if ok else (category or "slower"), speedup=speedup,
                       kernel_us=10 / speedup if speedup else None, eager_us=10.0, feedback=f"fb {cid}")


def test_reward_is_normalised_log_speedup():
    assert normalised_reward(1.0, 4.0) == 0.5
    assert normalised_reward(2.0, 4.0) == pytest.approx(0.75)
    assert normalised_reward(0.5, 4.0) == pytest.approx(0.25)
    assert normalised_reward(100.0, 4.0) == 1.0 and normalised_reward(0.001, 4.0) == 0.0
    assert normalised_reward(1.5, 3.0) == pytest.approx((math.log(1.5) / math.log(3.0) + 1) / 2)
    assert doctest.testmod(tree_mod).failed == 0


def test_a_node_scores_its_relative_gain_not_the_time_it_saves():
    # a 1 us op made 1.5x faster and a 1 ms op made 1.5x faster score alike (no raw microseconds),
    # and a 1 ms op saving 100 us (1.11x) scores below the 1 us op saving 0.5 us (1.5x)
    t = Tree("c", ceiling=3.0)
    rewards = {}
    for cid, eager, kernel in ((1, 1.5, 1.0), (2, 1500.0, 1000.0), (3, 1000.0, 900.0)):
        t.add(cid, None, "templates:t", {"i": cid})
        node = t.record(cid, accepted=eager / kernel >= 1.05, category=None if eager / kernel >= 1.05 else "slower",
                        speedup=eager / kernel, kernel_us=kernel, eager_us=eager)
        rewards[cid] = node.reward
    assert rewards[1] == pytest.approx(rewards[2]) == pytest.approx((math.log(1.5) / math.log(3.0) + 1) / 2)
    assert rewards[3] < rewards[1]


def test_root_first_then_progressive_widening():
    t = Tree("c", ceiling=4.0, config=TreeConfig(c=1.0, alpha=0.5))
    assert t.select() is t.root  # nothing yet: propose from scratch
    grow(t, None, 1, 1.2)
    # root has 1 visit -> 1 child allowed; the child may have 1 child: deepen it
    assert t.select() is t.nodes[1]
    grow(t, 1, 2, 1.3)
    # root has 2 visits -> ceil(sqrt 2) = 2 children allowed: widen the root again
    assert t.allowed_children(t.root) == 2 and t.select() is t.root
    grow(t, None, 3, 1.1)
    assert t.allowed_children(t.root) == 2 and len(t.root.children) == 2
    assert t.select() is not t.root


def test_failed_children_are_kept_with_feedback_but_never_selected():
    t = Tree("c", ceiling=4.0)
    grow(t, None, 1, None, category="compile")
    node = t.nodes[1]
    assert node.state == "failed" and node.reward is None and node in t.root.children
    assert t.root.visits == 1 and t.root.wins == 0 and t.root.q == 0.0  # effort counted, no value
    # nothing selectable below: the root is widened anyway, with the failure as feedback
    assert t.select() is t.root
    assert t.feedback(t.root) == ["candidate #1: fb 1"]
    grow(t, None, 2, 1.5)
    # root: 2 visits, 2 children allowed, both used: descend, past the failure, to the working kernel
    assert t.select() is t.nodes[2]
    grow(t, 2, 3, None, category="crash")
    grow(t, 2, 4, None, category="timeout")
    chosen = t.select()
    assert chosen.state != "failed" and chosen in (t.root, t.nodes[2])


def test_slower_but_correct_kernels_stay_selectable():
    t = Tree("c", ceiling=4.0)
    grow(t, None, 1, 0.9)  # correct, 10% slower than eager
    assert t.nodes[1].state == "ok" and t.nodes[1].reward < 0.5
    assert t.select() is t.nodes[1]


def test_uct_prefers_the_better_child_at_equal_visits():
    t = Tree("c", ceiling=4.0, config=TreeConfig(c=0.5, alpha=0.5, exploration=0.1))
    grow(t, None, 1, 1.1)
    grow(t, None, 2, 2.0)
    t.mark_exhausted(t.root)
    assert t.select() is t.nodes[2]
    assert t.uct(t.nodes[2], t.root) > t.uct(t.nodes[1], t.root)


def test_exploration_term_visits_the_less_tried_child():
    t = Tree("c", ceiling=4.0, config=TreeConfig(c=1.0, alpha=0.5, exploration=2.0))
    grow(t, None, 1, 1.3)
    grow(t, None, 2, 1.2)
    for cid in range(10, 16):  # many descendants under 1
        grow(t, 1, cid, 1.3)
    t.mark_exhausted(t.root)
    t.mark_exhausted(t.nodes[1])
    for cid in range(10, 16):
        t.mark_exhausted(t.nodes[cid])
    assert t.uct(t.nodes[2], t.root) > t.uct(t.nodes[1], t.root)
    assert t.select() is t.nodes[2]


def test_exhausted_subtrees_are_skipped_and_an_exhausted_tree_returns_none():
    t = Tree("c", ceiling=4.0)
    grow(t, None, 1, 1.5)
    grow(t, 1, 2, None, category="mismatch")
    t.mark_exhausted(t.nodes[1])
    assert t.select() is t.root  # the only working node has nothing left
    t.mark_exhausted(t.root)
    assert t.select() is None


def test_pending_children_count_for_widening_and_are_not_parents():
    t = Tree("c", ceiling=4.0)
    t.add(1, None, "templates:t", {"i": 1})
    assert t.nodes[1].state == "pending"
    assert t.select() is t.root  # forced widening: nothing selectable yet
    assert t.tried(t.root) == frozenset({'{"i": 1}'})
    t.record(1, accepted=True, category=None, speedup=1.3)
    with pytest.raises(ValueError):
        t.record(1, accepted=True, category=None, speedup=1.3)


def test_lineage_and_notes():
    t = Tree("c", ceiling=4.0)
    grow(t, None, 1, 1.2)
    grow(t, 1, 2, 1.4)
    t.note(2, "the reply had no fenced code block")
    lineage = t.lineage(t.nodes[2])
    assert [e.candidate_id for e in lineage] == [1, 2]
    assert lineage[1].speedup == 1.4 and lineage[1].accepted and lineage[0].kernel_us == pytest.approx(10 / 1.2)
    assert t.lineage(t.root) == []
    assert t.feedback(t.nodes[2]) == ["the reply had no fenced code block"]
    assert t.best() is t.nodes[2]
    assert t.counts() == {"accepted": 2}


def test_best_keeps_the_earlier_kernel_unless_a_later_one_is_faster_beyond_the_noise():
    """Which of two equally fast kernels a card keeps must not depend on timing noise: the earlier
    (in proposal order) stays, whichever measured a hair faster, and whatever order verdicts came in."""
    def record(t: Tree, cid: int, speedup: float, low: float, high: float) -> None:
        t.record(cid, accepted=True, category=None, speedup=speedup, ci_low=low, ci_high=high)

    for order in ([1, 2, 3], [3, 2, 1]):
        t = Tree("c", ceiling=4.0)
        for cid in (1, 2, 3):
            t.add(cid, None, "templates:t", {"i": cid})
        measured = {1: (1.30, 1.24, 1.35), 2: (1.34, 1.29, 1.40), 3: (1.31, 1.20, 1.45)}
        for cid in order:
            record(t, cid, *measured[cid])
        assert t.best() is t.nodes[1]  # 2 and 3 are within 1's noise: a tie, the earliest stays
    t = Tree("c", ceiling=4.0)
    for cid, m in {1: (1.30, 1.24, 1.35), 2: (1.50, 1.40, 1.58), 3: (1.52, 1.45, 1.60)}.items():
        t.add(cid, None, "templates:t", {"i": cid})
        record(t, cid, *m)
    assert t.best() is t.nodes[2]  # clearly faster than 1; 3 ties with 2
    # an interval that reaches the incumbent's is no replacement, nor a faster one by less than DRIFT
    a = tree_mod.Node(1, speedup=2.0, ci_low=1.999, ci_high=2.001)
    assert not tree_mod.clearly_faster(tree_mod.Node(2, speedup=2.03, ci_low=2.02, ci_high=2.04), a)
    assert tree_mod.clearly_faster(tree_mod.Node(2, speedup=2.05, ci_low=2.04, ci_high=2.06), a)


def test_an_llm_draws_its_parents_from_the_best_kernels_by_speedup():
    """The "best" policy: k calls in flight on a card go to its k best working kernels (the k-th call to the
    k-th best), the root joining them while widening allows; with nothing working yet, all start from
    scratch (best-of-k first attempts). Failed kernels are never parents."""
    t = Tree("c", ceiling=8.0, config=TreeConfig(policy="best", top=3))
    assert [t.select(rank) for rank in range(3)] == [t.root] * 3
    grow(t, None, 1, 1.3)
    grow(t, None, 2, 0.8)  # correct but slower: still a parent, after faster ones
    grow(t, None, 3, None, category="mismatch")
    grow(t, 1, 4, 2.1)
    grow(t, 4, 5, 1.6)
    assert not t.can_widen(t.root)  # 5 visits: 3 children allowed, 3 made
    assert [t.select(rank).id for rank in range(4)] == [4, 5, 1, 4]
    grow(t, 5, 6, 0.5)
    grow(t, 5, 7, 0.6)
    grow(t, 5, 8, 0.7)
    grow(t, 5, 9, 0.9)
    grow(t, 5, 10, 0.95)
    assert t.can_widen(t.root)  # 10 visits: a fourth child of the root is allowed: a fresh start joins
    assert [t.select(rank).id for rank in range(4)] == [4, 5, 1, None]
    # what else was tried, for the prompt: outside the parent's lineage, working kernels fastest first,
    # then the failures, each with the kernel it came from
    assert [e.candidate_id for e in t.evaluated(t.nodes[5])] == [10, 9, 2, 8, 7, 6, 3]
    assert [(e.candidate_id, e.parent_id) for e in t.evaluated(t.root, limit=3)] == [(4, 1), (5, 4), (1, None)]
    assert t.evaluated(t.nodes[5])[-1].category == "mismatch"
