"""Tree builders: grow a DraftTree from a drafter's next-token distributions (papers.md: EAGLE-1/2, DDTree).

Shape legend (docs/SHAPES.md): N tree nodes (root included), V vocab, P parents expanded in one drafter call,
W candidates kept per parent (top-k), K block positions of a block drafter.

  build_static             a fixed shape of sibling ranks (EAGLE-1 / Medusa), one drafter call per depth
  build_dynamic            EAGLE-2: expand the top-k frontier per depth, then rerank the whole tree by V
  build_best_first         DDTree: a max-heap on V, always expanding the single best node
  build_best_first_block   DDTree over a block drafter's independent per-position distributions
Every builder returns deterministic distinct siblings (sampled=False), so tree verification accepts a child x with
probability p(x) (see verify.py).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Sequence

import torch

from eyas.decoding.tree import DraftTree, PartialTree, SparseProbs


# expand(parent_ids, partial) -> probs_PV: the draft distribution at each given parent (one batched drafter call),
# dense, or a SparseProbs over a reduced draft vocabulary (ranked over its X entries, the same top-k: tree.py)
Expand = Callable[[list[int], PartialTree], "torch.Tensor | SparseProbs"]


def _expand(expand: Expand, parent_ids: list[int], partial: PartialTree, top_k: int
            ) -> tuple[torch.Tensor, list[list[float]], list[list[int]]]:
    """Calls expand; returns probs_PV and each parent's top_k (probability, token) candidates, best first."""
    probs_PV = expand(parent_ids, partial)
    if probs_PV.dim() != 2 or probs_PV.shape[0] != len(parent_ids):
        raise ValueError(f"expand returned shape {tuple(probs_PV.shape)} for {len(parent_ids)} parents; "
                         f"expected ({len(parent_ids)}, V)")
    if top_k > probs_PV.shape[1]:
        raise ValueError(f"top_k / rank {top_k} exceeds the vocabulary size {probs_PV.shape[1]}")
    conf_PW, token_PW = (probs_PV.top(top_k) if isinstance(probs_PV, SparseProbs)
                         else probs_PV.topk(top_k, dim=-1))
    # Clamp: V must not grow along a path (rerank and best-first rely on it); softmax can round to 1 + eps.
    return probs_PV, conf_PW.double().clamp(max=1.0).tolist(), token_PW.tolist()


def _best(node_ids: Sequence[int], scores: list[float], count: int) -> list[int]:
    """The `count` best nodes by V, ties broken by lower id (so a parent always ranks before an equal child)."""
    return sorted(node_ids, key=lambda i: (-scores[i], i))[:count]


# ---- static shapes (EAGLE-1 / Medusa): a node is the tuple of sibling ranks on its path, (0, 1) = "rank-1 child
# of the rank-0 child of the root"; every prefix of a tuple must also be in the shape.
StaticTreeShape = Sequence[tuple[int, ...]]


def CHAIN(depth: int) -> tuple[tuple[int, ...], ...]:  # noqa: N802 (a shape constant, named like one)
    """The top-1 chain of `depth` drafted tokens."""
    return tuple((0,) * d for d in range(1, depth + 1))


def KARY(k: int, depth: int) -> tuple[tuple[int, ...], ...]:  # noqa: N802
    """The full k-ary tree of the given depth: sum_d k^d drafted nodes."""
    return tuple(ranks for d in range(1, depth + 1) for ranks in itertools.product(range(k), repeat=d))


# EAGLE-1's default tree (`mc_sim_7b_63` in the EAGLE reference, also used by Medusa's EAGLE port): 25 drafted nodes
# + root = 26, depth 5; wide near the root (4 candidates) and narrowing to the top-1 spine, because acceptance of
# low-ranked candidates falls fast with depth. The EAGLE-1 paper found 26 nodes best for 7B/13B targets.
EAGLE_DEFAULT: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)


def build_static(root_token: int, shape: StaticTreeShape, expand: Expand) -> DraftTree:
    """Fill a static shape: one expand call per depth, batched over that depth's parents, taking the ranks the
    shape asks for. Medusa: expand returns head d's top-k at every parent; EAGLE-1: the drafter run on each parent.
    Nodes in BFS order, siblings by rank."""
    ranks = sorted(set(map(tuple, shape)), key=lambda r: (len(r), r))
    for r in ranks:
        if not r or min(r) < 0 or (len(r) > 1 and r[:-1] not in ranks):
            raise ValueError(f"build_static: bad shape entry {r}: ranks must be >= 0 and every prefix present")
    partial = PartialTree(root_token)
    node_of: dict[tuple[int, ...], int] = {(): 0}
    for depth in range(1, (len(ranks[-1]) if ranks else 0) + 1):
        layer = sorted((r for r in ranks if len(r) == depth), key=lambda r: (node_of[r[:-1]], r[-1]))
        parent_ids = list(dict.fromkeys(node_of[r[:-1]] for r in layer))
        row_of = {parent: row for row, parent in enumerate(parent_ids)}
        probs_PV, conf_PW, token_PW = _expand(expand, parent_ids, partial, max(r[-1] for r in layer) + 1)
        for r in layer:
            parent, row = node_of[r[:-1]], row_of[node_of[r[:-1]]]
            node_of[r] = partial.add(parent, token_PW[row][r[-1]], partial.scores[parent] * conf_PW[row][r[-1]],
                                     probs_PV[row])
    return partial.to_tree()


