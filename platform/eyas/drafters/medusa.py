"""Medusa-1: K independent heads on the target's last hidden state, head k guessing the token k+1 steps past the
next one.

Shape legend (docs/SHAPES.md): B batch, T tokens, K drafted positions (one head each: head k drafts depth k+1),
E target hidden size, V target vocab, X the draft vocabulary (V without one). This file adds R, the positions
(b, i) some head learns from in a training batch, and J, the indices whose target distribution those heads read.

Head k (0-based) at position i reads the final-normed target state h_i (tap ``num_layers``) and predicts t_{i+2+k}:
  p_k = softmax(LMHead(h + SiLU(W_k h)))   (``num_res_layers`` such residual blocks per head)
Choice: the LM head is the target's own, shared and frozen. The Medusa paper gives each head its own copy
initialised from the LM head; sharing keeps a head at E*E parameters instead of E*(E + V) (for a 128k vocabulary
and E = 4096, 17M instead of 540M per head), trains faster and keeps checkpoints small. W_k starts at zero, so every
head starts out predicting what the target predicts for the next token.

Loss: sum_k step_decay^k * CE(p_k, target for t_{i+2+k}) over positions whose token t_{i+2+k} is a response token;
acc_{k+1} is head k's top-1 agreement with the target's argmax. The target is the target model's distribution
(``loss_target: soft``, Medusa-2's self-distillation) or a one-hot on its argmax (``argmax``: Medusa-1's hard labels
on data the target regenerated greedily, and what greedy acceptance counts). The heads are read only at positions
where some head has a token to learn: K full-vocabulary logits per position are the whole step's cost, and a padded
batch of chat prompts holds more prompt than response.

Choice: ``draft_vocab_size`` reads the heads over the X most frequent target tokens of the training data only
(EAGLE-3's reduced draft vocabulary, ``eyas.drafters.vocab``), through those X rows of the target's LM head (frozen,
saved with the checkpoint): on a small target the LM head is a large share of a decode step (SmolLM2-135M: 28M of
its 135M weights), and one head is one pass of it per cycle. The heads then propose only those tokens; the losses
mask targets outside them and count them as misses.

Inference: the heads are read once per cycle on the state that predicted the root. A tree node at depth d takes
its candidates from head d-1's top-k, whatever its parent: the static tree (or chain / dynamic / best-first) is
built from products of the heads' probabilities, through the same builders as EAGLE.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eyas.config import require
from eyas.drafters.eagle import LOSS_TARGETS, hard_cross_entropy, masked_mean, scalar, step_mask
from eyas.drafters.trees import EXPAND_MODES, TreeSpec, grow_tree
from eyas.drafters.vocab import FrozenReadout
from eyas.models.decoder import Decoder
from eyas.models.packing import InferencePacking, linear
from eyas.decoding.builders import EAGLE_DEFAULT
from eyas.decoding.tree import DraftTree, PartialTree
from eyas.models.features import TargetFeatures, TrainBatch


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int = 4  # K: the deepest token a tree can draft
    num_res_layers: int = 1  # residual SiLU blocks per head
    step_decay: float = 0.8  # loss weight of head k: step_decay ** k
    loss_target: str = "soft"  # "soft": the target's distribution; "argmax": a one-hot on its argmax
    draft_vocab_size: int | None = None  # read the heads over the most frequent tokens only; None = all V

    def __post_init__(self) -> None:
        require(self.num_heads >= 1, "num_heads", self.num_heads, "must be >= 1")
        require(self.num_res_layers >= 1, "num_res_layers", self.num_res_layers, "must be >= 1")
        require(0 < self.step_decay <= 1, "step_decay", self.step_decay, "must be in (0, 1]")
        require(self.draft_vocab_size is None or self.draft_vocab_size >= 1, "draft_vocab_size",
                self.draft_vocab_size, "must be >= 1 (or null: the full vocabulary)")
        require(self.loss_target in LOSS_TARGETS, "loss_target", self.loss_target, f"must be one of {LOSS_TARGETS}")


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # the head starts as the identity: the target's next-token readout
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(linear(self.linear, x))


class MedusaModel(FrozenReadout, InferencePacking, nn.Module):
    drafter_type = "medusa"

    def __init__(self, config: MedusaConfig, target: Decoder, draft_vocab: list[int] | None = None) -> None:
        super().__init__()
        self.config = config
        self.target_config = target.config
        self.target_taps = (target.config.num_layers,)
        E = target.config.hidden_size
        self.init_readout(target.lm_head, draft_vocab, config.draft_vocab_size)
        self.heads = nn.ModuleList(nn.Sequential(*(ResBlock(E) for _ in range(config.num_res_layers)))
                                   for _ in range(config.num_heads))
        self.to(device=target.device, dtype=target.dtype)

    def head_logits(self, hidden_E: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[..., E] -> [..., K, X]: the logits of the first ``num_heads`` heads (all by default) over the draft
        vocabulary (X = V without one)."""
        hidden_E = hidden_E.to(self.heads[0][0].linear.weight.dtype)  # the heads may train in float32
        return torch.stack([self.readout(head(hidden_E)) for head in self.heads[:num_heads]], dim=-2)

    def training_loss(self, batch: TrainBatch, features: TargetFeatures) -> tuple[torch.Tensor, dict[str, float]]:
        K, final = self.config.num_heads, self.target_config.num_layers
        learn_KBT = torch.stack([step_mask(batch, 2 + k) for k in range(K)])  # head k at i predicts t_{i+2+k}
        b_R, i_R = learn_KBT.amax(0).nonzero(as_tuple=True)  # positions where some head has a token to learn
        learn_KR = learn_KBT[:, b_R, i_R]
        final_BTE = features.taps[final].detach()
        logits_RKX = self.head_logits(final_BTE[b_R, i_R])
        T = final_BTE.shape[1]
        ahead_KR = (i_R + 1 + torch.arange(K, device=i_R.device)[:, None]).clamp(max=T - 1)  # the target's index
        draft_KR = self.t2d[features.argmax_BT[b_R, ahead_KR]]  # the target's argmax; -1 outside the draft vocab
        soft = self.config.loss_target == "soft"
        if soft:  # the target's distribution at every index some head reads: those whose next token is learned
            b_J, t_J = (step_mask(batch, 1) > 0).nonzero(as_tuple=True)
            probs_JX = features.logits_at(b_J, t_J)[:, self.d2t].float().softmax(-1)  # restricted, renormalised
            row_BT = torch.zeros(final_BTE.shape[:2], dtype=torch.long, device=b_R.device)
            row_BT[b_J, t_J] = torch.arange(len(b_J), device=b_R.device)  # unread indices: row 0, masked
        loss = logits_RKX.new_zeros((), dtype=torch.float32)
        metrics: dict[str, float] = {}
        for k in range(K):
            logits_RX = logits_RKX[:, k]
            in_vocab_R = learn_KR[k] * (draft_KR[k] >= 0)
            if soft:
                log_q_RX = logits_RX.float().log_softmax(-1)
                ce = masked_mean(-(probs_JX[row_BT[b_R, ahead_KR[k]]] * log_q_RX).sum(-1), in_vocab_R)
            else:
                ce = hard_cross_entropy(logits_RX[None], draft_KR[k][None], in_vocab_R[None])
            loss = loss + self.config.step_decay ** k * ce
            # acceptance counts out-of-vocabulary targets as misses: the heads can never propose them
            agree_R = (logits_RX.argmax(-1) == draft_KR[k]).float()
            metrics[f"acc_{k + 1}"] = scalar(masked_mean(agree_R, learn_KR[k]))
            metrics[f"ce_{k + 1}"] = scalar(ce)
        metrics["loss"] = scalar(loss)
        return loss, metrics


