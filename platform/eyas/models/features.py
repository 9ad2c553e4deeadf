"""What the frozen target tells a drafter during training (shared by train/ and drafters/, which never import each
other): hidden-state taps, the target's greedy next tokens and its logits, computed online.

Shape legend: B batch, T tokens, E hidden size, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from eyas.models.decoder import Decoder


@dataclass
class TrainBatch:
    input_ids_BT: torch.Tensor   # prompt + response tokens, right-padded
    loss_mask_BT: torch.Tensor   # 1 where the token is a response token the drafter should learn to predict
    valid_BT: torch.Tensor       # 1 for real tokens, 0 for padding


Index = tuple[torch.Tensor, torch.Tensor]  # (b_R, t_R): R positions of a [B, T] batch (this file adds R)


class TargetFeatures:
    """The frozen target's view of a batch: ``taps`` {tap layer: hidden_BTE} (HF hidden_states numbering,
    num_layers = final-normed), its greedy next token ``argmax_BT`` at every position, and its next-token
    ``logits_BTV``.

    The logits are built on first use only (``logits_from(index)``: the LM head at ``index`` = (b_R, t_R), or at
    every position for None): the LM head over every position is the costliest part of a cached training step
    (smollm2, 4 x 384 positions x 49152: ~1.2 s of a 4.5 s EAGLE-3 step, 1 CPU thread), and only the soft-target
    losses (EAGLE-1, Medusa and EAGLE-3 with ``loss_target: soft``) read them, Medusa at its response positions
    only (``logits_at``); the argmax losses read ``argmax_BT``, which a feature cache stores, and DFlash neither.
    """

    def __init__(self, taps: dict[int, torch.Tensor], logits_BTV: torch.Tensor | None = None, *,
                 argmax_BT: torch.Tensor | None = None,
                 logits_from: Callable[[Index | None], torch.Tensor] | None = None) -> None:
        if logits_BTV is None and logits_from is None:
            raise ValueError("TargetFeatures needs logits_BTV or logits_from")
        if logits_BTV is None and argmax_BT is None:
            raise ValueError("TargetFeatures built lazily (logits_from) needs argmax_BT")
        self.taps = taps
        self._logits_BTV, self._logits_from = logits_BTV, logits_from
        self._argmax_BT = argmax_BT

    @property
    def logits_BTV(self) -> torch.Tensor:
        if self._logits_BTV is None:
            with torch.no_grad():
                self._logits_BTV = self._logits_from(None)
            self._logits_from = None
        return self._logits_BTV

    def logits_at(self, b_R: torch.Tensor, t_R: torch.Tensor) -> torch.Tensor:
        """[R, V]: the logits at positions (b_R[r], t_R[r]) only. A loss over the response tokens reads a fraction
        of a padded batch's positions: built lazily, that is the LM head over those rows alone."""
        if self._logits_BTV is not None:
            return self._logits_BTV[b_R, t_R]
        with torch.no_grad():
            return self._logits_from((b_R, t_R))

    @property
    def argmax_BT(self) -> torch.Tensor:
        if self._argmax_BT is None:
            self._argmax_BT = self._logits_BTV.argmax(-1)
        return self._argmax_BT


@torch.no_grad()
def target_features(target: Decoder, input_ids_BT: torch.Tensor, taps: tuple[int, ...]) -> TargetFeatures:
    """Run the frozen target causally over a right-padded batch (padding never influences real positions)."""
    B, T = input_ids_BT.shape
    cache = target.new_cache(B, T)
    positions_BT = torch.arange(T, device=input_ids_BT.device).expand(B, T)
    logits_BTV, hidden = target(input_ids_BT, positions_BT, cache, taps=taps)
    return TargetFeatures(hidden, logits_BTV)
