"""P-EAGLE (arXiv 2602.01469): an EAGLE-3 drafter that drafts every position of a chain in ONE pass.

Shape legend (docs/SHAPES.md): B batch, T tokens, S attended key slots, K drafted positions, E target hidden size,
F fused tap width (num_taps * E), V target vocab, X draft vocab; this file adds Q flattened training entries (all
depths of a row, T of them at depth 0) and R the entries a loss is taken at.

Architecture (papers.md, P-EAGLE): EAGLE-3's (eagle3.py: fc over the concatenated taps, a two-stream first layer
over concat(norm(embed), norm(hidden)), final norm, own LM head over a draft vocabulary), ``num_layers`` plain
Llama layers deep, plus ``mask_hidden`` [1, 1, F]: a learned stand-in for the target states a position further
ahead does not have yet. Indexing is EAGLE's (eagle.py): entry i reads (embed(t_{i+1}), fc(taps_i)) and predicts
t_{i+2}. A cycle appends the pending committed entries, the last of which reads the root (the bonus token), then
K-1 entries of (embed(mask_token_id), fc(mask_hidden)) at the next positions, and runs them all in one causal pass:
the root entry predicts depth 1 and mask entry d depth d+1. The K distributions come out of the same pass, so no
drafted token is fed back; the drafter never reads its own output (EAGLE-3's ``norm_output`` has no use here).

Trees: mode "block" drafts the chain of the K positions (tree.depth; default ``num_depths``), mode "ddtree" a
best-first tree over the K distributions taken as independent, as DFlash's are (drafters/dflash.py). Both are
lossless: greedy verification checks the target's argmax; a sampled chain draws token k from q_k, which does not
depend on the tokens drafted before it, so the p/q rule is exact; ddtree nodes are deterministic candidates.

Training: every depth-0 entry (the real prefix, as EAGLE-3's step 0) plus, for d = 1 .. num_depths-1, mask entries
at COD-sampled anchors (conditional drop: depth d keeps floor((n_valid - d) * max(cod_ratio^d, cod_min_ratio)) of
depth d-1's anchors whose depth-d target is a token to learn). All depths are one flattened sequence per row: entry
(anchor a, depth d) sits at position a + d and attends the depth-0 entries of anchors <= a and its own anchor's
entries of depth <= d (``cod_attention_mask``, an explicit boolean mask), exactly the keys inference gives it. The
loss is the soft cross-entropy to the target's distribution over the draft vocabulary at that entry's token,
averaged over all kept entries, with no depth decay; entries whose target argmax lies outside the draft vocabulary
are dropped (the reference's choice, as EAGLE-3's).

The mask token: any fixed id works (the embedding is the target's, frozen; ``mask_hidden`` is learned), so the
default 0 needs no spare token; exports write it as ``mask_token_id`` and ``pard_token`` (vLLM reads either).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from eyas.config import require
from eyas.decoding.tree import DraftTree
from eyas.drafters.eagle import KV, DraftLayer, DraftLayerConfig, masked_mean, scalar, step_mask
from eyas.drafters.eagle3 import Eagle3Model
from eyas.drafters.eagle_drafter import queue_entries
from eyas.drafters.trees import BLOCK_MODES, TreeSpec, block_tree
from eyas.models.cache import KVCache
from eyas.models.decoder import Decoder
from eyas.models.features import TargetFeatures, TrainBatch
from eyas.models.packing import linear


@dataclass(frozen=True)
class PEagleConfig:
    layer: DraftLayerConfig = field(default_factory=DraftLayerConfig)
    num_layers: int = 1  # decoder layers: the first two-stream (EAGLE-3's), the rest plain; one pass drafts all K
    taps: tuple[int, ...] | None = None  # as EAGLE-3's: None = eagle3_taps(num_layers)
    draft_vocab_size: int | None = None  # None = the full target vocabulary
    num_depths: int = 8  # depths trained, and the positions one pass drafts by default
    cod_ratio: float = 0.8  # COD: depth d keeps a cod_ratio^d share of the anchors ...
    cod_min_ratio: float = 0.2  # ... but never less than this share
    mask_token_id: int = 0  # the token the mask entries read (module docstring)
    noise_scale: float = 0.0  # uniform noise on the fused input states (training only)
    fc_norm: bool = False  # EAGLE-3.1's per-tap RMSNorm before fc (eagle3.py)
    last_layer_tap: bool = False  # as EAGLE-3's: also fuse the target's last (final-normed) state

    def __post_init__(self) -> None:
        require(self.num_layers >= 1, "num_layers", self.num_layers, "must be >= 1")
        require(self.taps is None or len(self.taps) >= 1, "taps", self.taps, "needs at least one tap layer")
        require(self.draft_vocab_size is None or self.draft_vocab_size >= 1, "draft_vocab_size",
                self.draft_vocab_size, "must be >= 1 (or null: the full vocabulary)")
        require(self.num_depths >= 1, "num_depths", self.num_depths, "must be >= 1")
        require(0 < self.cod_ratio <= 1, "cod_ratio", self.cod_ratio, "must be in (0, 1]")
        require(0 < self.cod_min_ratio <= 1, "cod_min_ratio", self.cod_min_ratio, "must be in (0, 1]")
        require(self.mask_token_id >= 0, "mask_token_id", self.mask_token_id, "must be a token id >= 0")
        require(self.noise_scale >= 0, "noise_scale", self.noise_scale, "must be >= 0")

    def keep_share(self, depth: int) -> float:
        return max(self.cod_ratio ** depth, self.cod_min_ratio)


class PEagleModel(Eagle3Model):
    drafter_type = "peagle"

    def __init__(self, config: PEagleConfig, target: Decoder, draft_vocab: list[int] | None = None) -> None:
        super().__init__(config, target, draft_vocab)
        V, F = target.config.vocab_size, len(self.target_taps) * target.config.hidden_size
        require(config.mask_token_id < V, "mask_token_id", config.mask_token_id, f"must lie in the target "
                f"vocabulary [0, {V})")
        self.later_layers = nn.ModuleList(DraftLayer(self.layer_config, two_stream=False)
                                          for _ in range(config.num_layers - 1))
        self.mask_hidden = nn.Parameter(0.02 * torch.randn(1, 1, F))
        self.place_like(target)

    @property
    def num_draft_layers(self) -> int:
        return self.config.num_layers

    def mask_state(self) -> torch.Tensor:
        """[E]: the fused state every mask entry reads."""
        return self.fuse(self.mask_hidden[0, 0])

    def forward_pass(self, tokens_BT: torch.Tensor, hidden_BTE: torch.Tensor, positions_BT: torch.Tensor,
                     past: list[KV] | None, mask_B1TS: torch.Tensor | None) -> tuple[torch.Tensor, list[KV]]:
        """All layers over T new entries; returns (final-normed states [B, T, E], each layer's new (k, v)).
        past: each layer's keys/values before these entries (None: none); mask_B1TS over past + new keys."""
        cos_BTD, sin_BTD = self.rope(positions_BT)
        x_BTE, kv = self.layer(hidden_BTE.to(self.dtype), self.embed(tokens_BT), cos_BTD, sin_BTD,
                               None if past is None else past[0], mask_B1TS)
        new_kv = [kv]
        for i, layer in enumerate(self.later_layers, start=1):
            x_BTE, kv = layer(x_BTE, None, cos_BTD, sin_BTD, None if past is None else past[i], mask_B1TS)
            new_kv.append(kv)
        return self.norm(x_BTE), new_kv

    def training_loss(self, batch: TrainBatch, features: TargetFeatures,
                      generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Soft CE over the COD-sampled entries of every depth, one pass (module docstring)."""
        config = self.config
        input_ids_BT = batch.input_ids_BT
        B, T = input_ids_BT.shape
        taps = {layer: features.taps[layer].detach() for layer in self.target_taps}
        real_BTE = self.add_noise(self.initial_hidden(taps), config.noise_scale)
        anchor_BQ, depth_BQ, real_BQ = cod_entries(batch, config, generator)
        Q = anchor_BQ.shape[1]
        is_mask_BQ = depth_BQ > 0
        positions_BQ = anchor_BQ + depth_BQ
        next_ids_BT = torch.cat([input_ids_BT[:, 1:], input_ids_BT.new_zeros(B, 1)], dim=1)  # t_{i+1} at i
        tokens_BQ = torch.where(is_mask_BQ, config.mask_token_id, next_ids_BT.gather(1, anchor_BQ))
        hidden_BQE = real_BTE.gather(1, anchor_BQ[..., None].expand(B, Q, real_BTE.shape[-1]))
        hidden_BQE = torch.where(is_mask_BQ[..., None], self.mask_state().to(hidden_BQE.dtype), hidden_BQE)
        mask_BQQ = cod_attention_mask(anchor_BQ, depth_BQ, real_BQ)
        out_BQE, _ = self.forward_pass(tokens_BQ, hidden_BQE, positions_BQ, None, mask_BQQ[:, None])
        # entry (a, d) predicts t_{a+2+d}: the target's distribution at a+1+d, learnable where step_mask(2+d)[a]
        learn_BT = step_mask(batch, 2)
        learn_BQ = real_BQ & (learn_BT.gather(1, positions_BQ.clamp(max=T - 1)) > 0)
        at_BQ = (positions_BQ + 1).clamp(max=T - 1)
        b_R, q_R = learn_BQ.nonzero(as_tuple=True)
        t_R = at_BQ[b_R, q_R]
        target_draft_R = self.t2d[features.argmax_BT[b_R, t_R]]  # -1: outside the draft vocabulary
        in_vocab_R = target_draft_R >= 0
        logits_RX = linear(self.lm_head, out_BQE[b_R, q_R])
        soft_RX = features.logits_at(b_R, t_R)[..., self.d2t].float().softmax(-1)
        ce_R = -(soft_RX * logits_RX.float().log_softmax(-1)).sum(-1)
        loss = masked_mean(ce_R, in_vocab_R)
        agree_R = (logits_RX.argmax(-1) == target_draft_R).float()  # outside the vocabulary: a miss
        depth_R = depth_BQ[b_R, q_R]
        metrics: dict[str, float] = {}
        for d in range(config.num_depths):
            at_depth_R = depth_R == d
            metrics[f"acc_{d + 1}"] = scalar(masked_mean(agree_R, at_depth_R))
            metrics[f"ce_{d + 1}"] = scalar(masked_mean(ce_R, at_depth_R & in_vocab_R))
        metrics["loss"] = scalar(loss)
        return loss, metrics


def cod_entries(batch: TrainBatch, config: PEagleConfig, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flattened training entries: (anchor_BQ, depth_BQ, real_BQ), depth 0 first (every index, Q >= T), then
    each depth's COD sample of the previous depth's anchors (module docstring), padded per depth to the row with
    the most; padding entries have real False (anchor 0) and must be ignored.

    Example: T = 6, learnable depth-0 anchors {2, 3, 4}, cod_ratio 0.5: depth 1 keeps floor((3-1)*0.5) = 1 of
    {2, 3} (anchor 4's depth-1 target lies past the sequence), say 3; depth 2 keeps floor((3-2)*0.25) = 0."""
    B, T = batch.input_ids_BT.shape
    device = batch.input_ids_BT.device
    per_depth = [[torch.arange(T, device=device) for _ in range(B)]]
    valid = [(step_mask(batch, 2 + d) > 0) for d in range(config.num_depths)]
    survivors = [valid[0][b].nonzero()[:, 0] for b in range(B)]
    num_valid = [int(s.numel()) for s in survivors]
    for d in range(1, config.num_depths):
        kept = []
        for b in range(B):
            candidates = survivors[b][valid[d][b, survivors[b]]]
            count = min(int((num_valid[b] - d) * config.keep_share(d)), int(candidates.numel()))
            order = torch.randperm(candidates.numel(), generator=generator, device="cpu").to(device)
            kept.append(candidates[order[:max(count, 0)]].sort().values)
        survivors = kept
        per_depth.append(kept)
    columns_anchor, columns_depth, columns_real = [], [], []
    for d, rows in enumerate(per_depth):
        width = max(int(r.numel()) for r in rows)
        anchor_BK = torch.zeros(B, width, dtype=torch.long, device=device)
        real_BK = torch.zeros(B, width, dtype=torch.bool, device=device)
        for b, r in enumerate(rows):
            anchor_BK[b, :r.numel()] = r
            real_BK[b, :r.numel()] = True
        columns_anchor.append(anchor_BK)
        columns_depth.append(torch.full_like(anchor_BK, d))
        columns_real.append(real_BK)
    return torch.cat(columns_anchor, 1), torch.cat(columns_depth, 1), torch.cat(columns_real, 1)


def cod_attention_mask(anchor_BQ: torch.Tensor, depth_BQ: torch.Tensor, real_BQ: torch.Tensor) -> torch.Tensor:
    """bool [B, Q, Q], True = query entry q attends key entry k: k at depth 0 with anchor <= q's, or k on q's own
    chain (same anchor, depth <= q's); padding entries see only themselves and are seen by nobody else.

    Example (rows: queries, columns: keys), depth-0 anchors 0 1 2, then depth 1 at anchor 1:
        a0 d0: 1 0 0 0     a1 d0: 1 1 0 0     a2 d0: 1 1 1 0     a1 d1: 1 1 0 1"""
    a_q, a_k = anchor_BQ[:, :, None], anchor_BQ[:, None, :]
    d_q, d_k = depth_BQ[:, :, None], depth_BQ[:, None, :]
    prefix = (d_k == 0) & (a_k <= a_q)
    own_chain = (a_k == a_q) & (d_k <= d_q)
    both_real = real_BQ[:, :, None] & real_BQ[:, None, :]
    eye_QQ = torch.eye(anchor_BQ.shape[1], dtype=torch.bool, device=anchor_BQ.device)
    return ((prefix | own_chain) & both_real) | eye_QQ


class PEagleDrafter:
    """Drafter protocol (base.py): one drafter pass per cycle drafts the K positions (module docstring).

    The drafter's KV cache (one entry per committed index, every layer) holds what EagleDrafter's holds; ``commit``
    queues the target states it is given, the newest waiting for its next token (the root); ``propose`` runs the
    queued entries and K-1 mask entries in one pass, then drops the mask entries' slots again."""

    def __init__(self, model: PEagleModel, tree: TreeSpec = TreeSpec(mode="block"), name: str | None = None,
                 max_len: int | None = None) -> None:
        tree.require_mode(BLOCK_MODES, "P-EAGLE")
        trained = model.config.num_depths
        require(tree.depth is None or tree.depth <= trained, "tree.depth", tree.depth,
                f"this P-EAGLE drafter was trained for {trained} depths (num_depths)")
        self.model, self.tree = model.eval(), tree
        depth = tree.depth or trained
        # a ddtree of num_nodes reaches no deeper than num_nodes positions
        self.depth = depth if tree.mode == "block" else min(depth, tree.num_nodes)
        self.max_draft_nodes = self.depth if tree.mode == "block" else tree.num_nodes
        self.name = name or ("peagle" if tree.mode == "block" else "peagle-ddtree")
        self.target_taps = tuple(model.target_taps)
        self.max_len = max_len or model.target_config.max_position_embeddings
        self.cache: KVCache | None = None
        self._pending_hidden_TE: torch.Tensor | None = None
        self._pending_next: list[int] = []
        self._num_committed = 0

    def _new_cache(self, num_slots: int) -> KVCache:
        config = self.model.layer_config
        return KVCache(self.model.num_draft_layers, 1, config.num_kv_heads, min(num_slots, self._max_slots),
                       config.head_dim, self.model.dtype, self.model.inv_freq.device)

    @property
    def _max_slots(self) -> int:
        return self.max_len + self.depth

    @torch.no_grad()
    def begin(self, prompt_ids: list[int], taps: dict[int, torch.Tensor]) -> None:
        self.cache = self._new_cache(2 * len(prompt_ids) + self.depth)
        self._num_committed = 0
        self._pending_hidden_TE = self.model.initial_hidden(taps)
        self._pending_next = list(prompt_ids[1:])
        assert len(self._pending_next) + 1 == self._pending_hidden_TE.shape[0], "one tap row per prompt token"

    @torch.no_grad()
    def commit(self, tokens: list[int], taps: dict[int, torch.Tensor]) -> None:
        assert self.cache is not None, "call begin() first"
        self.cache.truncate(0, self._num_committed)
        self._pending_hidden_TE, self._pending_next = queue_entries(
            self._pending_hidden_TE, self._pending_next, self.model.initial_hidden(taps), tokens)

    @torch.no_grad()
    def draft_logits(self, root_token: int) -> torch.Tensor:
        """[K, X]: one pass over the pending entries (ending with the root's) and K-1 mask entries; the root's and
        the mask entries' logits. Commits the pending entries; the mask slots are dropped."""
        assert self.cache is not None and self._pending_hidden_TE is not None, "call begin() first"
        hidden_TE, self._pending_hidden_TE = self._pending_hidden_TE, None
        K, C = self.depth, self._num_committed
        tokens = self._pending_next + [root_token] + [self.model.config.mask_token_id] * (K - 1)
        T = len(tokens)
        device = hidden_TE.device
        mask_state_E = self.model.mask_state().to(hidden_TE.dtype)
        hidden_TE = torch.cat([hidden_TE, mask_state_E.expand(K - 1, -1)])
        mask_TS = torch.ones(T, C + T, dtype=torch.bool, device=device)
        mask_TS[:, C:] = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        positions_T = torch.arange(C, C + T, device=device)
        self.cache.ensure_room(T, limit=self._max_slots)
        past = self.cache.layer_views(C) if C else None
        out_1TE, kv = self.model.forward_pass(torch.tensor(tokens, device=device)[None], hidden_TE[None],
                                              positions_T[None], past, mask_TS[None, None])
        self.cache.extend(kv)
        self._num_committed = C + T - (K - 1)
        self.cache.truncate(0, self._num_committed)
        return linear(self.model.lm_head, out_1TE[0, T - K:]).float()

    def propose(self, root_token: int, context_ids: list[int], temperature: float,
                generator: torch.Generator | None) -> DraftTree:
        return block_tree(self.tree, root_token, self.draft_logits(root_token), self.model.draft_probs,
                          self.model.d2t, temperature, generator)


def make_peagle_drafter(model: PEagleModel, target: Decoder, tree: TreeSpec, name: str) -> PEagleDrafter:
    """The registry's drafter builder."""
    return PEagleDrafter(model, tree, name)
