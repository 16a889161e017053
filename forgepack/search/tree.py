"""Tree search per card: UCT with progressive widening over candidates.

Nodes are candidates; a child is a proposal made from its parent (a template's neighbour parameters,
or an LLM's rewrite of the parent's source). The root stands for "from scratch" (no parent).

- **Reward**, normalised so one exploration constant fits every card: ``log(speedup)`` over
  ``log(ceiling)`` (the card's achievable headroom), clipped to [-1, 1] and mapped to [0, 1]
  (0.5 = eager parity). Kernel Forge used raw milliseconds, which makes a 1 us op and a 1 ms op
  incomparable. A correct kernel that was merely too slow (``slower``) keeps its measured reward: it
  can still be refined.
- **Failures** (did not compile, crashed, wrong, ...) are kept as children, with their feedback for the
  next proposal from the same parent, but are never selected; they count as visits of their ancestors
  (effort spent there) and add nothing to their value (the mean is over working kernels only).
- **Progressive widening**: a node may have ``ceil(c x visits ** alpha)`` children (failed and pending
  ones included), so the search deepens good kernels instead of only sampling new ones from the root.
  A node none of whose children can be selected is widened anyway, until its proposer runs dry
  (`mark_exhausted`).
- **Selection** (``policy="uct"``, the templates proposer's): from the root, widen where allowed, else
  descend to the child with the best ``Q + C sqrt(ln N / n)``; a subtree with nothing left to expand is
  skipped (backtracking).
- **Selection** (``policy="best"``, an LLM's): the parent is drawn from the best working kernels by
  speed-up, the ``rank``-th of them for the ``rank``-th call on this card still in flight, so a round
  of k samples refines the best, the second best, ... (AlphaEvolve's parent plus inspirations); the
  root (a kernel from scratch) joins them while progressive widening allows it another child, and is
  the only choice while no kernel works (best-of-k first attempts).
- **Best**: the card's kernel is its first accepted candidate (in proposal order) until a later one is
  faster beyond the noise (`clearly_faster`): two kernels whose speed-ups lie within each other's
  intervals are a tie, and a tie keeps the earlier one, so timing noise does not pick the kernel.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TreeConfig:
    c: float = 1.0  # progressive widening: children allowed = ceil(c * visits ** alpha)
    alpha: float = 0.5
    exploration: float = 0.5  # UCT constant, for rewards in [0, 1]
    policy: str = "uct"  # "uct" | "best" (see the module doc)
    top: int = 3  # "best": how many of the best working kernels parents are drawn from


@dataclass(frozen=True)
class LineageEntry:
    """An ancestor of the node being expanded, as a proposer sees it (root first)."""

    candidate_id: int
    proposer: str
    params: dict
    category: str | None
    accepted: bool
    speedup: float | None
    kernel_us: float | None
    eager_us: float | None
    feedback: str | None
    resources: str | None = None  # registers and spills per kernel (CUDA), one line
    parent_id: int | None = None  # the kernel it was made from (None: from scratch)


@dataclass
class Node:
    id: int | None  # candidate id; None for the root
    parent: Node | None = None
    proposer: str = ""
    params: dict = field(default_factory=dict)
    state: str = "pending"  # "root" | "pending" | "ok" | "failed"
    accepted: bool = False
    category: str | None = None
    speedup: float | None = None
    ci_low: float | None = None  # the speed-up's interval (None: not measured, the point itself)
    ci_high: float | None = None
    kernel_us: float | None = None
    eager_us: float | None = None
    feedback: str | None = None
    resources: str | None = None
    reward: float | None = None
    children: list[Node] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # feedback on calls from here that made no candidate
    visits: int = 0  # evaluated candidates in this subtree, itself included
    value: float = 0.0  # summed reward of the working candidates in this subtree
    wins: int = 0  # working candidates in this subtree
    exhausted: bool = False  # the proposer has nothing new to offer from here

    @property
    def q(self) -> float:
        return self.value / self.wins if self.wins else 0.0

    def params_key(self) -> str:
        return params_key(self.params)


def params_key(params: dict) -> str:
    return json.dumps(params, sort_keys=True, default=str)


DRIFT = 0.02  # between two runs of one build a kernel's speed-up moves by more than one run's interval shows


def clearly_faster(new: Node, incumbent: Node) -> bool:
    """Whether `new` is faster than `incumbent` beyond the noise: its speed-up interval lies wholly
    above the incumbent's, and its speed-up is at least `DRIFT` higher. The test a kernel passes
    against eager (interval above 1, speed-up at least 1 + margin), with the incumbent for eager.

    >>> a = Node(1, speedup=1.30, ci_low=1.25, ci_high=1.36)
    >>> clearly_faster(Node(2, speedup=1.33, ci_low=1.28, ci_high=1.38), a)  # within the noise: a tie
    False
    >>> clearly_faster(Node(3, speedup=1.45, ci_low=1.40, ci_high=1.50), a)
    True
    """
    new_low = new.ci_low if new.ci_low is not None else new.speedup
    old_high = incumbent.ci_high if incumbent.ci_high is not None else incumbent.speedup
    return new_low > old_high and new.speedup >= incumbent.speedup * (1 + DRIFT)


def normalised_reward(speedup: float, ceiling: float) -> float:
    """log speed-up over log ceiling, clipped to [-1, 1], mapped to [0, 1].

    >>> normalised_reward(1.0, 4.0), normalised_reward(2.0, 4.0), normalised_reward(16.0, 4.0)
    (0.5, 0.75, 1.0)
    """
    scale = math.log(max(ceiling, 1.5))
    r = math.log(max(speedup, 1e-9)) / scale
    return (max(-1.0, min(1.0, r)) + 1) / 2


class Tree:
    """The search tree of one card. Mutable; rebuilt from the store on resume."""

    def __init__(self, card_id: str, ceiling: float, config: TreeConfig | None = None):
        self.card_id = card_id
        self.ceiling = ceiling
        self.config = config or TreeConfig()
        self.root = Node(id=None, state="root")
        self.nodes: dict[int, Node] = {}

    # --- growth ----------------------------------------------------------------------------------

    def add(self, candidate_id: int, parent_id: int | None, proposer: str, params: dict) -> Node:
        """A new child, pending evaluation."""
        parent = self.node(parent_id)
        node = Node(id=candidate_id, parent=parent, proposer=proposer, params=dict(params))
        parent.children.append(node)
        self.nodes[candidate_id] = node
        return node

    def record(
        self,
        candidate_id: int,
        *,
        accepted: bool,
        category: str | None,
        speedup: float | None,
        kernel_us: float | None = None,
        eager_us: float | None = None,
        feedback: str | None = None,
        ci_low: float | None = None,
        ci_high: float | None = None,
        resources: str | None = None,
    ) -> Node:
        """A verdict arrived: set the node's reward and back it up to the root."""
        node = self.nodes[candidate_id]
        if node.state != "pending":
            raise ValueError(f"candidate #{candidate_id} already has a verdict")
        works = accepted or (category == "slower" and speedup is not None and speedup > 0)
        node.state = "ok" if works else "failed"
        node.accepted, node.category, node.speedup = accepted, category, speedup
        node.ci_low, node.ci_high = ci_low, ci_high
        node.kernel_us, node.eager_us, node.feedback = kernel_us, eager_us, feedback
        node.resources = resources
        node.reward = normalised_reward(speedup, self.ceiling) if works else None
        walk: Node | None = node
        while walk is not None:
            walk.visits += 1
            if works:
                walk.value += node.reward
                walk.wins += 1
            walk = walk.parent
        return node

    def note(self, parent_id: int | None, text: str) -> None:
        """Feedback on a call from `parent_id` that produced no new candidate (malformed, duplicate)."""
        self.node(parent_id).notes.append(text)

    def mark_exhausted(self, node: Node) -> None:
        node.exhausted = True

    # --- queries ---------------------------------------------------------------------------------

    def node(self, candidate_id: int | None) -> Node:
        return self.root if candidate_id is None else self.nodes[candidate_id]

    def allowed_children(self, node: Node) -> int:
        return max(1, math.ceil(self.config.c * node.visits**self.config.alpha))

    def can_widen(self, node: Node) -> bool:
        return not node.exhausted and len(node.children) < self.allowed_children(node)

    def uct(self, child: Node, parent: Node) -> float:
        explore = math.sqrt(math.log(max(parent.visits, 1)) / max(child.visits, 1))
        return child.q + self.config.exploration * explore

    def select(self, rank: int = 0) -> Node | None:
        """The node to propose a child of, or None when nothing in the tree can grow. `rank`: calls on this
        card already in flight (the "best" policy spreads them over its top kernels)."""
        if self.config.policy == "best":
            return self._select_best(rank)
        return self._select(self.root)

    def ranked(self) -> list[Node]:
        """Working kernels (accepted, or correct and slower), fastest first (ties: the earlier)."""
        return sorted((n for n in self.nodes.values() if n.state == "ok"), key=lambda n: (-(n.speedup or 0.0), n.id))

    def _select_best(self, rank: int) -> Node | None:
        options = [n for n in self.ranked() if not n.exhausted][: self.config.top]
        if not self.root.exhausted and (not options or self.can_widen(self.root)):
            options.append(self.root)
        return options[rank % len(options)] if options else None

    def _select(self, node: Node) -> Node | None:
        if self.can_widen(node):
            return node
        kids = [c for c in node.children if c.state == "ok"]
        for child in sorted(kids, key=lambda c: (-self.uct(c, node), c.id)):
            found = self._select(child)
            if found is not None:
                return found
        return None if node.exhausted else node

    def lineage(self, node: Node) -> list[LineageEntry]:
        """The ancestors of a proposal made from `node`: root first, `node` last (empty for the root)."""
        chain = []
        while node is not None and node.id is not None:
            chain.append(
                LineageEntry(
                    candidate_id=node.id,
                    proposer=node.proposer,
                    params=node.params,
                    category=node.category,
                    accepted=node.accepted,
                    speedup=node.speedup,
                    kernel_us=node.kernel_us,
                    eager_us=node.eager_us,
                    feedback=node.feedback,
                    resources=node.resources,
                    parent_id=node.parent.id if node.parent is not None else None,
                )
            )
            node = node.parent
        return chain[::-1]

    def evaluated(self, node: Node, limit: int = 8) -> list[LineageEntry]:
        """The card's evaluated kernels outside `node`'s lineage (its siblings, their subtrees, other
        branches): what was already tried, working ones fastest first, then the failed ones."""
        mine = {e.candidate_id for e in self.lineage(node)}
        done = [n for n in self.nodes.values() if n.state in ("ok", "failed") and n.id not in mine]
        done.sort(key=lambda n: (n.state != "ok", -(n.speedup or 0.0), n.id))
        return [self.lineage(n)[-1] for n in done[:limit]]

    def feedback(self, node: Node, limit: int = 6) -> list[str]:
        """What went wrong with earlier proposals from `node`: failed children and notes, newest last."""
        items = [f"candidate #{c.id}: {c.feedback or c.category}" for c in node.children if c.state == "failed"]
        items += node.notes
        return items[-limit:]

    def tried(self, node: Node) -> frozenset[str]:
        """Parameter keys of every child of `node` (pending and failed included): not to be proposed again."""
        return frozenset(c.params_key() for c in node.children)

    def best(self) -> Node | None:
        """The accepted kernel: the earliest, replaced only by a later one `clearly_faster` than it."""
        best = None
        for node in sorted((n for n in self.nodes.values() if n.accepted and n.speedup is not None),
                           key=lambda n: n.id):
            if best is None or clearly_faster(node, best):
                best = node
        return best

    def counts(self) -> dict[str, int]:
        """Verdict categories over all evaluated nodes (accepted ones as "accepted")."""
        out: dict[str, int] = {}
        for n in self.nodes.values():
            key = "pending" if n.state == "pending" else ("accepted" if n.accepted else n.category or "failed")
            out[key] = out.get(key, 0) + 1
        return out
