"""Hybrid drafting: a retrieval proposer (n-gram lookup or the suffix index, and their datastore) and a learned drafter in ONE tree, under one
node budget, verified in one forward (DESIGN.md: proposers compose).

Both proposers draft from the same root; ``merge`` lays their trees over each other by token path, so a token that
both put at the same place (the same path from the root) is one node, drafted by both. Every node gets one value,
an estimate of the probability that the target accepts its whole path:

  learned node     V = the product of draft confidences along its path (EAGLE-2's value, the tree's scores_N)
  retrieval node   share x r_1 x ... x r_d: share = the fraction of the retrieved continuations through the node
                   (the retrieval tree's scores: n-gram match counts, the datastore's weighted; the suffix
                   index's share of occurrences), r_j = the estimated
                   chance that the proposer's candidates at depth j hold the target's token once depth j - 1 was
                   accepted, the mean of a Beta(RETRIEVAL_PRIOR) per depth updated with this request's own verdicts
  a shared node    the larger of its two values

A learned drafter costs a pass (or several) every cycle it drafts, and where the retrieval tree already holds the
target's next token with high estimated chance it adds little: with ``learned_below`` set, a cycle runs the learned
drafter only when the retrieval tree's depth-1 value (the estimated chance that one of its depth-1 candidates is
the target's token: the sum of their values) is below it. The learned drafter then only queues the committed
states (base.py: commits without a propose between them) and catches up in its next drafting pass.

A value estimates the chance that the target accepts the node's path, so the kept nodes' values sum to the tokens a
cycle is expected to accept, beyond the target's own one. With ``verify_costs`` (t(N), seconds of a verify forward
over N new tokens, measured on this machine when the method is built: spec.cost_cut), a cycle keeps the best n
nodes for the n that maximises (1 + their values' sum) / (t(n + 1) + this cycle's drafting time): a weak match
costs a verify of a few nodes, not of the whole budget, where extra nodes make the forward compute-bound.

A value is clipped to its parent's, so values never grow along a path and the ``num_nodes`` best nodes (ties: the
shallower, then the earlier) always include their ancestors: the kept nodes form a tree.

Lossless: the merged tree is deterministic (sampled=False, distinct siblings, no draft distributions). Verification
then accepts a candidate x with probability p(x) and removes it from p on a rejection (verify.py), which is exact for
ANY candidates chosen without the verifier's randomness; so a learned part that sampled its chain at temperature > 0
(draft-lm, DFlash) joins as deterministic candidates and its q is not needed. (Choosing among sampled candidates by
value would bias the p/q rule, which this tree never uses.)

Shape legend (docs/SHAPES.md): N tree nodes, root included.
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import torch

from eyas.decoding.costs import cost_at
from eyas.decoding.tree import DraftTree, prune

# Beta(alpha, beta) prior of r_d at every depth: mean 0.6, worth 4 verdicts. n-gram acceptance at depth 1 given a
# match measured 0.6+ on the default target (issue 48); a request's own verdicts outweigh it after a few cycles.
RETRIEVAL_PRIOR = (2.4, 1.6)


def merge(parts: Sequence[tuple[str, DraftTree, Sequence[float]]], max_drafted: int) -> DraftTree:
    """One deterministic tree of the ``max_drafted`` best nodes of ``parts`` = (proposer, tree, value per node),
    trees with the same root; ``drafted_by`` names each node's proposers. Nodes in increasing depth, then value."""
    root = parts[0][1].tokens_list[0]
    node_of: dict[tuple[int, ...], int] = {(): 0}
    tokens, parents, values, drafted_by = [root], [-1], [1.0], [[]]
    for name, tree, tree_values in parts:
        assert tree.tokens_list[0] == root and len(tree_values) == tree.num_nodes, "trees of one root"
        path_of: list[tuple[int, ...]] = [()]
        for i in range(1, tree.num_nodes):
            path = path_of[tree.parents_list[i]] + (tree.tokens_list[i],)
            path_of.append(path)
            j = node_of.get(path)
            if j is None:  # a new node (a sampled part's repeated siblings fall together here)
                j = node_of[path] = len(tokens)
                tokens.append(path[-1])
                parents.append(node_of[path[:-1]])
                values.append(float(tree_values[i]))
                drafted_by.append([])
            values[j] = max(values[j], float(tree_values[i]))
            if name not in drafted_by[j]:
                drafted_by[j].append(name)
    depth = [0] * len(tokens)
    for j in range(1, len(tokens)):  # parents come first
        values[j] = min(values[j], values[parents[j]])
        depth[j] = depth[parents[j]] + 1
    best = sorted(range(1, len(tokens)), key=lambda j: (-values[j], depth[j], j))[:max(max_drafted, 0)]
    keep = [0] + sorted(best, key=lambda j: (depth[j], -values[j], j))
    new_id = {old: new for new, old in enumerate(keep)}
    assert all(parents[j] in new_id for j in keep[1:]), "the best nodes by a non-increasing value form a tree"
    return DraftTree(torch.tensor([tokens[j] for j in keep], dtype=torch.long),
                     torch.tensor([-1] + [new_id[parents[j]] for j in keep[1:]], dtype=torch.long),
                     torch.tensor([values[j] for j in keep], dtype=torch.float32),
                     drafted_by=tuple(tuple(drafted_by[j]) for j in keep))


