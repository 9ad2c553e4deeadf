"""EAGLE-3 drafters in the engines' layout (``LlamaForCausalLMEagle3`` / ``Eagle3LlamaForCausalLM``) and back.

Checked against the engines' own model files: SGLang models/llama_eagle3.py (LlamaForCausalLMEagle3: ``fc``
[E, 3*target_hidden_size], ``midlayer`` whose q/k/v take concat(input_layernorm(embeds), hidden_norm(hidden)) and
whose residual is the un-normed hidden state, final ``norm``, ``lm_head`` over ``draft_vocab_size``; load_weights
reads ``d2t`` as "target id minus draft id" (hot_token_id = d2t + arange) and skips ``t2d`` and unknown names);
vLLM models/llama_eagle3.py (the same names, ``midlayer.`` -> ``layers.0.``, ``d2t`` -> draft_id_to_target_id with
targets = arange + d2t, ``norm_before_residual`` false = residual before hidden_norm, embed_tokens shared with the
target when the checkpoint has none); SpecForge specforge/export/to_sglang.py (identity names midlayer.* / fc / norm
/ lm_head plus t2d / d2t, embeddings dropped) and its vocab mapping (d2t = used ids - arange, t2d a bool mask over the
target vocab). eyas's EAGLE-3 layer (drafters/eagle.py DraftLayer, two_stream) computes the
same thing, so the weights map name for name:

  eyas                       engines
  layer.<name>               midlayer.<name>      (input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj,
                                                   post_attention_layernorm, mlp.{gate,up,down}_proj)
  fc / norm / lm_head        fc / norm / lm_head
  draft_vocab (target ids)   d2t[x] = id - x (int64), t2d[id] = id in the draft vocab (bool)
The embedding is the target's and is not written. What cannot be written exactly is refused: a tap count other
than 3 (the engines' fc takes three target layers), taps an engine cannot capture (layer_ids.py).

EAGLE-3.1 and P-EAGLE are the same layout with more (papers.md; vLLM PRs #42764 and #32887, speculators 0.9.0
models/eagle3 and models/peagle): ``fc_norm.{0,1,2}.weight`` (a norm per tap before fc) with ``"fc_norm": true``;
``"norm_output": true`` (no tensor); P-EAGLE's ``"parallel_drafting": true``, ``mask_hidden`` [1, 1, 3E] and its mask
id written as both ``mask_token_id`` and ``pard_token`` (older vLLM reads only the latter), and its later layers as
``layers.{i}.*`` beside ``midlayer.*`` (vLLM loads midlayer as layers.0). Checked against vLLM 0.32.0's
model_executor/models/llama_eagle3.py (``fc_norm`` and ``norm_output`` read from the config, ``fc_norm.{i}`` one
RMSNorm per aux state, ``mask_hidden`` loaded as view(1, -1)) and v1/spec_decode/llm_base_proposer.py (the mask id
looked up as mask_token_id, then pard_token); vLLM takes ``parallel_drafting`` itself from the speculative config,
so the copy in config.json is what eyas's import reads. SGLang serves no parallel drafting, so a P-EAGLE drafter is
not written for it. Import picks the family from the same keys.

SGLang and EAGLE-3.1 (SGLang's models/llama_eagle3.py, LlamaForCausalLMEagle3): the SGLang export writes the same
keys as vLLM's, which is what an SGLang that serves EAGLE-3.1 reads: ``fc_norm`` (or its older spelling
``use_aux_norm``) builds one RMSNorm(target_hidden_size, rms_norm_eps) per aux state, counted from
``eagle_config.eagle_aux_hidden_state_layer_ids``, applied chunk by chunk to the 3E-wide target input before ``fc``;
``fc_norm.{i}.weight`` (older names ``aux_norm_{low,mid,high}``) load as ``model.fc_norm.{i}.weight``;
``norm_output`` (default false) feeds the post-norm state to the next step. Older SGLang (the sgl-project/sglang
llama_eagle3.py at 03d5a777 and d737979c) has neither flag, and its load_weights skips every tensor it has no
parameter for: it serves an EAGLE-3.1 export as a plain EAGLE-3 with the per-tap norms dropped and the pre-norm state
fed forward, without an error (still lossless, a different drafter). So the README of an EAGLE-3.1 SGLang export names
that requirement, and import reads SGLang's older spellings as ``fc_norm`` too (``SGLANG_FC_NORM_NAMES``).
"""
from __future__ import annotations

