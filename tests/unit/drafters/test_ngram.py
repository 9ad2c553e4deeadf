"""Prompt lookup: the continuations of the longest earlier match, most recent first, as a chain or a tree."""
from __future__ import annotations

import pytest

from eyas.drafters.ngram import NgramConfig, NgramDrafter, lookup


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


def test_config_errors():
    for bad in ({"min_ngram": 0}, {"min_ngram": 3, "max_ngram": 2}, {"num_draft": 0}, {"max_matches": 0}):
        with pytest.raises(ValueError):
            NgramConfig(**bad)