def cut_by_cost(tree: DraftTree, verify_costs: Mapping[int, float], draft_s: float) -> DraftTree:
    """``tree`` (a merged tree: scores are the values, non-increasing along paths) cut to its best n nodes for the n
    with the most expected tokens per second, (1 + the n values' sum) / (t(n + 1) + ``draft_s``)."""
    values = tree.scores_N.tolist()
    order = sorted(range(1, tree.num_nodes), key=lambda j: (-values[j], j))  # prune's order
    best_n, best_rate, expected = 0, 1.0 / (cost_at(verify_costs, 1) + draft_s), 1.0
    for n, j in enumerate(order, start=1):
        expected += values[j]
        rate = expected / (cost_at(verify_costs, n + 1) + draft_s)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return prune(tree, best_n)


class RetrievalEstimate:
    """r_d per depth d: the Beta posterior mean of "the retrieval candidates at depth d hold the target's token,
    given depth d - 1 was accepted", from RETRIEVAL_PRIOR and one request's verdicts."""

    def __init__(self, prior: tuple[float, float] = RETRIEVAL_PRIOR) -> None:
        self.prior = prior
        self.hits: list[int] = []
        self.misses: list[int] = []

    def record(self, depth: int, hit: bool) -> None:
        while len(self.hits) < depth:
            self.hits.append(0)
            self.misses.append(0)
        (self.hits if hit else self.misses)[depth - 1] += 1

    def rate(self, depth: int) -> float:
        hits = self.hits[depth - 1] if depth <= len(self.hits) else 0
        misses = self.misses[depth - 1] if depth <= len(self.misses) else 0
        alpha, beta = self.prior
        return (alpha + hits) / (alpha + beta + hits + misses)

    def values(self, tree: DraftTree) -> list[float]:
        """share x r_1 x ... x r_d for every node of a retrieval tree (root: 1)."""
        scores, parents = tree.scores_N.tolist(), tree.parents_list
        total = scores[0] if scores[0] > 0 else 1.0
        reach = [1.0] * tree.num_nodes  # r_1 x ... x r_d
        values = [1.0] * tree.num_nodes
        for i in range(1, tree.num_nodes):
            depth = int(tree.depth_N[i])
            reach[i] = reach[parents[i]] * self.rate(depth)
            values[i] = reach[i] * min(scores[i] / total, 1.0)
        return values


