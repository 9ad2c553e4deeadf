"""Prompt lookup: the continuations of the longest earlier match, most recent first, as a chain or a tree; with a
datastore, its continuations join them at a lower weight; a node budget keeps the best-supported nodes."""
from __future__ import annotations

import pytest

from eyas.drafters.datastore import Datastore
from eyas.drafters.ngram import NgramConfig, NgramDrafter, lookup


def token_paths(tree):
    """The token path to each root-to-leaf end."""
    return {tuple(tree.tokens_list[j] for j in path[1:]) for path in tree.paths()}


def test_lookup_prefers_the_longest_suffix_and_the_latest_match():
    context = [1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3]
    # suffix (2, 3) seen at 1 and 5 -> continuations after each, latest first; max_ngram 3: (5, 2, 3) is unseen
    assert lookup(context, NgramConfig(max_ngram=3, num_draft=2, max_matches=4)) == [[8, 5], [9, 1]]
    assert lookup(context, NgramConfig(num_draft=2, max_matches=1)) == [[8, 5]]
    assert lookup([4, 5, 6], NgramConfig()) == []  # nothing repeats
    assert lookup([7, 7, 7], NgramConfig(num_draft=3)) == [[7]]  # a continuation is cut at the context's end
    assert lookup([1, 2, 1, 2], NgramConfig(max_ngram=1, num_draft=3, max_matches=4)) == [[1, 2]]


def test_drafter_merges_shared_prefixes_into_a_tree():
    drafter = NgramDrafter(NgramConfig(max_ngram=1, num_draft=2, max_matches=3))
    assert drafter.max_draft_nodes == 6
    context = [5, 1, 2, 5, 1, 3, 5, 4, 5]
    tree = drafter.propose(5, context, 0.0, None)
    # continuations of (5,): [4, 5], [1, 3], [1, 2] -> root, 4, 1, 5, 3, 2 in BFS order
    assert tree.tokens_list == [5, 4, 1, 5, 3, 2] and tree.parents_list == [-1, 0, 0, 1, 2, 2]
    assert not tree.sampled
    assert drafter.propose(9, [9], 0.0, None).tokens_list == [9]  # no match: an empty draft


def test_node_budget_keeps_the_nodes_most_matches_agree_on():
    context = [5, 1, 2, 5, 1, 3, 5, 4, 5]  # continuations of (5,): [4, 5], [1, 3], [1, 2], each weight 1/3
    drafter = NgramDrafter(NgramConfig(max_ngram=1, num_draft=2, max_matches=3, num_nodes=2))
    assert drafter.max_draft_nodes == 2
    tree = drafter.propose(5, context, 0.0, None)
    # 1 is on two paths (2/3), then 4 (1/3, first seen among the 1/3 ties and shallower than 1-3 / 1-2)
    assert token_paths(tree) == {(1,), (4,)} and tree.tokens_list == [5, 4, 1]
    assert tree.scores_N.tolist() == pytest.approx([1.0, 1 / 3, 2 / 3])  # BFS order: root, 4, 1
    assert NgramDrafter(NgramConfig(max_ngram=1, num_draft=2, max_matches=3)).max_draft_nodes == 6  # no budget


def test_datastore_continuations_join_at_their_weight():
    store = Datastore([[7, 5, 8, 9], [6, 5, 8, 3], [5, 8, 9]])  # (7, 5) appears once in the store: [8, 9]
    config = NgramConfig(max_ngram=2, num_draft=3, max_matches=4, num_nodes=4, datastore_weight=0.5)
    drafter = NgramDrafter(config, store)
    assert drafter.propose(5, [7, 5], 0.0, None).tokens_list == [5, 8, 9]  # nothing in the context: the store
    # the context's own match (5 -> 1, 2, 7) weighs 1, the store's (7, 5 -> 8, 9) 0.5: the budget of 4 keeps
    # 1, 1-2, 1-2-7 and then 8, not 8-9
    tree = drafter.propose(5, [5, 1, 2, 7, 5], 0.0, None)
    assert token_paths(tree) == {(1, 2, 7), (8,)}
    assert tree.scores_N.tolist() == pytest.approx([1.5, 1, 0.5, 1, 1])  # BFS: root, 1, 8, 1-2, 1-2-7
    assert NgramDrafter(config).propose(5, [7, 5], 0.0, None).tokens_list == [5]  # without it: no draft


def test_config_errors():
    for bad in ({"min_ngram": 0}, {"min_ngram": 3, "max_ngram": 2}, {"num_draft": 0}, {"max_matches": 0},
                {"num_nodes": 0}, {"datastore_weight": -1.0}):
        with pytest.raises(ValueError):
            NgramConfig(**bad)
