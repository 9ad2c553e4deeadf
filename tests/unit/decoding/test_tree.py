"""DraftTree and its builders, checked against brute force on small vocabularies."""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from eyas.decoding.builders import (CHAIN, EAGLE_DEFAULT, KARY, build_best_first, build_best_first_block,
                                    build_dynamic, build_static)
from eyas.decoding.tree import DraftTree, PartialTree, chain, from_paths


def token_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Every drafted node as its token path below the root."""
    return {tuple(tree.tokens_list[j] for j in tree.path(i)[1:]) for i in range(1, tree.num_nodes)}


def path_dist(path: tuple[int, ...], vocab: int, seed: int) -> torch.Tensor:
    """A fixed random draft distribution for each context path (peaked enough to make rankings non-trivial)."""
    g = torch.Generator().manual_seed(hash((seed, path)) % 2**31)
    return (2.0 * torch.randn(vocab, generator=g, dtype=torch.float64)).softmax(-1).float()


def path_expand(vocab: int, seed: int = 0, calls: list | None = None):
    def expand(parent_ids: list[int], partial: PartialTree) -> torch.Tensor:
        if calls is not None:
            calls.append(list(parent_ids))
        return torch.stack([path_dist(tuple(partial.path_tokens(i)[1:]), vocab, seed) for i in parent_ids])
    return expand


def check_invariants(tree: DraftTree) -> None:
    parents = tree.parents_list
    assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, tree.num_nodes))
    assert (tree.scores_N[1:] <= tree.scores_N[tree.parents_N[1:]] + 1e-6).all(), "V grows along a path"
    for i in range(tree.num_nodes):
        kids = [tree.tokens_list[c] for c in tree.children(i)]
        assert len(kids) == len(set(kids)), "deterministic siblings must be distinct"


# ---- DraftTree itself -----------------------------------------------------------------------------------------

def test_chain_fields_and_scores():
    probs_KV = torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.2, 0.7], [0.9, 0.05, 0.05]])
    tree = chain(7, [1, 2, 0], probs_KV=probs_KV)
    assert tree.tokens_list == [7, 1, 2, 0] and tree.parents_list == [-1, 0, 1, 2]
    assert tree.depth_N.tolist() == [0, 1, 2, 3]
    assert torch.allclose(tree.scores_N, torch.tensor([1.0, 0.5, 0.35, 0.315]))
    assert torch.equal(tree.draft_probs_NV[1:], probs_KV) and tree.paths() == [[0, 1, 2, 3]]
    assert tree.position_ids(10).tolist() == [10, 11, 12, 13]
    assert torch.equal(tree.ancestor_mask_NN, torch.ones(4, 4, dtype=torch.bool).tril())
    assert chain(3, [4], scores=[0.25]).scores_N.tolist() == [1.0, 0.25]


def test_empty_chain_is_root_only():
    tree = chain(5, [])
    assert tree.num_nodes == 1 and tree.paths() == [[0]] and tree.children(0) == []
    assert tree.ancestor_mask_NN.tolist() == [[True]]


def test_from_paths_merges_shared_prefixes():
    tree = from_paths(9, [[5, 6, 1], [5, 7], [8], [5, 6, 2]])
    assert tree.num_nodes == 1 + 6  # 5, 8, 5-6, 5-7, 5-6-1, 5-6-2
    assert token_paths(tree) == {(5,), (8,), (5, 6), (5, 7), (5, 6, 1), (5, 6, 2)}
    assert tree.tokens_list[:3] == [9, 5, 8] and tree.depth_N.tolist() == [0, 1, 1, 2, 2, 3, 3]  # BFS order
    assert sorted(tuple(tree.tokens_list[j] for j in p[1:]) for p in tree.paths()) == [(5, 6, 1), (5, 6, 2),
                                                                                        (5, 7), (8,)]


@pytest.mark.parametrize("seed", range(10))
def test_weighted_paths_score_each_node_by_its_paths_and_a_budget_keeps_a_tree(seed):
    rng = random.Random(seed)
    paths = [[rng.randrange(3) for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 8))]
    weights = [rng.choice([0.25, 0.5, 1.0]) for _ in paths]
    full = from_paths(9, paths, weights)
    support = {pre: sum(w for p, w in zip(paths, weights) if tuple(p[:len(pre)]) == pre)
               for pre in {tuple(p[:d]) for p in paths for d in range(1, len(p) + 1)}}
    assert full.num_nodes == 1 + len(support) and full.scores_N[0].item() == pytest.approx(sum(weights))
    for i in range(1, full.num_nodes):
        assert full.scores_N[i].item() == pytest.approx(support[tuple(full_prefix(full, i))])
        assert full.scores_N[i] <= full.scores_N[full.parents_list[i]]
    budget = rng.randint(0, len(support))
    kept = from_paths(9, paths, weights, max_drafted=budget)
    kept_prefixes = [full_prefix(kept, i) for i in range(1, kept.num_nodes)]
    assert len(kept_prefixes) == budget and all(p[:-1] in kept_prefixes or len(p) == 1 for p in kept_prefixes)
    best = sorted(support.values(), reverse=True)
    assert sorted((support[p] for p in kept_prefixes), reverse=True) == best[:budget]  # the best-supported nodes
    assert kept.depth_N.tolist() == sorted(kept.depth_N.tolist())  # still BFS order


def full_prefix(tree, i):
    """The tokens from the root's child down to node i."""
    tokens = []
    while i > 0:
        tokens.append(tree.tokens_list[i])
        i = tree.parents_list[i]
    return tuple(reversed(tokens))


