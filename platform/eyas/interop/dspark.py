"""DSpark drafters in the engines' layout (``Qwen3DSparkModel``) and back.

DSpark is DFlash's layout (dflash.py: ``layers.*``, ``fc``, ``hidden_norm``, ``norm``; the target's embedding and
LM head) plus two heads and their keys. Checked against:
  SGLang   models/dspark.py (``Qwen3DSparkModel`` = DSparkDraftModel over its DFlashDraftModel: ``markov_head.
           markov_w1`` Embedding(vocab_size, markov_rank), ``markov_head.markov_w2`` Linear(markov_rank -> vocab_size,
           no bias), ``confidence_head.proj`` Linear(hidden_size + markov_rank -> 1, bias) over [hidden ; w1(prev)];
           a missing confidence weight is an error, embed_tokens / lm_head are skipped (the target's)) and
           speculative/dspark_components/dspark_config.py (``markov_rank`` / ``markov_head_type`` top level or in
           ``dspark_config``; gamma = ``block_size``, run with ``--speculative-num-draft-tokens`` gamma + 1; a config
           with ``speculators_model_type: dspark`` is refused, so this layout never carries one).
  vLLM     models/qwen3_dspark.py (Qwen3DSparkForCausalLM over DFlashQwen3Model: the same names; ``markov_rank``,
           ``enable_confidence_head``, ``confidence_head_with_markov`` read from the top level; the heads' weights
           loaded under ``model.``) and transformers_utils/configs/speculators/algos.py ``update_dspark`` (what a
           speculators DSpark becomes: the DFlash keys plus markov_rank / markov_head_type / sample_from_anchor, also
           mirrored into ``dflash_config``; written the same way here); ``num_speculative_tokens`` = block_size.
The block convention is DeepSpec's, eyas's and both engines': block [anchor, MASK x (G-1)], slot k drafts the token
at anchor + k + 1, so G slots draft G tokens (``sample_from_anchor: true``). eyas's DSpark has the ``vanilla`` Markov
head and a confidence head over [hidden ; w1(prev)]; other head types (``gated``: gate_proj, ``rnn``: joint_proj),
no confidence head, or a confidence head without the Markov embedding are refused on import, as a draft vocabulary
is on export (SGLang's markov_w2 spans the whole vocabulary).
"""
from __future__ import annotations

from typing import Any

import torch

from eyas.drafters.dspark import DSparkConfig, DSparkModel
from eyas.interop import dflash
from eyas.models.config import CheckpointError
from eyas.models.decoder import Decoder

ARCHITECTURE = "Qwen3DSparkModel"
ARCHITECTURES = (ARCHITECTURE, "DSparkDraftModel")  # the engines' entry class and the class SGLang maps it to
HEAD_PREFIXES = ("markov_head.", "confidence_head.")


def export_config(model: DSparkModel, engine: str = "vllm") -> dict[str, Any]:
    """DFlash's config.json with DSpark's architecture and head keys (the same for SGLang and vLLM)."""
    config = dflash.export_config(model, engine)
    heads = {"markov_rank": model.config.markov_rank, "markov_head_type": model.config.markov_head_type,
             "sample_from_anchor": True}
    config.update(architectures=[ARCHITECTURE], enable_confidence_head=True, confidence_head_with_markov=True,
                  **heads)
    config["dflash_config"].update(heads)
    return config


def export_weights(model: DSparkModel) -> dict[str, torch.Tensor]:
    return dflash.export_weights(model)  # the heads' names are already the engines'


def _value(config: dict[str, Any], name: str, default: Any = None) -> Any:
    """A DSpark key as the engines look it up: ``dspark_config``, then ``dflash_config``, then the top level."""
    for section in ("dspark_config", "dflash_config"):
        value = (config.get(section) or {}).get(name)
        if value is not None:
            return value
    return config.get(name, default)


def family_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The DSparkConfig fields the DSpark keys set; CheckpointError for a DSpark eyas cannot run exactly."""
    rank = _value(config, "markov_rank")
    if not isinstance(rank, int) or rank < 1:
        raise CheckpointError(f"{where}: markov_rank={rank!r}; a DSpark checkpoint needs a Markov head of rank >= 1")
    head_type = str(_value(config, "markov_head_type", "vanilla")).lower()
    if head_type != "vanilla":
        raise CheckpointError(f"{where}: markov_head_type={head_type!r}; eyas's DSpark has the vanilla Markov head "
                              "(bias = w2(w1(prev))), not the gated or rnn variants and their extra weights")
    if _value(config, "sample_from_anchor", True) is not True:
        raise CheckpointError(f"{where}: sample_from_anchor=false; eyas's DSpark drafts from the anchor slot too "
                              "(slot k predicts anchor + k + 1)")
    for flag in ("enable_confidence_head", "confidence_head_with_markov"):
        if _value(config, flag, True) is not True:
            raise CheckpointError(f"{where}: {flag}=false; eyas's DSpark always has a confidence head over "
                                  "[hidden ; markov_w1(prev)]")
    return {"markov_rank": rank, "markov_head_type": head_type}


def import_config(config: dict[str, Any], target: Decoder, where: str, eyas_block: dict[str, Any] | None
                  ) -> DSparkConfig:
    return dflash.import_config(config, target, where, eyas_block, DSparkConfig, family_fields(config, where))


def import_weights(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    return dflash.import_weights(state, where, own_prefixes=HEAD_PREFIXES)
