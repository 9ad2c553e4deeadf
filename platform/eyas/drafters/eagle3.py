"""EAGLE-3 (arXiv 2503.01840): multi-layer fusion, no feature loss, training-time test, reduced draft vocabulary.

Shape legend (docs/SHAPES.md): B batch, T tokens, E target hidden size, V target vocab, X draft vocab.

Step 0 at index i reads concat(low, mid, high target states at i) -> Linear(3E -> E) with embed(t_{i+1}); the one
decoder layer's attention reads concat(norm(embed), norm(hidden)) (q/k/v take 2E) and its residual stream is the
hidden state; logits = own LM head (over the draft vocabulary) of norm(output). Step j >= 1 reads its own output of
step j-1 (training-time test, TTT; the mask and indexing are in eagle.py), at training exactly as at inference.

Loss: sum_j step_decay^j * CE_j, where CE_j at index i is the soft cross-entropy against the target's distribution
for t_{i+2+j}, restricted to the draft vocabulary and renormalised; indices whose target argmax lies outside the
draft vocabulary are masked (the reference's choice: the drafter cannot propose that token anyway). No feature loss.
``loss_target: argmax`` swaps the soft distribution for a one-hot on the target's argmax (not in the paper): under
greedy verification the chance that a drafted token is accepted is the chance that it IS the target's argmax, so a
drafter trained this way has confidences calibrated to greedy acceptance even when the target's own distribution is
flat, which the dynamic tree's value V (a product of confidences) relies on (papers.md, EAGLE-2).

EAGLE-3.1 (arXiv 2605.09992, "attention drift"; papers.md) is this family with two flags, method ``eagle3.1``:
``fc_norm`` puts an RMSNorm on each tap's state before the concat and ``fc`` (vLLM's ``fc_norm.{0,1,2}.weight``;
not speculators' ``norm_before_fc``, one norm over the whole 3E), and ``norm_output`` feeds the final-normed state,
the one the LM head reads, to the next draft step, where EAGLE-3 feeds the pre-norm one (no new parameters; the
post-norm feedback of SpecForge PR #879, not #568's logits-only switch). ``Eagle31Config`` turns both on, and its
checkpoints carry drafter_type "eagle3.1", so jobs.bench finds them beside, not instead of, an EAGLE-3 drafter.

Draft vocabulary: the ``draft_vocab_size`` most frequent target tokens of the training data (``eyas.drafters.vocab``),
kept as d2t (draft index -> target token id, ascending ids) and saved in the checkpoint's config.json.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from eyas.config import require
from eyas.drafters.eagle import (KV, LOSS_TARGETS, DraftLayerConfig, EagleModel, check_taps, gather_rows,
                                 hard_cross_entropy, masked_mean, scalar, selected_indices, shift_left,
                                 soft_cross_entropy, step_mask, unroll_selected)
from eyas.drafters.vocab import to_target_probs, vocab_maps
from eyas.models.decoder import Decoder, RMSNorm
from eyas.models.features import TargetFeatures, TrainBatch
from eyas.models.packing import linear


def eagle3_taps(num_layers: int) -> tuple[int, int, int]:
    """Low / mid / high tap layers (HF hidden_states numbering). The reference's (2, N/2, N-3) when those are
    distinct and increasing (N >= 7); on shallower targets (1, N/2, N-1), never the final-normed N itself."""
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers}: a target needs at least one layer")
    low, mid, high = 2, num_layers // 2, num_layers - 3
    if low < mid < high:
        return low, mid, high
    return 1, max(1, num_layers // 2), max(1, num_layers - 1)


@dataclass(frozen=True)
class Eagle3Config:
    layer: DraftLayerConfig = field(default_factory=DraftLayerConfig)
    taps: tuple[int, ...] | None = None  # target tap layers fused at step 0; None = eagle3_taps(num_layers)
    draft_vocab_size: int | None = None  # None = the full target vocabulary
    ttt_steps: int = 7  # training-time-test steps
    step_decay: float = 0.8  # weight of step j: step_decay ** j
    noise_scale: float = 0.0  # uniform noise on the fused input states (training only)
    loss_target: str = "soft"  # "soft": the target's distribution (paper); "argmax": one-hot on its argmax
    # also fuse the target's last (final-normed) state, the one EAGLE-1 reads and every feature cache keeps
    last_layer_tap: bool = False
    # step 0's CE on prompt positions too, times this weight (0 = off): their labels (the target's argmax or
    # distribution at the next position) are in the features already; acc_j stays on the response
    prompt_loss_weight: float = 0.0
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm per tap before fc (module docstring)
    norm_output: bool = False  # EAGLE-3.1: the post-norm state feeds the LM head and the next draft step

    def __post_init__(self) -> None:
        require(self.taps is None or len(self.taps) >= 1, "taps", self.taps, "needs at least one tap layer")
        require(self.draft_vocab_size is None or self.draft_vocab_size >= 1, "draft_vocab_size",
                self.draft_vocab_size, "must be >= 1 (or null: the full vocabulary)")
        require(self.ttt_steps >= 1, "ttt_steps", self.ttt_steps, "must be >= 1")
        require(0 < self.step_decay <= 1, "step_decay", self.step_decay, "must be in (0, 1]")
        require(self.noise_scale >= 0, "noise_scale", self.noise_scale, "must be >= 0")
        require(self.loss_target in LOSS_TARGETS, "loss_target", self.loss_target, f"must be one of {LOSS_TARGETS}")
        require(self.prompt_loss_weight >= 0, "prompt_loss_weight", self.prompt_loss_weight, "must be >= 0 (0 = off)")


class Eagle3Model(EagleModel):
    drafter_type = "eagle3"

    def __init__(self, config: Eagle3Config, target: Decoder, draft_vocab: Sequence[int] | torch.Tensor | None = None
                 ) -> None:
        super().__init__(config, target, two_stream=True)
        num_layers, E, V = target.config.num_layers, target.config.hidden_size, target.config.vocab_size
        taps = tuple(config.taps or eagle3_taps(num_layers))
        if config.last_layer_tap and num_layers not in taps:
            taps += (num_layers,)
        self.target_taps = check_taps(taps, num_layers, "taps")
        d2t_X, t2d_V = vocab_maps(draft_vocab, config.draft_vocab_size, V)
        self.draft_vocab = None if draft_vocab is None else d2t_X.tolist()
        self.register_buffer("d2t", d2t_X, persistent=False)  # draft index -> target id (saved in config.json)
        self.register_buffer("t2d", t2d_V, persistent=False)  # target id -> draft index, -1 outside
        self.fc = nn.Linear(len(self.target_taps) * E, E, bias=False)
        if config.fc_norm:  # state names fc_norm.{i}.weight, as vLLM stores them
            self.fc_norm = nn.ModuleList(RMSNorm(E, target.config.rms_norm_eps) for _ in self.target_taps)
        self.norm = RMSNorm(E, target.config.rms_norm_eps)
        self.lm_head = nn.Linear(E, d2t_X.numel(), bias=False)
        with torch.no_grad():  # start from the target's own readout, restricted to the draft vocabulary
            self.norm.weight.copy_(target.norm.weight)
            self.lm_head.weight.copy_(target.lm_head.weight[d2t_X.to(target.device)])
        self.place_like(target)

    def initial_hidden(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        return self.fuse(torch.cat([taps[layer] for layer in self.target_taps], dim=-1))

    def fuse(self, concat_TF: torch.Tensor) -> torch.Tensor:
        """[..., F] (the taps' states side by side, F = num_taps * E) -> [..., E]: fc, after a norm per tap when
        ``fc_norm``."""
        concat_TF = concat_TF.to(self.dtype)
        if self.config.fc_norm:
            parts = concat_TF.chunk(len(self.target_taps), dim=-1)
            concat_TF = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts)], dim=-1)
        return linear(self.fc, concat_TF)

    def step(self, tokens_BT: torch.Tensor, hidden_BTE: torch.Tensor, positions_BT: torch.Tensor,
             past: KV | None, mask_B1TS: torch.Tensor | None, last_logits: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, KV]:
        out_BTE, kv = self.layer_pass(tokens_BT, hidden_BTE, positions_BT, past, mask_B1TS)
        return self.carry(out_BTE), self.readout(out_BTE[:, -1:] if last_logits else out_BTE), kv

    def layer_pass(self, tokens_BT: torch.Tensor, hidden_BTE: torch.Tensor, positions_BT: torch.Tensor,
                   past: KV | None, mask_B1TS: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        """The decoder layer alone: (hidden out, its new keys and values)."""
        cos_BTD, sin_BTD = self.rope(positions_BT)
        return self.layer(hidden_BTE.to(self.dtype), self.embed(tokens_BT), cos_BTD, sin_BTD, past, mask_B1TS)

    def readout(self, out_BTE: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., X] of the layer's output."""
        return linear(self.lm_head, self.norm(out_BTE))

    def carry(self, out_BTE: torch.Tensor) -> torch.Tensor:
        """The state the next draft step reads: the layer's output, or its final-normed form (``norm_output``)."""
        return self.norm(out_BTE) if self.config.norm_output else out_BTE

    def draft_probs(self, logits_X: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., X] -> probabilities over the target vocabulary [..., V] (0 outside)."""
        return to_target_probs(logits_X, self.d2t, self.target_config.vocab_size)

    def training_loss(self, batch: TrainBatch, features: TargetFeatures) -> tuple[torch.Tensor, dict[str, float]]:
        """Step j's CE against the target's next-token choice 1 + j positions ahead, over the draft vocabulary: a
        one-hot on its argmax ("argmax"; argmaxes outside the draft vocabulary are masked) or its distribution
        restricted and renormalised ("soft"). Only the indices some step learns from are unrolled and read out
        (``unroll_selected``); ``prompt_loss_weight`` adds step 0's CE at the prompt positions."""
        config = self.config
        taps = {layer: features.taps[layer].detach() for layer in self.target_taps}
        hidden_BTE = self.add_noise(self.initial_hidden(taps), config.noise_scale)
        target_draft_BT = self.t2d[features.argmax_BT]  # -1: outside the draft vocabulary
        soft_BTX = (features.logits_BTV[..., self.d2t].float().softmax(-1) if config.loss_target == "soft"
                    else None)
        learn_KBT = torch.stack([step_mask(batch, 2 + j) for j in range(config.ttt_steps)])
        index_BR, kept_BR = selected_indices(learn_KBT.amax(0))
        first_BTE, steps = unroll_selected(self, batch.input_ids_BT, hidden_BTE, config.ttt_steps, index_BR)
        loss = hidden_BTE.new_zeros((), dtype=torch.float32)
        metrics: dict[str, float] = {}
        for j, (_, logits_BRX) in enumerate(steps):
            draft_BR = shift_left(target_draft_BT, 1 + j).gather(1, index_BR)  # zero-padded where learn is 0
            learn_BR = learn_KBT[j].gather(1, index_BR) * kept_BR
            ce = self.step_ce(logits_BRX, draft_BR, learn_BR, soft_BTX, index_BR + 1 + j)
            loss = loss + config.step_decay ** j * ce
            # acceptance counts out-of-vocabulary targets as misses: the drafter can never propose them
            agree_BR = (logits_BRX.argmax(-1) == draft_BR).float()
            metrics[f"acc_{j + 1}"] = scalar(masked_mean(agree_BR, learn_BR))
            metrics[f"ce_{j + 1}"] = scalar(ce)
        if config.prompt_loss_weight > 0:
            prompt_ce = self.prompt_ce(batch, first_BTE, target_draft_BT, soft_BTX, learn_KBT[0])
            loss = loss + config.prompt_loss_weight * prompt_ce
            metrics["prompt_ce"] = scalar(prompt_ce)
        metrics["loss"] = scalar(loss)
        return loss, metrics

    def step_ce(self, logits_BRX: torch.Tensor, draft_BR: torch.Tensor, learn_BR: torch.Tensor,
                soft_BTX: torch.Tensor | None, label_at_BR: torch.Tensor) -> torch.Tensor:
        """CE at the selected indices against the argmax labels ``draft_BR`` (outside the draft vocabulary:
        masked), or against the target's distribution at ``label_at_BR`` (soft)."""
        in_vocab_BR = learn_BR * (draft_BR >= 0)
        if soft_BTX is None:
            return hard_cross_entropy(logits_BRX, draft_BR, in_vocab_BR)
        probs_BRX = gather_rows(soft_BTX, label_at_BR.clamp(max=soft_BTX.shape[1] - 1))
        return soft_cross_entropy(logits_BRX, probs_BRX, in_vocab_BR)

    def prompt_ce(self, batch: TrainBatch, first_BTE: torch.Tensor, target_draft_BT: torch.Tensor,
                  soft_BTX: torch.Tensor | None, learn_BT: torch.Tensor) -> torch.Tensor:
        """Step 0's CE at the real positions it does not learn from already (the prompt), labels from the
        features: the target's choice for the token after next, as at the response."""
        prompt_BT = shift_left(batch.valid_BT.float(), 2) * (1 - learn_BT)
        index_BR, kept_BR = selected_indices(prompt_BT)
        logits_BRX = self.readout(gather_rows(first_BTE, index_BR))
        draft_BR = shift_left(target_draft_BT, 1).gather(1, index_BR)
        return self.step_ce(logits_BRX, draft_BR, prompt_BT.gather(1, index_BR) * kept_BR, soft_BTX, index_BR + 1)

@dataclass(frozen=True)
class Eagle31Config(Eagle3Config):
    """EAGLE-3.1: EAGLE-3 with both of its flags on (module docstring)."""
    fc_norm: bool = True  # an RMSNorm per tap before fc
    norm_output: bool = True  # the post-norm state feeds the LM head and the next draft step


class Eagle31Model(Eagle3Model):
    drafter_type = "eagle3.1"