@pytest.mark.parametrize("seed", range(5))
def test_derived_fields_match_brute_force(seed):
    rng = random.Random(seed)
    num_nodes = rng.randint(1, 30)
    parents = [-1] + [rng.randrange(i) for i in range(1, num_nodes)]
    tree = DraftTree(torch.arange(num_nodes), torch.tensor(parents), torch.ones(num_nodes))  # distinct tokens

    def ancestors(i):  # i included
        out = {i}
        while parents[i] >= 0:
            i = parents[i]
            out.add(i)
        return out

    for i in range(num_nodes):
        assert tree.depth_N[i] == len(ancestors(i)) - 1
        assert {j for j in range(num_nodes) if tree.ancestor_mask_NN[i, j]} == ancestors(i)
        assert tree.children(i) == [j for j in range(num_nodes) if parents[j] == i]
    assert tree.position_ids(7).tolist() == [7 + len(ancestors(i)) - 1 for i in range(num_nodes)]
    leaves = [i for i in range(num_nodes) if i not in parents]
    assert tree.paths() == [sorted(ancestors(leaf)) for leaf in leaves]


def test_validation():
    t = lambda *xs: torch.tensor(xs)  # noqa: E731
    with pytest.raises(ValueError, match="parent -1"):
        DraftTree(t(1, 2), t(0, 0), torch.ones(2))
    with pytest.raises(ValueError, match="topological"):
        DraftTree(t(1, 2, 3), t(-1, 2, 0), torch.ones(3))
    with pytest.raises(ValueError, match="shape"):
        DraftTree(t(1, 2, 3), t(-1, 0), torch.ones(3))
    with pytest.raises(ValueError, match="distinct"):
        DraftTree(t(1, 2, 2), t(-1, 0, 0), torch.ones(3))
    DraftTree(t(1, 2, 2), t(-1, 0, 0), torch.ones(3), torch.ones(3, 4) / 4, sampled=True)  # i.i.d. repeats are fine


# ---- static shapes ---------------------------------------------------------------------------------------------

def test_static_shape_constants():
    assert CHAIN(3) == ((0,), (0, 0), (0, 0, 0))
    assert len(KARY(2, 3)) == 2 + 4 + 8 and len(KARY(3, 2)) == 12
    assert len(EAGLE_DEFAULT) == 25 and max(map(len, EAGLE_DEFAULT)) == 5  # 26 nodes with the root
    assert all(r[:-1] in EAGLE_DEFAULT for r in EAGLE_DEFAULT if len(r) > 1)


@pytest.mark.parametrize("shape", [CHAIN(4), KARY(2, 3), KARY(3, 2), EAGLE_DEFAULT], ids=["chain", "k2d3", "k3d2",
                                                                                        "eagle"])
