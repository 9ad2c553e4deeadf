"""DFlash (arXiv 2602.06036): a block-diffusion drafter that drafts a whole block in ONE forward.

Shape legend: B batch, T tokens, A anchors (blocks) per sequence, K block size, Q block tokens (A*K),
S attended keys, C committed context positions, E hidden size (the target's), H heads, D head dim, V vocab.

Architecture (papers.md, DFlash):
  context_CE = RMSNorm(Linear(concat(target taps))): num_taps target layers, evenly spaced from the 2nd to the
               3rd-from-last (`dflash_taps`), fused into one feature per committed position.
  block      = [anchor/root token, MASK x (K-1)] at positions a .. a+K-1, embedded by the TARGET's frozen embedding.
  every layer: queries from the block only; keys/values = [k_proj(context) ; k_proj(block)] (the same projections,
               RoPE at each key's own position), the block attends to itself bidirectionally.
  logits     = the TARGET's frozen LM head on the final-normed block states; slot k predicts the token at a+k.
The target's embedding and LM head are shared, never trained and never saved.

Context timing: the root (slot 0) at position L is the last emitted token, which the target has not run yet, so
the context is exactly the committed positions 0..L-1. Training mirrors that: a block anchored at position a sees
the fused target features of positions < a (the anchor's own feature is NOT visible; the anchor enters as a clean
token embedding) plus its own K slots, never another block (`anchor_block_mask`).

The mask token: ``mask_token_id`` is the tokenizer's ``<|mask|>`` id when the vocabulary has one (the embedding is
frozen, so any fixed row works as a constant input). Fallback when the target's vocabulary has no spare token:
``mask_token_id=None`` gives the drafter its own trainable ``mask_embedding`` vector (saved in the checkpoint);
no real token is repurposed, so nothing the target can emit is ever confused with a mask.

Training losses, metrics, anchors and the block mask live in ``dflash_train.py``.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from eyas.config import require
from eyas.models.config import CheckpointError, ModelConfig
from eyas.models.decoder import MLP, Decoder, RMSNorm, TensorParallel, apply_rope, rope_inv_freq
from eyas.spec.tree import DraftTree, build_best_first_block, chain

DRAFTER_TYPE = "dflash"
MASK_TOKEN = "<|mask|>"
# The paper's loss decay per block size (gamma 7 for B = 16, 5 for 10, 4 for 8).
PAPER_LOSS_DECAY = {8: 4.0, 10: 5.0, 16: 7.0}
TREES = ("block", "ddtree")


@dataclass(frozen=True)
class DFlashConfig:
    num_layers: int = 5          # drafter layers; depth is cheap, the whole block costs one forward
    block_size: int = 16         # K: the root + K-1 drafted tokens per forward
    num_taps: int = 5            # target layers fused into the context feature
    loss_decay: float = 7.0      # gamma in w_k = exp(-(k-1)/gamma); see PAPER_LOSS_DECAY
    num_anchors: int = 512       # blocks per training sequence, redrawn at every call
    mask_token_id: int | None = None  # the tokenizer's <|mask|> id; None = a learned mask embedding (module doc)

    def __post_init__(self) -> None:
        require(self.num_layers >= 1, "dflash.num_layers", self.num_layers, "must be >= 1")
        require(self.block_size >= 2, "dflash.block_size", self.block_size,
                "must be >= 2 (the root plus at least one drafted token)")
        require(self.num_taps >= 1, "dflash.num_taps", self.num_taps, "must be >= 1")
        require(self.loss_decay > 0, "dflash.loss_decay", self.loss_decay, "must be > 0")
        require(self.num_anchors >= 1, "dflash.num_anchors", self.num_anchors, "must be >= 1")
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
        k_BHSD = self.k_proj(x_BSE).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_BHSD = self.v_proj(x_BSE).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            k_BHSD = self.k_norm(k_BHSD)
        return apply_rope(k_BHSD, cos_BSD, sin_BSD), v_BHSD

    def forward(self, x_BQE: torch.Tensor, cos_BQD: torch.Tensor, sin_BQD: torch.Tensor, ctx_k_BHCD: torch.Tensor,
                ctx_v_BHCD: torch.Tensor, mask_B1QS: torch.Tensor | None) -> torch.Tensor:
        B, Q, _ = x_BQE.shape
        q_BHQD = self.q_proj(x_BQE).view(B, Q, self.num_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q_BHQD = self.q_norm(q_BHQD)
        q_BHQD = apply_rope(q_BHQD, cos_BQD, sin_BQD)
        blk_k_BHQD, blk_v_BHQD = self.project_kv(x_BQE, cos_BQD, sin_BQD)
        k_BHSD = torch.cat([ctx_k_BHCD, blk_k_BHQD], dim=2)  # S = C + Q
        v_BHSD = torch.cat([ctx_v_BHCD, blk_v_BHQD], dim=2)
        out_BHQD = F.scaled_dot_product_attention(q_BHQD, k_BHSD, v_BHSD, attn_mask=mask_B1QS, enable_gqa=True)
        return self.o_proj(out_BHQD.transpose(1, 2).reshape(B, Q, -1))


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


class DFlashModel(nn.Module):
    """The trainable DFlash drafter. ``embed_tokens`` / ``lm_head`` are the target's, held outside the module's
    parameters (not trained, not in ``state_dict``)."""

    def __init__(self, config: DFlashConfig, target_config: ModelConfig, embed_tokens: nn.Embedding,
                 lm_head: nn.Linear, target_taps: tuple[int, ...] | None = None) -> None:
        super().__init__()
        taps = tuple(target_taps) if target_taps is not None else dflash_taps(target_config.num_layers,
                                                                              config.num_taps)
        if len(taps) != config.num_taps or not all(0 <= t <= target_config.num_layers for t in taps):
            raise ValueError(f"target_taps={taps}: need dflash.num_taps={config.num_taps} layers in "
                             f"[0, {target_config.num_layers}]")
        if config.mask_token_id is not None and config.mask_token_id >= target_config.vocab_size:
            raise ValueError(f"dflash.mask_token_id={config.mask_token_id} is outside the target vocabulary "
                             f"({target_config.vocab_size}); use the tokenizer's {MASK_TOKEN} id or null")
        self.config, self.target_config, self.target_taps = config, target_config, taps
        E = target_config.hidden_size
        layer_config = replace(target_config, num_layers=config.num_layers)
        self.fc = nn.Linear(config.num_taps * E, E, bias=False)
        self.hidden_norm = RMSNorm(E, target_config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(layer_config) for _ in range(config.num_layers))
        self.norm = RMSNorm(E, target_config.rms_norm_eps)
        if config.mask_token_id is None:
            self.mask_embedding = nn.Parameter(embed_tokens.weight.detach().float().std() * torch.randn(E))
        # object.__setattr__ keeps the shared target modules out of parameters(), state_dict() and .to().
        object.__setattr__(self, "embed_tokens", embed_tokens)
        object.__setattr__(self, "lm_head", lm_head)
        self.to(device=embed_tokens.weight.device, dtype=embed_tokens.weight.dtype)
        # float32 RoPE frequencies whatever the weights' dtype (like the target's)
        self.register_buffer("inv_freq", rope_inv_freq(target_config).to(self.fc.weight.device), persistent=False)

    @classmethod
    def for_target(cls, config: DFlashConfig, target: Decoder, target_taps: tuple[int, ...] | None = None
                   ) -> "DFlashModel":
        return cls(config, target.config, target.embed_tokens, target.lm_head, target_taps)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def fuse(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        """The context feature: concat the target taps [..., T, E] -> Linear(num_taps*E -> E) -> RMSNorm."""
        missing = [t for t in self.target_taps if t not in taps]
        if missing:
            raise ValueError(f"DFlash needs target taps {self.target_taps}; missing {missing}")
        return self.hidden_norm(self.fc(torch.cat([taps[t] for t in self.target_taps], dim=-1)))

    def embed_block(self, anchors_X: torch.Tensor) -> torch.Tensor:
        """[..., K, E]: slot 0 the clean anchor (root) token, slots 1..K-1 the mask."""
        K = self.block_size
        with torch.no_grad():  # frozen, shared target embedding
            anchor_XE = self.embed_tokens(anchors_X)
            if self.config.mask_token_id is not None:
                mask_E = self.embed_tokens.weight[self.config.mask_token_id]
        if self.config.mask_token_id is None:
            mask_E = self.mask_embedding
        mask_XKE = mask_E.to(anchor_XE.dtype).expand(*anchors_X.shape, K - 1, anchor_XE.shape[-1])
        return torch.cat([anchor_XE.unsqueeze(-2), mask_XKE], dim=-2)

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

    def logits(self, hidden_XE: torch.Tensor) -> torch.Tensor:
        """The target's frozen LM head (gradients reach the drafter states, never the head)."""
        return F.linear(hidden_XE, self.lm_head.weight.detach())

    def forward(self, batch, features, generator: torch.Generator | None = None):
        """Training: ``(loss, metrics)``; forward so that DDP wrappers see the call. See dflash_train.py."""
        from eyas.drafters.dflash_train import block_loss

        return block_loss(self, batch, features, generator)

    def training_loss(self, batch, features, generator: torch.Generator | None = None):
        return self(batch, features, generator)

    # ---- checkpoints: config.json (drafter_type, target_taps, family config) + model.safetensors
    def checkpoint_config(self) -> dict:
        return {"drafter_type": DRAFTER_TYPE, "target_taps": list(self.target_taps), "dflash": asdict(self.config)}


