"""Draft trees: the DraftTree container and the builders that grow one from a drafter.

Shape legend: N tree nodes (root included), V vocab, K candidates (chain length / block positions),
P parents expanded in one drafter call.

Node 0 is the ROOT: the last committed token, whose K/V is not yet in the target cache. Nodes 1.. are drafted
tokens in topological order (a parent before its children). The value V(node) (`scores_N`, EAGLE-2) is the
product of draft confidences along the root-to-node path; the root has V = 1.

Builders:
  chain / from_paths       fixed token sequences
  build_static             a fixed shape of sibling ranks (EAGLE-1 / Medusa), one drafter call per depth
  build_dynamic            EAGLE-2: expand the top-k frontier per depth, then rerank the whole tree by V
  build_best_first         DDTree: a max-heap on V, always expanding the single best node
  build_best_first_block   DDTree over a block drafter's independent per-position distributions
Every builder that ranks candidates (all but chain / from_paths) returns deterministic distinct siblings
(sampled=False), so tree verification accepts a child x with probability p(x) (see verify.py).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Sequence

import torch


@dataclass(eq=False)
class DraftTree:
    """Drafted tokens as a tree; a chain is a tree whose nodes each have at most one child.

    sampled=True: the children of a node were sampled i.i.d. from the draft distribution q (verification uses the
    p/q rejection rule and needs `draft_probs_NV`). sampled=False: children are deterministic distinct candidates
    (top-k, n-gram, static tree): q is a point mass, so siblings must carry distinct tokens.
    """

    tokens_N: torch.Tensor  # long; node 0 = root = last committed token
    parents_N: torch.Tensor  # long; -1 for the root, parents_N[i] < i
    scores_N: torch.Tensor  # V = product of draft confidences on the root->node path (root 1.0)
    draft_probs_NV: torch.Tensor | None = None  # row i: the distribution node i's token was chosen from; row 0 unused
    sampled: bool = False
    depth_N: torch.Tensor = field(init=False, repr=False)  # long; root depth 0

    def __post_init__(self) -> None:
        if self.tokens_N.dim() != 1 or self.tokens_N.numel() < 1:
            raise ValueError(f"DraftTree: tokens_N must be 1-D with the root, got shape {tuple(self.tokens_N.shape)}")
        num_nodes = self.tokens_N.numel()
        for name in ("parents_N", "scores_N"):
            if tuple(getattr(self, name).shape) != (num_nodes,):
                raise ValueError(f"DraftTree: {name} has shape {tuple(getattr(self, name).shape)}, "
                                 f"expected ({num_nodes},) like tokens_N")
        if self.draft_probs_NV is not None and (self.draft_probs_NV.dim() != 2
                                                or self.draft_probs_NV.shape[0] != num_nodes):
            raise ValueError(f"DraftTree: draft_probs_NV has shape {tuple(self.draft_probs_NV.shape)}, "
                             f"expected ({num_nodes}, V)")
        parents, tokens = self.parents_list, self.tokens_list
        if parents[0] != -1:
            raise ValueError(f"DraftTree: the root must have parent -1, got {parents[0]}")
        depth = [0] * num_nodes
        seen: set[tuple[int, int]] = set()
        for i in range(1, num_nodes):
            if not 0 <= parents[i] < i:
                raise ValueError(f"DraftTree: node {i} has parent {parents[i]}; nodes must be in topological order "
                                 f"(0 <= parent < index)")
            depth[i] = depth[parents[i]] + 1
            if not self.sampled:
                if (parents[i], tokens[i]) in seen:
                    raise ValueError(f"DraftTree: node {i} repeats token {tokens[i]} among the children of "
                                     f"{parents[i]}; deterministic (sampled=False) siblings must be distinct")
                seen.add((parents[i], tokens[i]))
        self.depth_N = torch.tensor(depth, dtype=torch.long, device=self.tokens_N.device)

    @property
    def num_nodes(self) -> int:
        return self.tokens_N.numel()

    @cached_property
    def tokens_list(self) -> list[int]:
        return self.tokens_N.tolist()

    @cached_property
    def parents_list(self) -> list[int]:
        return self.parents_N.tolist()

    @cached_property
    def _children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, parent in enumerate(self.parents_list[1:], start=1):
            kids[parent].append(i)
        return kids

    def children(self, i: int) -> list[int]:
        """Children of node i, in node order."""
        return self._children[i]

    def path(self, i: int) -> list[int]:
        """Node indices from the root to node i, both included."""
        nodes = [i]
        while nodes[-1] != 0:
            nodes.append(self.parents_list[nodes[-1]])
        return nodes[::-1]

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node-index paths, leaves in node order (root only: [[0]])."""
        return [self.path(i) for i in range(self.num_nodes) if not self._children[i]]

    @cached_property
    def ancestor_mask_NN(self) -> torch.Tensor:
        """bool [N, N]: [i, j] True iff j is an ancestor of i or j == i (the tree-attention pattern)."""
        rows, cols = [], []
        for i in range(self.num_nodes):
            anc = self.path(i)
            rows += [i] * len(anc)
            cols += anc
        mask_NN = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.bool)
        mask_NN[rows, cols] = True
        return mask_NN.to(self.tokens_N.device)

    def position_ids(self, prefix_len: int) -> torch.Tensor:
        """long [N]: prefix_len + depth (the root sits at position prefix_len)."""
        return self.depth_N + prefix_len


