"""SpecStats and judged_nodes on hand-built cycles: tau, n-alpha, calibration bins, merge, the JSON view."""
from __future__ import annotations

import torch

from eyas.decoding.stats import NUM_CONFIDENCE_BINS, SpecStats, judged_nodes
from eyas.decoding.tree import DraftTree


def test_tau_and_per_depth_acceptance():
    stats = SpecStats()
    assert stats.tau is None and stats.per_depth_accept == []
    stats.record_cycle(2, 3, [], 5)  # depth 1, 2 accepted; depth 3 judged and rejected
    stats.record_cycle(0, 1, [], 5)  # depth 1 judged and rejected
    stats.record_cycle(1, 2, [], 5)
    assert stats.cycles == 3 and stats.accepted_per_cycle == [2, 0, 1]
    assert stats.tau == (3 + 1 + 2) / 3
    assert stats.depth_offered == [3, 2, 1] and stats.depth_accepted == [2, 1, 0]
    assert stats.per_depth_accept == [2 / 3, 0.5, 0.0]
    assert stats.to_dict()["mean_draft_nodes"] == 5.0


def test_tau_counts_what_was_emitted():
    stats = SpecStats()
    stats.record_cycle(3, 3, [], 3)
    stats.record_cycle(3, 3, [], 3)  # committed 4 + 4 tokens; a stop (or the budget) kept 5 of them
    stats.emitted(5)
    assert stats.num_cut == 3 and stats.tau == 5 / 2
    assert stats.accepted_per_cycle == [3, 3] and stats.per_depth_accept == [1.0, 1.0, 1.0]  # as verified
    stats.emitted(8)
    assert stats.num_cut == 0 and stats.tau == 4.0
    merged = stats.merge(SpecStats(cycles=1, accepted_per_cycle=[1], num_cut=1))
    assert merged.num_cut == 1 and merged.tau == (8 + 2 - 1) / 3 and merged.to_dict()["num_cut"] == 1


def test_calibration_bins_confidence_against_acceptance():
    stats = SpecStats()
    stats.record_cycle(1, 1, [(0.95, True), (0.91, False), (0.05, False), (1.0, True)], 4)
    rows = {row["bin_low"]: row for row in stats.calibration()}
    assert set(rows) == {0.0, 0.9}  # 1.0 falls in the top bin, not an 11th
    assert rows[0.9]["count"] == 3 and rows[0.9]["acceptance"] == 2 / 3
    assert abs(rows[0.9]["mean_confidence"] - (0.95 + 0.91 + 1.0) / 3) < 1e-12
    assert rows[0.0] == {"bin_low": 0.0, "mean_confidence": 0.05, "acceptance": 0.0, "count": 1}
    assert len(stats.confidence_count) == NUM_CONFIDENCE_BINS


def test_merge_adds_everything():
    a, b = SpecStats(), SpecStats()
    a.record_cycle(1, 2, [(0.5, True)], 3)
    b.record_cycle(3, 4, [(0.5, False)], 6)
    b.record_cycle(0, 1, [], 6)
    a.new_tokens, b.new_tokens, a.draft_s, b.draft_s = 3, 6, 0.25, 0.5
    merged = a.merge(b)
    assert merged.accepted_per_cycle == [1, 3, 0] and merged.cycles == 3 and merged.tau == 7 / 3
    assert merged.depth_offered == [3, 2, 1, 1] and merged.depth_accepted == [2, 1, 1, 0]
    assert merged.new_tokens == 9 and merged.draft_s == 0.75 and merged.num_draft_nodes == 15
    assert merged.confidence_count[5] == 2 and merged.confidence_accepted[5] == 1


def test_judged_nodes_are_the_children_of_accepted_nodes():
    #        0 (V 1)
    #      /        \
    #     1 (.8)     2 (.1)
    #    /   \
    #   3(.4) 4(.2)
    #   |
    #   5 (.2)
    tree = DraftTree(torch.tensor([9, 1, 2, 3, 4, 5]), torch.tensor([-1, 0, 0, 1, 1, 3]),
                     torch.tensor([1.0, 0.8, 0.1, 0.4, 0.2, 0.2]))
    deepest, judged = judged_nodes(tree, [0, 1])  # node 1 accepted, its children 3 and 4 rejected
    assert deepest == 2
    assert [(round(c, 6), ok) for c, ok in judged] == [(0.8, True), (0.1, False), (0.5, False), (0.25, False)]
    deepest, judged = judged_nodes(tree, [0, 1, 3, 5])
    assert deepest == 3 and [ok for _, ok in judged] == [True, False, True, False, True]


def test_acceptance_per_proposer_and_depth():
    # root -> a (ngram, eagle3) -> b (ngram) ; root -> c (eagle3) ; a -> d (eagle3) ; b -> e (ngram)
    tree = DraftTree(torch.tensor([0, 1, 2, 3, 4, 5]), torch.tensor([-1, 0, 1, 0, 1, 2]), torch.ones(6),
                     drafted_by=((), ("ngram", "eagle3"), ("ngram",), ("eagle3",), ("eagle3",), ("ngram",)))
    stats = SpecStats()
    assert stats.record_verdict(tree, [0, 1, 2]) == 3  # a, b accepted; e judged at depth 3 and rejected
    assert stats.proposer_offered == {"eagle3": [1, 1], "ngram": [1, 1, 1]}
    assert stats.proposer_accepted == {"eagle3": [1, 0], "ngram": [1, 1, 0]}
    stats.record_verdict(tree, [0, 3])  # c (eagle3) accepted at depth 1, the leaf
    stats.record_verdict(tree, [0])  # all rejected
    assert stats.per_proposer_accept == {"eagle3": [2 / 3, 0.0], "ngram": [1 / 3, 1.0, 0.0]}
    assert stats.cycles == 3 and stats.accepted_per_cycle == [2, 1, 0] and stats.depth_offered == [3, 1, 1]
    merged = stats.merge(SpecStats())
    assert merged.per_proposer_accept == stats.per_proposer_accept and merged.to_dict()["per_proposer_accept"] == \
        stats.per_proposer_accept
    plain = SpecStats()
    plain.record_verdict(DraftTree(tree.tokens_N, tree.parents_N, tree.scores_N), [0, 1])
    assert plain.proposer_offered == {} and plain.to_dict()["per_proposer_accept"] == {}
