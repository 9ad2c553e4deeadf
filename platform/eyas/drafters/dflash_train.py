"""DFlash training: random anchors, the anchor/block attention mask, and the decayed block loss with its metrics.

Shape legend (docs/SHAPES.md): B batch, T tokens, K drafted (predicting) block slots 1..G-1, S = T + Q attended
keys (context positions, then block tokens), E hidden size, V vocab, X the draft vocabulary (V without one); this
file adds A anchors (blocks) per sequence, G block size (the anchor + K slots), Q = A*G block tokens, R = A*K
predicting slots flattened.

All blocks of a batch run in ONE drafter forward. The queries are the Q block tokens; the keys are the T context
positions (fused target features) followed by the Q block tokens. Worked example, T = 6, G = 3, anchors [1, 4]:
  block 0 = [t1, M, M] at positions 1, 2, 3: sees context position 0 and its own 3 slots; labels t2, t3
  block 1 = [t4, M, M] at positions 4, 5, 6: sees context positions 0..3 and its own 3 slots; labels t5 (t6 is
            past the end: masked)
The anchor's own target feature (position a) is NOT visible to its block: at inference the root is the bonus token,
which the target has not run yet, so the drafter has features for positions < a only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eyas.models.features import TargetFeatures, TrainBatch


def draw_anchors(loss_mask_BT: torch.Tensor, valid_BT: torch.Tensor, num_anchors: int,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors per row: up to ``num_anchors`` distinct positions a, uniformly among the response positions
    whose next token is a response token too (a block with at least one label), sorted ascending.

    Returns anchors_BA (long) and anchor_valid_BA (bool) with A = min(num_anchors, most candidates in a row);
    rows with fewer candidates are padded with anchor 0, anchor_valid False. A new draw on every call.
    """
    B, T = loss_mask_BT.shape
    assert valid_BT.shape == (B, T), f"valid_BT {tuple(valid_BT.shape)} != loss_mask_BT {(B, T)}"
    response_BT = loss_mask_BT.bool() & valid_BT.bool()
    candidate_BT = torch.zeros_like(response_BT)
    candidate_BT[:, :-1] = response_BT[:, :-1] & response_BT[:, 1:]
    A = max(1, min(num_anchors, int(candidate_BT.sum(1).max())))
    # a uniform random key per position, non-candidates last: the first A keys are a uniform draw without
    # replacement among the candidates
    keys_BT = torch.rand(B, T, generator=generator, device=loss_mask_BT.device)
    keys_BT = keys_BT.masked_fill(~candidate_BT, 2.0)
    picked_BA = keys_BT.argsort(dim=1)[:, :A]
    anchor_valid_BA = candidate_BT.gather(1, picked_BA)
    anchors_BA = picked_BA.masked_fill(~anchor_valid_BA, T).sort(dim=1).values  # padding sorts last
    anchor_valid_BA = anchors_BA < T
    return anchors_BA.masked_fill(~anchor_valid_BA, 0), anchor_valid_BA


def anchor_block_mask(anchors_BA: torch.Tensor, valid_BT: torch.Tensor, block_size: int) -> torch.Tensor:
    """bool mask_BQS (True = attend) for all blocks of a batch in one forward.

    Query q = a*G + j (slot j of block a) sees context key p < T iff p < anchors[a] and p is a real token, and block
    key T + a'*G + j' iff a' == a (bidirectional inside its own block, never another block). A padding anchor
    (position 0) sees no context, only its own block, so no row is empty.
    """
    B, A = anchors_BA.shape
    T, G = valid_BT.shape[1], block_size
    context_BAT = (torch.arange(T, device=anchors_BA.device) < anchors_BA[..., None]) & valid_BT.bool()[:, None, :]
    context_BQT = context_BAT.repeat_interleave(G, dim=1)
    block_of_Q = torch.arange(A * G, device=anchors_BA.device) // G
    own_block_QQ = block_of_Q[:, None] == block_of_Q[None, :]
    return torch.cat([context_BQT, own_block_QQ.expand(B, A * G, A * G)], dim=-1)


