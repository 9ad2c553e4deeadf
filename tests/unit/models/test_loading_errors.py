"""A checkpoint eyas cannot load raises CheckpointError naming the file and the problem."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eyas.models import CheckpointError, Decoder, ModelConfig, load_target

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "torch_dtype": "float32"}


def hf_state_dict() -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face's names (``model.`` prefix, lm_head at the top)."""
    torch.manual_seed(0)
    native = Decoder(ModelConfig.from_hf_dict(CONFIG)).state_dict()
    return {(k if k.startswith("lm_head") else f"model.{k}"): v.contiguous() for k, v in native.items()}


def write_config(directory: Path, **changes) -> None:
    (directory / "config.json").write_text(json.dumps({**CONFIG, **changes}))


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    write_config(directory)
    save_file(hf_state_dict(), str(directory / "model.safetensors"))
    return directory


def sharded(directory: Path) -> dict[str, str]:
    """Re-save the checkpoint as two shards plus an index; returns the index's weight_map."""
    state = hf_state_dict()
    (directory / "model.safetensors").unlink()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(directory / file))
        weight_map.update({k: file for k in keys})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def load_error(directory: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_target(directory)
    return str(info.value)


def test_good_checkpoints_load(checkpoint):
    assert load_target(checkpoint).config.hidden_size == 32
    sharded(checkpoint)
    target = load_target(checkpoint)
    torch.testing.assert_close(target.norm.weight, hf_state_dict()["model.norm.weight"])


def test_missing_directory(tmp_path):
    message = load_error(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in message and "does not exist" in message


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    message = load_error(checkpoint)
    assert str(checkpoint / "config.json") in message and "missing" in message


def test_config_not_json(checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    message = load_error(checkpoint)
    assert str(checkpoint / "config.json") in message and "not valid JSON" in message


def test_missing_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    message = load_error(checkpoint)
    assert str(checkpoint) in message and "model.safetensors" in message and "missing" in message


def test_unsupported_architecture(checkpoint):
    write_config(checkpoint, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    message = load_error(checkpoint)
    assert str(checkpoint / "config.json") in message
    assert "unsupported architecture" in message and "gpt2" in message


def test_shape_mismatch(checkpoint):
    write_config(checkpoint, hidden_size=16)  # weights were saved for hidden_size 32
    message = load_error(checkpoint)
    assert str(checkpoint / "model.safetensors") in message and "config.json" in message
    assert "shape mismatch" in message and "32" in message and "16" in message


def test_wrong_dtype(checkpoint):
    state = hf_state_dict()
    state["model.norm.weight"] = torch.ones(32, dtype=torch.int8)
    save_file(state, str(checkpoint / "model.safetensors"))
    message = load_error(checkpoint)
    assert str(checkpoint / "model.safetensors") in message
    assert "model.norm.weight" in message and "torch.int8" in message


def test_missing_tensor(checkpoint):
    state = hf_state_dict()
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(checkpoint / "model.safetensors"))
    message = load_error(checkpoint)
    assert str(checkpoint / "model.safetensors") in message and "layers.1.mlp.up_proj.weight" in message


def test_corrupt_weights(checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"\x00\x01not a safetensors file")
    message = load_error(checkpoint)
    assert str(checkpoint / "model.safetensors") in message and "cannot read safetensors" in message


def test_missing_shard(checkpoint):
    sharded(checkpoint)
    (checkpoint / "model-00002-of-00002.safetensors").unlink()
    message = load_error(checkpoint)
    assert str(checkpoint / "model-00002-of-00002.safetensors") in message
    assert "missing" in message and "model.safetensors.index.json" in message


def test_sliding_window_layers_that_eyas_cannot_mix(checkpoint):
    write_config(checkpoint, model_type="qwen2", use_sliding_window=True, sliding_window=8,
                 layer_types=["full_attention", "sliding_attention"])
    message = load_error(checkpoint)
    assert str(checkpoint / "config.json") in message and "layer_types" in message


def test_sliding_window_is_read_per_family():
    qwen_all_full = {**CONFIG, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
                     "max_window_layers": 28}  # transformers: only layers >= max_window_layers slide
    assert ModelConfig.from_hf_dict(qwen_all_full).sliding_window is None
    qwen_off = {**CONFIG, "model_type": "qwen2", "use_sliding_window": False, "sliding_window": 8}
    assert ModelConfig.from_hf_dict(qwen_off).sliding_window is None
    assert ModelConfig.from_hf_dict({**CONFIG, "model_type": "mistral", "sliding_window": 8}).sliding_window == 8
    assert ModelConfig.from_hf_dict({**CONFIG, "model_type": "mistral", "sliding_window": None}).sliding_window is None
