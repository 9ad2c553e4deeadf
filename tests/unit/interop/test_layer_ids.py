"""Layer ids: on a target whose layers are distinguishable, the ids eyas exports select, under each engine's
documented capture convention, exactly the hidden states eyas trained on (and the ids it imports map back)."""
import json

import pytest
import torch
from interop_testing import BLOCK_FAMILIES, LLAMA, QWEN3, drafter, tiny

from eyas.interop import layer_ids, write_export
from eyas.models.config import CheckpointError


def layer_inputs(target, tokens_1T: torch.Tensor) -> dict[int, torch.Tensor]:
    """What an engine captures: the residual stream at the INPUT of each 0-based layer k (vLLM / SGLang llama.py
    append ``hidden_states + residual`` before running layer k)."""
    captured = {}
    for k, layer in enumerate(target.layers):  # Decoder calls layer.forward directly: wrap it per instance
        def capture(x_BTE, *args, k=k, run=layer.forward, **kwargs):
            captured[k] = x_BTE.clone()
            return run(x_BTE, *args, **kwargs)
        layer.forward = capture
    try:
        target(tokens_1T, torch.arange(tokens_1T.shape[1])[None], target.new_cache(1, tokens_1T.shape[1]))
    finally:
        for layer in target.layers:
            del layer.forward
    return captured


ENGINE_CAPTURE = {  # config.json -> the 0-based layers whose inputs the engine captures, as each engine documents
    ("eagle3", "sglang"): lambda c: [j + 1 for j in c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]],
    ("eagle3", "vllm"): lambda c: list(c["eagle_aux_hidden_state_layer_ids"]),
    ("dflash", "sglang"): lambda c: [j + 1 for j in c["dflash_config"]["target_layer_ids"]],  # capture before j+1
    ("dflash", "vllm"): lambda c: [j + 1 for j in c["dflash_config"]["target_layer_ids"]],  # eagle3_utils adds 1
    # DSpark and DFlash2 are read through DFlash's config (SGLang's parse_dflash_draft_config, vLLM's DFlash model)
    ("dspark", "sglang"): lambda c: [j + 1 for j in c["dflash_config"]["target_layer_ids"]],
    ("dspark", "vllm"): lambda c: [j + 1 for j in c["dflash_config"]["target_layer_ids"]],
    ("dflash2", "vllm"): lambda c: [j + 1 for j in c["dflash_config"]["target_layer_ids"]],
    # vLLM's speculators adapter: eagle_aux_hidden_state_layer_ids = the ids (capture points) for the DFlash family
    ("dspark", "speculators"): lambda c: list(c["aux_hidden_state_layer_ids"]),
}


@pytest.mark.parametrize("drafter_type,fmt", list(ENGINE_CAPTURE))
def test_exported_ids_select_the_trained_states(tmp_path, drafter_type, fmt):
    target = tiny(QWEN3 if drafter_type in BLOCK_FAMILIES else LLAMA)
    model = drafter(drafter_type, target)
    tokens_1T = torch.tensor([[3, 14, 15, 9, 26]])
    engine = layer_inputs(target, tokens_1T)
    _, eyas_taps = target(tokens_1T, torch.arange(5)[None], target.new_cache(1, 5), taps=model.target_taps)
    states = list(engine.values())  # distinguishable: no two layers' states agree
    assert all(not torch.allclose(a, b) for i, a in enumerate(states) for b in states[i + 1:])
    config = json.loads((write_export(model, fmt, tmp_path / fmt, "tiny") / "config.json").read_text())
    captured = ENGINE_CAPTURE[(drafter_type, fmt)](config)
    assert len(captured) == len(model.target_taps)
    for tap, k in zip(model.target_taps, captured):
        assert torch.equal(engine[k], eyas_taps[tap]), f"tap {tap}: the engine would read layer {k}'s input"


def test_the_same_numbers_mean_different_layers():
    # eyas taps (2, 4, 5) of an 8-layer target: vLLM writes them as is, SGLang one lower, DFlash one lower
    assert layer_ids.to_engine((2, 4, 5), 8, "vllm-eagle3") == [2, 4, 5]
    assert layer_ids.to_engine((2, 4, 5), 8, "sglang-eagle3") == [1, 3, 4]
    assert layer_ids.to_engine((2, 4, 6), 8, "dflash") == [1, 3, 5]
    for convention in layer_ids.CONVENTIONS:
        assert layer_ids.from_engine(layer_ids.to_engine((2, 4, 5), 8, convention), 8, convention) == (2, 4, 5)
    with pytest.raises(CheckpointError, match="final-NORMED"):
        layer_ids.to_engine((2, 8), 8, "vllm-eagle3")
    with pytest.raises(CheckpointError, match="cannot be exported to sglang-eagle3"):
        layer_ids.to_engine((0, 4, 5), 8, "sglang-eagle3")
    assert layer_ids.to_engine((0, 4, 5), 8, "vllm-eagle3") == [0, 4, 5]  # vLLM can capture the embeddings
    with pytest.raises(CheckpointError, match="outside this 8-layer target"):
        layer_ids.from_engine([7], 8, "dflash")
