"""Draft trees: the DraftTree container, and what the engine does to trees: cap, prune and pack them.

Shape legend (docs/SHAPES.md): N tree nodes (root included), V vocab, K drafted positions of a chain, B batch rows,
T the packed width of one forward (the largest tree).

Node 0 is the ROOT: the last committed token, whose K/V is not yet in the target cache. Nodes 1.. are drafted
tokens in topological order (a parent before its children). The value V(node) (`scores_N`, EAGLE-2) is the
product of draft confidences along the root-to-node path; the root has V = 1.

  chain / from_paths       fixed token sequences (the builders that rank candidates live in builders.py)
  PartialTree              the tree a builder grows, handed to the drafter's expand callback
  MAX_TREE_NODES           the one cap on a cycle's tree, root included; the context room a request reserves
  prune                    a tree cut to a node budget (load-adaptive speculation)
  pack_trees               B ragged trees as one forward's tokens, positions and attention mask
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Sequence

import torch

from eyas.config import ConfigError

# A cycle's tree never exceeds this many nodes, root included: tree specs whose trees could be larger are refused
# (eyas.drafters.trees.TreeSpec), so is an engine whose drafter could draft more than its cap (check_tree_size),
# and every request reserves this much context room for its last cycle's tree.
MAX_TREE_NODES = 64


def check_tree_size(num_draft_nodes: int, max_tree_nodes: int, drafter: str) -> None:
    """The one size rule: a drafter whose trees could exceed ``max_tree_nodes`` (root included) is refused."""
    if num_draft_nodes + 1 > max_tree_nodes:
        raise ConfigError(f"the {drafter} drafter's trees reach {num_draft_nodes} drafted nodes + the root, over the "
                          f"cap of {max_tree_nodes} (root included; at most MAX_TREE_NODES = {MAX_TREE_NODES}): "
                          "lower the tree's spec.num_nodes / spec.depth / spec.num_draft or raise max_tree_nodes")


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
    # a hybrid tree's nodes: the proposers that drafted each (root: ()), for per-proposer acceptance in SpecStats
    drafted_by: tuple[tuple[str, ...], ...] | None = None
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
        if self.drafted_by is not None and len(self.drafted_by) != num_nodes:
            raise ValueError(f"DraftTree: drafted_by has {len(self.drafted_by)} entries, expected {num_nodes}")
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
    if not num_drafted and probs_KV is None:  # a bare root (every vanilla cycle): the fewest tensor ops
        return DraftTree(torch.tensor([root_token]), torch.tensor([-1]), torch.ones(1), None, sampled)
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


def from_paths(root_token: int, paths: Sequence[Sequence[int]], weights: Sequence[float] | None = None,
               max_drafted: int | None = None) -> DraftTree:
    """A tree holding each token path (below the root); shared prefixes are merged. Nodes in BFS order, siblings in
    order of first appearance.

    Without ``weights`` every score is 1.0 (no draft confidences). With them a node's score is the total weight of
    the paths through it (the root's: all of it), so a child's share of its parent's score is how often that
    continuation followed, and scores never grow along a path: ``max_drafted`` then keeps the highest-scoring
    nodes (ties: shallower, then first seen), which still form a tree.
    """
    if weights is not None and len(weights) != len(paths):
        raise ValueError(f"from_paths: {len(weights)} weights for {len(paths)} paths")
    first_seen: dict[tuple[int, ...], int] = {}
    score: dict[tuple[int, ...], float] = {(): 0.0}
    for path, weight in zip(paths, weights if weights is not None else [1.0] * len(paths)):
        score[()] += weight
        for d in range(1, len(path) + 1):
            prefix = tuple(path[:d])
            first_seen.setdefault(prefix, len(first_seen))
            score[prefix] = score.get(prefix, 0.0) + weight
    prefixes = list(first_seen)
    if max_drafted is not None and len(prefixes) > max_drafted:
        prefixes = sorted(prefixes, key=lambda pre: (-score[pre], len(pre), first_seen[pre]))[:max(max_drafted, 0)]
    prefixes.sort(key=lambda pre: (len(pre), first_seen[pre]))
    node_of = {(): 0}
    tokens, parents = [root_token], [-1]
    for pre in prefixes:
        node_of[pre] = len(tokens)
        tokens.append(pre[-1])
        parents.append(node_of[pre[:-1]])
    scores = [score[()]] + [score[pre] for pre in prefixes] if weights is not None else [1.0] * len(tokens)
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                     torch.tensor(scores, dtype=torch.float32))


class SparseProbs:
    """Draft distributions [P, X] that are zero outside X target ids (a reduced draft vocabulary, ascending ids):
    what an ``expand`` callback may return in place of the dense probs_PV it stands for. A builder ranks the X
    entries (``top``) instead of all V, and ``PartialTree.to_tree`` builds dense rows only for the nodes it keeps.
    Indexing a row gives a one-row SparseProbs; ``dense`` the [..., V] tensor itself."""

    __slots__ = ("probs_PX", "d2t_X", "vocab_size")

    def __init__(self, probs_PX: torch.Tensor, d2t_X: torch.Tensor, vocab_size: int) -> None:
        self.probs_PX, self.d2t_X, self.vocab_size = probs_PX, d2t_X, vocab_size

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.probs_PX.shape[:-1], self.vocab_size)

    def dim(self) -> int:
        return self.probs_PX.dim()

    def __getitem__(self, row: int) -> "SparseProbs":
        return SparseProbs(self.probs_PX[row], self.d2t_X, self.vocab_size)

    def dense(self) -> torch.Tensor:
        """The probabilities over the whole vocabulary [..., V], 0 outside the X ids."""
        full = self.probs_PX.new_zeros(self.shape)
        return full.index_copy_(-1, self.d2t_X, self.probs_PX)

    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs_PW, tokens_PW): ``dense().topk(k)`` exactly, from the X entries. Where the k + 1 best of a row
        are distinct and the k-th is positive, that top-k is the only one, and the X entries hold it (the zeros
        outside rank below); elsewhere (ties, zeros, NaN) it is the dense tensor's own topk."""
        num_ids = self.probs_PX.shape[-1]
        probs_PW, index_PW = self.probs_PX.topk(min(k + 1, num_ids), dim=-1)
        values = probs_PW.tolist()
        unique = k <= num_ids and all(row[k - 1] > 0 and all(a > b for a, b in zip(row, row[1:]))
                                      for row in values)
        if not unique:
            return self.dense().topk(k, dim=-1)
        return probs_PW[..., :k], self.d2t_X[index_PW[..., :k]]


def dense_probs(probs: "torch.Tensor | SparseProbs") -> torch.Tensor:
    """A draft distribution as the dense [..., V] tensor (SparseProbs built, tensors as they are)."""
    return probs.dense() if isinstance(probs, SparseProbs) else probs


class PartialTree:
    """The tree grown so far, handed to `expand` callbacks. Node ids are this object's (root = 0); the final
    DraftTree may relabel them (build_dynamic keeps only the best nodes)."""

    def __init__(self, root_token: int):
        self.tokens: list[int] = [root_token]
        self.parents: list[int] = [-1]
        self.depth: list[int] = [0]
        self.scores: list[float] = [1.0]
        # the distribution each node was chosen from (dense [V] or a SparseProbs row)
        self.draft_rows: list[torch.Tensor | SparseProbs | None] = [None]

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, score: float, draft_row_V: "torch.Tensor | SparseProbs") -> int:
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
            rows = [dense_probs(self.draft_rows[i]) for i in keep[1:]]
            draft_probs_NV = torch.stack([torch.zeros_like(rows[0]), *rows])
        return DraftTree(torch.tensor([self.tokens[i] for i in keep], dtype=torch.long),
                         torch.tensor(parents, dtype=torch.long),
                         torch.tensor([self.scores[i] for i in keep], dtype=torch.float32),
                         draft_probs_NV, sampled=False)


