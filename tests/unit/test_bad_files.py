"""Corrupt and mismatched files (issue 16, section 5): each load fails with an error that names the file and says what
to do, and nothing half-written is ever read as complete. One row per bad file; the data-set rerun that builds a
truncated shard again is tests/unit/train/test_generate_data_job.py's."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.drafters import registry
from eyas.methods import load_drafter
from eyas.models import CheckpointError, Decoder, ModelConfig, load_target
from eyas.train.data import SequenceDataset, ShardError, response_row, shard_path, write_shard

HF_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
             "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 64}


def tiny_target(hidden_size: int = 32) -> Decoder:
    torch.manual_seed(0)
    config = ModelConfig.from_hf_dict({**HF_CONFIG, "hidden_size": hidden_size})
    return Decoder(config).eval().requires_grad_(False)


def target_checkpoint(tmp_path: Path) -> Path:
    """config.json + model.safetensors under Hugging Face's names."""
    directory = tmp_path / "target"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(HF_CONFIG))
    state = {(k if k.startswith("lm_head") else f"model.{k}"): v.contiguous()
             for k, v in tiny_target().state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    return directory


def drafter_checkpoint(tmp_path: Path) -> Path:
    torch.manual_seed(1)
    return registry.save_drafter(registry.build_model("eagle1", {}, tiny_target()), tmp_path / "drafter", "tiny")


def cut(file: Path, keep: float = 0.5) -> None:
    """Truncate ``file`` as an interrupted download or copy would."""
    data = file.read_bytes()
    file.write_bytes(data[:int(len(data) * keep)])


def edit_json(file: Path, change: Callable[[dict], None]) -> None:
    data = json.loads(file.read_text())
    change(data)
    file.write_text(json.dumps(data))


# ---------------------------------------------------------------- the cases: (build the bad file, load it) -> error


def truncated_target_weights(tmp_path):
    directory = target_checkpoint(tmp_path)
    cut(directory / "model.safetensors")
    return directory / "model.safetensors", lambda: load_target(directory)


def truncated_drafter_weights(tmp_path):
    directory = drafter_checkpoint(tmp_path)
    cut(directory / "model.safetensors")
    return directory / "model.safetensors", lambda: load_drafter(directory, tiny_target())


def drafter_missing_config_key(tmp_path):
    directory = drafter_checkpoint(tmp_path)
    edit_json(directory / "config.json", lambda meta: meta.pop("target_taps"))
    return directory / "config.json", lambda: load_drafter(directory, tiny_target())


def drafter_missing_tensor(tmp_path):
    directory = drafter_checkpoint(tmp_path)
    state = load_file(str(directory / "model.safetensors"))
    state.pop(sorted(state)[0])
    save_file(state, str(directory / "model.safetensors"))
    return directory / "model.safetensors", lambda: load_drafter(directory, tiny_target())


def drafter_for_another_target(tmp_path):
    directory = drafter_checkpoint(tmp_path)
    return directory, lambda: load_drafter(directory, tiny_target(hidden_size=48))


def unsupported_architecture(tmp_path):
    directory = target_checkpoint(tmp_path)
    edit_json(directory / "config.json", lambda c: c.update(model_type="gpt2", architectures=["GPT2LMHeadModel"]))
    return directory / "config.json", lambda: load_target(directory)


def truncated_parquet_shard(tmp_path):
    rows = [response_row([1, 2, 3], [4, 5, 6, 7]) for _ in range(8)]
    write_shard(shard_path(tmp_path, "train", 0), rows)
    write_shard(shard_path(tmp_path, "train", 1), rows)
    cut(shard_path(tmp_path, "train", 1))
    return shard_path(tmp_path, "train", 1), lambda: SequenceDataset(tmp_path, "train")


CASES = {  # case -> (builder, error type, what the message says besides the file: the problem, then what to do)
    "truncated target safetensors": (truncated_target_weights, CheckpointError,
                                     ["truncated or corrupt", "jobs.fetch_target"]),
    "truncated drafter safetensors": (truncated_drafter_weights, CheckpointError,
                                      ["truncated or corrupt", "jobs.train_drafter"]),
    "drafter missing a config key": (drafter_missing_config_key, CheckpointError,
                                     ["missing field(s) ['target_taps']", "jobs.train_drafter"]),
    "drafter missing a tensor": (drafter_missing_tensor, CheckpointError, ["missing [", "jobs.train_drafter"]),
    "drafter for another target": (drafter_for_another_target, CheckpointError,
                                   ["trained for target 'tiny'", "hidden_size: checkpoint 32, target 48",
                                    "train one for this target"]),
    "unsupported architecture": (unsupported_architecture, CheckpointError,
                                 ["unsupported architecture model_type='gpt2'", "point the target at"]),
    "truncated parquet shard": (truncated_parquet_shard, ShardError,
                                ["cannot read this parquet shard", "rerun python -m jobs.generate_data"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_file_is_named_with_what_to_do(case, tmp_path):
    build, error, says = CASES[case]
    file, load = build(tmp_path)
    with pytest.raises(error) as info:
        load()
    message = str(info.value)
    assert str(file) in message, message
    for words in says:
        assert words in message, message


# ---------------------------------------------------------------- nothing partial is published as complete


def test_an_interrupted_drafter_save_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    directory = drafter_checkpoint(tmp_path)
    before = load_file(str(directory / "model.safetensors"))

    def dies_midway(state, path, **kwargs):
        Path(path).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(registry, "save_file", dies_midway)
    torch.manual_seed(2)
    with pytest.raises(OSError, match="disk full"):
        registry.save_drafter(registry.build_model("eagle1", {}, tiny_target()), directory, "tiny")
    loaded = registry.load_model(directory, tiny_target())  # the old checkpoint, whole
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in before.items())


def test_an_interrupted_shard_write_leaves_no_shard(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    def dies_midway(table, where, **kwargs):
        Path(where).write_bytes(b"PAR1 half")
        raise OSError("killed")

    monkeypatch.setattr(pq, "write_table", dies_midway)
    with pytest.raises(OSError, match="killed"):
        write_shard(shard_path(tmp_path, "train", 0), [response_row([1], [2])])
    assert not shard_path(tmp_path, "train", 0).exists()  # only a temp file, which readers never glob
