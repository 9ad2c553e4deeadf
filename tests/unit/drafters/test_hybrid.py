"""eyas.drafters.hybrid: the merge of two proposers' trees (a shared token is one node, the budget keeps the best
nodes by one value with their ancestors), the online retrieval estimate, and the drafter's calls to its parts."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas.decoding.tree import DraftTree, chain, from_paths, prune
from eyas.drafters.hybrid import RETRIEVAL_PRIOR, HybridDrafter, RetrievalEstimate, cut_by_cost, merge


def paths_of(tree: DraftTree) -> dict[tuple[int, ...], int]:
    """token path from the root (excluded) -> node index"""
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, tree.num_nodes):
        paths.append(paths[tree.parents_list[i]] + (tree.tokens_list[i],))
    return {path: i for i, path in enumerate(paths)}


def best_values(tree: DraftTree, values: list[float]) -> dict[tuple[int, ...], float]:
    """token path -> the largest value of the tree's nodes on it (a sampled tree may repeat a path)"""
    paths: list[tuple[int, ...]] = [()]
    best: dict[tuple[int, ...], float] = {}
    for i in range(1, tree.num_nodes):
        paths.append(paths[tree.parents_list[i]] + (tree.tokens_list[i],))
        best[paths[i]] = max(best.get(paths[i], 0.0), values[i])
    return best


def test_a_shared_token_is_one_node_and_the_budget_keeps_the_best_with_their_ancestors():
    retrieved = from_paths(5, [[1, 2, 3], [1, 4]], [0.5, 0.5])  # nodes 1, 1-2, 1-4, 1-2-3
    drafted = chain(5, [1, 2, 7], scores=[0.9, 0.5, 0.1])
    tree = merge([("ngram", retrieved, [1.0, 0.6, 0.36, 0.2, 0.3]), ("eagle3", drafted, drafted.scores_N.tolist())],
                 max_drafted=4)
    paths = paths_of(tree)
    assert tree.num_nodes == 5 and not tree.sampled and tree.draft_probs_NV is None
    assert set(paths) == {(), (1,), (1, 2), (1, 4), (1, 2, 3)}  # 1-2-7 (V 0.1) is the node the budget drops
    assert tree.drafted_by[paths[(1,)]] == ("ngram", "eagle3") and tree.drafted_by[paths[(1, 2)]] == ("ngram", "eagle3")
    assert tree.drafted_by[paths[(1, 4)]] == ("ngram",) and tree.drafted_by[0] == ()
    scores = tree.scores_N.tolist()
    assert abs(scores[paths[(1,)]] - 0.9) < 1e-6  # the larger of its values
    assert abs(scores[paths[(1, 2)]] - 0.5) < 1e-6
    # a budget of 1 keeps the best node; 0 the bare root
    assert paths_of(merge([("ngram", retrieved, [1.0, 0.6, 0.36, 0.2, 0.3]), ("eagle3", drafted, [1, .9, .5, .1])],
                          1)) == {(): 0, (1,): 1}
    assert merge([("ngram", retrieved, [1.0] * 5), ("eagle3", drafted, [1.0] * 4)], 0).num_nodes == 1
    # the engine's load-adaptive prune keeps the best of them, and who drafted each
    pruned = prune(tree, 2)
    assert set(paths_of(pruned)) == {(), (1,), (1, 2)} and pruned.drafted_by[1:] == (("ngram", "eagle3"),) * 2


def test_a_value_that_grows_along_a_path_is_clipped_to_its_parents():
    retrieved = from_paths(5, [[1, 2]], [1.0])
    drafted = chain(5, [3], scores=[0.5])
    tree = merge([("ngram", retrieved, [1.0, 0.1, 0.9]), ("eagle3", drafted, [1.0, 0.5])], max_drafted=2)
    assert set(paths_of(tree)) == {(), (3,), (1,)}  # 1-2's 0.9 counts as its parent's 0.1


@st.composite
def trees(draw, root: int = 0):
    num_nodes = draw(st.integers(1, 12))
    parents, tokens = [-1], [root]
    for i in range(1, num_nodes):
        parents.append(draw(st.integers(0, i - 1)))
        tokens.append(draw(st.integers(0, 3)))
    sampled = draw(st.booleans())
    if not sampled:  # deterministic siblings are distinct: drop repeats
        seen, keep = set(), [0]
        for i in range(1, num_nodes):
            if (parents[i], tokens[i]) not in seen and parents[i] in keep:
                seen.add((parents[i], tokens[i]))
                keep.append(i)
        new_id = {old: new for new, old in enumerate(keep)}
        parents = [-1] + [new_id[parents[i]] for i in keep[1:]]
        tokens = [tokens[i] for i in keep]
    values = [1.0] + [draw(st.floats(0.0, 1.0)) for _ in tokens[1:]]
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(values), sampled=sampled)
    return tree, values


