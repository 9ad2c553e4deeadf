"""DSpark (arXiv 2607.05147): a DFlash backbone whose block slots all draft, with a Markov head that makes each slot
depend on the token drafted before it, and a confidence head that sets the verification length.

Shape legend (docs/SHAPES.md; dflash.py adds A anchors, G block size, Q block tokens): B batch, T tokens, E hidden
size, V vocab, X the draft vocabulary (V without one), K drafted tokens; this file adds r the Markov rank.

Against DFlash (papers.md, DSpark):
  sample_from_anchor  slot k = 0..G-1 of the block [anchor, MASK x (G-1)] predicts the token at anchor + k + 1, so a
                      block of G drafts G tokens (DFlash: G-1, slot 0 unused); loss weight exp(-k/gamma), gamma 4.
  Markov head         logits_k = backbone_logits_k + markov_w2(markov_w1(prev_k)), markov_w1 = Embedding(V, r),
                      markov_w2 = Linear(r -> X, no bias); prev_0 is the anchor, prev_k the token of slot k-1 (the
                      gold token in training, the drafted one at inference). Variant ``vanilla``.
  confidence head     conf_k = sigmoid(proj([h_k ; markov_w1(prev_k)])), proj = Linear(E + r -> 1), trained with
                      alpha * BCE(conf_k, 1 - TV(q_k, p_k)): 1 - TV = sum_x min(p, q) is the probability that slot k is
                      accepted by rejection sampling given the slots before it were (label detached).
Inference: ONE backbone pass over the block, then a sequential walk over the slots that adds the Markov bias of the
token just drafted, draws the next one (argmax at T = 0, a sample of q_k = softmax(logits_k / T) above) and keeps q_k
as that node's draft distribution, so the p/q verification stays exact. The chain ends where the product of the
confidences so far falls below ``verify_threshold`` (0: the whole block), its scores are those products.
The Markov and confidence heads are the only weights DSpark adds; checkpoints save them next to DFlash's as
``markov_head.markov_w{1,2}.weight`` and ``confidence_head.proj.{weight,bias}`` (the names of the engines' DSpark).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eyas.config import require
from eyas.drafters.dflash import DFlashConfig, DFlashDrafter, DFlashModel
from eyas.drafters.dflash_train import block_metrics, block_states, block_targets, decayed_ce, draw_anchors
from eyas.drafters.trees import TreeSpec
from eyas.decoding.tree import DraftTree, chain
from eyas.models.decoder import Decoder
from eyas.models.features import TargetFeatures, TrainBatch
from eyas.models.packing import linear

DRAFTER_TYPE = "dspark"
MARKOV_HEAD_TYPES = ("vanilla",)


@dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    """DFlash's fields (dflash.DFlashConfig) with DSpark's defaults (B = 8, gamma 4) and the two heads'."""
    block_size: int = 8                  # G: all G slots draft (sample_from_anchor)
    loss_decay: float = 4.0              # w_k = exp(-k/gamma), k = 0..G-1
    markov_rank: int = 256               # r: width of the Markov embedding (markov_w1) and its readout
    markov_head_type: str = "vanilla"    # how the previous token biases the logits: vanilla = w2(w1(prev))
    confidence_loss_alpha: float = 1.0  # alpha of the confidence BCE; 0 trains the head not at all
    verify_threshold: float = 0.0        # cut the chain where the confidence product drops below it; 0: whole block

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.markov_rank >= 1, "dspark.markov_rank", self.markov_rank, "must be >= 1")
        require(self.markov_head_type in MARKOV_HEAD_TYPES, "dspark.markov_head_type", self.markov_head_type,
                f"must be one of {list(MARKOV_HEAD_TYPES)}")
        require(self.confidence_loss_alpha >= 0, "dspark.confidence_loss_alpha", self.confidence_loss_alpha,
                "must be >= 0")
        require(0.0 <= self.verify_threshold < 1.0, "dspark.verify_threshold", self.verify_threshold,
                "must be in [0, 1): the confidence product below which the drafted chain ends (0: never)")