def prune(tree: DraftTree, max_drafted: int) -> DraftTree:
    """The tree cut to at most ``max_drafted`` drafted nodes (root kept), still a tree, nodes relabelled in order.

    Deterministic trees keep their highest-V nodes (ties: lower index): V never grows along a path, so those form a
    connected subtree (the same rule as EAGLE-2's rerank). Sampled trees keep their first nodes in index order
    instead: choosing among i.i.d. samples by their values would bias the draft and break lossless verification;
    for a chain this is a prefix, exactly a shorter draft.
    """
    num_drafted = tree.num_nodes - 1
    if num_drafted <= max_drafted:
        return tree
    if max_drafted <= 0:
        return chain(int(tree.tokens_list[0]), [])
    keep = list(range(max_drafted + 1))
    if not tree.sampled:
        scores = tree.scores_N.tolist()
        best = sorted(range(1, tree.num_nodes), key=lambda i: (-scores[i], i))[:max_drafted]
        candidate = [0, *sorted(best)]
        kept = set(candidate)
        if all(tree.parents_list[i] in kept for i in candidate[1:]):
            keep = candidate
    new_id = {old: new for new, old in enumerate(keep)}
    parents = [-1] + [new_id[tree.parents_list[i]] for i in keep[1:]]
    index = torch.tensor(keep, dtype=torch.long)
    probs = tree.draft_probs_NV[index.to(tree.draft_probs_NV.device)] if tree.draft_probs_NV is not None else None
    drafted_by = tuple(tree.drafted_by[i] for i in keep) if tree.drafted_by is not None else None
    return DraftTree(tree.tokens_N[index.to(tree.tokens_N.device)], torch.tensor(parents, dtype=torch.long),
                     tree.scores_N[index.to(tree.scores_N.device)], probs, tree.sampled, drafted_by)