class HybridDrafter:
    """Drafter protocol (base.py) over one retrieval proposer and one learned drafter, each with its own state;
    ``begin`` and ``commit`` reach both. The next ``propose`` scores the last tree's retrieval candidates against
    what the target chose: the committed tokens, then the new root (the last cycle's bonus: the target's token
    after the accepted path). It reads the tree it proposed: a node the engine's load-adaptive prune dropped can
    count as judged too (only under batch load; the estimate ranks, verification stays exact)."""

    name = "hybrid"

    def __init__(self, retrieval: Any, learned: Any, num_nodes: int | None = None,
                 prior: tuple[float, float] = RETRIEVAL_PRIOR, learned_below: float | None = None,
                 verify_costs: Mapping[int, float] | None = None) -> None:
        self.retrieval, self.learned = retrieval, learned
        self.prior = prior  # the Beta prior of the retrieval estimate (spec.retrieval_prior)
        self.learned_below = learned_below  # spec.learned_below: None, the learned drafter drafts every cycle
        self.cycles = self.learned_cycles = 0  # this request's cycles, and those the learned drafter drafted in
        self.verify_costs = verify_costs  # t(N) in seconds (spec.cost_cut); None: every cycle keeps the budget
        self.max_draft_nodes = min(num_nodes or learned.max_draft_nodes,
                                   retrieval.max_draft_nodes + learned.max_draft_nodes)
        self.target_taps = tuple(dict.fromkeys((*retrieval.target_taps, *learned.target_taps)))
        self.estimate = RetrievalEstimate(prior)
        self._last: DraftTree | None = None  # the last tree proposed, until its verdict is read
        self._committed: list[int] = []  # tokens committed since it, root included

    def begin(self, prompt_ids: list[int], taps: dict[int, torch.Tensor]) -> None:
        self.estimate = RetrievalEstimate(self.prior)  # learned per request
        self._last, self._committed = None, []
        self.cycles = self.learned_cycles = 0
        self.retrieval.begin(prompt_ids, taps)
        self.learned.begin(prompt_ids, taps)

    def propose(self, root_token: int, context_ids: list[int], temperature: float,
                generator: torch.Generator | None) -> DraftTree:
        if self._last is not None and self._committed[:1] == self._last.tokens_list[:1]:
            self._learn(self._last, self._committed[1:] + [root_token])
        self._committed = []
        start = time.perf_counter()
        retrieved = self.retrieval.propose(root_token, context_ids, temperature, generator)
        parts = [(self.retrieval.name, retrieved, self.estimate.values(retrieved))]
        self.cycles += 1
        if self.learned_pays(retrieved, parts[0][2]):
            self.learned_cycles += 1
            drafted = self.learned.propose(root_token, context_ids, temperature, generator)
            parts.append((self.learned.name, drafted, drafted.scores_N.tolist()))
        self._last = merge(parts, self.max_draft_nodes)
        if self.verify_costs is not None:
            self._last = cut_by_cost(self._last, self.verify_costs, time.perf_counter() - start)
        return self._last

    def learned_pays(self, retrieved: DraftTree, values: Sequence[float]) -> bool:
        """Whether this cycle runs the learned drafter: always without ``learned_below``, else when the retrieval
        tree's depth-1 value is below it."""
        if self.learned_below is None:
            return True
        depth_one = sum(values[i] for i in range(1, retrieved.num_nodes) if retrieved.parents_list[i] == 0)
        return depth_one < self.learned_below

    def commit(self, tokens: list[int], taps: dict[int, torch.Tensor]) -> None:
        self._committed += tokens
        self.retrieval.commit(tokens, taps)
        self.learned.commit(tokens, taps)

    def _learn(self, tree: DraftTree, chosen: list[int]) -> None:
        """Walk the target's tokens after the root down the tree: at each depth whose parent was accepted and that
        holds retrieval candidates, a hit if the target's token is one of them; the walk ends at the first miss."""
        node = 0
        for depth, token in enumerate(chosen, start=1):
            children = tree.children(node)
            match = next((c for c in children if tree.tokens_list[c] == token), None)
            if any(self.retrieval.name in tree.drafted_by[c] for c in children):
                self.estimate.record(depth, match is not None and self.retrieval.name in tree.drafted_by[match])
            if match is None:
                return
            node = match
