"""What every drafter provides to the speculative loop (DESIGN.md: the Drafter contract).

A drafter never calls the target. The loop hands it the target's hidden states ("taps", Hugging Face
``hidden_states`` numbering) for the tokens that entered the target's KV cache, and asks it for a DraftTree.

Its state is a function of those tokens and taps alone, however they are split into calls: ``commit(a + b, taps
of a then b)`` is ``commit(a, ...)`` then ``commit(b, ...)``, and ``begin(p + a, ...)`` is ``begin(p, ...)`` then
``commit(a, ...)``. The engine relies on it: a drafter that sits out cycles (a speculation budget of 0) gets all
their tokens in one call, right before it next proposes (decoding/engine.py).

Shape legend (docs/SHAPES.md): T tokens (the prompt's, or those committed in one cycle), E target hidden size.
"""
from __future__ import annotations

from typing import Protocol

import torch

from eyas.decoding.tree import DraftTree


class Drafter(Protocol):
    name: str
    target_taps: tuple[int, ...]  # target hidden states this drafter reads; () for drafters that need none
    max_draft_nodes: int  # the most drafted nodes (root excluded) one of its trees can have (the engine checks it)

    def begin(self, prompt_ids: list[int], taps: dict[int, torch.Tensor]) -> None:
        """Start a sequence. taps[l] is [T, E]: the target's state after each prompt token."""

    def propose(self, root_token: int, context_ids: list[int], temperature: float,
                generator: torch.Generator | None) -> DraftTree:
        """Draft a tree rooted at ``root_token`` (the last emitted token, not yet in the target's cache).

        context_ids: every token emitted so far, prompt included, ending with root_token. With temperature > 0
        a drafter that samples sets ``sampled=True`` and ``draft_probs_NV`` on the tree.
        """

    def commit(self, tokens: list[int], taps: dict[int, torch.Tensor]) -> None:
        """Tokens entered the target's cache (a cycle's root and accepted drafted tokens, or several cycles'
        in order); taps[l] is [T, E] for them. Called only before a propose, never twice in a row by the engine."""
