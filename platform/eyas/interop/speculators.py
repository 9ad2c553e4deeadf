"""The ``speculators`` package's format (vllm-project/speculators 0.9.0, which vLLM also serves).

Checked against the installed speculators 0.9.0 source: models/eagle3/config.py (Eagle3SpeculatorConfig:
``transformer_layer_config``, ``draft_vocab_size``, ``norm_before_residual`` (default False here; vLLM's
speculators adapter update_eagle3 defaults it to True when absent, so eyas always writes it), ``target_hidden_size``,
``eagle_aux_hidden_state_layer_ids``, ``norm_before_fc`` / ``fc_norm`` / ``norm_output`` (EAGLE-3.1: eyas writes and
reads ``fc_norm`` and ``norm_output``, refuses ``norm_before_fc``, a single norm over the whole 3E it does not have)),
models/peagle/config.py + core.py (PEagleSpeculatorConfig: eagle3's fields, ``speculators_model_type`` "peagle",
``mask_token_id``; PEagleDraftModel: ``mask_hidden`` [1, 1, num_aux * E], layers ``layers.{i}``),
models/eagle3/core.py (Eagle3DraftModel: ``fc``, ``layers.0.*`` whose first layer splits
cat(embeds, hidden), normalises each and keeps the un-normed hidden as residual, ``norm``, ``lm_head`` over the
draft vocab, ``embed_tokens`` [V, E] and the ``d2t`` / ``t2d`` buffers only when draft vocab < vocab),
models/dflash/config.py + core.py (DFlashSpeculatorConfig: ``aux_hidden_state_layer_ids``, top-level
``mask_token_id``, ``block_size``, ``sample_from_anchor``, ``sliding_window_non_causal``; DFlashDraftModel: Qwen3
layers with q/k norms, ``fc`` + ``hidden_norm`` over the context, its own ``embed_tokens`` / ``lm_head``) and
config.py (``speculators_config``: algorithm, proposal_methods, default_proposal_method, verifier),
models/dspark/config.py + core.py (DSparkSpeculatorConfig: DFlash's fields with ``sample_from_anchor`` default true,
``markov_rank``, ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``; DSparkDraftModel:
``markov_head.markov_w{1,2}``, ``confidence_head.proj``; proposal tokens = block_size) and models/dflash2/config.py +
core.py (DFlash2SpeculatorConfig: ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``,
the full verifier vocabulary; DFlash2DraftModel: ``layers.{i}.{attention,mlp}_conv.*``, ``candidate_selector.*``).
vLLM maps a speculators ``dspark`` to its DSpark model (algos.py update_dspark); it has no ``dflash2`` adapter yet
(speculators docs/algorithms/dflash2.md), so a speculators DFlash2 export is for speculators itself and eyas.

Layer ids: speculators' ids are vLLM capture points, HF numbering (vLLM's speculators adapter passes
eagle_aux_hidden_state_layer_ids through for EAGLE-3 and, for DFlash, sets eagle_aux_hidden_state_layer_ids = ids and
dflash_config.target_layer_ids = ids - 1). ``sliding_window_non_causal`` is written true: speculators keeps full
attention bidirectional either way, but vLLM's adapter sets dflash_config.causal = not sliding_window_non_causal.
"""
from __future__ import annotations

from typing import Any

import torch

from eyas.interop import dflash, dflash2, eagle3, layer_ids
from eyas.models.config import CheckpointError
from eyas.models.decoder import Decoder

VERSION = "0.9.0"
VERIFIER_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                          "mistral": "MistralForCausalLM"}
TOP_LEVEL = ("architectures", "torch_dtype", "vocab_size")
# the DFlash family: speculators' architecture name (its config default), its own config fields, fixed flags
BLOCK_ARCHITECTURES = {"dflash": "DFlashSpeculator", "dspark": "DSparkSpeculator", "dflash2": "DFlash2DraftModel"}
BLOCK_FIELDS = {"dflash": (), "dspark": ("markov_rank", "markov_head_type"), "dflash2": dflash2.FIELDS}
BLOCK_FLAGS = {"dflash": {}, "dspark": {"enable_confidence_head": True, "confidence_head_with_markov": True},
               "dflash2": {}}