class MarkovHead(nn.Module):
    """bias_X = markov_w2(markov_w1(prev)): a rank-r bigram correction from the previous token to the next."""

    def __init__(self, vocab_size: int, rank: int, num_outputs: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # a small bias at the start, as speculators' DSpark
        self.markov_w2 = nn.Linear(rank, num_outputs, bias=False)

    def forward(self, embedded_r: torch.Tensor) -> torch.Tensor:
        return linear(self.markov_w2, embedded_r)


class ConfidenceHead(nn.Module):
    """The logit of the probability that a slot is accepted, from its state and its predecessor's embedding."""

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def forward(self, hidden_E: torch.Tensor, embedded_r: torch.Tensor) -> torch.Tensor:
        return linear(self.proj, torch.cat([hidden_E, embedded_r.to(hidden_E.dtype)], dim=-1))[..., 0]


class DSparkModel(DFlashModel):
    """DFlash's backbone (its layers, context fusion, mask and frozen readout) plus the Markov and confidence heads."""

    drafter_type = DRAFTER_TYPE

    def __init__(self, config: DSparkConfig, target: Decoder, draft_vocab: list[int] | None = None) -> None:
        super().__init__(config, target, draft_vocab)
        X = int(self.d2t.numel())
        self.markov_head = MarkovHead(target.config.vocab_size, config.markov_rank, X)
        self.confidence_head = ConfidenceHead(target.config.hidden_size, config.markov_rank)
        self.markov_head.to(device=target.device, dtype=target.dtype)
        self.confidence_head.to(device=target.device, dtype=target.dtype)

    @property
    def num_drafted(self) -> int:
        return self.config.block_size  # sample_from_anchor: slot 0 drafts too

    def forward(self, batch, features, generator: torch.Generator | None = None):
        if generator is None and not self.training:
            generator = torch.Generator(device=self.inv_freq.device).manual_seed(0)
        return dspark_loss(self, batch, features, generator)


def dspark_loss(model: DSparkModel, batch: TrainBatch, features: TargetFeatures,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Decayed CE of the Markov-corrected logits of slots k = 0..G-1 against the tokens at a+k+1 (teacher-forced
    predecessors), plus alpha * BCE(conf_k, 1 - TV(q_k, p_k)). Metrics: DFlash's (acc_1..acc_G: depth k+1 is slot
    k) plus ``conf_bce`` and ``conf_error`` (mean |conf - (1 - TV)|)."""
    config = model.config
    anchors_BA, anchor_valid_BA = draw_anchors(batch.loss_mask_BT, batch.valid_BT, config.num_anchors, generator)
    hidden_BAGE = block_states(model, batch.input_ids_BT, batch.valid_BT, features.taps, anchors_BA)
    targets = block_targets(model, batch, anchors_BA, anchor_valid_BA)  # slot k: the token at a+1+k
    prev_pos_BAG = targets.label_pos_BAK - 1  # its predecessor: the anchor, then the gold tokens (teacher forcing)
    T = batch.input_ids_BT.shape[1]
    prev_ids_BAG = batch.input_ids_BT.gather(1, prev_pos_BAG.clamp(max=T - 1).flatten(1)).view_as(prev_pos_BAG)
    embedded_BAGr = model.markov_head.markov_w1(prev_ids_BAG)
    logits_BAGX = (model.logits(hidden_BAGE) + model.markov_head(embedded_BAGr.to(hidden_BAGE.dtype))).float()
    ce_loss, ce_BAG = decayed_ce(logits_BAGX, targets, config.loss_decay)
    mask_BAG = targets.mask_BAK

    conf_logit_BAG = model.confidence_head(hidden_BAGE, embedded_BAGr).float()
    b_R, a_R, k_R = mask_BAG.nonzero(as_tuple=True)
    accept_R = acceptance_label(model, logits_BAGX[b_R, a_R, k_R].detach(),
                                features.logits_at(b_R, prev_pos_BAG[b_R, a_R, k_R]))
    conf_logit_R = conf_logit_BAG[b_R, a_R, k_R]
    conf_bce = (F.binary_cross_entropy_with_logits(conf_logit_R, accept_R) if len(b_R)
                else conf_logit_BAG.sum() * 0.0)
    loss = ce_loss + config.confidence_loss_alpha * conf_bce
    metrics = block_metrics(logits_BAGX.detach(), targets.labels_BAK, mask_BAG, ce_BAG.detach() * targets.in_vocab_BAK,
                            loss.detach(), anchor_valid_BA, targets.in_vocab_BAK)
    metrics["conf_bce"] = float(conf_bce.detach())
    metrics["conf_error"] = float((conf_logit_R.detach().sigmoid() - accept_R).abs().mean()) if len(b_R) else 0.0
    return loss, metrics


@torch.no_grad()
def acceptance_label(model: DSparkModel, draft_logits_RX: torch.Tensor, target_logits_RV: torch.Tensor
                     ) -> torch.Tensor:
    """[R]: 1 - TV(q, p) = sum_x min(q(x), p(x)), the chance rejection sampling accepts a token drawn from q."""
    draft_RV = model.draft_probs(draft_logits_RX)
    target_RV = target_logits_RV.float().softmax(-1)
    return torch.minimum(draft_RV, target_RV).sum(-1).clamp(0.0, 1.0)


class DSparkDrafter(DFlashDrafter):
    """One backbone pass, then the Markov walk (module docstring). Tree mode ``block`` only: each slot's
    distribution depends on the token drafted before it, so the draft is one chain; ``tree.depth`` caps it."""

    TREE_MODES = ("block",)

    def __init__(self, model: DSparkModel, tree: TreeSpec = TreeSpec(mode="block"), name: str | None = None):
        super().__init__(model, tree, name or DRAFTER_TYPE)

    def propose(self, root_token: int, context_ids: list[int], temperature: float,
                generator: torch.Generator | None) -> DraftTree:
        self.check_context(context_ids)
        with torch.inference_mode():
            tokens, probs_KV, conf_K = self.walk(root_token, temperature, generator)
        keep = self.verify_length(conf_K)
        return chain(root_token, tokens[:keep], probs_KV[:keep], conf_K.cumprod(0)[:keep], sampled=temperature > 0)

    def walk(self, root_token: int, temperature: float, generator: torch.Generator | None
             ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The K = ``self.depth`` drafted tokens, the distribution q_k each was drawn from [K, V] and each slot's
        confidence [K], one slot at a time after one backbone pass."""
        model = self.model
        hidden_KE = self.draft_states(root_token)[:self.depth]
        base_KX = model.logits(hidden_KE)
        tokens, rows, confs = [], [], []
        prev = root_token
        for k in range(self.depth):
            embedded_r = model.markov_head.markov_w1.weight[prev]
            logits_X = (base_KX[k] + model.markov_head(embedded_r)).float()
            confs.append(model.confidence_head(hidden_KE[k], embedded_r).float().sigmoid())
            q_V = model.draft_probs(logits_X / (temperature if temperature > 0 else 1.0))
            if temperature > 0:
                prev = int(torch.multinomial(q_V, 1, generator=generator))
            else:
                prev = int(model.d2t[int(logits_X.argmax())])
            tokens.append(prev)
            rows.append(q_V)
        return tokens, torch.stack(rows), torch.stack(confs).cpu()

    def verify_length(self, conf_K: torch.Tensor) -> int:
        """Drafted tokens to verify: up to the last whose confidence product is >= verify_threshold (at least 1)."""
        above = conf_K.cumprod(0) >= self.model.config.verify_threshold
        return max(1, int(above.long().cumprod(0).sum()))


def make_dspark_drafter(model: DSparkModel, target: Decoder, tree: TreeSpec, name: str) -> DSparkDrafter:
    """The registry's drafter builder."""
    return DSparkDrafter(model, tree, name)