def build_dynamic(root_token: int, expand: Expand, depth: int, top_k: int, num_nodes: int) -> DraftTree:
    """EAGLE-2 dynamic tree: `depth` expand steps (= the maximum tree depth), then rerank.

    Step 1 expands the root. Each later step takes the top_k nodes by V among those added by the previous step (the
    frontier), expands them in one call, and adds each one's top_k children with V = V(parent) * confidence.
    Rerank keeps the num_nodes best drafted nodes of the whole tree by V (ties: earlier node first); as V never
    grows along a path, they form a connected subtree. Nodes are relabelled in topological (BFS) order.
    """
    if depth < 1 or top_k < 1 or num_nodes < 1:
        raise ValueError(f"build_dynamic: depth, top_k, num_nodes must be >= 1, got {depth}, {top_k}, {num_nodes}")
    partial = PartialTree(root_token)
    frontier = [0]
    for _ in range(depth):
        probs_PV, conf_PW, token_PW = _expand(expand, frontier, partial, top_k)
        added = [partial.add(parent, token, partial.scores[parent] * conf, probs_PV[row])
                 for row, parent in enumerate(frontier)
                 for conf, token in zip(conf_PW[row], token_PW[row])]
        frontier = _best(added, partial.scores, top_k)
    keep = _best(range(1, len(partial)), partial.scores, num_nodes)
    return partial.to_tree([0, *keep])


def build_best_first(root_token: int, expand: Expand, num_nodes: int, top_k: int, max_depth: int) -> DraftTree:
    """DDTree best-first: the num_nodes highest-V nodes among paths whose every token is in its parent's top_k and
    whose depth is <= max_depth.

    A max-heap holds two kinds of entries. ("child", parent, rank): a known candidate with its V. ("expand", node):
    a node whose children are not computed yet, keyed by V(node), an upper bound on any child's V. Popping a
    candidate adds it to the tree and pushes its next sibling and its own "expand" entry; popping an "expand" entry
    calls the drafter on that one node and pushes its first child. Keys popped never increase, so nodes are added
    best first and the drafter runs only on nodes whose children could still make the cut.
    """
    if num_nodes < 1 or top_k < 1 or max_depth < 1:
        raise ValueError(f"build_best_first: num_nodes, top_k, max_depth must be >= 1, got "
                         f"{num_nodes}, {top_k}, {max_depth}")
    partial = PartialTree(root_token)
    candidates: dict[int, tuple[torch.Tensor, list[float], list[int]]] = {}  # parent -> (probs_V, confs, tokens)
    counter = itertools.count()  # tie-break: earlier push first
    heap: list[tuple[float, int, int, int]] = [(-1.0, next(counter), 0, -1)]  # (-key, seq, node, rank; -1 = expand)
    while heap and len(partial) - 1 < num_nodes:
        neg_key, _, node, rank = heapq.heappop(heap)
        if rank < 0:  # expand `node`
            probs_PV, conf_PW, token_PW = _expand(expand, [node], partial, top_k)
            candidates[node] = (probs_PV[0], conf_PW[0], token_PW[0])
            heapq.heappush(heap, (-partial.scores[node] * conf_PW[0][0], next(counter), node, 0))
            continue
        probs_V, confs, tokens = candidates[node]
        child = partial.add(node, tokens[rank], -neg_key, probs_V)
        if rank + 1 < top_k:
            heapq.heappush(heap, (-partial.scores[node] * confs[rank + 1], next(counter), node, rank + 1))
        if partial.depth[child] < max_depth:
            heapq.heappush(heap, (neg_key, next(counter), child, -1))
    return partial.to_tree()


def build_best_first_block(root_token: int, probs_KV: torch.Tensor, num_nodes: int,
                           top_k: int | None = None) -> DraftTree:
    """DDTree over a block drafter: position k's distribution q_k is taken as independent of the tokens before it,
    so a node is a tuple of per-position ranks with V = prod_k q_k(rank_k), and the best tree of num_nodes nodes is
    the num_nodes most probable prefixes. Heap over rank tuples: each pop adds a node and pushes its next sibling
    and its first child; O(num_nodes log num_nodes). top_k optionally caps the ranks per position."""
    if probs_KV.dim() != 2 or num_nodes < 1:
        raise ValueError(f"build_best_first_block: need probs_KV of shape (K, V) and num_nodes >= 1, got "
                         f"{tuple(probs_KV.shape)} and {num_nodes}")
    num_positions, vocab = probs_KV.shape
    width = min(vocab, num_nodes, top_k or vocab)
    conf_KW, token_KW = probs_KV.topk(width, dim=-1)
    confs, tokens = conf_KW.double().clamp(max=1.0).tolist(), token_KW.tolist()
    partial = PartialTree(root_token)
    counter = itertools.count()
    # (-V, seq, parent, rank): the rank-th candidate at position depth(parent) under `parent`
    heap = [(-confs[0][0], next(counter), 0, 0)] if num_positions else []
    while heap and len(partial) - 1 < num_nodes:
        neg_score, _, parent, rank = heapq.heappop(heap)
        pos = partial.depth[parent]  # this node's block position (0-based)
        node = partial.add(parent, tokens[pos][rank], -neg_score, probs_KV[pos])
        if rank + 1 < width:
            heapq.heappush(heap, (-partial.scores[parent] * confs[pos][rank + 1], next(counter), parent, rank + 1))
        if pos + 1 < num_positions:
            heapq.heappush(heap, (neg_score * confs[pos + 1][0], next(counter), node, 0))
    return partial.to_tree()
