"""Tree options for drafters that grow a tree through an ``expand`` callback (EAGLE-1, EAGLE-3, Medusa).

A drafter supplies ``expand(parent_ids, partial) -> probs_PV``, its next-token distribution at each given node of
the partial tree (one batched call); the options below pick which builder of ``eyas.decoding.tree`` uses it:

  chain       the top-1 chain of ``depth`` tokens
  static      a fixed shape of sibling ranks (``shape``; default: EAGLE-1's 26-node tree), one call per depth
  dynamic     EAGLE-2: ``depth`` expand steps over the top_k frontier, then the ``num_nodes`` best nodes by V
  best-first  DDTree: a max-heap on V; the ``num_nodes`` best nodes with rank < top_k and depth <= ``depth``

Every mode yields deterministic top-k candidates (sampled=False), which verification handles exactly at any
temperature, so the trees do not depend on the sampling settings.
"""
from __future__ import annotations

from dataclasses import dataclass

from eyas.config import require
from eyas.decoding.builders import CHAIN, EAGLE_DEFAULT, Expand, build_best_first, build_dynamic, build_static
from eyas.decoding.tree import DraftTree

TREE_MODES = ("chain", "static", "dynamic", "best-first")


@dataclass(frozen=True)
class TreeConfig:
    mode: str = "dynamic"
    depth: int = 5  # chain length; dynamic expand steps; best-first maximum depth
    top_k: int = 4  # children per expanded node (dynamic, best-first)
    num_nodes: int = 24  # drafted-node budget, root excluded (dynamic, best-first)
    shape: tuple[tuple[int, ...], ...] | None = None  # static: sibling-rank tuples; None = EAGLE_DEFAULT

    def __post_init__(self) -> None:
        require(self.mode in TREE_MODES, "tree.mode", self.mode, f"must be one of {list(TREE_MODES)}")
        require(self.depth >= 1, "tree.depth", self.depth, "must be >= 1")
        require(self.top_k >= 1, "tree.top_k", self.top_k, "must be >= 1")
        require(self.num_nodes >= 1, "tree.num_nodes", self.num_nodes, "must be >= 1")
        if self.shape is not None:
            ranks = set(map(tuple, self.shape))
            for r in ranks:
                require(len(r) >= 1 and min(r) >= 0 and (len(r) == 1 or r[:-1] in ranks), "tree.shape", r,
                        "each entry is a non-empty tuple of ranks >= 0 whose every prefix is also in the shape")

    @property
    def static_shape(self) -> tuple[tuple[int, ...], ...]:
        return tuple(map(tuple, self.shape)) if self.shape is not None else EAGLE_DEFAULT

    @property
    def max_depth(self) -> int:
        """The deepest node this configuration can draft."""
        if self.mode == "static":
            return max((len(r) for r in self.static_shape), default=0)
        return self.depth

    @property
    def max_expanded(self) -> int:
        """An upper bound on the nodes (root included) whose drafter state one tree needs."""
        if self.mode == "chain":
            return self.depth
        if self.mode == "static":
            return 1 + len(self.static_shape)
        if self.mode == "dynamic":
            return 1 + (self.depth - 1) * self.top_k
        return 1 + self.num_nodes


def grow_tree(tree: TreeConfig, root_token: int, expand: Expand) -> DraftTree:
    """The DraftTree that ``tree`` asks for, grown from ``root_token`` with the drafter's ``expand``."""
    if tree.mode == "chain":
        return build_static(root_token, CHAIN(tree.depth), expand)
    if tree.mode == "static":
        return build_static(root_token, tree.static_shape, expand)
    if tree.mode == "dynamic":
        return build_dynamic(root_token, expand, tree.depth, tree.top_k, tree.num_nodes)
    return build_best_first(root_token, expand, tree.num_nodes, tree.top_k, tree.depth)
