"""DFlash drafters in the engines' layout (``DFlashDraftModel``) and back.

Checked against: SGLang models/dflash.py (DFlashDraftModel: ``layers.*`` Qwen3-style layers with per-head q_norm /
k_norm ALWAYS present, bidirectional (ENCODER_ONLY) attention when config.layer_types is absent, SiLU MLP;
``fc`` [E, K*E] then ``hidden_norm`` over the concatenated target features; final ``norm``; no embedding or LM
head: the target's are used) and speculative/dflash_utils.py (parse_dflash_draft_config: ``block_size`` top
level or in dflash_config, ``dflash_config.target_layer_ids`` "output of layer j", ``mask_token_id``; without
target_layer_ids it picks num_DRAFT_LAYERS ids by its own rule, so eyas always writes them); vLLM
models/qwen3_dflash.py (the same names; context K/V = k_norm(k_proj(hidden_norm(fc(features)))) with RoPE at the
context positions; causal only when config.is_causal / dflash_config.causal / sliding layer_types say so; a
separate ``mask_embedding`` tensor REPLACES embed_tokens[mask_token_id] wherever that id appears).

eyas's DFlash (drafters/dflash.py) computes the same thing when the target has q/k norms (Qwen3) and no biases;
its weights then map name for name. Refused, with the difference named: a target without qk_norm (eyas's layer
has no q/k norm then; the engines' always normalise), biases, a learned mask embedding (mask_token_id null: the
engines embed the mask through a token id, and vLLM's mask_embedding would also replace that id as an anchor),
taps an engine cannot capture.
"""
from __future__ import annotations

from typing import Any

import torch

from eyas.config import from_dict
from eyas.drafters.dflash import DFlashConfig, DFlashModel, dflash_taps
from eyas.interop import layer_ids
from eyas.models.config import CheckpointError
from eyas.models.decoder import Decoder

ARCHITECTURE = "DFlashDraftModel"


def check_exportable(model: DFlashModel) -> None:
    target, kind = model.target_config, model.drafter_type
    if model.draft_vocab is not None:
        raise CheckpointError(f"this {kind} drafter reads a draft vocabulary ({kind}.draft_vocab_size); the engines' "
                              "DFlash-family models read the target's whole LM head. Train it without one to export it")
    if not target.qk_norm:
        raise CheckpointError(f"a {kind} drafter for a {target.model_type} target without q/k norms cannot be exported: "
                              "the engines' DFlashDraftModel always applies per-head q_norm/k_norm (Qwen3 layers), "
                              "eyas's layer for this target does not")
    if target.attention_bias or target.o_proj_bias or target.mlp_bias:
        raise CheckpointError(f"a {kind} drafter with attention/MLP biases cannot be exported exactly: the engines tie "
                              "o_proj's bias to attention_bias and have no MLP bias")
    if model.config.mask_token_id is None:
        raise CheckpointError(f"this {kind} drafter uses a learned mask embedding ({kind}.mask_token_id null); the "
                              "engines embed the mask through a token id (dflash_config.mask_token_id). Retrain with "
                              "the tokenizer's <|mask|> id to export it")


def export_config(model: DFlashModel, engine: str = "vllm") -> dict[str, Any]:
    """config.json of ``model`` for ``engine``: SGLang and vLLM read the same DFlashDraftModel layout."""
    check_exportable(model)
    target, config = model.target_config, model.config
    return {"architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_size": target.hidden_size,
            "intermediate_size": target.intermediate_size, "num_attention_heads": target.num_heads,
            "num_key_value_heads": target.num_kv_heads, "head_dim": target.head_dim,
            "num_hidden_layers": config.num_layers, "hidden_act": "silu", "rms_norm_eps": target.rms_norm_eps,
            "rope_theta": target.rope_theta, "rope_scaling": target.rope_scaling,
            "max_position_embeddings": target.max_position_embeddings, "vocab_size": target.vocab_size,
            "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32",
            "block_size": config.block_size, "num_target_layers": target.num_layers,
            "dflash_config": {"mask_token_id": config.mask_token_id,
                              "target_layer_ids": layer_ids.to_engine(model.target_taps, target.num_layers, "dflash")}}


def export_weights(model: DFlashModel) -> dict[str, torch.Tensor]:
    check_exportable(model)
    return {name: tensor.detach().float().contiguous().cpu() for name, tensor in model.state_dict().items()}


def _require_equal(where: str, name: str, value: Any, expected: Any, meaning: str) -> None:
    if value is not None and value != expected:
        raise CheckpointError(f"{where}: {name}={value!r} but {meaning} is {expected!r}; eyas's DFlash cannot "
                              "represent that drafter exactly")