def chain(root_token: int, tokens: Sequence[int], probs_KV: torch.Tensor | None = None,
          scores: Sequence[float] | torch.Tensor | None = None, sampled: bool = False) -> DraftTree:
    """A chain root -> tokens[0] -> ... -> tokens[K-1].

    probs_KV row k is the distribution tokens[k] was chosen from. scores are the V of the K drafted nodes; by
    default the running product of probs_KV[k, tokens[k]] (1.0 without probs_KV).
    """
    num_drafted = len(tokens)
    tokens_N = torch.tensor([root_token, *tokens], dtype=torch.long)
    parents_N = torch.arange(-1, num_drafted, dtype=torch.long)
    draft_probs_NV = None
    if probs_KV is not None:
        if probs_KV.dim() != 2 or probs_KV.shape[0] != num_drafted:
            raise ValueError(f"chain: probs_KV has shape {tuple(probs_KV.shape)}, expected ({num_drafted}, V)")
        draft_probs_NV = torch.cat([probs_KV.new_zeros(1, probs_KV.shape[1]), probs_KV])
    if scores is None:
        conf_K = (probs_KV[torch.arange(num_drafted), tokens_N[1:].to(probs_KV.device)].float().cpu()
                  if probs_KV is not None else torch.ones(num_drafted))
        scores_N = torch.cat([torch.ones(1), conf_K.cumprod(0)])
    else:
        scores_K = torch.as_tensor(scores, dtype=torch.float32).cpu()
        if scores_K.shape != (num_drafted,):
            raise ValueError(f"chain: scores has shape {tuple(scores_K.shape)}, expected ({num_drafted},)")
        scores_N = torch.cat([torch.ones(1), scores_K])
    return DraftTree(tokens_N, parents_N, scores_N, draft_probs_NV, sampled)


def from_paths(root_token: int, paths: Sequence[Sequence[int]]) -> DraftTree:
    """A tree holding each token path (below the root); shared prefixes are merged. Nodes in BFS order, siblings in
    order of first appearance; scores are 1.0 (no draft confidences)."""
    first_seen: dict[tuple[int, ...], int] = {}
    for path in paths:
        for d in range(1, len(path) + 1):
            first_seen.setdefault(tuple(path[:d]), len(first_seen))
    prefixes = sorted(first_seen, key=lambda pre: (len(pre), first_seen[pre]))
    node_of = {(): 0}
    tokens, parents = [root_token], [-1]
    for pre in prefixes:
        node_of[pre] = len(tokens)
        tokens.append(pre[-1])
        parents.append(node_of[pre[:-1]])
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                     torch.ones(len(tokens)))