class ContextCache:
    """Per drafter layer, the keys/values of the committed positions' fused target features.

    Only the accepted path is ever committed, so the cache only grows (no rollback). Capacity doubles as needed.
    """

    def __init__(self) -> None:
        self.k_LBHCD: list[torch.Tensor] = []
        self.v_LBHCD: list[torch.Tensor] = []
        self.length = 0

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append each layer's (k_1HAD, v_1HAD) of A new positions."""
        end = self.length + kv[0][0].shape[2]
        if not self.k_LBHCD or end > self.k_LBHCD[0].shape[2]:
            capacity = max(2 * end, 64)
            fresh = [None] * len(kv)
            self.k_LBHCD = [self._grown(old, k, capacity) for old, (k, _) in zip(self.k_LBHCD or fresh, kv)]
            self.v_LBHCD = [self._grown(old, v, capacity) for old, (_, v) in zip(self.v_LBHCD or fresh, kv)]
        for layer, (k_1HAD, v_1HAD) in enumerate(kv):
            self.k_LBHCD[layer][:, :, self.length:end] = k_1HAD
            self.v_LBHCD[layer][:, :, self.length:end] = v_1HAD
        self.length = end

    def _grown(self, old_1HCD: torch.Tensor | None, like_1HAD: torch.Tensor, capacity: int) -> torch.Tensor:
        new_1HCD = like_1HAD.new_zeros(*like_1HAD.shape[:2], capacity, like_1HAD.shape[3])
        if old_1HCD is not None:
            new_1HCD[:, :, :self.length] = old_1HCD[:, :, :self.length]
        return new_1HCD

    def view(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, :, :self.length], v[:, :, :self.length]) for k, v in zip(self.k_LBHCD, self.v_LBHCD)]