@given(trees(), trees(), st.integers(0, 20))
@settings(max_examples=200, deadline=None)
def test_merge_properties(first, second, budget):
    (tree_a, values_a), (tree_b, values_b) = first, second
    merged = merge([("a", tree_a, values_a), ("b", tree_b, values_b)], budget)
    union = set(paths_of(tree_a)) | set(paths_of(tree_b))
    kept = paths_of(merged)
    assert len(kept) == merged.num_nodes  # a token path is one node (siblings distinct: a valid deterministic tree)
    assert merged.num_nodes - 1 == min(budget, len(union) - 1)
    assert set(kept) <= union and all(path[:-1] in kept for path in kept if path)  # ancestors kept
    for path, i in kept.items():  # drafted_by names exactly the trees that hold the path
        assert set(merged.drafted_by[i]) == {name for name, tree in (("a", tree_a), ("b", tree_b))
                                             if path in paths_of(tree)} or not path
    # the best nodes: no dropped node's (clipped) value beats a kept one's
    best_a, best_b = best_values(tree_a, values_a), best_values(tree_b, values_b)
    clipped = {(): 1.0}
    for path in sorted(union, key=len):
        if path:
            clipped[path] = min(max(best_a.get(path, 0.0), best_b.get(path, 0.0)), clipped[path[:-1]])
    dropped = [clipped[p] for p in union - set(kept)]
    if dropped and len(kept) > 1:
        assert max(dropped) <= min(clipped[p] for p in kept) + 1e-6


def test_the_retrieval_estimate_starts_at_its_prior_and_learns_per_depth():
    estimate = RetrievalEstimate()
    alpha, beta = RETRIEVAL_PRIOR
    assert estimate.rate(1) == estimate.rate(3) == alpha / (alpha + beta)
    for _ in range(6):
        estimate.record(1, True)
        estimate.record(2, False)
    assert estimate.rate(1) == (alpha + 6) / (alpha + beta + 6) and estimate.rate(2) == alpha / (alpha + beta + 6)
    tree = from_paths(9, [[1, 2], [3]], [0.75, 0.25])  # nodes 1, 3, 1-2
    values = estimate.values(tree)
    assert abs(values[1] - 0.75 * estimate.rate(1)) < 1e-6
    assert abs(values[3] - 0.75 * estimate.rate(1) * estimate.rate(2)) < 1e-6


class Fixed:
    """A proposer that drafts fixed paths and logs its calls."""

    def __init__(self, name: str, paths: list[list[int]], scores: list[float] | None = None) -> None:
        self.name, self.paths, self.scores = name, paths, scores
        self.target_taps, self.max_draft_nodes = ((3,) if scores else ()), 8
        self.calls: list[tuple[str, list[int]]] = []

    def begin(self, prompt_ids, taps):
        self.calls.append(("begin", list(prompt_ids)))

    def propose(self, root_token, context_ids, temperature, generator):
        self.calls.append(("propose", [root_token]))
        if self.scores is not None:
            return chain(root_token, self.paths[0], scores=self.scores)
        return from_paths(root_token, self.paths, [1.0] * len(self.paths))

    def commit(self, tokens, taps):
        self.calls.append(("commit", list(tokens)))


def test_the_drafter_reaches_both_parts_and_learns_from_the_verdicts():
    retrieval, learned = Fixed("ngram", [[1, 2, 3]]), Fixed("eagle3", [[4]], scores=[0.9])
    drafter = HybridDrafter(retrieval, learned, num_nodes=3)
    assert drafter.max_draft_nodes == 3 and drafter.target_taps == (3,)
    drafter.begin([7, 8], {})
    tree = drafter.propose(8, [7, 8], 0.0, None)
    assert set(paths_of(tree)) == {(), (4,), (1,), (1, 2)}  # 0.9 > 0.6 > 0.36 > 0.216
    drafter.commit([8, 1, 2], {})  # the target took 1, 2, then 5 (the next root): depth 3 was retrieval's miss
    drafter.propose(5, [7, 8, 1, 2, 5], 0.0, None)
    assert drafter.estimate.hits[:2] == [1, 1] and drafter.estimate.misses[:2] == [0, 0]
    assert drafter.estimate.misses[2:] == []  # depth 3 was not in the verified tree: no verdict
    drafter.commit([5], {})
    drafter.propose(6, [7, 8, 1, 2, 5, 6], 0.0, None)  # depth 1: 6, not retrieval's 1
    assert drafter.estimate.misses[0] == 1
    for part in (retrieval, learned):
        assert [what for what, _ in part.calls] == ["begin", "propose", "commit", "propose", "commit", "propose"]
        assert part.calls[2] == ("commit", [8, 1, 2])
    drafter.begin([1], {})  # a new request starts from the prior
    assert drafter.estimate.hits == [] and drafter.estimate.misses == []