# speculators 0.9.0's defaults for keys a config may leave out (models/dspark/config.py, models/dflash2/config.py)
BLOCK_DEFAULTS = {"dflash": {}, "dspark": {"markov_rank": 256, "markov_head_type": "vanilla",
                                           "enable_confidence_head": True, "confidence_head_with_markov": True},
                  "dflash2": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}}


def _rope_parameters(layer: dict[str, Any]) -> dict[str, Any]:
    scaling = dict(layer.pop("rope_scaling", None) or {"rope_type": "default"})
    return {"rope_theta": layer.pop("rope_theta"), **scaling}


def _speculators_block(algorithm: str, num_tokens: int, target_config, target_ref: str) -> dict[str, Any]:
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(target_ref),
                         "architectures": [VERIFIER_ARCHITECTURES[target_config.model_type]]}}


def eagle3_config(model, target_ref: str) -> dict[str, Any]:
    """EAGLE-3 and EAGLE-3.1 as speculators' ``eagle3``, P-EAGLE as its ``peagle``."""
    layer = {k: v for k, v in eagle3.llama_layer_config(model).items() if k not in ("torch_dtype",)}
    layer["rope_parameters"] = _rope_parameters(layer)
    target = model.target_config
    kind = "peagle" if model.drafter_type == "peagle" else "eagle3"
    num_tokens = model.config.num_depths if kind == "peagle" else model.config.ttt_steps
    config = {"architectures": ["PEagleSpeculator" if kind == "peagle" else "Eagle3Speculator"],
              "speculators_model_type": kind, "speculators_version": VERSION, "transformer_layer_config": layer,
              "draft_vocab_size": len(model.draft_vocab) if model.draft_vocab else target.vocab_size,
              "norm_before_residual": False, "target_hidden_size": target.hidden_size,
              "eagle_aux_hidden_state_layer_ids": eagle3.engine_ids(model, "vllm-eagle3"),
              "norm_before_fc": False, "fc_norm": bool(model.config.fc_norm),
              "norm_output": bool(getattr(model.config, "norm_output", False)),
              "speculators_config": _speculators_block(kind, num_tokens, target, target_ref)}
    if kind == "peagle":
        config["mask_token_id"] = model.config.mask_token_id
    return config