class DFlashDrafter:
    """The speculative-loop side of DFlash: one drafter forward per cycle drafts the whole block.

    tree="block":  the chain of the K-1 block positions. Greedy: each position's argmax (deterministic). With
                   temperature T > 0 each token is SAMPLED from q_k = softmax(logits_k / T) and the chain carries
                   sampled=True and the q's, so verification uses the exact p/q rule and accepts x with
                   min(1, p(x)/q(x)), whose mean sum_x min(p, q) beats the p(argmax) a deterministic chain gets
                   once the drafter is calibrated. The block is drafted in one pass, so q_k does not depend on the
                   drafted tokens before it and is exactly the distribution token k was drawn from.
    tree="ddtree": best-first over the per-position distributions (independent per position) with a budget of
                   num_nodes drafted nodes, ranks per position capped by top_k; deterministic distinct candidates
                   (sampled=False), lossless under sampling via the p(x) rule. Scores use softmax(logits / T)
                   (T = 1 when greedy).
    """

    def __init__(self, model: DFlashModel, tree: str = "block", num_nodes: int = 24, top_k: int | None = None):
        if tree not in TREES:
            raise ValueError(f"tree={tree!r}: DFlash drafts one of {list(TREES)}")
        if num_nodes < 1 or (top_k is not None and top_k < 1):
            raise ValueError(f"num_nodes={num_nodes}, top_k={top_k}: both must be >= 1")
        self.model, self.tree, self.num_nodes, self.top_k = model, tree, num_nodes, top_k
        self.name = "dflash" if tree == "block" else "dflash-ddtree"
        self.target_taps = model.target_taps
        self.context = ContextCache()

    @property
    def device(self) -> torch.device:
        return self.model.inv_freq.device

    @torch.inference_mode()
    def _commit_features(self, taps: dict[int, torch.Tensor]) -> None:
        features_1AE = self.model.fuse({t: taps[t].to(self.device)[None] for t in self.target_taps})
        start = self.context.length
        positions_1A = torch.arange(start, start + features_1AE.shape[1], device=self.device)[None]
        self.context.append(self.model.context_kv(features_1AE, positions_1A))

    def begin(self, prompt_ids: list[int], taps: dict[int, torch.Tensor]) -> None:
        self.context = ContextCache()
        self._commit_features(taps)

    def commit(self, tokens: list[int], taps: dict[int, torch.Tensor]) -> None:
        self._commit_features(taps)

    @torch.inference_mode()
    def draft_logits(self, root_token: int) -> torch.Tensor:
        """[K-1, V]: the logits of block positions 1..K-1 after the committed context."""
        K, start = self.model.block_size, self.context.length
        x_1KE = self.model.embed_block(torch.tensor([root_token], device=self.device))
        positions_1K = torch.arange(start, start + K, device=self.device)[None]
        hidden_1KE = self.model.block_hidden(x_1KE, positions_1K, self.context.view(), mask_BQS=None)
        return self.model.logits(hidden_1KE[0, 1:]).float()

    def propose(self, root_token: int, context_ids: list[int], temperature: float,
                generator: torch.Generator | None) -> DraftTree:
        if len(context_ids) - 1 != self.context.length:
            raise RuntimeError(f"DFlash holds features of {self.context.length} committed positions but the context "
                               f"has {len(context_ids) - 1} before the root: call begin() and commit() every cycle")
        logits_KV = self.draft_logits(root_token)
        probs_KV = torch.softmax(logits_KV / (temperature if temperature > 0 else 1.0), dim=-1)
        if self.tree == "ddtree":
            return build_best_first_block(root_token, probs_KV, self.num_nodes, self.top_k)
        if temperature > 0:
            tokens = torch.multinomial(probs_KV, 1, generator=generator)[:, 0].tolist()
            return chain(root_token, tokens, probs_KV, sampled=True)
        return chain(root_token, logits_KV.argmax(-1).tolist(), probs_KV)


