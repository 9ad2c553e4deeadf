"""A reduced draft vocabulary: the X most frequent target tokens of the training data, read through X rows of an LM
head instead of all V (EAGLE-3's draft vocabulary; EAGLE-1, Medusa and DFlash may have one too). A drafter that has
one proposes only those tokens; verification is unchanged, so output stays lossless.

Shape legend (docs/SHAPES.md): V the target vocabulary, X the draft vocabulary.

  d2t_X  draft index -> target token id (ascending ids; saved in the checkpoint's config.json as ``draft_vocab``)
  t2d_V  target token id -> draft index, -1 outside the draft vocabulary
"""
from __future__ import annotations

from typing import Sequence

import torch

from eyas.models.packing import frozen_head


def build_draft_vocab(token_counts_V: torch.Tensor, size: int) -> torch.Tensor:
    """d2t: the ``size`` most frequent token ids (ties: lower id first), as a long tensor in ascending id order.

    token_counts_V: counts per target token id, e.g. ``torch.bincount(ids[loss_mask > 0], minlength=V)``."""
    if token_counts_V.dim() != 1:
        raise ValueError(f"token_counts must be 1-D over the target vocabulary, got {tuple(token_counts_V.shape)}")
    if not 1 <= size <= token_counts_V.numel():
        raise ValueError(f"draft_vocab_size={size}: must be in [1, {token_counts_V.numel()}] (the target vocab)")
    order_V = torch.sort(-token_counts_V.double(), stable=True).indices  # descending count, lower id on ties
    return order_V[:size].sort().values.long()


def vocab_maps(draft_vocab: Sequence[int] | torch.Tensor | None, size: int | None,
               vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t_X, t2d_V) for a drafter's ``draft_vocab`` (None: the whole target vocabulary, X = V) checked against
    its config's ``draft_vocab_size`` (None: whatever the list holds)."""
    if draft_vocab is None:
        if size not in (None, vocab_size):
            raise ValueError(f"draft_vocab_size={size} needs a draft vocabulary: build it "
                             f"with build_draft_vocab(token_counts, {size})")
        d2t_X = torch.arange(vocab_size)
    else:
        d2t_X = torch.as_tensor(draft_vocab, dtype=torch.long).cpu()
        if d2t_X.dim() != 1 or d2t_X.numel() == 0 or d2t_X.unique().numel() != d2t_X.numel():
            raise ValueError("draft_vocab must be a non-empty list of distinct target token ids")
        if int(d2t_X.min()) < 0 or int(d2t_X.max()) >= vocab_size:
            raise ValueError(f"draft_vocab holds ids outside the target vocabulary [0, {vocab_size})")
        if size is not None and d2t_X.numel() != size:
            raise ValueError(f"draft_vocab has {d2t_X.numel()} ids but draft_vocab_size={size}")
    t2d_V = torch.full((vocab_size,), -1, dtype=torch.long)
    t2d_V[d2t_X] = torch.arange(d2t_X.numel())
    return d2t_X, t2d_V


def to_target_probs(logits_X: torch.Tensor, d2t_X: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary logits [..., X] -> probabilities over the target vocabulary [..., V] (0 outside)."""
    probs = logits_X.float().softmax(-1)
    full = probs.new_zeros(*probs.shape[:-1], vocab_size)
    full[..., d2t_X] = probs
    return full


class FrozenReadout:
    """For drafters that read tokens through the target's frozen LM head (EAGLE-1, Medusa, DFlash; mixed in before
    ``nn.Module``): ``init_readout`` once in ``__init__``, then ``readout(hidden)`` gives logits over the draft
    vocabulary and ``draft_probs`` maps them onto the target's.

    Without a draft vocabulary the readout is the target's own head, shared, neither trained nor saved. With one
    it is those X rows of it as ``vocab_head``: frozen, saved with the checkpoint (packed for inference like the
    drafter's other linears), and listed in ``TARGET_DERIVED``, so a checkpoint saved without a draft vocabulary
    can warm-start a drafter with one (``registry.load_model``)."""

    TARGET_DERIVED = ("vocab_head.weight",)  # copied from the target at construction; a checkpoint may lack them

    def init_readout(self, target_head: torch.nn.Linear, draft_vocab: Sequence[int] | None,
                     size: int | None) -> None:
        d2t_X, t2d_V = vocab_maps(draft_vocab, size, target_head.weight.shape[0])
        self.draft_vocab = None if draft_vocab is None else d2t_X.tolist()
        self.register_buffer("d2t", d2t_X, persistent=False)  # draft index -> target id (saved in config.json)
        self.register_buffer("t2d", t2d_V, persistent=False)  # target id -> draft index, -1 outside
        self.target_head = (target_head,)  # in a tuple: shared and frozen, not registered, not saved
        if draft_vocab is not None:
            self.vocab_head = torch.nn.Linear(target_head.in_features, d2t_X.numel(), bias=False)
            self.vocab_head.requires_grad_(False)
            with torch.no_grad():
                self.vocab_head.weight.copy_(target_head.weight[d2t_X.to(target_head.weight.device)])

    def readout(self, hidden_E: torch.Tensor) -> torch.Tensor:
        """[..., E] -> [..., X]: gradients reach the input, never the weight."""
        return frozen_head(self.vocab_head if self.draft_vocab is not None else self.target_head[0], hidden_E)

    def draft_probs(self, logits_X: torch.Tensor) -> torch.Tensor:
        """[..., X] -> probabilities over the target vocabulary [..., V] (0 outside the draft vocabulary)."""
        if self.draft_vocab is None:
            return logits_X.float().softmax(-1)
        return to_target_probs(logits_X, self.d2t, self.target_head[0].weight.shape[0])