class MedusaDrafter:
    """Drafter protocol (base.py): the heads read the target state that predicted the root."""

    def __init__(self, model: MedusaModel, tree: TreeSpec, name: str | None = None) -> None:
        tree.require_mode(EXPAND_MODES, "Medusa")
        num_heads = model.config.num_heads
        if tree.mode == "static" and tree.shape is None:  # EAGLE-1's default tree, cut to the heads' depth
            tree = dataclasses.replace(tree, shape=tuple(r for r in EAGLE_DEFAULT if len(r) <= num_heads))
        require(tree.max_depth <= num_heads, "tree.depth" if tree.mode != "static" else "tree.shape",
                tree.max_depth, f"Medusa drafts at most num_heads={num_heads} tokens deep")
        self.model = model.eval()
        self.tree = tree
        self.max_draft_nodes = tree.max_draft_nodes
        self.name = name or model.drafter_type
        self.target_taps = tuple(model.target_taps)
        self._last_state_E: torch.Tensor | None = None

    def begin(self, prompt_ids: list[int], taps: dict[int, torch.Tensor]) -> None:
        self._last_state_E = taps[self.target_taps[0]][-1]

    def commit(self, tokens: list[int], taps: dict[int, torch.Tensor]) -> None:
        self._last_state_E = taps[self.target_taps[0]][-1]  # the last accepted node's state predicted the bonus

    @torch.no_grad()
    def propose(self, root_token: int, context_ids: list[int], temperature: float = 0.0,
                generator: torch.Generator | None = None) -> DraftTree:
        """Deterministic top-k trees at any temperature: temperature and generator are not used."""
        assert self._last_state_E is not None, "call begin() first"
        # only the heads the tree reaches: each costs one pass of the target's LM head
        probs_KV = self.model.draft_probs(self.model.head_logits(self._last_state_E, self.tree.max_depth))

        def expand(parent_ids: list[int], partial: PartialTree) -> torch.Tensor:
            return probs_KV[[partial.depth[p] for p in parent_ids]]  # head d drafts depth d + 1

        return grow_tree(self.tree, root_token, expand)
