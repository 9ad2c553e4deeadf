"""What the frozen target tells a drafter during training (shared by train/ and drafters/, which never import each
other): hidden-state taps and logits, computed online.

Shape legend: B batch, T tokens, E hidden size, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.models.decoder import Decoder


@dataclass
class TrainBatch:
    input_ids_BT: torch.Tensor   # prompt + response tokens, right-padded
    loss_mask_BT: torch.Tensor   # 1 where the token is a response token the drafter should learn to predict
    valid_BT: torch.Tensor       # 1 for real tokens, 0 for padding


@dataclass
class TargetFeatures:
    taps: dict[int, torch.Tensor]  # {tap layer: hidden_BTE}, HF hidden_states numbering (num_layers = final-normed)
    logits_BTV: torch.Tensor       # the target's next-token logits at every position


@torch.no_grad()
def target_features(target: Decoder, input_ids_BT: torch.Tensor, taps: tuple[int, ...]) -> TargetFeatures:
    """Run the frozen target causally over a right-padded batch (padding never influences real positions)."""
    B, T = input_ids_BT.shape
    cache = target.new_cache(B, T)
    positions_BT = torch.arange(T, device=input_ids_BT.device).expand(B, T)
    logits_BTV, hidden = target(input_ids_BT, positions_BT, cache, taps=taps)
    return TargetFeatures(taps=hidden, logits_BTV=logits_BTV)