def save_dflash(model: DFlashModel, directory: str | Path, extra: dict | None = None) -> Path:
    """Write config.json + model.safetensors (the target's embedding / LM head are not saved)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**model.checkpoint_config(), **(extra or {})}, indent=2))
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()},
              str(directory / "model.safetensors"))
    return directory


def dflash_from_checkpoint(raw: dict, state: dict[str, torch.Tensor], target: Decoder,
                           source: str = "config.json") -> DFlashModel:
    """Rebuild a DFlashModel on ``target`` from a checkpoint's config dict and tensors."""
    if raw.get("drafter_type") != DRAFTER_TYPE:
        raise CheckpointError(f"{source}: drafter_type={raw.get('drafter_type')!r}, expected {DRAFTER_TYPE!r}")
    try:
        config = DFlashConfig(**raw["dflash"])
        model = DFlashModel.for_target(config, target, tuple(raw["target_taps"]))
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{source}: not a DFlash checkpoint for this target ({err})") from None
    try:
        model.load_state_dict({k: v.to(model.inv_freq.device) for k, v in state.items()})
    except RuntimeError as err:
        raise CheckpointError(f"{source}: weights do not fit the DFlash config / target ({err})") from None
    return model.eval().requires_grad_(False)


def load_dflash(directory: str | Path, target: Decoder) -> DFlashModel:
    directory = Path(directory)
    config_path, weights_path = directory / "config.json", directory / "model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise CheckpointError(f"{path}: missing file (a DFlash checkpoint has config.json and model.safetensors)")
    return dflash_from_checkpoint(json.loads(config_path.read_text()), load_file(str(weights_path)), target,
                                  str(config_path))