def test_build_static_fills_ranks(shape):
    vocab, calls = 8, []
    tree = build_static(0, shape, path_expand(vocab, calls=calls))
    check_invariants(tree)
    assert tree.num_nodes == len(shape) + 1
    assert len(calls) == max(map(len, shape))  # one batched drafter call per depth
    assert tree.depth_N.tolist() == sorted(tree.depth_N.tolist())  # BFS order
    got = set()
    for i in range(1, tree.num_nodes):  # each node is its parent's rank-r candidate, V = product of confidences
        path = tuple(tree.tokens_list[j] for j in tree.path(i)[1:])
        ranks, score = [], 1.0
        for d in range(len(path)):
            dist = path_dist(path[:d], vocab, 0)
            ranks.append(dist.argsort(descending=True).tolist().index(path[d]))
            score *= dist[path[d]].item()
        assert math.isclose(tree.scores_N[i].item(), score, rel_tol=1e-5)
        assert torch.equal(tree.draft_probs_NV[i], path_dist(path[:-1], vocab, 0))
        got.add(tuple(ranks))
    assert got == set(shape)


# ---- EAGLE-2 dynamic tree --------------------------------------------------------------------------------------

def test_dynamic_reproduces_papers_worked_example():
    """papers.md: frontier V {0.95, 0.6, 0.3, 0.05}, k = 2 -> expand 0.95 and 0.6; children {0.855, 0.38} and
    {0.42, 0.12}: the weak parent's strong child (0.42) beats the strong parent's weak child (0.38). The paper's
    numbers are confidences, not normalised distributions (0.9 + 0.4 > 1); the builder only ranks them."""
    conf = {(): {1: 1.0, 2: 1.0}, (1,): {3: 0.95, 4: 0.3}, (2,): {5: 0.6, 6: 0.05},
            (1, 3): {7: 0.9, 8: 0.4}, (2, 5): {9: 0.7, 10: 0.2}}
    calls = []

    def expand(parent_ids, partial):
        calls.append([tuple(partial.path_tokens(i)[1:]) for i in parent_ids])
        rows = torch.zeros(len(parent_ids), 11)
        for row, path in enumerate(calls[-1]):
            for token, c in conf[path].items():
                rows[row, token] = c
        return rows

    tree = build_dynamic(0, expand, depth=3, top_k=2, num_nodes=6)
    assert calls == [[()], [(1,), (2,)], [(1, 3), (2, 5)]]  # the frontier 0.95, 0.6 is expanded, not 0.3
    assert token_paths(tree) == {(1,), (2,), (1, 3), (2, 5), (1, 3, 7), (2, 5, 9)}
    assert sorted(tree.scores_N.tolist(), reverse=True)[-2:] == pytest.approx([0.6, 0.42])  # 0.42 in, 0.38 out
    check_invariants(tree)


@pytest.mark.parametrize("seed,depth,top_k,num_nodes", [(0, 4, 3, 12), (1, 5, 2, 9), (2, 3, 4, 30), (3, 6, 3, 1)])
def test_dynamic_is_the_best_connected_subtree_of_the_candidates(seed, depth, top_k, num_nodes):
    vocab, calls = 6, []
    tree = build_dynamic(0, path_expand(vocab, seed, calls), depth, top_k, num_nodes)
    check_invariants(tree)
    assert len(calls) == depth and all(len(c) <= top_k for c in calls)
    # Brute force: the candidate pool is every expanded parent's top-k children; the tree keeps its best nodes.
    expanded = {()}
    for d in range(1, depth):  # frontier at step d+1 = the top_k of the nodes added at step d
        layer = [p + (t,) for p in expanded if len(p) == d - 1 for t in range(vocab)
                 if t in path_dist(p, vocab, seed).topk(top_k).indices.tolist()]
        expanded |= set(sorted(layer, key=lambda p: -value(p, vocab, seed))[:top_k])
    pool = [p + (t,) for p in expanded for t in path_dist(p, vocab, seed).topk(top_k).indices.tolist()]
    best = set(sorted(pool, key=lambda p: -value(p, vocab, seed))[:num_nodes])
    assert token_paths(tree) == best
    for i in range(1, tree.num_nodes):
        path = tuple(tree.tokens_list[j] for j in tree.path(i)[1:])
        assert math.isclose(tree.scores_N[i].item(), value(path, vocab, seed), rel_tol=1e-5)


