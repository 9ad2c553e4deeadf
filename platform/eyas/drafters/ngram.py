"""Prompt lookup (n-gram) drafting: copy what followed the last n-gram the last time it appeared.

No training and no target features. One match gives a chain; several earlier matches with different continuations
give a tree (shared prefixes merged), so the verifier can pick whichever continuation the target agrees with.
Candidates are deterministic (sampled=False), so sampling verification stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.decoding.tree import DraftTree, from_paths


@dataclass(frozen=True)
class NgramConfig:
    max_ngram: int = 3      # longest suffix to look up; shorter ones are tried when it has no match
    min_ngram: int = 1
    num_draft: int = 6      # tokens copied per match (tree depth)
    max_matches: int = 4    # most recent distinct continuations kept (tree width); 1 = always a chain

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"min_ngram={self.min_ngram}, max_ngram={self.max_ngram}: need 1 <= min <= max")
        if self.num_draft < 1:
            raise ValueError(f"num_draft={self.num_draft}: must be >= 1")
        if self.max_matches < 1:
            raise ValueError(f"max_matches={self.max_matches}: must be >= 1")


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

    def __init__(self, config: NgramConfig = NgramConfig()) -> None:
        self.config = config
        self.max_draft_nodes = config.num_draft * config.max_matches  # distinct paths, shared prefixes merged

    def begin(self, prompt_ids: list[int], taps: dict[int, torch.Tensor]) -> None:
        pass

    def propose(self, root_token: int, context_ids: list[int], temperature: float,
                generator: torch.Generator | None) -> DraftTree:
        return from_paths(root_token, lookup(context_ids, self.config))

    def commit(self, tokens: list[int], taps: dict[int, torch.Tensor]) -> None:
        pass
