"""DFlash2 drafters in vLLM's layout (``DFlash2DraftModel``) and back. SGLang has none eyas can write.

DFlash2 is DFlash's layout (dflash.py) plus a dynamic convolution on each side of every layer's attention and MLP and
a candidate selector. Checked against vLLM's model_executor/models/qwen3_dflash2.py (vllm-project/vllm#52816:
DFlash2Qwen3ForCausalLM over DFlashQwen3ForCausalLM, so the same ``model.``-prefixed names; per layer
``attention_conv`` / ``mlp_conv`` = ``base_kernel`` [2, W, E] + ``kernel_projection`` Linear(E -> 2*W*E/group), the
taps zeroed across the query block of 1 + num_speculative_tokens tokens; ``candidate_selector.predecessor_codebook``
/ ``successor_codebook`` [V, r] + ``hidden_projection`` Linear(E -> r), scoring the target head's top-k as
unary + <A[prev] * P h, B[c]>; ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k`` and
the optional ``input_embedding_scale``, ``output_multiplier``, ``final_logit_softcapping`` read from
``dflash_config``), served with ``{"method": "dflash", "num_speculative_tokens": block_size - 1}``, and against
speculators 0.9.0 models/dflash2 (the same names and arithmetic; its docs/algorithms/dflash2.md describes this
native config: the layer config at the top level, ``architectures: ["DFlash2DraftModel"]``, the module sizes under
``dflash_config``). eyas's DFlash2 (drafters/dflash2.py) computes the same thing with those names; it has no
embedding scale, output multiplier or softcap, so a checkpoint that sets them is refused on import.

SGLang: its DFlash2 (sgl-project/sglang#35371) is not in the SGLang source checked here: that models/dflash.py has
no convolution or selector and its loader skips tensors it has no parameter for, so a DFlash2 written in SGLang's
DFlash layout would load there as a plain DFlash with the convolutions and selector silently dropped. The SGLang
export is refused rather than written unverified.
"""
from __future__ import annotations

from typing import Any

import torch

from eyas.drafters.dflash2 import DFlash2Config, DFlash2Model
from eyas.interop import dflash
from eyas.models.config import CheckpointError
from eyas.models.decoder import Decoder

ARCHITECTURE = "DFlash2DraftModel"
FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
NEUTRAL = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}  # vLLM's defaults


def export_config(model: DFlash2Model, engine: str = "vllm") -> dict[str, Any]:
    if engine == "sglang":
        raise CheckpointError("a DFlash2 drafter has no SGLang format eyas can write: SGLang's DFlash2 "
                              "(sgl-project/sglang#35371) is not in the SGLang source checked (eyas.interop.dflash2); "
                              "export it --to vllm (DFlash2DraftModel) or --to speculators")
    config = dflash.export_config(model, engine)
    config["architectures"] = [ARCHITECTURE]
    config["dflash_config"].update({name: getattr(model.config, name) for name in FIELDS})
    return config


def export_weights(model: DFlash2Model) -> dict[str, torch.Tensor]:
    return dflash.export_weights(model)  # the convolutions' and the selector's names are already the engines'


def family_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The DFlash2Config fields of ``dflash_config`` (the top level as a fallback)."""
    section = config.get("dflash_config") or {}
    value = lambda name: section.get(name, config.get(name))  # noqa: E731
    missing = [name for name in FIELDS if value(name) is None]
    if missing:
        raise CheckpointError(f"{where}: no {missing} in dflash_config; a DFlash2DraftModel needs its convolution "
                              "and selector sizes")
    for name, neutral in NEUTRAL.items():
        if value(name) not in (None, neutral):
            raise CheckpointError(f"{where}: {name}={value(name)!r}; eyas's DFlash2 has no {name} (it computes the "
                                  f"{neutral!r} case only)")
    if value("sample_from_anchor"):
        raise CheckpointError(f"{where}: sample_from_anchor=true; a DFlash2 block is [bonus token, MASK x (G-1)] "
                              "whose slots 1..G-1 draft (its convolution block is 1 + num_speculative_tokens)")
    return {name: int(value(name)) for name in FIELDS}


def import_config(config: dict[str, Any], target: Decoder, where: str, eyas_block: dict[str, Any] | None
                  ) -> DFlash2Config:
    return dflash.import_config(config, target, where, eyas_block, DFlash2Config, family_fields(config, where))


def import_weights(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    return dflash.import_weights(state, where)
