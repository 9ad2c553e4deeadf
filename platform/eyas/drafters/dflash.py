"""DFlash (arXiv 2602.06036): a block-diffusion drafter that drafts a whole block in ONE forward.

Shape legend (docs/SHAPES.md): B batch, T tokens, K drafted block slots (G - 1), S attended keys, C committed
context positions, E hidden size (the target's), H heads, D head dim, V vocab, X the draft vocabulary (V without
one); this file adds A anchors (blocks) per sequence, G block size (the root + K slots), Q block tokens (A*G), F
fused tap width (num_taps * E).

Architecture (papers.md, DFlash):
  context_CE = RMSNorm(Linear(concat(target taps))): num_taps target layers, evenly spaced from the 2nd to the
               3rd-from-last (`dflash_taps`), fused into one feature per committed position.
  block      = [anchor/root token, MASK x (G-1)] at positions a .. a+G-1, embedded by the TARGET's frozen embedding.
  every layer: queries from the block only; keys/values = [k_proj(context) ; k_proj(block)] (the same projections,
               RoPE at each key's own position), the block attends to itself bidirectionally.
  logits     = the TARGET's frozen LM head on the final-normed block states; slot k predicts the token at a+k.
The target's embedding and LM head are shared, never trained and never saved. Choice (not in the paper):
``draft_vocab_size`` reads the block through the LM-head rows of the training data's most frequent tokens only
(``eyas.drafters.vocab.FrozenReadout``, as EAGLE-1 and Medusa may): on a small target the head is most of the cost
of a training step's A*(G-1) slots and of a drafted block, so a step affords more anchors for the same time.

Context timing: the root (slot 0) at position L is the last emitted token, which the target has not run yet, so
the context is exactly the committed positions 0..L-1. Training mirrors that: a block anchored at position a sees
the fused target features of positions < a (the anchor's own feature is NOT visible; the anchor enters as a clean
token embedding) plus its own G slots, never another block (`anchor_block_mask`).

The mask token: ``mask_token_id`` is the tokenizer's ``<|mask|>`` id when the vocabulary has one (the embedding is
frozen, so any fixed row works as a constant input). Fallback when the target's vocabulary has no spare token:
``mask_token_id=None`` gives the drafter its own trainable ``mask_embedding`` vector (saved in the checkpoint);
no real token is repurposed, so nothing the target can emit is ever confused with a mask.

Training losses, metrics, anchors and the block mask live in ``dflash_train.py``. Checkpoints go through
``registry.save_drafter`` / ``load_model`` (config.json with drafter_type "dflash", target_taps and this config,
plus model.safetensors); methods ``dflash`` (tree mode "block") and ``dflash-ddtree`` (mode "ddtree").
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from eyas.config import require
from eyas.drafters.dflash_train import block_loss
from eyas.drafters.trees import BLOCK_MODES, TreeSpec, block_tree
from eyas.drafters.vocab import FrozenReadout
from eyas.models.cache import KVCache
from eyas.models.config import ModelConfig
from eyas.models.packing import InferencePacking, linear
from eyas.models.decoder import MLP, Decoder, RMSNorm, TensorParallel, apply_rope, rope_inv_freq
from eyas.decoding.tree import DraftTree

DRAFTER_TYPE = "dflash"
MASK_TOKEN = "<|mask|>"
# The paper's loss decay per block size (gamma 7 for B = 16, 5 for 10, 4 for 8).
PAPER_LOSS_DECAY = {8: 4.0, 10: 5.0, 16: 7.0}
CONTEXT_MIN_SLOTS = 64  # the context cache's first size; it doubles as needed


@dataclass(frozen=True)
class DFlashConfig:
    num_layers: int = 5          # drafter layers; depth is cheap, the whole block costs one forward
    block_size: int = 16         # G: the root + K = G-1 drafted tokens per forward
    num_taps: int = 5            # target layers fused into the context feature
    loss_decay: float = 7.0      # gamma in w_k = exp(-(k-1)/gamma); see PAPER_LOSS_DECAY
    num_anchors: int = 512       # blocks per training sequence, redrawn at every call
    mask_token_id: int | None = None  # the tokenizer's <|mask|> id; None = a learned mask embedding (module doc)
    draft_vocab_size: int | None = None  # read the block through the most frequent tokens' LM-head rows; None = all V
    init_from_target: bool = False  # start as copies of the target's last num_layers (DFlashModel.copy_target_layers)

    def __post_init__(self) -> None:
        require(self.num_layers >= 1, "dflash.num_layers", self.num_layers, "must be >= 1")
        require(self.block_size >= 2, "dflash.block_size", self.block_size,
                "must be >= 2 (the root plus at least one drafted token)")
        require(self.num_taps >= 1, "dflash.num_taps", self.num_taps, "must be >= 1")
        require(self.loss_decay > 0, "dflash.loss_decay", self.loss_decay, "must be > 0")
        require(self.num_anchors >= 1, "dflash.num_anchors", self.num_anchors, "must be >= 1")
        require(self.draft_vocab_size is None or self.draft_vocab_size >= 1, "dflash.draft_vocab_size",
                self.draft_vocab_size, "must be >= 1 (or null: the full vocabulary)")
        require(self.mask_token_id is None or self.mask_token_id >= 0, "dflash.mask_token_id", self.mask_token_id,
                "must be a token id >= 0, or null for a learned mask embedding")


PRESETS = {
    "paper": DFlashConfig(),
    "small": DFlashConfig(num_layers=3, block_size=10, num_taps=5, loss_decay=5.0, num_anchors=256),
    "tiny": DFlashConfig(num_layers=1, block_size=8, num_taps=3, loss_decay=4.0, num_anchors=64),
}


def dflash_taps(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """Target taps (HF hidden_states numbering: i = output of layer i) evenly spaced from the 2nd layer to the
    3rd-from-last, as the DFlash reference picks them (its 0-based layer ids 1 .. L-3, plus 1 for the embeddings
    entry). One tap: the middle layer. E.g. 36 layers, 5 taps -> (2, 10, 18, 26, 34)."""
    if num_taps == 1:
        return (num_target_layers // 2 + 1,)
    first, last = 2, num_target_layers - 2
    taps = tuple(int(round(first + i * (last - first) / (num_taps - 1))) for i in range(num_taps))
    if last < first or len(set(taps)) != num_taps:
        raise ValueError(f"dflash.num_taps={num_taps}: a {num_target_layers}-layer target has only "
                         f"{max(last - first + 1, 0)} layers between the 2nd and the 3rd-from-last; lower num_taps")
    return taps


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [..., D] at the given positions (the target's RoPE, computed on the fly)."""
    freqs = positions.float()[..., None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class ContextAttention(nn.Module):
    """Attention whose queries are the block tokens and whose keys/values are [context ; block]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        E, D = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, D
        self.q_proj = nn.Linear(E, self.num_heads * D, bias=config.attention_bias)
        self.k_proj = nn.Linear(E, self.num_kv_heads * D, bias=config.attention_bias)
        self.v_proj = nn.Linear(E, self.num_kv_heads * D, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * D, E, bias=config.o_proj_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(D, config.rms_norm_eps)
            self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def project_kv(self, x_BSE: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (RoPE applied) and values of S inputs: [B, H_kv, S, D] each. Used for context and block alike."""
        B, S, _ = x_BSE.shape
        k_BHSD = linear(self.k_proj, x_BSE).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_BHSD = linear(self.v_proj, x_BSE).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            k_BHSD = self.k_norm(k_BHSD)
        return apply_rope(k_BHSD, cos_BSD, sin_BSD), v_BHSD

    def forward(self, x_BQE: torch.Tensor, cos_BQD: torch.Tensor, sin_BQD: torch.Tensor, ctx_k_BHCD: torch.Tensor,
                ctx_v_BHCD: torch.Tensor, mask_B1QS: torch.Tensor | None) -> torch.Tensor:
        B, Q, _ = x_BQE.shape
        q_BHQD = linear(self.q_proj, x_BQE).view(B, Q, self.num_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q_BHQD = self.q_norm(q_BHQD)
        q_BHQD = apply_rope(q_BHQD, cos_BQD, sin_BQD)
        blk_k_BHQD, blk_v_BHQD = self.project_kv(x_BQE, cos_BQD, sin_BQD)
        k_BHSD = torch.cat([ctx_k_BHCD, blk_k_BHQD], dim=2)  # S = C + Q
        v_BHSD = torch.cat([ctx_v_BHCD, blk_v_BHQD], dim=2)
        out_BHQD = F.scaled_dot_product_attention(q_BHQD, k_BHSD, v_BHSD, attn_mask=mask_B1QS, enable_gqa=True)
        return linear(self.o_proj, out_BHQD.transpose(1, 2).reshape(B, Q, -1))


class DFlashLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = ContextAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, TensorParallel())

    def forward(self, x_BQE, cos_BQD, sin_BQD, ctx_k_BHCD, ctx_v_BHCD, mask_B1QS) -> torch.Tensor:
        x_BQE = x_BQE + self.self_attn(self.input_layernorm(x_BQE), cos_BQD, sin_BQD, ctx_k_BHCD, ctx_v_BHCD,
                                       mask_B1QS)
        return x_BQE + self.mlp(self.post_attention_layernorm(x_BQE))


class DFlashModel(FrozenReadout, InferencePacking, nn.Module):
    """The trainable DFlash drafter. The target's ``embed_tokens`` / ``lm_head`` are held outside the module's
    parameters (not trained, not in ``state_dict``, so not in checkpoints; a draft vocabulary's rows of the head are
    saved, ``FrozenReadout``)."""

    drafter_type = DRAFTER_TYPE

    def __init__(self, config: DFlashConfig, target: Decoder, draft_vocab: list[int] | None = None) -> None:
        super().__init__()
        target_config = target.config
        if config.mask_token_id is not None and config.mask_token_id >= target_config.vocab_size:
            raise ValueError(f"dflash.mask_token_id={config.mask_token_id} is outside the target vocabulary "
                             f"({target_config.vocab_size}); use the tokenizer's {MASK_TOKEN} id or null")
        self.config, self.target_config = config, target_config
        self.target_taps = dflash_taps(target_config.num_layers, config.num_taps)
        E = target_config.hidden_size
        layer_config = replace(target_config, num_layers=config.num_layers)
        self.fc = nn.Linear(config.num_taps * E, E, bias=False)
        self.hidden_norm = RMSNorm(E, target_config.rms_norm_eps)
        self.layers = nn.ModuleList(self.make_layer(layer_config) for _ in range(config.num_layers))
        self.norm = RMSNorm(E, target_config.rms_norm_eps)
        if config.mask_token_id is None:
            self.mask_embedding = nn.Parameter(target.embed_tokens.weight.detach().float().std() * torch.randn(E))
        # object.__setattr__ keeps the shared target embedding out of parameters(), state_dict() and .to().
        object.__setattr__(self, "embed_tokens", target.embed_tokens)
        self.init_readout(target.lm_head, draft_vocab, config.draft_vocab_size)
        self.to(device=target.device, dtype=target.dtype)
        # float32 RoPE frequencies whatever the weights' dtype (like the target's)
        self.register_buffer("inv_freq", rope_inv_freq(target_config).to(target.device), persistent=False)

    def make_layer(self, layer_config: ModelConfig) -> nn.Module:
        """One drafter layer (DFlash2 wraps its sublayers in dynamic convolutions)."""
        return DFlashLayer(layer_config)

    def init_fresh(self, target: Decoder) -> None:
        """A new drafter's start (registry.build_model; never a checkpoint's, whose weights are its own):
        ``init_from_target`` copies the target's last layers."""
        if self.config.init_from_target:
            self.copy_target_layers(target)

    @torch.no_grad()
    def copy_target_layers(self, target: Decoder) -> None:
        """``init_from_target``: drafter layer i starts as the target's layer L - num_layers + i, the layers whose
        output the final norm and LM head read; ``fc`` starts by passing the last tap through (the closest to those
        layers' input) and ``hidden_norm`` as the first copied layer's input norm, so the context keys and values
        start out as those layers' own. Choice (not in the paper): on a CPU budget a drafter trained from scratch
        barely learns, and the copied layers lowered the held-out loss (docs/training.md)."""
        num_layers, E = self.config.num_layers, self.target_config.hidden_size
        if num_layers > len(target.layers) or target.tp.size != 1:
            raise ValueError(f"dflash.init_from_target: needs {num_layers} layers of an unsharded target "
                             f"(it has {len(target.layers)}, tensor_parallel_size={target.tp.size})")
        copied = target.layers[len(target.layers) - num_layers:]
        for layer, source in zip(self.layers, copied):
            missing, unexpected = layer.load_state_dict(source.state_dict(), strict=False)
            own = getattr(layer, "OWN_MODULES", ())  # a DFlash2 layer's convolutions keep their identity start
            assert not unexpected and all(name.split(".")[0] in own for name in missing), (missing, unexpected)
        self.fc.weight.zero_()
        self.fc.weight[:, (self.config.num_taps - 1) * E:] = torch.eye(E)
        self.hidden_norm.load_state_dict(copied[0].input_layernorm.state_dict())

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_drafted(self) -> int:
        """Tokens one block drafts: slots 1..G-1 predict their own positions (DSpark's slots 0..G-1 the next)."""
        return self.config.block_size - 1

    def fuse(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        """The context feature: concat the target taps [..., T, E] -> Linear(num_taps*E -> E) -> RMSNorm."""
        missing = [t for t in self.target_taps if t not in taps]
        if missing:
            raise ValueError(f"DFlash needs target taps {self.target_taps}; missing {missing}")
        concat_TF = torch.cat([taps[t] for t in self.target_taps], dim=-1).to(self.fc.weight.dtype)
        return self.hidden_norm(linear(self.fc, concat_TF))

    def embed_block(self, anchors: torch.Tensor) -> torch.Tensor:
        """[..., G, E]: slot 0 the clean anchor (root) token, slots 1..G-1 the mask."""
        G = self.block_size
        with torch.no_grad():  # frozen, shared target embedding
            anchor_E = self.embed_tokens(anchors).to(self.fc.weight.dtype)
            if self.config.mask_token_id is not None:
                mask_E = self.embed_tokens.weight[self.config.mask_token_id]
        if self.config.mask_token_id is None:
            mask_E = self.mask_embedding
        mask_KE = mask_E.to(anchor_E.dtype).expand(*anchors.shape, G - 1, anchor_E.shape[-1])
        return torch.cat([anchor_E.unsqueeze(-2), mask_KE], dim=-2)

    def context_kv(self, features_BCE: torch.Tensor, positions_BC: torch.Tensor
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys/values of the fused context features: [(k_BHCD, v_BHCD)] per layer."""
        cos_BCD, sin_BCD = rope_cos_sin(self.inv_freq, positions_BC, features_BCE.dtype)
        return [layer.self_attn.project_kv(features_BCE, cos_BCD, sin_BCD) for layer in self.layers]

    def block_hidden(self, x_BQE: torch.Tensor, positions_BQ: torch.Tensor,
                     context_kv: list[tuple[torch.Tensor, torch.Tensor]], mask_BQS: torch.Tensor | None
                     ) -> torch.Tensor:
        """Run the drafter layers over the block tokens; returns the final-normed states [B, Q, E].
        mask_BQS (True = attend) over [context ; block] keys; None = everything visible (inference)."""
        cos_BQD, sin_BQD = rope_cos_sin(self.inv_freq, positions_BQ, x_BQE.dtype)
        mask_B1QS = mask_BQS.unsqueeze(1) if mask_BQS is not None else None
        for layer, (ctx_k_BHCD, ctx_v_BHCD) in zip(self.layers, context_kv):
            x_BQE = layer(x_BQE, cos_BQD, sin_BQD, ctx_k_BHCD, ctx_v_BHCD, mask_B1QS)
        return self.norm(x_BQE)

    def logits(self, hidden_E: torch.Tensor) -> torch.Tensor:
        """[..., X]: the target's frozen LM head, or its draft-vocabulary rows (gradients reach the drafter states,
        never the head)."""
        return self.readout(hidden_E)

    def forward(self, batch, features, generator: torch.Generator | None = None):
        """Training: ``(loss, metrics)`` of one batch (dflash_train.block_loss). Anchors are redrawn on every call
        from ``generator`` (default: torch's global RNG); in eval mode without a generator they come from a fixed
        seed, so held-out metrics are comparable across evaluations."""
        if generator is None and not self.training:
            generator = torch.Generator(device=self.inv_freq.device).manual_seed(0)
        return block_loss(self, batch, features, generator)

    def training_loss(self, batch, features, generator: torch.Generator | None = None):
        return self(batch, features, generator)


class DFlashDrafter:
    """The speculative-loop side of DFlash: one drafter forward per cycle drafts the whole block.

    mode="block":  the chain of the G-1 block positions (the first tree.depth of them when set: a shorter chain
                   costs fewer LM-head rows and a smaller verify; the block still runs whole). Greedy: each
                   position's argmax (deterministic). With temperature T > 0 each token is SAMPLED from
                   q_k = softmax(logits_k / T) and the chain carries sampled=True and the q's, so verification uses
                   the exact p/q rule and accepts x with min(1, p(x)/q(x)), whose mean sum_x min(p, q) beats the
                   p(argmax) a deterministic chain gets once the drafter is calibrated. The block is drafted in one
                   pass, so q_k does not depend on the drafted tokens before it and is exactly the distribution
                   token k was drawn from.
    mode="ddtree": best-first over the per-position distributions (taken as independent) with a budget of
                   num_nodes drafted nodes, ranks per position capped by top_k, positions by tree.depth;
                   deterministic distinct candidates (sampled=False), lossless under sampling via the p(x) rule.
                   Scores use softmax(logits / T) (T = 1 when greedy).
    """

    TREE_MODES = BLOCK_MODES

    def __init__(self, model: DFlashModel, tree: TreeSpec = TreeSpec(mode="block"), name: str | None = None):
        tree.require_mode(self.TREE_MODES, type(model).__name__.removesuffix("Model"))
        whole = model.num_drafted
        require(tree.depth is None or tree.depth <= whole, "tree.depth", tree.depth,
                f"a block of block_size={model.block_size} drafts at most {whole} positions")
        self.model, self.tree = model, tree
        # the positions read through the LM head (its cost per cycle): a ddtree of num_nodes reaches no deeper
        self.depth = min(tree.depth or whole, whole if tree.mode == "block" else tree.num_nodes)
        self.max_draft_nodes = self.depth if tree.mode == "block" else tree.num_nodes
        self.name = name or ("dflash" if tree.mode == "block" else "dflash-ddtree")
        self.target_taps = model.target_taps
        self.context = self._new_context()

    def _new_context(self) -> KVCache:
        """The context cache: per drafter layer, the keys/values of the committed positions' fused target features.
        Only the accepted path is ever committed, so it only grows (no rollback); it starts small and doubles."""
        config = self.model.target_config
        return KVCache(self.model.config.num_layers, 1, config.num_kv_heads, CONTEXT_MIN_SLOTS, config.head_dim,
                       self.model.fc.weight.dtype, self.device)

    @property
    def device(self) -> torch.device:
        return self.model.inv_freq.device

    @torch.inference_mode()
    def _commit_features(self, taps: dict[int, torch.Tensor]) -> None:
        features_1TE = self.model.fuse({t: taps[t].to(self.device)[None] for t in self.target_taps})
        start = self.context.lengths[0]
        positions_1T = torch.arange(start, start + features_1TE.shape[1], device=self.device)[None]
        self.context.ensure_room(features_1TE.shape[1])
        self.context.extend(self.model.context_kv(features_1TE, positions_1T))

    def begin(self, prompt_ids: list[int], taps: dict[int, torch.Tensor]) -> None:
        self.context = self._new_context()
        self._commit_features(taps)

    def commit(self, tokens: list[int], taps: dict[int, torch.Tensor]) -> None:
        self._commit_features(taps)

    @torch.inference_mode()
    def draft_states(self, root_token: int) -> torch.Tensor:
        """[G, E]: the final-normed drafter states of the block [root, MASK x (G-1)] after the committed context,
        one forward (the block's positions attend to each other)."""
        G, start = self.model.block_size, self.context.lengths[0]
        x_1GE = self.model.embed_block(torch.tensor([root_token], device=self.device))
        positions_1G = torch.arange(start, start + G, device=self.device)[None]
        return self.model.block_hidden(x_1GE, positions_1G, self.context.layer_views(start), mask_BQS=None)[0]

    @torch.inference_mode()
    def draft_logits(self, root_token: int) -> torch.Tensor:
        """[K, X]: the logits (over the draft vocabulary, X = V without one) of block positions 1..K (K =
        ``self.depth`` <= G-1) after the committed context. The whole block still runs through the drafter layers."""
        return self.model.logits(self.draft_states(root_token)[1:1 + self.depth]).float()

    def check_context(self, context_ids: list[int]) -> None:
        if len(context_ids) - 1 != self.context.lengths[0]:
            raise RuntimeError(f"{self.name} holds features of {self.context.lengths[0]} committed positions but "
                               f"the context has {len(context_ids) - 1} before the root: call begin() and commit() "
                               "every cycle")

    def propose(self, root_token: int, context_ids: list[int], temperature: float,
                generator: torch.Generator | None) -> DraftTree:
        self.check_context(context_ids)
        return block_tree(self.tree, root_token, self.draft_logits(root_token), self.model.draft_probs,
                          self.model.d2t, temperature, generator)


def make_dflash_drafter(model: DFlashModel, target: Decoder, tree: TreeSpec, name: str) -> DFlashDrafter:
    """The registry's drafter builder."""
    return DFlashDrafter(model, tree, name)