def value(path: tuple[int, ...], vocab: int, seed: int) -> float:
    return math.prod(path_dist(path[:d], vocab, seed)[path[d]].item() for d in range(len(path)))


# ---- best-first (DDTree) ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed,num_nodes,top_k,max_depth", [(0, 10, 4, 3), (1, 25, 2, 5), (2, 7, 4, 1),
                                                            (3, 40, 3, 3)])
def test_best_first_returns_the_highest_value_prefixes(seed, num_nodes, top_k, max_depth):
    vocab, calls = 4, []
    tree = build_best_first(0, path_expand(vocab, seed, calls), num_nodes, top_k, max_depth)
    check_invariants(tree)
    # Brute force: every path of depth <= max_depth whose tokens are each within the parent's top_k.
    universe, layer = [], [()]
    for _ in range(max_depth):
        layer = [p + (t,) for p in layer for t in path_dist(p, vocab, seed).topk(top_k).indices.tolist()]
        universe += layer
    best = sorted(universe, key=lambda p: -value(p, vocab, seed))[:num_nodes]
    assert token_paths(tree) == set(best)
    assert tree.num_nodes == 1 + min(num_nodes, len(universe))
    assert len(calls) <= tree.num_nodes and all(len(c) == 1 for c in calls)


# ---- best-first over a block drafter ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed,num_positions,vocab,num_nodes", [(0, 4, 5, 10), (1, 3, 4, 30), (2, 5, 3, 1),
                                                                (3, 2, 3, 100)])
def test_block_heap_matches_enumeration(seed, num_positions, vocab, num_nodes):
    g = torch.Generator().manual_seed(seed)
    probs_KV = (2.0 * torch.randn(num_positions, vocab, generator=g)).softmax(-1)
    tree = build_best_first_block(0, probs_KV, num_nodes)
    check_invariants(tree)
    prefixes = [p for d in range(1, num_positions + 1) for p in itertools.product(range(vocab), repeat=d)]
    prob = lambda p: math.prod(probs_KV[d, t].item() for d, t in enumerate(p))  # noqa: E731
    best = sorted(prefixes, key=lambda p: -prob(p))[:num_nodes]
    assert token_paths(tree) == set(best)
    for i in range(1, tree.num_nodes):
        assert torch.equal(tree.draft_probs_NV[i], probs_KV[tree.depth_N[i] - 1])
    assert tree.scores_N[1:].tolist() == sorted(tree.scores_N[1:].tolist(), reverse=True)  # added best first


def test_sparse_probs_rank_as_the_dense_tensor_does():
    """SparseProbs.top is dense().topk: from the X entries where the top k + 1 are distinct and positive, through
    the dense tensor on ties, zeros and k past X; rows and dense() place the probabilities at their target ids."""
    from eyas.decoding.tree import SparseProbs, dense_probs
    d2t_X = torch.tensor([1, 4, 5, 9])
    probs_PX = torch.tensor([[0.1, 0.4, 0.3, 0.2], [0.25, 0.25, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0]])
    sparse = SparseProbs(probs_PX, d2t_X, 12)
    dense_PV = torch.zeros(3, 12)
    dense_PV[:, d2t_X] = probs_PX
    assert sparse.shape == (3, 12) and sparse.dim() == 2 and torch.equal(sparse.dense(), dense_PV)
    assert torch.equal(dense_probs(sparse[1]), dense_PV[1]) and dense_probs(dense_PV) is dense_PV
    for k in range(1, 13):
        want_values, want_tokens = dense_PV.topk(k, dim=-1)
        values, tokens = sparse.top(k)
        assert torch.equal(values, want_values) and torch.equal(tokens, want_tokens), k
    distinct = SparseProbs(probs_PX[:1], d2t_X, 12)
    assert distinct.top(2)[1].tolist() == [[4, 5]]
