"""Prompt lookup (n-gram) drafting: copy what followed the last n-gram the last time it appeared.

No training and no target features. One match gives a chain; several earlier matches with different continuations
give a tree (shared prefixes merged), so the verifier can pick whichever continuation the target agrees with.
With a datastore (``eyas.drafters.datastore``: REST / SuffixDecoding retrieval) the continuations of the same
n-gram in earlier text the target wrote join them. Each node is scored by the share of the candidate paths through
it (the context's matches weigh ``1`` in all, the datastore's ``datastore_weight``: the request's own text predicts
best), and a node budget keeps the highest-scoring nodes: on a CPU a verify of 4 rows costs about one decode step
and 16 rows over two, so the budget, not the number of matches, sets the cost.
Candidates are deterministic (sampled=False), so sampling verification stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.decoding.tree import DraftTree, from_paths
from eyas.drafters.datastore import Datastore


@dataclass(frozen=True)
class NgramConfig:
    max_ngram: int = 3      # longest suffix to look up; shorter ones are tried when it has no match
    min_ngram: int = 1
    num_draft: int = 6      # tokens copied per match (tree depth)
    max_matches: int = 4    # most recent distinct continuations kept (tree width); 1 = always a chain
    num_nodes: int | None = None  # node budget (drafted nodes, root excluded); None: num_draft * max_matches
    datastore_weight: float = 0.25  # the datastore's continuations' weight in all, against the context's 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"min_ngram={self.min_ngram}, max_ngram={self.max_ngram}: need 1 <= min <= max")
        if self.num_draft < 1:
            raise ValueError(f"num_draft={self.num_draft}: must be >= 1")
        if self.max_matches < 1:
            raise ValueError(f"max_matches={self.max_matches}: must be >= 1")
        if self.num_nodes is not None and self.num_nodes < 1:
            raise ValueError(f"num_nodes={self.num_nodes}: must be >= 1")
        if self.datastore_weight < 0:
            raise ValueError(f"datastore_weight={self.datastore_weight}: must be >= 0")

    @property
    def node_budget(self) -> int:
        return self.num_nodes if self.num_nodes is not None else self.num_draft * self.max_matches


def lookup(context: list[int], config: NgramConfig) -> list[list[int]]:
    """Continuations of the longest context suffix seen earlier, most recent first, distinct."""
    num_tokens = len(context)
    for n in range(min(config.max_ngram, num_tokens - 1), config.min_ngram - 1, -1):
        suffix = context[num_tokens - n:]
        found: list[list[int]] = []
        for start in range(num_tokens - n - 1, -1, -1):  # latest match first; the suffix itself is excluded
            if context[start:start + n] == suffix:
                continuation = context[start + n:start + n + config.num_draft]
                if continuation and continuation not in found:
                    found.append(continuation)
                    if len(found) == config.max_matches:
                        break
        if found:
            return found
    return []


class NgramDrafter:
    name = "ngram"
    target_taps: tuple[int, ...] = ()

    def __init__(self, config: NgramConfig = NgramConfig(), datastore: Datastore | None = None) -> None:
        self.config = config
        self.datastore = datastore  # shared read-only by every row's drafter
        self.max_draft_nodes = config.node_budget

    def begin(self, prompt_ids: list[int], taps: dict[int, torch.Tensor]) -> None:
        pass

    def propose(self, root_token: int, context_ids: list[int], temperature: float,
                generator: torch.Generator | None) -> DraftTree:
        paths = lookup(context_ids, self.config)
        weights = [1.0 / len(paths)] * len(paths) if paths else []
        retrieved, counts = (self.datastore.continuations(context_ids, self.config.num_draft) if self.datastore
                             else ([], []))
        if retrieved:
            paths += retrieved
            weights += [self.config.datastore_weight * count / sum(counts) for count in counts]
        return from_paths(root_token, paths, weights, max_drafted=self.config.node_budget)

    def commit(self, tokens: list[int], taps: dict[int, torch.Tensor]) -> None:
        pass