class Silent(Fixed):
    """A retrieval proposer that finds no match on the roots in ``silent_on``."""

    def __init__(self, name: str, paths: list[list[int]], silent_on: set[int]) -> None:
        super().__init__(name, paths)
        self.silent_on = silent_on

    def propose(self, root_token, context_ids, temperature, generator):
        self.calls.append(("propose", [root_token]))
        return chain(root_token, []) if root_token in self.silent_on else from_paths(root_token, self.paths, [1.0])


def test_learned_below_runs_the_learned_drafter_only_where_retrieval_is_weak():
    retrieval, learned = Silent("ngram", [[1, 2]], silent_on={5}), Fixed("eagle3", [[4]], scores=[0.9])
    drafter = HybridDrafter(retrieval, learned, num_nodes=3, learned_below=0.5)
    drafter.begin([7, 8], {})
    tree = drafter.propose(8, [7, 8], 0.0, None)  # retrieval's depth 1 at the prior, 0.6 >= 0.5: no learned pass
    assert set(paths_of(tree)) == {(), (1,), (1, 2)} and all(by == ("ngram",) for by in tree.drafted_by[1:])
    drafter.commit([8, 1, 2], {})
    tree = drafter.propose(5, [7, 8, 1, 2, 5], 0.0, None)  # no match: the learned drafter drafts
    assert set(paths_of(tree)) == {(), (4,)}
    assert (drafter.cycles, drafter.learned_cycles) == (2, 1)
    # the learned part saw every commit, with one propose between its begin and the second commit
    assert [what for what, _ in learned.calls] == ["begin", "commit", "propose"]
    weak = HybridDrafter(Silent("ngram", [[1, 2]], silent_on=set()), Fixed("eagle3", [[4]], scores=[0.9]),
                         num_nodes=3, learned_below=0.7)
    weak.begin([7, 8], {})
    assert (4,) in paths_of(weak.propose(8, [7, 8], 0.0, None))  # 0.6 < 0.7: it drafts beside retrieval
    always = HybridDrafter(Silent("ngram", [[1, 2]], silent_on=set()), Fixed("eagle3", [[4]], scores=[0.9]),
                           num_nodes=3)
    always.begin([7, 8], {})
    always.propose(8, [7, 8], 0.0, None)
    assert always.learned_cycles == always.cycles == 1


def test_the_cost_cut_keeps_the_nodes_worth_their_verify_time():
    tree = merge([("ngram", from_paths(9, [[1, 2, 3]], [1.0]), [1.0, 0.9, 0.8, 0.1])], 8)
    flat = {1: 1.0, 64: 1.0}  # extra nodes are free: keep all
    assert cut_by_cost(tree, flat, 0.0).num_nodes == 4
    # t(n): 1, 1.1, 1.2, 1.3 + ... : node 3 (value 0.1) adds 0.1 tokens for 0.1 s: 2.8 / 1.3 < 2.7 / 1.2
    linear = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}
    cut = cut_by_cost(tree, linear, 0.0)
    assert cut.tokens_list == [9, 1, 2] and cut.drafted_by == ((), ("ngram",), ("ngram",))
    # the drafting time already spent makes a node cheaper relative to the cycle: with 3 s of it, 2.8 / 4.3 wins
    assert cut_by_cost(tree, linear, 3.0).num_nodes == 4
    steep = {1: 1.0, 2: 2.5}  # a second token costs more than 0.9 tokens are worth: plain decoding
    assert cut_by_cost(tree, steep, 0.0).num_nodes == 1


def test_the_drafter_cuts_each_merged_tree_by_cost():
    retrieval, learned = Fixed("ngram", [[1, 2, 3]]), Fixed("eagle3", [[4]], scores=[0.05])
    steep = {1: 1.0, 2: 1.0, 3: 1.5, 8: 10.0}  # two drafted nodes are free, a third costs half a step
    drafter = HybridDrafter(retrieval, learned, num_nodes=4, verify_costs=steep)
    drafter.begin([7, 8], {})
    tree = drafter.propose(8, [7, 8], 0.0, None)
    assert set(paths_of(tree)) == {(), (1,)}  # 0.6 (1), 0.36 (1, 2): 1.96 / 1.5 < 1.6 / 1.0