from typing import Any

import torch

from eyas.config import from_dict
from eyas.drafters.eagle import DraftLayerConfig
from eyas.drafters.eagle3 import Eagle3Config, Eagle3Model, Eagle31Config, eagle3_taps
from eyas.drafters.peagle import PEagleConfig
from eyas.interop import layer_ids
from eyas.models.config import CheckpointError
from eyas.models.decoder import Decoder

SGLANG_ARCH, VLLM_ARCH = "LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"
ARCHITECTURES = (SGLANG_ARCH, VLLM_ARCH)
LAYER_PREFIX, ENGINE_LAYER_PREFIX = "layer.", "midlayer."
# engine-only tensors eyas has no counterpart for: refusing beats silently dropping them
UNSUPPORTED_PREFIXES = ("midlayers.", "additional_layers.")
DRAFTER_TYPES = ("eagle3", "eagle3.1", "peagle")  # the eyas families written in this layout
LATER_PREFIX = "later_layers."  # P-EAGLE's layers after the first: engine layers.{i + 1}
CONFIG_CLASSES = {"eagle3": Eagle3Config, "eagle3.1": Eagle31Config, "peagle": PEagleConfig}
# SGLang's older names for EAGLE-3.1's per-tap norms (its load_weights maps them to fc_norm.{0,1,2}); the flag is
# ``use_aux_norm`` there
SGLANG_FC_NORM_NAMES = {"aux_norm_low.": "fc_norm.0.", "aux_norm_mid.": "fc_norm.1.", "aux_norm_high.": "fc_norm.2."}


def uses_fc_norm(config: dict[str, Any]) -> bool:
    """EAGLE-3.1's per-tap norms, under vLLM's and speculators' key or SGLang's older one."""
    return bool(config.get("fc_norm") or config.get("use_aux_norm"))


def drafter_type(config: dict[str, Any]) -> str:
    """The eyas family an engine config describes: P-EAGLE with parallel drafting, EAGLE-3.1 with either 3.1 flag."""
    if config.get("parallel_drafting"):
        return "peagle"
    return "eagle3.1" if uses_fc_norm(config) or config.get("norm_output") else "eagle3"