class PartialTree:
    """The tree grown so far, handed to `expand` callbacks. Node ids are this object's (root = 0); the final
    DraftTree may relabel them (build_dynamic keeps only the best nodes)."""

    def __init__(self, root_token: int):
        self.tokens: list[int] = [root_token]
        self.parents: list[int] = [-1]
        self.depth: list[int] = [0]
        self.scores: list[float] = [1.0]
        self.draft_rows: list[torch.Tensor | None] = [None]  # the distribution each node was chosen from

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, score: float, draft_row_V: torch.Tensor) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.scores.append(score)
        self.draft_rows.append(draft_row_V)
        return len(self.tokens) - 1

    def path(self, i: int) -> list[int]:
        """Node ids from the root to node i, both included."""
        nodes = [i]
        while nodes[-1] != 0:
            nodes.append(self.parents[nodes[-1]])
        return nodes[::-1]

    def path_tokens(self, i: int) -> list[int]:
        """Tokens from the root to node i, both included."""
        return [self.tokens[j] for j in self.path(i)]

    def to_tree(self, keep: Sequence[int] | None = None) -> DraftTree:
        """The DraftTree of the kept nodes (all by default), relabelled in increasing id order, which is
        topological because a node is always added after its parent."""
        keep = sorted(range(len(self)) if keep is None else keep)
        new_id = {old: new for new, old in enumerate(keep)}
        assert keep[0] == 0 and all(self.parents[i] in new_id for i in keep[1:]), "kept nodes are not a subtree"
        parents = [-1] + [new_id[self.parents[i]] for i in keep[1:]]
        draft_probs_NV = None
        if len(keep) > 1:
            rows = [self.draft_rows[i] for i in keep[1:]]
            draft_probs_NV = torch.stack([torch.zeros_like(rows[0]), *rows])
        return DraftTree(torch.tensor([self.tokens[i] for i in keep], dtype=torch.long),
                         torch.tensor(parents, dtype=torch.long),
                         torch.tensor([self.scores[i] for i in keep], dtype=torch.float32),
                         draft_probs_NV, sampled=False)


# expand(parent_ids, partial) -> probs_PV: the draft distribution at each given parent (one batched drafter call).
Expand = Callable[[list[int], PartialTree], torch.Tensor]


def _expand(expand: Expand, parent_ids: list[int], partial: PartialTree, top_k: int
            ) -> tuple[torch.Tensor, list[list[float]], list[list[int]]]:
    """Calls expand; returns probs_PV and each parent's top_k (probability, token) candidates, best first."""
    probs_PV = expand(parent_ids, partial)
    if probs_PV.dim() != 2 or probs_PV.shape[0] != len(parent_ids):
        raise ValueError(f"expand returned shape {tuple(probs_PV.shape)} for {len(parent_ids)} parents; "
                         f"expected ({len(parent_ids)}, V)")
    if top_k > probs_PV.shape[1]:
        raise ValueError(f"top_k / rank {top_k} exceeds the vocabulary size {probs_PV.shape[1]}")
    conf_PK, token_PK = probs_PV.topk(top_k, dim=-1)
    # Clamp: V must not grow along a path (rerank and best-first rely on it); softmax can round to 1 + eps.
    return probs_PV, conf_PK.double().clamp(max=1.0).tolist(), token_PK.tolist()


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
        probs_PV, conf_PK, token_PK = _expand(expand, parent_ids, partial, max(r[-1] for r in layer) + 1)
        for r in layer:
            parent, row = node_of[r[:-1]], row_of[node_of[r[:-1]]]
            node_of[r] = partial.add(parent, token_PK[row][r[-1]], partial.scores[parent] * conf_PK[row][r[-1]],
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
        probs_PV, conf_PK, token_PK = _expand(expand, frontier, partial, top_k)
        added = [partial.add(parent, token, partial.scores[parent] * conf, probs_PV[row])
                 for row, parent in enumerate(frontier)
                 for conf, token in zip(conf_PK[row], token_PK[row])]
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
            probs_PV, conf_PK, token_PK = _expand(expand, [node], partial, top_k)
            candidates[node] = (probs_PV[0], conf_PK[0], token_PK[0])
            heapq.heappush(heap, (-partial.scores[node] * conf_PK[0][0], next(counter), node, 0))
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
