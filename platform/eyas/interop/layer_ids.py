"""Hidden-state layer ids: eyas's numbering and each engine's, converted in one place.

eyas numbers taps as Hugging Face's ``hidden_states``: 0 = the embeddings, i = the output of decoder layer i
(1-based, before the final norm), N = the final-normed output of an N-layer target (``Decoder.forward``).

The engines capture the residual stream at the INPUT of a 0-based layer k, which is HF index k (checked against:
vLLM models/llama.py, ``if idx in self.aux_hidden_state_layers: aux_hidden_states.append(hidden_states +
residual)`` before layer idx runs; SGLang models/llama.py and qwen3.py capture the same way before layer i):
  EAGLE-3, vLLM    ``eagle_aux_hidden_state_layer_ids`` (top level) are capture points as given: id k = HF k
                   (vllm v1 spec_decode eagle3_utils.get_eagle3_aux_layers_from_config).
  EAGLE-3, SGLang  ``eagle_config.eagle_aux_hidden_state_layer_ids`` are shifted +1 (``set_eagle3_layers_to_capture``
                   sets ``layers_to_capture = [val + 1 ...]``): id j = output of 0-based layer j = HF j + 1.
  DFlash, both     ``dflash_config.target_layer_ids`` mean "output of 0-based layer j" = HF j + 1 (vLLM adds 1 in
                   get_eagle3_aux_layers_from_config, SGLang in set_dflash_layers_to_capture).
No engine can capture eyas's tap N (the final-NORMED state) or, except vLLM's EAGLE-3, the embeddings (tap 0).
Defaults when a checkpoint names no ids: EAGLE-3 (2, N//2, N-3) in capture points = HF numbering, in both engines
(SupportsEagle3.get_eagle3_default_aux_hidden_state_layers; SGLang set_eagle3_layers_to_capture(None)).
"""
from __future__ import annotations

from typing import Iterable

from eyas.models.config import CheckpointError

# convention name -> (HF index - engine id, the lowest HF index it can name)
CONVENTIONS = {
    "vllm-eagle3": (0, 0),      # id k = HF k
    "sglang-eagle3": (1, 1),    # id j = HF j + 1
    "dflash": (1, 1),           # target_layer_ids j = HF j + 1 (both engines)
}


def to_engine(taps: Iterable[int], num_layers: int, convention: str) -> list[int]:
    """eyas taps (HF numbering) -> the engine's ids; refuses a tap the engine cannot capture."""
    shift, lowest = CONVENTIONS[convention]
    taps = [int(t) for t in taps]
    bad = [t for t in taps if not lowest <= t <= num_layers - 1]
    if bad:
        raise CheckpointError(f"taps {bad} cannot be exported to {convention}: the engine captures layer inputs "
                              f"(HF hidden_states {lowest}..{num_layers - 1} of this {num_layers}-layer target); "
                              f"tap {num_layers} is eyas's final-NORMED state and tap 0 the embeddings")
    return [t - shift for t in taps]


def from_engine(ids: Iterable[int], num_layers: int, convention: str) -> tuple[int, ...]:
    """The engine's ids -> eyas taps (HF numbering); refuses ids outside the target."""
    shift, lowest = CONVENTIONS[convention]
    taps = tuple(int(i) + shift for i in ids)
    bad = [t - shift for t in taps if not lowest <= t <= num_layers - 1]
    if bad:
        raise CheckpointError(f"{convention} layer ids {bad} lie outside this {num_layers}-layer target")
    return taps


def default_eagle3_taps(num_layers: int) -> tuple[int, int, int]:
    """What both engines capture for an EAGLE-3 checkpoint that names no layer ids (HF numbering)."""
    return 2, num_layers // 2, num_layers - 3
