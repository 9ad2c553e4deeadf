"""DFlash2 (z-lab's DFlash v2, as the engines serving ``DFlash2DraftModel`` define it): the DFlash backbone with dynamic
convolutions around every attention and MLP sublayer, and a candidate selector that walks the block's slots.

Shape legend (docs/SHAPES.md; dflash.py adds A anchors, G block size, Q block tokens): B batch, E hidden size, V
vocab, X the draft vocabulary (V without one), K drafted slots (G - 1); this file adds C selector candidates per
slot, r the selector rank, W the convolution's kernel taps.

Dynamic convolution (papers.md, DFlash2), around one sublayer f with input h (the sublayer's normed input):
  kernels   base_kernel [2, W, E] + delta, delta = kernel_projection(h) [Q, 2, W, E/16] shared by each group of
            16 channels (conv_group_size): one projection gives the input-side (0) and the output-side (1) kernel
  convolve  out[i, c] = sum_t kernel[i, t, c] * x[i - t, c], t < W, terms reaching across the block start zeroed
  sublayer  x + convolve(f(convolve(h, kernel_0)), kernel_1)
base_kernel starts at the identity (1 at t = 0) and kernel_projection at zero, so a fresh DFlash2 backbone computes
exactly what the DFlash backbone with the same weights does.

Candidate selector: slot k keeps the top ``selector_top_k`` of its unary logits u_k (the target's LM head) and scores
candidate c after predecessor p (the anchor for slot 1, then the previous slot's token) as
  s_k(c) = u_k(c) + < predecessor_codebook[p] * hidden_projection(h_k), successor_codebook[c] >.
The walk from the anchor takes the argmax at T = 0; at T > 0 it samples by inverse CDF from q_k = softmax(s_k / T)
over the candidates and keeps q_k (0 outside them) as the node's draft distribution, so verification stays exact.
successor_codebook starts at zero (as SpecForge's), so a fresh selector picks DFlash's argmax.

Loss (the published objective is not; speculators' variant): DFlash's decayed CE plus alpha times the same-weighted
C-way CE of s_k over the unary top-C with the teacher-forced predecessor, the gold token put in place of the last
candidate where the top-C lacks it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eyas.config import require
from eyas.drafters.dflash import DFlashConfig, DFlashDrafter, DFlashLayer, DFlashModel
from eyas.drafters.dflash_train import (BlockTargets, block_metrics, block_states, block_targets, decayed_ce,
                                        draw_anchors, position_weights)
from eyas.drafters.trees import TreeSpec
from eyas.decoding.tree import DraftTree, chain
from eyas.models.config import ModelConfig
from eyas.models.decoder import Decoder
from eyas.models.features import TargetFeatures, TrainBatch
from eyas.models.packing import linear

DRAFTER_TYPE = "dflash2"


@dataclass(frozen=True)
class DFlash2Config(DFlashConfig):
    """DFlash's fields (dflash.DFlashConfig) with DFlash2's defaults (B = 8 so K = 7, gamma 4) and its modules'."""
    block_size: int = 8              # G: the root + K = G-1 drafted slots
    loss_decay: float = 4.0          # gamma of the decayed block CE (4 for B = 8)
    conv_kernel_size: int = 2        # W: taps of the dynamic convolution (the token and the one before it)
    conv_group_size: int = 16        # channels sharing one predicted kernel offset
    selector_rank: int = 256         # r: width of the selector codebooks and hidden projection
    selector_top_k: int = 16         # C: unary candidates per slot
    selector_loss_alpha: float = 1.0  # weight of the selector CE added to the DFlash loss

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            require(getattr(self, name) >= 1, f"dflash2.{name}", getattr(self, name), "must be >= 1")
        require(self.selector_loss_alpha >= 0, "dflash2.selector_loss_alpha", self.selector_loss_alpha,
                "must be >= 0")