def llama_layer_config(model: Eagle3Model) -> dict[str, Any]:
    """The LlamaConfig keys of the drafter's one decoder layer (its own widths, the target's rope and norm eps)."""
    layer = model.layer_config
    return {"model_type": "llama", "hidden_size": layer.hidden_size, "intermediate_size": layer.intermediate_size,
            "num_attention_heads": layer.num_heads, "num_key_value_heads": layer.num_kv_heads,
            "head_dim": layer.head_dim, "num_hidden_layers": getattr(model, "num_draft_layers", 1), "hidden_act": "silu", "rms_norm_eps": layer.rms_norm_eps,
            "rope_theta": layer.rope_theta, "rope_scaling": layer.rope_scaling,
            "max_position_embeddings": layer.max_position_embeddings, "vocab_size": model.target_config.vocab_size,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32"}


def engine_ids(model: Eagle3Model, convention: str) -> list[int]:
    taps = list(model.target_taps)
    if len(taps) != 3:
        fix = " and without last_layer_tap" if getattr(model.config, "last_layer_tap", False) else ""
        raise CheckpointError(f"an EAGLE-3 drafter with {len(taps)} taps {taps} cannot be exported: the engines' fc "
                              f"fuses exactly three target layers (fc.weight [E, 3*target_hidden_size]); train one "
                              f"with three taps{fix} to serve it there")
    return layer_ids.to_engine(taps, model.target_config.num_layers, convention)


def export_config(model: Eagle3Model, engine: str) -> dict[str, Any]:
    """config.json for ``engine`` "sglang" (ids in eagle_config, +1 convention) or "vllm" (top-level ids)."""
    config = llama_layer_config(model)
    config["draft_vocab_size"] = len(model.draft_vocab) if model.draft_vocab else model.target_config.vocab_size
    config["target_hidden_size"] = model.target_config.hidden_size
    if engine == "sglang":
        ids = engine_ids(model, "sglang-eagle3")
        config["architectures"] = [SGLANG_ARCH]
        config["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": ids}
    elif engine == "vllm":
        config["architectures"] = [VLLM_ARCH]
        config["eagle_config"] = {"use_aux_hidden_state": True}
        config["eagle_aux_hidden_state_layer_ids"] = engine_ids(model, "vllm-eagle3")
        config["norm_before_residual"] = False  # eyas: residual = the un-normed hidden state
    else:
        raise ValueError(f"unknown engine {engine!r}")
    if model.config.fc_norm:
        config["fc_norm"] = True
    if getattr(model.config, "norm_output", False):
        config["norm_output"] = True
    if model.drafter_type == "peagle":
        if engine == "sglang":
            raise CheckpointError("a P-EAGLE drafter has no SGLang format: SGLang serves no parallel drafting; export "
                                  "it --to vllm or --to speculators")
        config["parallel_drafting"] = True
        config["mask_token_id"] = config["pard_token"] = model.config.mask_token_id
    return config


def export_weights(model: Eagle3Model) -> dict[str, torch.Tensor]:
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith(LAYER_PREFIX):
            key = ENGINE_LAYER_PREFIX + name[len(LAYER_PREFIX):]
        elif name.startswith(LATER_PREFIX):
            index, rest = name[len(LATER_PREFIX):].split(".", 1)
            key = f"layers.{int(index) + 1}.{rest}"
        else:
            key = name
        state[key] = tensor.detach().float().contiguous().cpu()
    if not model.draft_vocab:
        # the full vocabulary: the engines build no id mapping then, and vLLM refuses a d2t it has no parameter for
        return state
    d2t_X = model.d2t.cpu()
    state["d2t"] = (d2t_X - torch.arange(d2t_X.numel())).contiguous()  # target id minus draft id
    t2d_V = torch.zeros(model.target_config.vocab_size, dtype=torch.bool)
    t2d_V[d2t_X] = True
    state["t2d"] = t2d_V
    return state


# ---- import ------------------------------------------------------------------------------------------------

def _require_equal(where: str, name: str, value: Any, expected: Any, meaning: str) -> None:
    if value is not None and value != expected:
        raise CheckpointError(f"{where}: {name}={value!r} but {meaning} is {expected!r}; eyas's EAGLE-3 cannot "
                              "represent that drafter exactly")


def import_taps(config: dict[str, Any], num_layers: int, where: str) -> tuple[int, ...]:
    """The taps (HF numbering) an engine would capture for this config: top-level ids are vLLM's capture points,
    ``eagle_config`` ids SGLang's (+1); both present must agree; neither = the engines' default."""
    vllm_ids = config.get("eagle_aux_hidden_state_layer_ids")
    sglang_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm_taps = layer_ids.from_engine(vllm_ids, num_layers, "vllm-eagle3") if vllm_ids else None
    sglang_taps = layer_ids.from_engine(sglang_ids, num_layers, "sglang-eagle3") if sglang_ids else None
    if vllm_taps and sglang_taps and vllm_taps != sglang_taps:
        raise CheckpointError(f"{where}: eagle_aux_hidden_state_layer_ids {vllm_ids} (vLLM: HF {list(vllm_taps)}) "
                              f"and eagle_config's {sglang_ids} (SGLang, +1: HF {list(sglang_taps)}) select different "
                              "target layers; the two engines would serve this drafter differently")
    return vllm_taps or sglang_taps or layer_ids.default_eagle3_taps(num_layers)


def _layer_config(config: dict[str, Any], target: Decoder) -> DraftLayerConfig:
    """The layer widths, with None where the target's value gives the same layer (eyas's default)."""
    t = target.config
    explicit = {"intermediate_size": config.get("intermediate_size", t.intermediate_size),
                "num_heads": config.get("num_attention_heads", t.num_heads),
                "num_kv_heads": config.get("num_key_value_heads", config.get("num_attention_heads", t.num_kv_heads)),
                "head_dim": config.get("head_dim") or config.get("hidden_size", t.hidden_size)
                // config.get("num_attention_heads", t.num_heads)}
    wanted = DraftLayerConfig(**explicit).model_config(t)
    fields = dict(explicit)
    for name in list(fields):  # drop overrides the default already reproduces
        trial = {**fields, name: None}
        if DraftLayerConfig(**trial).model_config(t) == wanted:
            fields = trial
    return DraftLayerConfig(**fields)


def check_architecture(config: dict[str, Any], target: Decoder, where: str) -> None:
    t = target.config
    _require_equal(where, "hidden_size", config.get("hidden_size"), t.hidden_size, "the target's hidden size")
    _require_equal(where, "target_hidden_size", config.get("target_hidden_size"), t.hidden_size,
                   "the target's hidden size")
    _require_equal(where, "vocab_size", config.get("vocab_size"), t.vocab_size, "the target's vocab size")
    if not config.get("parallel_drafting"):  # P-EAGLE may have several layers
        _require_equal(where, "num_hidden_layers", config.get("num_hidden_layers"), 1, "eyas's drafter layer count")
    _require_equal(where, "hidden_act", config.get("hidden_act"), "silu", "eyas's activation")
    _require_equal(where, "rms_norm_eps", config.get("rms_norm_eps"), t.rms_norm_eps, "the target's norm eps")
    _require_equal(where, "rope_theta", config.get("rope_theta"), t.rope_theta, "the target's rope theta")
    _require_equal(where, "norm_before_residual", config.get("norm_before_residual"), False,
                   "eyas's layer (residual = the un-normed hidden state)")
    _require_equal(where, "tie_word_embeddings", config.get("tie_word_embeddings"), False,
                   "eyas's EAGLE-3 (its own LM head)")
    for flag in ("attention_bias", "mlp_bias", "bias"):
        _require_equal(where, flag, config.get(flag), False, "eyas's drafter layer (no biases)")
    if (config.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise CheckpointError(f"{where}: use_aux_hidden_state=false (an EAGLE-1-style feature drafter); eyas's "
                              "EAGLE-3 fuses three target layers")


def import_weights(state: dict[str, torch.Tensor], target: Decoder, draft_vocab_size: int, where: str
                   ) -> tuple[dict[str, torch.Tensor], list[int] | None]:
    """Engine tensors -> (eyas state_dict, draft_vocab as target ids or None for the full vocabulary)."""
    unsupported = sorted(k for k in state if k.startswith(UNSUPPORTED_PREFIXES) or k.endswith(".bias"))
    if unsupported:
        raise CheckpointError(f"{where}: tensors {unsupported[:4]} have no counterpart in eyas's EAGLE-3 family "
                              "(extra layers or biases); refusing rather than dropping them")
    embed = state.get("embed_tokens.weight")
    if embed is not None and not torch.equal(embed.to(target.embed_tokens.weight), target.embed_tokens.weight):
        raise CheckpointError(f"{where}: embed_tokens.weight differs from the target's embedding; eyas's EAGLE-3 "
                              "reads tokens through the target's own (frozen) embedding")
    out = {}
    for name, tensor in state.items():
        if name in ("d2t", "t2d", "embed_tokens.weight"):
            continue
        out[_eyas_name(name)] = tensor
    V = target.config.vocab_size
    if "d2t" not in state:
        if draft_vocab_size != V:
            raise CheckpointError(f"{where}: draft_vocab_size={draft_vocab_size} < vocab {V} but no d2t tensor maps "
                                  "draft ids to target ids")
        return out, None
    d2t_X = state["d2t"].long()
    ids_X = d2t_X + torch.arange(d2t_X.numel())  # d2t holds target id minus draft id
    if d2t_X.numel() != draft_vocab_size:
        raise CheckpointError(f"{where}: d2t has {d2t_X.numel()} entries, draft_vocab_size={draft_vocab_size}")
    if draft_vocab_size == V and torch.equal(ids_X, torch.arange(V)):
        return out, None
    return out, ids_X.tolist()


def _eyas_name(name: str) -> str:
    """An engine tensor name -> eyas's: midlayer.* / layers.0.* the first layer, layers.{i}.* P-EAGLE's later ones,
    SGLang's aux_norm_{low,mid,high}.* the per-tap norms fc_norm.{0,1,2}.*."""
    for old, new in SGLANG_FC_NORM_NAMES.items():
        if name.startswith(old):
            return new + name[len(old):]
    if name.startswith(ENGINE_LAYER_PREFIX):
        return LAYER_PREFIX + name[len(ENGINE_LAYER_PREFIX):]
    if name.startswith("layers."):
        index, rest = name[len("layers."):].split(".", 1)
        return f"{LAYER_PREFIX}{rest}" if index == "0" else f"{LATER_PREFIX}{int(index) - 1}.{rest}"
    return name


def _family_fields(config: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    """The config fields the engine keys set beyond EAGLE-3's: the 3.1 flags, P-EAGLE's layers and mask id."""
    fields: dict[str, Any] = {"fc_norm": uses_fc_norm(config)}
    if kind == "peagle":
        mask_id, pard = config.get("mask_token_id"), config.get("pard_token")
        if mask_id is None or (pard is not None and pard != mask_id):
            raise CheckpointError(f"{where}: parallel drafting needs one mask token id (mask_token_id={mask_id}, "
                                  f"pard_token={pard})")
        if config.get("norm_output"):
            raise CheckpointError(f"{where}: norm_output=true with parallel drafting; eyas's P-EAGLE never feeds "
                                  "a drafted state forward, so the flag has no meaning there")
        fields.update(num_layers=int(config.get("num_hidden_layers") or 1), mask_token_id=int(mask_id))
    else:
        fields["norm_output"] = bool(config.get("norm_output"))
    return fields


def import_config(config: dict[str, Any], target: Decoder, where: str, eyas_block: dict[str, Any] | None
                  ) -> Eagle3Config | PEagleConfig:
    """The config (Eagle3Config, Eagle31Config or PEagleConfig: ``drafter_type``) an engine checkpoint describes.
    eyas's own exports carry an ``eyas`` block with the training-only settings (ttt_steps, step_decay, ...); its
    architecture must agree with the engine keys."""
    check_architecture(config, target, where)
    kind = drafter_type(config)
    taps = import_taps(config, target.config.num_layers, where)
    vocab = config.get("draft_vocab_size") or target.config.vocab_size
    config_cls = CONFIG_CLASSES[kind]
    derived = config_cls(layer=_layer_config(config, target), taps=taps,
                         draft_vocab_size=None if vocab == target.config.vocab_size else vocab,
                         **_family_fields(config, kind, where))
    if eyas_block is None:
        return derived
    saved = from_dict(config_cls, eyas_block, prefix="eyas.config.")
    extra = _family_fields(config, kind, where)
    same = (tuple(saved.taps or eagle3_taps(target.config.num_layers)) == taps
            and saved.layer.model_config(target.config) == derived.layer.model_config(target.config)
            and (saved.draft_vocab_size or target.config.vocab_size) == vocab
            and all(getattr(saved, name) == value for name, value in extra.items()))
    if not same:
        raise CheckpointError(f"{where}: the eyas block disagrees with the engine keys (taps, layer widths or draft "
                              "vocab size); was config.json edited by hand? Remove the eyas block to load by the "
                              "engine keys alone")
    return saved
