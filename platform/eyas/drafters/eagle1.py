"""EAGLE-1 (arXiv 2401.15077): extrapolate the target's top-layer feature one step, conditioned on the next token.

Shape legend (docs/SHAPES.md): B batch, T tokens, E target hidden size, V target vocab, X the draft vocabulary
(V without one).

Input at index i: concat(embed(t_{i+1}), f_i) -> Linear(2E -> E) -> one decoder layer -> predicted f_{i+1}, whose
tokens come from the target's frozen LM head. f is the target's final-normed state (tap ``num_layers``, what the
LM head reads). The target's embedding and LM head are frozen, neither trained nor saved. The layer is a plain
pre-norm Llama layer (the reference drops the input norm of its single layer; keeping it costs nothing).

Loss at index i (the token t_{i+2} it predicts must be a response token):
  reg_weight * SmoothL1(f_pred_{i+1}, f_{i+1}) + cls_weight * CE(LMHead(f_pred_{i+1}), p_target(. | t_<=i+1))
The classification target is the target's full distribution at position i+1 (soft CE, as in the reference), which
on regenerated greedy data puts its mode on the data token, and carries more signal than the argmax alone.
Uniform noise U(-0.5, 0.5) * noise_scale is added to the input features in training. ``ttt_steps > 1`` optionally
unrolls the drafter on its own predicted features too (EAGLE-3's training-time test, weights step_decay^j);
acc_1..acc_K (K = max(ttt_steps, metric_steps)) are top-1 agreements with the target at each unrolled step.

Choice (not in the paper): ``draft_vocab_size`` reads tokens through the X rows of the frozen head that are the
training data's most frequent tokens (``eyas.drafters.vocab.FrozenReadout``): on a small target the LM head is most
of a drafter pass (SmolLM2-135M: 28M weights against the layer's ~4M). The classification target is then the
target's distribution restricted to them and renormalised; positions whose target argmax lies outside are left out
of it and count as misses.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from eyas.config import require
from eyas.drafters.eagle import (KV, DraftLayerConfig, EagleModel, masked_mean, scalar, shift_left,
                                 soft_cross_entropy, step_mask, unroll)
from eyas.drafters.vocab import FrozenReadout
from eyas.models.decoder import Decoder
from eyas.models.features import TargetFeatures, TrainBatch
from eyas.models.packing import linear


@dataclass(frozen=True)
class Eagle1Config:
    layer: DraftLayerConfig = field(default_factory=DraftLayerConfig)
    noise_scale: float = 0.2  # amplitude of the uniform input-feature noise (training only)
    reg_weight: float = 1.0  # SmoothL1 feature regression
    cls_weight: float = 0.1  # soft CE against the target's distribution
    ttt_steps: int = 1  # unrolled training steps; 1 = the original EAGLE-1 objective
    step_decay: float = 0.8  # weight of unrolled step j: step_decay ** j
    metric_steps: int = 4  # steps unrolled (without gradient beyond ttt_steps) to report acc_1..acc_K
    draft_vocab_size: int | None = None  # read tokens over the most frequent ones only; None = all V

    def __post_init__(self) -> None:
        require(self.noise_scale >= 0, "noise_scale", self.noise_scale, "must be >= 0")
        require(self.reg_weight >= 0, "reg_weight", self.reg_weight, "must be >= 0")
        require(self.cls_weight >= 0, "cls_weight", self.cls_weight, "must be >= 0")
        require(self.reg_weight + self.cls_weight > 0, "cls_weight", self.cls_weight,
                "reg_weight and cls_weight cannot both be 0")
        require(self.ttt_steps >= 1, "ttt_steps", self.ttt_steps, "must be >= 1")
        require(0 < self.step_decay <= 1, "step_decay", self.step_decay, "must be in (0, 1]")
        require(self.metric_steps >= 1, "metric_steps", self.metric_steps, "must be >= 1")
        require(self.draft_vocab_size is None or self.draft_vocab_size >= 1, "draft_vocab_size",
                self.draft_vocab_size, "must be >= 1 (or null: the full vocabulary)")


class Eagle1Model(FrozenReadout, EagleModel):
    drafter_type = "eagle1"

    def __init__(self, config: Eagle1Config, target: Decoder, draft_vocab: list[int] | None = None) -> None:
        super().__init__(config, target, two_stream=False)
        E = target.config.hidden_size
        self.target_taps = (target.config.num_layers,)
        self.fc = nn.Linear(2 * E, E, bias=True)
        self.init_readout(target.lm_head, draft_vocab, config.draft_vocab_size)
        self.place_like(target)

    def initial_hidden(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        return taps[self.target_config.num_layers]

    def step(self, tokens_BT: torch.Tensor, hidden_BTE: torch.Tensor, positions_BT: torch.Tensor,
             past: KV | None, mask_B1TS: torch.Tensor | None, last_logits: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, KV]:
        x_BTE = linear(self.fc, torch.cat([self.embed(tokens_BT), hidden_BTE.to(self.dtype)], dim=-1))
        cos_BTD, sin_BTD = self.rope(positions_BT)
        feature_BTE, kv = self.layer(x_BTE, None, cos_BTD, sin_BTD, past, mask_B1TS)
        return feature_BTE, self.readout(feature_BTE[:, -1:] if last_logits else feature_BTE), kv

    def training_loss(self, batch: TrainBatch, features: TargetFeatures) -> tuple[torch.Tensor, dict[str, float]]:
        config = self.config
        feature_BTE = features.taps[self.target_config.num_layers].detach()
        num_steps = max(config.ttt_steps, config.metric_steps)
        steps = unroll(self, batch.input_ids_BT, self.add_noise(feature_BTE, config.noise_scale), num_steps,
                       config.ttt_steps)
        target_draft_BT = self.t2d[features.argmax_BT]  # -1: outside the draft vocabulary
        logits_BTX = features.logits_BTV if self.draft_vocab is None else features.logits_BTV[..., self.d2t]
        target_probs_BTX = logits_BTX.float().softmax(-1)  # once: step j reads it 1 + j ahead
        loss = feature_BTE.new_zeros((), dtype=torch.float32)
        metrics: dict[str, float] = {}
        for j, (pred_BTE, logits_BTX) in enumerate(steps):
            mask_BT = step_mask(batch, 2 + j)  # step j at index i predicts t_{i+2+j}
            draft_BT = shift_left(target_draft_BT, 1 + j)
            # acceptance counts out-of-vocabulary targets as misses: the drafter can never propose them
            agree_BT = (logits_BTX.argmax(-1) == draft_BT).float()
            metrics[f"acc_{j + 1}"] = scalar(masked_mean(agree_BT, mask_BT))
            if j >= config.ttt_steps:
                continue
            reg = masked_mean(F.smooth_l1_loss(pred_BTE.float(), shift_left(feature_BTE, 1 + j).float(),
                                               reduction="none").mean(-1), mask_BT)
            cls = soft_cross_entropy(logits_BTX, target_probs_BTX, mask_BT * (draft_BT >= 0), ahead=1 + j)
            loss = loss + config.step_decay ** j * (config.reg_weight * reg + config.cls_weight * cls)
            if j == 0:
                metrics["reg_loss"], metrics["cls_loss"] = scalar(reg), scalar(cls)
        metrics["loss"] = scalar(loss)
        return loss, metrics