def position_weights(block_size: int, loss_decay: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..G-1: an early miss discards the rest of the block."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / loss_decay)


def block_loss(model, batch: TrainBatch, features: TargetFeatures, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """The DFlash loss: CE of block positions 1..G-1 against the (target-regenerated) tokens t_{a+k}, weighted by
    w_k and masked by the loss mask / validity, averaged over the weights. Metrics: loss, ce (unweighted),
    acc_1..acc_{G-1} (per-position top-1 on the batch), accept_len = sum_k prod_{i<=k} acc_i, num_blocks.

    Cost note: logits are materialised for all A*(G-1) block slots ([B, A, G-1, X]); lower num_anchors for large
    vocabularies, or give the drafter a draft vocabulary.
    """
    anchors_BA, anchor_valid_BA = draw_anchors(batch.loss_mask_BT, batch.valid_BT, model.config.num_anchors,
                                               generator)
    logits_BAKX = block_logits(model, batch.input_ids_BT, batch.valid_BT, features.taps, anchors_BA).float()
    targets = block_targets(model, batch, anchors_BA, anchor_valid_BA)
    loss, ce_BAK = decayed_ce(logits_BAKX, targets, model.config.loss_decay)
    return loss, block_metrics(logits_BAKX.detach(), targets.labels_BAK, targets.mask_BAK,
                               ce_BAK.detach() * targets.in_vocab_BAK, loss.detach(), anchor_valid_BA,
                               targets.in_vocab_BAK)


@dataclass(frozen=True)
class BlockTargets:
    """What the K drafting slots of every block must predict: drafting slot k (DFlash: block slot k+1; DSpark: slot
    k) is scored against the token at a+1+k."""
    label_pos_BAK: torch.Tensor  # a+1+k
    labels_BAK: torch.Tensor     # those tokens as draft-vocabulary indices (-1 outside it)
    mask_BAK: torch.Tensor       # in the sequence, a learnable response token, a real anchor
    in_vocab_BAK: torch.Tensor   # mask_BAK and inside the draft vocabulary: the slots that learn


def block_targets(model, batch: TrainBatch, anchors_BA: torch.Tensor, anchor_valid_BA: torch.Tensor
                  ) -> BlockTargets:
    input_ids_BT = batch.input_ids_BT
    B, T = input_ids_BT.shape
    K = model.num_drafted
    label_pos_BAK = anchors_BA[..., None] + 1 + torch.arange(K, device=input_ids_BT.device)
    in_range_BAK = label_pos_BAK < T
    flat_pos_BR = label_pos_BAK.clamp(max=T - 1).reshape(B, -1)
    labels_BAK = model.t2d[input_ids_BT.gather(1, flat_pos_BR).view_as(label_pos_BAK)]  # -1: outside the vocab
    learnable_BT = batch.loss_mask_BT.bool() & batch.valid_BT.bool()
    mask_BAK = in_range_BAK & anchor_valid_BA[..., None] & learnable_BT.gather(1, flat_pos_BR).view_as(in_range_BAK)
    return BlockTargets(label_pos_BAK, labels_BAK, mask_BAK, mask_BAK & (labels_BAK >= 0))


def decayed_ce(logits_BAKX: torch.Tensor, targets: BlockTargets, loss_decay: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_k w_k CE_k / sum_k w_k over the learning slots, ce_BAK): w_k = exp(-k/gamma) for drafting slot k."""
    ce_BAK = F.cross_entropy(logits_BAKX.flatten(0, 2), targets.labels_BAK.clamp(min=0).flatten(),
                             reduction="none").view_as(targets.mask_BAK)
    K = logits_BAKX.shape[2]
    weight_BAK = position_weights(K + 1, loss_decay).to(ce_BAK.device) * targets.in_vocab_BAK
    return (ce_BAK * weight_BAK).sum() / weight_BAK.sum().clamp(min=1e-6), ce_BAK


def block_logits(model, input_ids_BT: torch.Tensor, valid_BT: torch.Tensor, taps: dict[int, torch.Tensor],
                 anchors_BA: torch.Tensor) -> torch.Tensor:
    """logits_BAKX of block slots k = 1..G-1 for every anchor (over the draft vocabulary: X = V without one), all
    blocks in one forward (anchor_block_mask)."""
    return model.logits(block_states(model, input_ids_BT, valid_BT, taps, anchors_BA)[:, :, 1:])


def block_states(model, input_ids_BT: torch.Tensor, valid_BT: torch.Tensor, taps: dict[int, torch.Tensor],
                 anchors_BA: torch.Tensor) -> torch.Tensor:
    """hidden_BAGE: the final-normed drafter states of every slot of every anchor's block (slot 0 the anchor), all
    blocks in one forward (anchor_block_mask). DFlash reads slots 1..G-1; DSpark reads all G."""
    B, T = input_ids_BT.shape
    A, G, E = anchors_BA.shape[1], model.block_size, model.target_config.hidden_size
    positions_BQ = (anchors_BA[..., None] + torch.arange(G, device=input_ids_BT.device)).reshape(B, A * G)
    features_BTE = model.fuse(taps)
    context_kv = model.context_kv(features_BTE, torch.arange(T, device=input_ids_BT.device).expand(B, T))
    x_BQE = model.embed_block(input_ids_BT.gather(1, anchors_BA)).reshape(B, A * G, E)
    hidden_BQE = model.block_hidden(x_BQE, positions_BQ, context_kv, anchor_block_mask(anchors_BA, valid_BT, G))
    return hidden_BQE.view(B, A, G, E)


@torch.no_grad()
def block_metrics(logits_BAKX: torch.Tensor, labels_BAK: torch.Tensor, mask_BAK: torch.Tensor, ce_BAK: torch.Tensor,
                  loss: torch.Tensor, anchor_valid_BA: torch.Tensor, ce_mask_BAK: torch.Tensor | None = None
                  ) -> dict[str, float]:
    """acc_k over every learned slot (labels outside a draft vocabulary, -1, are misses); ce over ``ce_mask_BAK``
    (default: the learned slots)."""
    ce_mask_BAK = mask_BAK if ce_mask_BAK is None else ce_mask_BAK
    correct_BAK = (logits_BAKX.argmax(-1) == labels_BAK) & mask_BAK
    count_k = mask_BAK.sum((0, 1))
    acc_k = (correct_BAK.sum((0, 1)) / count_k.clamp(min=1)).tolist()
    metrics = {"loss": float(loss), "ce": float((ce_BAK * ce_mask_BAK).sum() / ce_mask_BAK.sum().clamp(min=1)),
               "num_blocks": int(anchor_valid_BA.sum())}
    metrics.update({f"acc_{k}": acc for k, acc in enumerate(acc_k, start=1)})
    metrics["accept_len"] = sum(math.prod(acc_k[:k]) for k in range(1, len(acc_k) + 1))
    return metrics
