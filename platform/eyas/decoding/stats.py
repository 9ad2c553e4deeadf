"""SpecStats: what one speculative generation did, in the terms papers report.

tau = tokens emitted per verify cycle: the mean of (accepted drafted tokens + 1 bonus), less what a stop (EOS, a
stop string) or the token budget cut from the final cycle (``emitted``); n-alpha = acceptance at depth n given all
shallower drafted tokens were accepted, as the verifier judged them (a cut does not undo an acceptance);
calibration = draft confidence binned against measured acceptance.
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
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"cycles": self.cycles, "tau": self.tau, "accepted_per_cycle": list(self.accepted_per_cycle),
                "per_depth_accept": self.per_depth_accept, "calibration": self.calibration(),
                "new_tokens": self.new_tokens, "num_cut": self.num_cut,
                "mean_draft_nodes": self.num_draft_nodes / max(self.cycles, 1),
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
