"""The suffix index (SuffixDecoding): the longest matching suffix over every source, a tree of its most frequent
continuations with per-node probabilities from counts, depth and node budget, FIFO eviction under a token budget;
the lookup equals a brute-force scan of the text."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from eyas.drafters.suffix import SuffixConfig, SuffixDrafter, SuffixIndex, continuation_tree, lookup


def index_of(*sequences, config=SuffixConfig(), max_tokens=None) -> SuffixIndex:
    index = SuffixIndex(config.anchors, max_tokens)
    for sequence in sequences:
        index.add(sequence)
    return index


def token_paths(tree) -> dict[tuple[int, ...], float]:
    """Each node's token path from the root -> its probability."""
    paths, out = [()], {}
    for i in range(1, tree.num_nodes):
        paths.append(paths[tree.parents_list[i]] + (tree.tokens_list[i],))
        out[paths[-1]] = round(float(tree.scores_N[i]), 4)
    return out


def test_the_longest_suffix_wins_and_its_continuations_are_counted():
    index = index_of([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9], [5, 2, 3, 4, 5, 8])
    config = SuffixConfig(depth=3)
    assert lookup([0, 2, 3], [index], config) == (2, [[4, 5, 8], [9, 9], [4, 5, 6]])  # latest first
    assert lookup([1, 2, 3], [index], config) == (3, [[9, 9], [4, 5, 6]])  # (1, 2, 3): two of the three
    assert lookup([0, 0, 7], [index], config) == (0, [])  # 7 ends a sequence: nothing follows it
    tree = continuation_tree(3, lookup([0, 2, 3], [index], config)[1], config)
    assert token_paths(tree) == {(4,): 0.6667, (9,): 0.3333, (4, 5): 0.6667, (9, 9): 0.3333, (4, 5, 8): 0.3333,
                                 (4, 5, 6): 0.3333}
    assert float(tree.scores_N[0]) == pytest.approx(1.0) and not tree.sampled


def test_min_prob_depth_and_the_node_budget_shape_the_tree():
    index = index_of(*[[1, 2, 3, 4, 5, 6]] * 6, [1, 2, 3, 7], [1, 2, 3, 4, 8])
    continuations = lookup([1, 2, 3], [index], SuffixConfig(depth=3))[1]
    assert len(continuations) == 8
    wide = continuation_tree(3, continuations, SuffixConfig(depth=3, min_prob=0.1))
    assert set(token_paths(wide)) == {(4,), (7,), (4, 5), (4, 8), (4, 5, 6)}
    narrow = continuation_tree(3, continuations, SuffixConfig(depth=3, min_prob=0.5))
    assert token_paths(narrow) == {(4,): 0.875, (4, 5): 0.75, (4, 5, 6): 0.75}  # the frequent path only
    budget = continuation_tree(3, continuations, SuffixConfig(depth=3, min_prob=0.0, num_nodes=2))
    assert set(token_paths(budget)) == {(4,), (4, 5)}  # the two most probable, a tree
    shallow = lookup([1, 2, 3], [index], SuffixConfig(depth=1))[1]
    assert sorted(map(tuple, shallow)) == sorted([(4,)] * 7 + [(7,)])


def test_sources_form_one_suffix_tree_and_the_longest_match_of_any_source_wins():
    config = SuffixConfig(depth=2)
    local, store = index_of([9, 1, 2, 5, 5]), index_of([7, 1, 2, 6, 6], [8, 9, 1, 2, 4, 4])
    assert lookup([9, 1, 2], [local, store], config) == (3, [[5, 5], [4, 4]])  # sources in order
    assert lookup([3, 1, 2], [local, store], config) == (2, [[5, 5], [4, 4], [6, 6]])


def test_the_drafter_indexes_its_own_context_as_it_grows():
    drafter = SuffixDrafter(SuffixConfig(depth=4))
    drafter.begin([5, 6, 7, 8, 5, 6], {})
    tree = drafter.propose(6, [5, 6, 7, 8, 5, 6], 0.0, None)
    assert token_paths(tree) == {(7,): 1.0, (7, 8): 1.0, (7, 8, 5): 1.0, (7, 8, 5, 6): 1.0}
    assert drafter.last_match == 2
    tree = drafter.propose(9, [5, 6, 7, 8, 5, 6, 7, 9], 0.0, None)  # context grew: (7, 9) never seen
    assert tree.num_nodes == 1 and drafter.last_match == 0
    drafter.begin([1, 2], {})  # a new request: nothing of the last one
    assert drafter.propose(2, [1, 2], 0.0, None).num_nodes == 1


def test_fifo_eviction_keeps_the_token_budget_and_forgets_the_oldest():
    config = SuffixConfig(depth=2)
    index = index_of(config=config, max_tokens=10)
    index.add([1, 2, 3, 4])
    index.add([5, 6, 7, 8])
    assert lookup([1, 2], [index], config)[1] == [[3, 4]]
    index.add([9, 1, 2, 7])  # 12 tokens > 10: the first sequence goes
    assert index.num_tokens == 8 and index.base == 5
    assert lookup([0, 1, 2], [index], config)[1] == [[7]]
    assert lookup([2, 3], [index], config) == (0, [])
    for _ in range(50):  # the dicts stay bounded too: only live k-grams keep a latest position
        index.add([random.randrange(1000) for _ in range(5)])
    assert index.num_tokens <= 10 and len(index.tokens_T) <= 12
    assert all(len(latest) <= 10 for latest in index.latest.values())
    with pytest.raises(ValueError, match="max_tokens=0"):
        SuffixIndex((2,), max_tokens=0)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="max_match=2: must be >= min_match=3"):
        SuffixConfig(min_match=3, max_match=2)
    with pytest.raises(ValueError, match="min_prob=1.5"):
        SuffixConfig(min_prob=1.5)
    with pytest.raises(ValueError, match="depth=0"):
        SuffixConfig(depth=0)


def brute_force(context, sequences, config):
    """Every occurrence of a context suffix in the sequences: the longest match (>= min_match, capped), and the
    continuations of the occurrences that reach it."""
    found = []
    for sequence in sequences:
        for end in range(len(sequence) - 1):  # an occurrence ending at the last token has no continuation
            length = 0
            while (length < config.max_match and length <= end and length < len(context)
                   and sequence[end - length] == context[-1 - length]):
                length += 1
            if length >= config.min_match:
                found.append((length, sequence[end + 1:end + 1 + config.depth]))
    best = max((length for length, _ in found), default=0)
    return best, sorted(tuple(c) for length, c in found if length == best)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=6),
       st.lists(st.integers(0, 3), min_size=1, max_size=12), st.integers(1, 3), st.integers(3, 9),
       st.integers(1, 5))
def test_lookup_equals_a_brute_force_scan(sequences, context, min_match, max_match, depth):
    config = SuffixConfig(min_match=min_match, max_match=max_match, depth=depth, max_occurrences=10_000)
    index = index_of(*sequences, config=config)
    best, continuations = lookup(context, [index], config)
    assert (best, sorted(map(tuple, continuations))) == brute_force(context, sequences, config)