class DynamicConv(nn.Module):
    """The kernels of the convolutions around one sublayer (module docstring)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        base_2WE = torch.zeros(2, kernel_size, hidden_size)
        base_2WE[:, 0] = 1.0  # the identity
        self.base_kernel = nn.Parameter(base_2WE)
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * hidden_size // group_size, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def kernels(self, h_BQE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The input-side and output-side kernels [B, Q, W, E] of each token."""
        B, Q, E = h_BQE.shape
        delta_BQ2WE = (linear(self.kernel_projection, h_BQE).view(B, Q, 2, self.kernel_size, E // self.group_size)
                       .repeat_interleave(self.group_size, dim=-1))
        kernel_BQ2WE = self.base_kernel.to(h_BQE.dtype) + delta_BQ2WE
        return kernel_BQ2WE[:, :, 0], kernel_BQ2WE[:, :, 1]


def convolve(x_BQE: torch.Tensor, kernel_BQWE: torch.Tensor, block_size: int) -> torch.Tensor:
    """out[i] = sum_t kernel[i, t] * x[i - t] inside each block of ``block_size`` consecutive tokens.
    e.g. G = 2, W = 2, x = [a0, a1, b0, b1] -> [k0 a0, k0 a1 + k1 a0, k0 b0, k0 b1 + k1 b0]."""
    Q = x_BQE.shape[1]
    slot_Q = torch.arange(Q, device=x_BQE.device) % block_size
    out_BQE = kernel_BQWE[:, :, 0] * x_BQE
    for t in range(1, kernel_BQWE.shape[2]):
        shifted_BQE = F.pad(x_BQE, (0, 0, t, 0))[:, :Q] * (slot_Q >= t)[None, :, None].to(x_BQE.dtype)
        out_BQE = out_BQE + kernel_BQWE[:, :, t] * shifted_BQE
    return out_BQE


class DFlash2Layer(DFlashLayer):
    """A DFlash layer with a dynamic convolution on each side of its attention and of its MLP."""

    OWN_MODULES = ("attention_conv", "mlp_conv")

    def __init__(self, config: ModelConfig, model_config: DFlash2Config) -> None:
        super().__init__(config)
        E, W, group = config.hidden_size, model_config.conv_kernel_size, model_config.conv_group_size
        self.block_size = model_config.block_size
        self.attention_conv = DynamicConv(E, W, group)
        self.mlp_conv = DynamicConv(E, W, group)

    def forward(self, x_BQE, cos_BQD, sin_BQD, ctx_k_BHCD, ctx_v_BHCD, mask_B1QS) -> torch.Tensor:
        G = self.block_size
        h_BQE = self.input_layernorm(x_BQE)
        k_in, k_out = self.attention_conv.kernels(h_BQE)
        attn_BQE = self.self_attn(convolve(h_BQE, k_in, G), cos_BQD, sin_BQD, ctx_k_BHCD, ctx_v_BHCD, mask_B1QS)
        x_BQE = x_BQE + convolve(attn_BQE, k_out, G)
        h_BQE = self.post_attention_layernorm(x_BQE)
        k_in, k_out = self.mlp_conv.kernels(h_BQE)
        return x_BQE + convolve(self.mlp(convolve(h_BQE, k_in, G)), k_out, G)


class CandidateSelector(nn.Module):
    """The pair term of the selector's score (module docstring); codebooks are indexed by target token ids."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def pair_scores(self, hidden_E: torch.Tensor, prev: torch.Tensor, candidates_C: torch.Tensor) -> torch.Tensor:
        """[..., C]: <A[prev] * P h, B[c]> for hidden [..., E], prev [...] and candidates [..., C] (token ids)."""
        query_r = self.predecessor_codebook[prev] * linear(self.hidden_projection, hidden_E)
        return (self.successor_codebook[candidates_C] * query_r.unsqueeze(-2)).sum(-1)


class DFlash2Model(DFlashModel):
    """DFlash's backbone with DFlash2 layers, plus the candidate selector."""

    drafter_type = DRAFTER_TYPE

    def __init__(self, config: DFlash2Config, target: Decoder, draft_vocab: list[int] | None = None) -> None:
        E = target.config.hidden_size
        if E % config.conv_group_size:
            raise ValueError(f"dflash2.conv_group_size={config.conv_group_size} must divide the target's hidden "
                             f"size {E}")
        super().__init__(config, target, draft_vocab)
        require(config.selector_top_k <= self.d2t.numel(), "dflash2.selector_top_k", config.selector_top_k,
                f"exceeds the draft vocabulary ({self.d2t.numel()} tokens)")
        self.candidate_selector = CandidateSelector(target.config.vocab_size, E, config.selector_rank)
        self.candidate_selector.to(device=target.device, dtype=target.dtype)

    def make_layer(self, layer_config: ModelConfig) -> nn.Module:
        return DFlash2Layer(layer_config, self.config)

    def forward(self, batch, features, generator: torch.Generator | None = None):
        if generator is None and not self.training:
            generator = torch.Generator(device=self.inv_freq.device).manual_seed(0)
        return dflash2_loss(self, batch, features, generator)


def dflash2_loss(model: DFlash2Model, batch: TrainBatch, features: TargetFeatures,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """DFlash's loss on the unary logits + alpha * the selector's C-way CE (module docstring). Metrics: DFlash's
    (acc_k of the unary argmax), ``selector_ce`` and ``selector_acc`` (the selector's pick with gold predecessors)."""
    config = model.config
    anchors_BA, anchor_valid_BA = draw_anchors(batch.loss_mask_BT, batch.valid_BT, config.num_anchors, generator)
    hidden_BAKE = block_states(model, batch.input_ids_BT, batch.valid_BT, features.taps, anchors_BA)[:, :, 1:]
    unary_BAKX = model.logits(hidden_BAKE).float()
    targets = block_targets(model, batch, anchors_BA, anchor_valid_BA)
    dflash_loss, ce_BAK = decayed_ce(unary_BAKX, targets, config.loss_decay)
    selector_ce, selector_acc = selector_loss(model, batch, hidden_BAKE, unary_BAKX, targets)
    loss = dflash_loss + config.selector_loss_alpha * selector_ce
    metrics = block_metrics(unary_BAKX.detach(), targets.labels_BAK, targets.mask_BAK,
                            ce_BAK.detach() * targets.in_vocab_BAK, loss.detach(), anchor_valid_BA,
                            targets.in_vocab_BAK)
    metrics.update(dflash_loss=float(dflash_loss.detach()), selector_ce=float(selector_ce.detach()),
                   selector_acc=selector_acc)
    return loss, metrics


def selector_loss(model: DFlash2Model, batch: TrainBatch, hidden_BAKE: torch.Tensor, unary_BAKX: torch.Tensor,
                  targets: BlockTargets) -> tuple[torch.Tensor, float]:
    """(the position-weighted C-way CE over the learning slots, the selector's top-1 rate there)."""
    b_R, a_R, k_R = targets.in_vocab_BAK.nonzero(as_tuple=True)
    if len(b_R) == 0:
        return unary_BAKX.sum() * 0.0, 0.0
    gold_R = targets.labels_BAK[b_R, a_R, k_R]  # draft-vocabulary indices
    unary_RX = unary_BAKX[b_R, a_R, k_R]
    candidates_RC = unary_RX.detach().topk(model.config.selector_top_k, dim=-1).indices
    missing_R = ~(candidates_RC == gold_R[:, None]).any(-1)
    candidates_RC[missing_R, -1] = gold_R[missing_R]  # inject the gold token where the top-C lacks it
    gold_index_R = (candidates_RC == gold_R[:, None]).long().argmax(-1)
    prev_R = batch.input_ids_BT[b_R, targets.label_pos_BAK[b_R, a_R, k_R] - 1]  # the teacher-forced predecessor
    scores_RC = unary_RX.gather(1, candidates_RC) + model.candidate_selector.pair_scores(
        hidden_BAKE[b_R, a_R, k_R], prev_R, model.d2t[candidates_RC]).float()
    weight_R = position_weights(unary_BAKX.shape[2] + 1, model.config.loss_decay).to(scores_RC.device)[k_R]
    ce_R = F.cross_entropy(scores_RC, gold_index_R, reduction="none")
    accuracy = float((scores_RC.detach().argmax(-1) == gold_index_R).float().mean())
    return (ce_R * weight_R).sum() / weight_R.sum(), accuracy


class DFlash2Drafter(DFlashDrafter):
    """One backbone pass, then the selector's walk over slots 1..K (module docstring). Tree mode ``block`` only: a
    slot's candidates are scored after the token drafted before it, so the draft is one chain; ``tree.depth`` caps
    it."""

    TREE_MODES = ("block",)

    def __init__(self, model: DFlash2Model, tree: TreeSpec = TreeSpec(mode="block"), name: str | None = None):
        super().__init__(model, tree, name or DRAFTER_TYPE)

    def propose(self, root_token: int, context_ids: list[int], temperature: float,
                generator: torch.Generator | None) -> DraftTree:
        self.check_context(context_ids)
        with torch.inference_mode():
            tokens, probs_KV = self.walk(root_token, temperature, generator)
        return chain(root_token, tokens, probs_KV, sampled=temperature > 0)

    def walk(self, root_token: int, temperature: float, generator: torch.Generator | None
             ) -> tuple[list[int], torch.Tensor]:
        """The K = ``self.depth`` drafted tokens and the distribution q_k each was drawn from [K, V]."""
        model = self.model
        hidden_KE = self.draft_states(root_token)[1:1 + self.depth]
        unary_KC, index_KC = model.logits(hidden_KE).float().topk(model.config.selector_top_k, dim=-1)
        candidates_KC = model.d2t[index_KC]
        V = model.target_config.vocab_size
        tokens, rows = [], []
        prev = torch.tensor(root_token, device=self.device)
        for k in range(self.depth):
            scores_C = unary_KC[k] + model.candidate_selector.pair_scores(hidden_KE[k], prev, candidates_KC[k]).float()
            q_C = (scores_C / (temperature if temperature > 0 else 1.0)).softmax(-1)
            if temperature > 0:  # inverse CDF: the first candidate whose cumulative mass passes u ~ U(0, 1)
                u = torch.rand((), generator=generator, device=q_C.device)
                pick = int(torch.searchsorted(q_C.cumsum(0), u[None]).clamp(max=len(q_C) - 1))
            else:
                pick = int(scores_C.argmax())
            prev = candidates_KC[k, pick]
            tokens.append(int(prev))
            rows.append(torch.zeros(V, device=q_C.device).index_put_((candidates_KC[k],), q_C))
        return tokens, torch.stack(rows)


def make_dflash2_drafter(model: DFlash2Model, target: Decoder, tree: TreeSpec, name: str) -> DFlash2Drafter:
    """The registry's drafter builder."""
    return DFlash2Drafter(model, tree, name)