def import_config(config: dict[str, Any], target: Decoder, where: str, eyas_block: dict[str, Any] | None,
                  config_cls: type[DFlashConfig] = DFlashConfig, family_fields: dict[str, Any] | None = None
                  ) -> DFlashConfig:
    """The ``config_cls`` (DFlash's, or DSpark's / DFlash2's with ``family_fields``: what their own keys set) an
    engine checkpoint describes, checked against ``target``; eyas's own exports carry an ``eyas`` block with the
    training-only settings, whose architecture must agree with the engine keys."""
    t = target.config
    family_fields = family_fields or {}
    dflash = config.get("dflash_config") or {}
    if not t.qk_norm:
        raise CheckpointError(f"{where}: a DFlashDraftModel normalises q/k per head; eyas's DFlash layer for this "
                              f"{t.model_type} target (qk_norm false) does not, so it cannot run this drafter")
    for name, expected, meaning in (("hidden_size", t.hidden_size, "the target's hidden size"),
                                    ("target_hidden_size", t.hidden_size, "the target's hidden size"),
                                    ("vocab_size", t.vocab_size, "the target's vocab size"),
                                    ("num_target_layers", t.num_layers, "the target's layer count"),
                                    ("num_attention_heads", t.num_heads, "the target's head count"),
                                    ("num_key_value_heads", t.num_kv_heads, "the target's kv heads"),
                                    ("head_dim", t.head_dim, "the target's head dim"),
                                    ("intermediate_size", t.intermediate_size, "the target's MLP width"),
                                    ("rms_norm_eps", t.rms_norm_eps, "the target's norm eps"),
                                    ("rope_theta", t.rope_theta, "the target's rope theta"),
                                    ("hidden_act", "silu", "eyas's activation"),
                                    ("attention_bias", False, "eyas's DFlash layer (no biases)"),
                                    ("is_causal", False, "eyas's block attention (bidirectional)"),
                                    ("fc_norm", False, "eyas's context fusion (fc then hidden_norm, no norm per tap)"),
                                    ("draft_vocab_size", t.vocab_size, "the target's vocab (DFlash uses its LM head)")):
        _require_equal(where, name, config.get(name), expected, meaning)
    if set(config.get("layer_types") or ["full_attention"]) != {"full_attention"}:
        raise CheckpointError(f"{where}: layer_types {config['layer_types']}; eyas's DFlash layers are full attention "
                              "(no sliding window)")
    _require_equal(where, "dflash_config.causal", dflash.get("causal"), False, "eyas's block attention")
    _require_equal(where, "dflash_config.projector_type", dflash.get("projector_type"), None, "eyas's (plain fc)")
    mask_token_id = dflash.get("mask_token_id", config.get("mask_token_id"))
    if mask_token_id is None:
        raise CheckpointError(f"{where}: no dflash_config.mask_token_id; eyas would not know which embedding row the "
                              "drafter was trained with as its mask")
    ids = dflash.get("target_layer_ids", config.get("target_layer_ids"))
    if not ids:
        raise CheckpointError(f"{where}: no dflash_config.target_layer_ids; the engines would pick layers by their "
                              "own rule, so the training layers are unknown")
    taps = layer_ids.from_engine(ids, t.num_layers, "dflash")
    block_size = dflash.get("block_size", config.get("block_size")) or config_cls().block_size
    derived = config_cls(num_layers=int(config["num_hidden_layers"]), block_size=int(block_size),
                         num_taps=len(taps), mask_token_id=int(mask_token_id), **family_fields)
    if eyas_block is not None:
        saved = from_dict(config_cls, eyas_block, prefix="eyas.config.")
        names = ("num_layers", "block_size", "num_taps", "mask_token_id", *family_fields)
        if any(getattr(saved, name) != getattr(derived, name) for name in names):
            raise CheckpointError(f"{where}: the eyas block disagrees with the engine keys ({', '.join(names)}); "
                                  "was config.json edited by hand?")
        derived = saved
    expected = dflash_taps(t.num_layers, derived.num_taps)
    if taps != expected:
        raise CheckpointError(f"{where}: target_layer_ids {list(ids)} (HF hidden_states {list(taps)}) differ from the "
                              f"layers eyas's DFlash reads for {derived.num_taps} taps of a {t.num_layers}-layer target "
                              f"({list(expected)}, drafters/dflash.py dflash_taps)")
    return derived


def import_weights(state: dict[str, torch.Tensor], where: str, own_prefixes: tuple[str, ...] = ()
                   ) -> dict[str, torch.Tensor]:
    """Engine tensors -> eyas's state_dict (the same names); ``own_prefixes`` name a family's modules, whose biases
    are its own (DSpark's confidence head)."""
    extra = sorted(k for k in state if (k.endswith(".bias") and not k.startswith(own_prefixes))
                   or k.startswith(("embed_tokens", "lm_head", "mask_embedding", "model.")))
    if extra:
        raise CheckpointError(f"{where}: tensors {extra[:4]} have no counterpart in eyas's DFlash (it uses the "
                              "target's embedding and LM head, a token-id mask and no biases)")
    return dict(state)