def eagle3_weights(model) -> dict[str, torch.Tensor]:
    state = {}
    for name, tensor in eagle3.export_weights(model).items():
        state["layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name] = tensor
    if not model.draft_vocab:  # speculators registers d2t / t2d only for a reduced draft vocabulary
        state.pop("d2t", None), state.pop("t2d", None)  # (eagle3.export_weights writes none for the full one)
    state["embed_tokens.weight"] = model.frozen.embed.weight.detach().float().contiguous().cpu()
    return state


def dflash_config(model, target_ref: str) -> dict[str, Any]:
    """DFlash as speculators' ``dflash``, DSpark as its ``dspark`` (slot 0 drafts: block_size tokens), DFlash2 as
    its ``dflash2`` (the full vocabulary, which it requires), each with its own keys at the top level."""
    kind = model.drafter_type
    engine = dflash.export_config(model)
    layer = {k: v for k, v in engine.items() if k not in ("architectures", "torch_dtype", "block_size",
                                                          "num_target_layers", "dflash_config")}
    layer["rope_parameters"] = _rope_parameters(layer)
    layer["layer_types"] = ["full_attention"] * model.config.num_layers
    target, block_size = model.target_config, model.config.block_size
    from_anchor = kind == "dspark"
    return {"architectures": [BLOCK_ARCHITECTURES[kind]], "speculators_model_type": kind,
            "speculators_version": VERSION, "transformer_layer_config": layer, "draft_vocab_size": target.vocab_size,
            "block_size": block_size, "target_hidden_size": target.hidden_size,
            "aux_hidden_state_layer_ids": list(model.target_taps), "mask_token_id": model.config.mask_token_id,
            "sliding_window_non_causal": True, "sample_from_anchor": from_anchor,
            **{name: getattr(model.config, name) for name in BLOCK_FIELDS[kind]}, **BLOCK_FLAGS[kind],
            "speculators_config": _speculators_block(kind, block_size if from_anchor else block_size - 1, target,
                                                     target_ref)}


def dflash_weights(model) -> dict[str, torch.Tensor]:
    state = dflash.export_weights(model)
    state["embed_tokens.weight"] = model.embed_tokens.weight.detach().float().contiguous().cpu()
    state["lm_head.weight"] = model.target_head[0].weight.detach().float().contiguous().cpu()
    return state


# ---- import ------------------------------------------------------------------------------------------------

def drafter_type(config: dict[str, Any], where) -> str:
    kind = config.get("speculators_model_type") or (config.get("speculators_config") or {}).get("algorithm")
    if kind not in ("eagle3", "peagle", *BLOCK_ARCHITECTURES):
        raise CheckpointError(f"{where}: speculators model type {kind!r}; eyas reads eagle3, peagle, dflash, dspark "
                              "and dflash2 speculators")
    if kind == "eagle3":
        return eagle3.drafter_type(config)
    return kind


def _layer(config: dict[str, Any]) -> dict[str, Any]:
    layer = dict(config.get("transformer_layer_config") or {})
    rope = dict(layer.pop("rope_parameters", None) or {})
    if rope:
        layer["rope_theta"] = rope.pop("rope_theta", layer.get("rope_theta"))
        if rope.get("rope_type", "default") != "default":
            layer["rope_scaling"] = rope
    return layer


def _same_as_target(state: dict[str, torch.Tensor], name: str, weight: torch.Tensor, where) -> None:
    if name in state and not torch.equal(state.pop(name).to(weight), weight):
        raise CheckpointError(f"{where}: {name} differs from the target's; eyas's drafters use the target's own")


def to_engine(config: dict[str, Any], state: dict[str, torch.Tensor], target: Decoder, where
              ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A speculators checkpoint -> (the engine-style config and tensor names eagle3.py / dflash.py import)."""
    state = {k: v for k, v in state.items() if not k.startswith(("verifier_lm_head.", "verifier_norm."))}
    layer, kind = _layer(config), drafter_type(config, where)
    if kind in eagle3.DRAFTER_TYPES:
        if config.get("norm_before_fc"):
            raise CheckpointError(f"{where}: norm_before_fc=true (one norm over the concatenated taps); eyas's EAGLE-3 "
                                  "family has fc_norm (a norm per tap) instead")
        if "norm_before_residual" not in config:
            raise CheckpointError(f"{where}: no norm_before_residual; speculators defaults it to false and vLLM to "
                                  "true, so the residual convention is ambiguous")
        engine = {**layer, "draft_vocab_size": config.get("draft_vocab_size"),
                  "norm_before_residual": config["norm_before_residual"],
                  "eagle_aux_hidden_state_layer_ids": config.get("eagle_aux_hidden_state_layer_ids")}
        if config.get("target_hidden_size") is not None:
            engine["target_hidden_size"] = config["target_hidden_size"]
        engine.update({flag: True for flag in ("fc_norm", "norm_output") if config.get(flag)})
        if kind == "peagle":
            engine.update(parallel_drafting=True, mask_token_id=config.get("mask_token_id"))
        renamed = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
        return engine, renamed
    from_anchor = config.get("sample_from_anchor", kind == "dspark")  # speculators' default per type
    if from_anchor != (kind == "dspark"):
        raise CheckpointError(f"{where}: a speculators {kind} with sample_from_anchor={from_anchor}; eyas's {kind} "
                              + ("drafts from the anchor slot too (slot k predicts anchor + k + 1)" if kind == "dspark"
                                 else "drafts block slots 1..G-1 after a bonus-token anchor"))
    types = set(layer.pop("layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        raise CheckpointError(f"{where}: layer_types {sorted(types)}; eyas's DFlash layers are full attention")
    ids = config.get("aux_hidden_state_layer_ids") or []
    taps = layer_ids.from_engine([i - 1 for i in ids], target.config.num_layers, "dflash")  # HF = speculators id
    own = {**BLOCK_DEFAULTS[kind], **{k: config[k] for k in BLOCK_DEFAULTS[kind] if config.get(k) is not None}}
    engine = {**layer, "block_size": config.get("block_size"), "draft_vocab_size": config.get("draft_vocab_size"),
              "target_hidden_size": config.get("target_hidden_size"), "sample_from_anchor": from_anchor,
              "dflash_config": {"mask_token_id": config.get("mask_token_id"),
                                "target_layer_ids": layer_ids.to_engine(taps, target.config.num_layers, "dflash"),
                                **own}}
    _same_as_target(state, "embed_tokens.weight", target.embed_tokens.weight, where)
    _same_as_target(state, "lm_head.weight", target.lm_head.weight, where)
    return engine, state
