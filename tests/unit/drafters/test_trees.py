"""TreeSpec: per-mode settings, defaults, the one size cap, the bounds drafters size their state by, and grow_tree
dispatching to the builders."""
from __future__ import annotations

import pytest
import torch

from eyas.config import ConfigError
from eyas.decoding.builders import CHAIN, EAGLE_DEFAULT, build_best_first, build_dynamic, build_static
from eyas.decoding.tree import MAX_TREE_NODES
from eyas.drafters.trees import MODE_SETTINGS, TREE_MODES, TreeSpec, grow_tree


def test_defaults_fill_only_what_a_mode_reads():
    assert TreeSpec() == TreeSpec("dynamic", depth=5, top_k=4, num_nodes=24)
    assert TreeSpec("chain") == TreeSpec("chain", depth=5) and TreeSpec("chain").top_k is None
    assert TreeSpec("static").shape is None and TreeSpec("static").static_shape == EAGLE_DEFAULT
    assert TreeSpec("block") == TreeSpec("block", None, None, None, None)
    assert TreeSpec("ddtree").depth is None and TreeSpec("ddtree").num_nodes == 24
    assert TreeSpec("static", shape=[[0], [0, 0]]).shape == ((0,), (0, 0))  # YAML lists become tuples
    assert set(TREE_MODES) == set(MODE_SETTINGS)


@pytest.mark.parametrize("spec, size, depth, expanded", [
    (TreeSpec("chain", depth=3), 3, 3, 3),
    (TreeSpec("static"), 25, 5, 26),
    (TreeSpec("static", shape=((0,), (1,), (0, 0))), 3, 2, 4),
    (TreeSpec("dynamic", depth=4, top_k=3, num_nodes=12), 12, 4, 10),
    (TreeSpec("best-first", depth=6, top_k=2, num_nodes=9), 9, 6, 10),
    (TreeSpec("ddtree", top_k=3, num_nodes=7), 7, None, None),
    (TreeSpec("block"), None, None, None),
    (TreeSpec("block", depth=3), 3, 3, None),
    (TreeSpec("ddtree", depth=2, num_nodes=5), 5, 2, None),
])
def test_bounds(spec, size, depth, expanded):
    assert spec.max_draft_nodes == size and spec.max_depth == depth
    if expanded is not None:
        assert spec.max_expanded == expanded


@pytest.mark.parametrize("options, message", [
    ({"mode": "wide"}, "tree.mode='wide': must be one of"),
    ({"mode": "static", "depth": 3}, r"tree.depth=3: does not apply to a static tree \(it reads \['shape'\]\)"),
    ({"mode": "chain", "num_nodes": 3}, "tree.num_nodes=3: does not apply to a chain tree"),
    ({"mode": "block", "top_k": 3}, r"tree.top_k=3: does not apply to a block tree \(it reads \['depth'\]\)"),
    ({"mode": "ddtree", "shape": ((0,),)}, "tree.shape=.*does not apply to a ddtree tree"),
    ({"mode": "dynamic", "depth": 0}, "tree.depth=0: must be >= 1"),
    ({"mode": "dynamic", "top_k": 5, "num_nodes": 4}, "tree.top_k=5: cannot exceed the node budget"),
    ({"mode": "dynamic", "num_nodes": MAX_TREE_NODES}, "tree.num_nodes=64: a tree may draft at most 63 nodes"),
    ({"mode": "ddtree", "num_nodes": 100}, "tree.num_nodes=100: a tree may draft at most 63"),
    ({"mode": "chain", "depth": 70}, "tree.depth=70: a tree may draft at most 63"),
    ({"mode": "static", "shape": ((0,), (1, 0))}, "tree.shape=.*every prefix is also in the shape"),
])
def test_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        TreeSpec(**options)


def test_require_mode():
    TreeSpec("chain").require_mode(("chain", "static"), "EAGLE")
    with pytest.raises(ConfigError, match=r"tree.mode='block': a EAGLE drafter drafts one of \['chain'\]"):
        TreeSpec("block").require_mode(("chain",), "EAGLE")


def fixed_expand(parent_ids, partial):
    """A drafter whose next-token distribution depends only on the depth: deterministic, distinct top-k."""
    probs_PV = torch.zeros(len(parent_ids), 16)
    for row, parent in enumerate(parent_ids):
        d = partial.depth[parent]
        probs_PV[row] = torch.softmax(torch.arange(16, dtype=torch.float32).roll(d) / 3, dim=0)
    return probs_PV


@pytest.mark.parametrize("spec, build", [
    (TreeSpec("chain", depth=4), lambda r: build_static(r, CHAIN(4), fixed_expand)),
    (TreeSpec("static"), lambda r: build_static(r, EAGLE_DEFAULT, fixed_expand)),
    (TreeSpec("dynamic", depth=3, top_k=2, num_nodes=5), lambda r: build_dynamic(r, fixed_expand, 3, 2, 5)),
    (TreeSpec("best-first", depth=4, top_k=3, num_nodes=6), lambda r: build_best_first(r, fixed_expand, 6, 3, 4)),
])
def test_grow_tree_is_the_modes_builder(spec, build):
    grown, direct = grow_tree(spec, 7, fixed_expand), build(7)
    assert grown.tokens_list == direct.tokens_list and grown.parents_list == direct.parents_list
    assert grown.num_nodes - 1 <= spec.max_draft_nodes
