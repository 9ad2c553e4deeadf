"""The one tree spec: which tree a drafter drafts each cycle, and how it is grown.

A TreeSpec names a mode and only the settings that mode reads; a setting the mode does not read is an error, not
ignored. The modes (papers.md):

  mode        reads                     the tree
  chain       depth                     the top-1 chain of ``depth`` tokens
  static      shape                     a fixed shape of sibling ranks (default: EAGLE-1's 26-node tree)
  dynamic     depth, top_k, num_nodes   EAGLE-2: ``depth`` expand steps over the top_k frontier, then the
                                        ``num_nodes`` best nodes by V
  best-first  depth, top_k, num_nodes   DDTree: a max-heap on V; the ``num_nodes`` best nodes with rank < top_k
                                        and depth <= ``depth``
  block       depth (optional)          DFlash: the chain of one block's first ``depth`` positions (default: all
                                        of them, the checkpoint's block_size - 1)
  ddtree      depth (optional), top_k,  DDTree over a block drafter's per-position distributions (the first
              num_nodes                 ``depth`` of them; default: the whole block)

Drafters with an ``expand`` callback (EAGLE-1, EAGLE-3, Medusa) grow the first four with ``grow_tree``; DFlash
drafts the last two. Every mode yields deterministic top-k candidates (sampled=False) except a sampled DFlash
block, and verification handles both exactly at any temperature.

Size: a tree's drafted nodes are capped once, by ``eyas.decoding.tree.MAX_TREE_NODES`` (root included), and a spec
whose trees could exceed it is refused here (``max_draft_nodes``), before any request runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from eyas.config import ConfigError, require
from eyas.decoding.builders import (CHAIN, EAGLE_DEFAULT, Expand, build_best_first, build_best_first_block,
                                    build_dynamic, build_static)
from eyas.decoding.tree import MAX_TREE_NODES, DraftTree, chain
from eyas.decoding.verify import argmax_rows

# mode -> the settings it reads (the others must stay unset)
MODE_SETTINGS: dict[str, tuple[str, ...]] = {
    "chain": ("depth",),
    "static": ("shape",),
    "dynamic": ("depth", "top_k", "num_nodes"),
    "best-first": ("depth", "top_k", "num_nodes"),
    "block": ("depth",),
    "ddtree": ("depth", "top_k", "num_nodes"),
}
TREE_MODES = tuple(MODE_SETTINGS)
EXPAND_MODES = ("chain", "static", "dynamic", "best-first")  # grown through a drafter's expand callback
BLOCK_MODES = ("block", "ddtree")  # drafted from one block of per-position distributions
DEFAULTS = {"depth": 5, "top_k": 4, "num_nodes": 24}
BLOCK_DEFAULTS = {"depth": None}  # a block drafter's depth defaults to its checkpoint's whole block


@dataclass(frozen=True)
class TreeSpec:
    mode: str = "dynamic"
    depth: int | None = None  # chain length; dynamic expand steps; best-first maximum depth (default 5)
    top_k: int | None = None  # children per expanded node / ranks per block position (default 4)
    num_nodes: int | None = None  # drafted-node budget, root excluded (default 24)
    shape: tuple[tuple[int, ...], ...] | None = None  # static: sibling-rank tuples; None = EAGLE_DEFAULT

    def __post_init__(self) -> None:
        require(self.mode in MODE_SETTINGS, "tree.mode", self.mode, f"must be one of {list(TREE_MODES)}")
        reads = MODE_SETTINGS[self.mode]
        for name in ("depth", "top_k", "num_nodes", "shape"):
            value = getattr(self, name)
            if name not in reads:
                require(value is None, f"tree.{name}", value, f"does not apply to a {self.mode} tree (it reads "
                        f"{list(reads)})")
            elif value is None and name in DEFAULTS:
                default = BLOCK_DEFAULTS.get(name, DEFAULTS[name]) if self.mode in BLOCK_MODES else DEFAULTS[name]
                object.__setattr__(self, name, default)
        for name in ("depth", "top_k", "num_nodes"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"tree.{name}", value, "must be >= 1")
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(map(tuple, self.shape)))
            ranks = set(self.shape)
            for r in ranks:
                require(len(r) >= 1 and min(r) >= 0 and (len(r) == 1 or r[:-1] in ranks), "tree.shape", r,
                        "each entry is a non-empty tuple of ranks >= 0 whose every prefix is also in the shape")
        if self.mode in ("dynamic", "best-first"):
            require(self.top_k <= self.num_nodes, "tree.top_k", self.top_k,
                    f"cannot exceed the node budget tree.num_nodes={self.num_nodes}")
        size = self.max_draft_nodes
        if size is not None:
            require(size < MAX_TREE_NODES, "tree.num_nodes" if self.num_nodes else f"tree.{reads[0]}", size,
                    f"a tree may draft at most {MAX_TREE_NODES - 1} nodes (MAX_TREE_NODES = {MAX_TREE_NODES}, "
                    "root included)")

    @property
    def static_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.shape if self.shape is not None else EAGLE_DEFAULT

    @property
    def max_draft_nodes(self) -> int | None:
        """The most drafted nodes (root excluded) one tree can have; None for a whole block (the checkpoint's
        size)."""
        return _MAX_DRAFT_NODES[self.mode](self)

    @property
    def max_depth(self) -> int | None:
        """The deepest node this spec can draft (None for a whole block: the checkpoint's block size - 1)."""
        return _MAX_DEPTH[self.mode](self)

    @property
    def max_expanded(self) -> int:
        """An upper bound on the nodes (root included) whose drafter state one tree needs (expand modes)."""
        return _MAX_EXPANDED[self.mode](self)

    def require_mode(self, modes: tuple[str, ...], drafter: str) -> None:
        if self.mode not in modes:
            raise ConfigError(f"tree.mode={self.mode!r}: a {drafter} drafter drafts one of {list(modes)}")


_MAX_DRAFT_NODES: dict[str, Callable[[TreeSpec], int | None]] = {
    "chain": lambda spec: spec.depth,
    "static": lambda spec: len(spec.static_shape),
    "dynamic": lambda spec: spec.num_nodes,
    "best-first": lambda spec: spec.num_nodes,
    "block": lambda spec: spec.depth,
    "ddtree": lambda spec: spec.num_nodes,
}
_MAX_DEPTH: dict[str, Callable[[TreeSpec], int | None]] = {
    "chain": lambda spec: spec.depth,
    "static": lambda spec: max((len(r) for r in spec.static_shape), default=0),
    "dynamic": lambda spec: spec.depth,
    "best-first": lambda spec: spec.depth,
    "block": lambda spec: spec.depth,
    "ddtree": lambda spec: spec.depth,
}
_MAX_EXPANDED: dict[str, Callable[[TreeSpec], int]] = {
    "chain": lambda spec: spec.depth,
    "static": lambda spec: 1 + len(spec.static_shape),
    "dynamic": lambda spec: 1 + (spec.depth - 1) * spec.top_k,
    "best-first": lambda spec: 1 + spec.num_nodes,
}
_GROW: dict[str, Callable[[TreeSpec, int, Expand], DraftTree]] = {
    "chain": lambda spec, root, expand: build_static(root, CHAIN(spec.depth), expand),
    "static": lambda spec, root, expand: build_static(root, spec.static_shape, expand),
    "dynamic": lambda spec, root, expand: build_dynamic(root, expand, spec.depth, spec.top_k, spec.num_nodes),
    "best-first": lambda spec, root, expand: build_best_first(root, expand, spec.num_nodes, spec.top_k, spec.depth),
}


def grow_tree(tree: TreeSpec, root_token: int, expand: Expand) -> DraftTree:
    """The DraftTree that ``tree`` asks for, grown from ``root_token`` with the drafter's ``expand``."""
    return _GROW[tree.mode](tree, root_token, expand)


def block_tree(tree: TreeSpec, root_token: int, logits_KX: torch.Tensor, draft_probs: Callable, d2t_X: torch.Tensor,
               temperature: float, generator: torch.Generator | None) -> DraftTree:
    """The tree of a drafter that drafts K positions in one pass (DFlash's block, P-EAGLE's mask slots) from their
    draft-vocabulary logits [K, X]: ``block``, the chain of their argmaxes (or samples at temperature > 0); ``ddtree``,
    a best-first tree over the K distributions. ``draft_probs`` maps logits to target-vocabulary probabilities
    [K, V] and ``d2t_X`` draft indices to target ids."""
    probs_KV = draft_probs(logits_KX / (temperature if temperature > 0 else 1.0))
    if tree.mode == "ddtree":
        return build_best_first_block(root_token, probs_KV, tree.num_nodes, tree.top_k)
    if temperature > 0:
        tokens = torch.multinomial(probs_KV, 1, generator=generator)[:, 0].tolist()
        return chain(root_token, tokens, probs_KV, sampled=True)
    return chain(root_token, d2t_X[argmax_rows(logits_KX)].tolist(), probs_KV)
