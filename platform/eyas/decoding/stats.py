"""SpecStats: what one speculative generation did, in the terms papers report.

tau = tokens emitted per verify cycle: the mean of (accepted drafted tokens + 1 bonus), less what a stop (EOS, a
stop string) or the token budget cut from the final cycle (``emitted``); n-alpha = acceptance at depth n given all
shallower drafted tokens were accepted, as the verifier judged them (a cut does not undo an acceptance);
calibration = draft confidence binned against measured acceptance. A hybrid tree (``DraftTree.drafted_by``) also
gets n-alpha per proposer: at depth d, the cycles where that proposer had a judged node, and those where the
accepted depth-d node was one it drafted (a node two proposers drafted counts for both).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eyas.decoding.tree import DraftTree

NUM_CONFIDENCE_BINS = 10


@dataclass
class SpecStats:
    cycles: int = 0
    accepted_per_cycle: list[int] = field(default_factory=list)
    # per depth d (index d-1): cycles where a depth-d node was judged (its parent accepted), and cycles where
    # one of them was accepted; their ratio is n-alpha
    depth_offered: list[int] = field(default_factory=list)
    depth_accepted: list[int] = field(default_factory=list)
    confidence_sum: list[float] = field(default_factory=lambda: [0.0] * NUM_CONFIDENCE_BINS)
    confidence_count: list[int] = field(default_factory=lambda: [0] * NUM_CONFIDENCE_BINS)
    confidence_accepted: list[int] = field(default_factory=lambda: [0] * NUM_CONFIDENCE_BINS)
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    new_tokens: int = 0
    num_draft_nodes: int = 0
    num_cut: int = 0  # tokens the cycles committed that a stop or the budget then cut (the final cycle's tail)
    # proposer -> per depth d (index d-1): cycles with a judged depth-d node of it, and with an accepted one
    proposer_offered: dict[str, list[int]] = field(default_factory=dict)
    proposer_accepted: dict[str, list[int]] = field(default_factory=dict)

    @property
    def tau(self) -> float | None:
        if not self.cycles:
            return None
        return (sum(a + 1 for a in self.accepted_per_cycle) - self.num_cut) / self.cycles

    def emitted(self, num_tokens: int) -> None:
        """The cycles emitted ``num_tokens`` in all (the prefill's first token not counted): what they committed
        past that (the final cycle cut at EOS, a stop string or max_new_tokens) leaves tau."""
        committed = sum(a + 1 for a in self.accepted_per_cycle)
        self.num_cut = min(max(committed - num_tokens, 0), committed)

    @property
    def per_depth_accept(self) -> list[float]:
        return [a / o if o else 0.0 for a, o in zip(self.depth_accepted, self.depth_offered)]

    @property
    def per_proposer_accept(self) -> dict[str, list[float]]:
        """proposer -> n-alpha of its nodes per depth (hybrid trees only; {} otherwise)."""
        return {name: [a / o if o else 0.0 for a, o in zip(self.proposer_accepted[name], offered)]
                for name, offered in self.proposer_offered.items()}

    def _grow(self, depth: int) -> None:
        while len(self.depth_offered) < depth:
            self.depth_offered.append(0)
            self.depth_accepted.append(0)

    def record_cycle(self, num_accepted: int, judged_depth: int, judged: list[tuple[float, bool]],
                     num_nodes: int) -> None:
        """One verify cycle.

        num_accepted: drafted tokens accepted. judged_depth: the deepest depth whose nodes the target judged
        (a node is judged when its parent was accepted). judged: (draft confidence, accepted) per judged node.
        """
        self.cycles += 1
        self.accepted_per_cycle.append(num_accepted)
        self.num_draft_nodes += num_nodes
        self._grow(judged_depth)
        for depth in range(1, judged_depth + 1):
            self.depth_offered[depth - 1] += 1
            if depth <= num_accepted:
                self.depth_accepted[depth - 1] += 1
        for confidence, accepted in judged:
            b = min(max(int(confidence * NUM_CONFIDENCE_BINS), 0), NUM_CONFIDENCE_BINS - 1)
            self.confidence_sum[b] += confidence
            self.confidence_count[b] += 1
            self.confidence_accepted[b] += int(accepted)

    def record_verdict(self, tree: DraftTree, path: list[int]) -> int:
        """One verify cycle of ``tree`` whose accepted node path (root included) is ``path``; returns the deepest
        judged depth."""
        judged_depth, judged = judged_nodes(tree, path) if tree.num_nodes > 1 else (0, [])
        self.record_cycle(len(path) - 1, judged_depth, judged, tree.num_nodes - 1)
        if tree.drafted_by is not None:
            self.record_proposers(tree, path)
        return judged_depth

    def record_proposers(self, tree: DraftTree, path: list[int]) -> None:
        """Per-proposer n-alpha of one cycle of a tree that names its nodes' proposers."""
        assert tree.drafted_by is not None
        on_path, parents, depth = set(path), tree.parents_list, tree.depth_N.tolist()
        offered: set[tuple[str, int]] = set()
        accepted: set[tuple[str, int]] = set()
        for i in range(1, tree.num_nodes):
            if parents[i] in on_path:
                for name in tree.drafted_by[i]:
                    offered.add((name, depth[i]))
                    if i in on_path:
                        accepted.add((name, depth[i]))
        for name, d in sorted(offered):
            self._count(name, d, 1, int((name, d) in accepted))

    def _count(self, name: str, depth: int, num_offered: int, num_accepted: int) -> None:
        offered = self.proposer_offered.setdefault(name, [])
        accepted = self.proposer_accepted.setdefault(name, [])
        while len(offered) < depth:
            offered.append(0)
            accepted.append(0)
        offered[depth - 1] += num_offered
        accepted[depth - 1] += num_accepted

    def calibration(self) -> list[dict[str, float]]:
        rows = []
        for b in range(NUM_CONFIDENCE_BINS):
            count = self.confidence_count[b]
            if count:
                rows.append({"bin_low": b / NUM_CONFIDENCE_BINS, "mean_confidence": self.confidence_sum[b] / count,
                             "acceptance": self.confidence_accepted[b] / count, "count": count})
        return rows

    def merge(self, other: "SpecStats") -> "SpecStats":
        out = SpecStats(cycles=self.cycles + other.cycles,
                        accepted_per_cycle=self.accepted_per_cycle + other.accepted_per_cycle,
                        draft_s=self.draft_s + other.draft_s, verify_s=self.verify_s + other.verify_s,
                        other_s=self.other_s + other.other_s, new_tokens=self.new_tokens + other.new_tokens,
                        num_draft_nodes=self.num_draft_nodes + other.num_draft_nodes,
                        num_cut=self.num_cut + other.num_cut)
        out._grow(max(len(self.depth_offered), len(other.depth_offered)))
        for src in (self, other):
            for d in range(len(src.depth_offered)):
                out.depth_offered[d] += src.depth_offered[d]
                out.depth_accepted[d] += src.depth_accepted[d]
            for b in range(NUM_CONFIDENCE_BINS):
                out.confidence_sum[b] += src.confidence_sum[b]
                out.confidence_count[b] += src.confidence_count[b]
                out.confidence_accepted[b] += src.confidence_accepted[b]
            for name, offered in src.proposer_offered.items():
                for d, (o, a) in enumerate(zip(offered, src.proposer_accepted[name]), start=1):
                    out._count(name, d, o, a)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"cycles": self.cycles, "tau": self.tau, "accepted_per_cycle": list(self.accepted_per_cycle),
                "per_depth_accept": self.per_depth_accept, "calibration": self.calibration(),
                "new_tokens": self.new_tokens, "num_cut": self.num_cut,
                "mean_draft_nodes": self.num_draft_nodes / max(self.cycles, 1),
                "per_proposer_accept": self.per_proposer_accept,
                "time_s": {"draft": self.draft_s, "verify": self.verify_s, "other": self.other_s}}


def judged_nodes(tree: DraftTree, path: list[int]) -> tuple[int, list[tuple[float, bool]]]:
    """Nodes the target judged (children of accepted nodes): (deepest depth, [(confidence, accepted)]).
    A node's confidence is its V over its parent's V: the draft probability of its own token."""
    on_path = set(path)
    scores = tree.scores_N.tolist()
    parents = tree.parents_N.tolist()
    depth = tree.depth_N.tolist()
    judged, deepest = [], 0
    for i in range(1, tree.num_nodes):
        if parents[i] in on_path:
            parent_score = scores[parents[i]]
            confidence = scores[i] / parent_score if parent_score > 0 else 0.0
            judged.append((confidence, i in on_path))
            deepest = max(deepest, depth[i])
    return deepest, judged