def pack_trees(plan: Sequence[tuple[Sequence[int], Sequence[int]]], lengths: Sequence[int],
               device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One forward's inputs for B ragged trees: plan[b] = (tokens, parents) of row b's tree (node 0 = root).

    Returns tokens_BT, positions_BT (row b's node i at lengths[b] + depth_i) and mask_BTT (True = attend: each node
    sees itself and its ancestors; a padding slot sees only itself, so no softmax row is empty), or None for the
    mask when every tree is a bare root (plain decoding). Example, trees of 3 and 1 nodes, T = 3:
        row 0: tokens [r0, a, b], parents [-1, 0, 0]    mask [[1,0,0],[1,1,0],[1,0,1]]
        row 1: tokens [r1, 0, 0] (2 padding slots)      mask [[1,0,0],[0,1,0],[0,0,1]]
    """
    T = max(len(tokens) for tokens, _ in plan)
    if T == 1:  # plain decoding: one root per row at its own length, no mask
        tokens_BT = torch.tensor([[tokens[0]] for tokens, _ in plan], dtype=torch.long)
        positions_BT = torch.tensor([[length] for length in lengths], dtype=torch.long)
        return tokens_BT.to(device), positions_BT.to(device), None
    token_rows, position_rows, masks = [], [], []
    for (tokens, parents), length in zip(plan, lengths):
        depth, mask_NN = tree_layout(tuple(parents))
        pad = T - len(tokens)
        token_rows.append([*tokens, *[0] * pad])
        position_rows.append([length + d for d in depth] + [length] * pad)
        masks.append(mask_NN if not pad else _padded_mask(mask_NN, T))
    mask_BTT = torch.stack(masks)
    return (torch.tensor(token_rows, dtype=torch.long).to(device),
            torch.tensor(position_rows, dtype=torch.long).to(device), mask_BTT.to(device))


@lru_cache(maxsize=4096)
def tree_layout(parents: tuple[int, ...]) -> tuple[tuple[int, ...], torch.Tensor]:
    """(depth of each node, ancestor mask_NN) of a tree shape, cached: static trees and chains repeat their shape
    every cycle. The mask is built from per-node ancestor bit sets (node i's = its parent's plus bit i, parents
    first) unpacked in one tensor op, not node by node. Shared: callers must not write to it."""
    num_nodes = len(parents)
    depth, bits = [0] * num_nodes, [1] * num_nodes
    for i in range(1, num_nodes):
        depth[i] = depth[parents[i]] + 1
        bits[i] = bits[parents[i]] | (1 << i)
    # two's complement, so a 64-node tree's top bit fits an int64; (v >> j) & 1 reads bit j either way
    words_N = torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in bits], dtype=torch.long)
    mask_NN = ((words_N[:, None] >> torch.arange(num_nodes)) & 1).bool()
    return tuple(depth), mask_NN


def _padded_mask(mask_NN: torch.Tensor, width: int) -> torch.Tensor:
    """mask_NN in the top-left corner of a [width, width] identity (padding slots see only themselves)."""
    mask_TT = torch.eye(width, dtype=torch.bool)
    mask_TT[:mask_NN.shape[0], :mask_NN.shape[0]] = mask_NN
    return mask_TT
