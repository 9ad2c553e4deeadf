"""The disk feature cache is shared by content: a second drafter training on the same target, data and taps runs
no target forward at all (train and held-out features both come from disk), also when it runs from a copy of the
job's working dir (as under ``ray job submit``: the target copied, with new file times); other data or other taps
compute their own features, unless another drafter's cache of the same sequences kept every tap they read; a data
set that grows or is reordered computes only the sequences it has not seen."""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from train_testing import epoch_config, train_once

from eyas.models import load_target
from eyas.train.config import TrainConfig
from eyas.train.data import SequenceDataset, read_shard, response_row, shard_path, write_shard
from eyas.train.trainer import Trainer


def write_data(directory: Path, vocab_size: int, seed: int) -> Path:
    rng = random.Random(seed)
    for split, count in (("train", 8), ("heldout", 2)):
        rows = [response_row([rng.randrange(4, vocab_size) for _ in range(3)],
                             [rng.randrange(4, vocab_size) for _ in range(rng.randrange(6, 14))])
                for _ in range(count)]
        write_shard(shard_path(directory, split, 0), rows)
    return directory


def config(drafter: dict) -> TrainConfig:
    return epoch_config(drafter, "cache-reuse", "unused", "unused", max_len=32)


def test_second_training_from_a_copied_working_dir_runs_no_target_forward(random_checkpoint, tmp_path,
                                                                          monkeypatch):
    home = tmp_path / "eyas-home"
    data_dir = write_data(home / "data" / "chat", 320, seed=0)
    first_dir, copy_dir = tmp_path / "workdir", tmp_path / "workdir-copy"
    shutil.copytree(random_checkpoint, first_dir / "target")
    eagle3 = config({"type": "eagle3", "config": {"ttt_steps": 2, "draft_vocab_size": 64}})

    monkeypatch.chdir(first_dir)  # the target by a path relative to the working dir
    first_losses, first_forwards = train_once(eagle3, "target", data_dir)
    assert first_forwards == 2 + 1  # two train batches of 4, one held-out batch of 2

    shutil.copytree(first_dir, copy_dir, copy_function=shutil.copyfile)  # new file times, another path
    monkeypatch.chdir(copy_dir)
    second_losses, second_forwards = train_once(eagle3, "target", data_dir)
    assert second_forwards == 0
    assert second_losses == pytest.approx(first_losses, abs=1e-6)  # the cached features are the computed ones

    other_data = write_data(home / "data" / "chat-regenerated", 320, seed=1)
    shutil.copytree(data_dir / "features", other_data / "features")  # stale features by row index must not match
    assert train_once(eagle3, "target", other_data)[1] == 3


def test_a_drafter_reading_fewer_taps_reads_another_drafters_cache(random_checkpoint, tmp_path, monkeypatch):
    """EAGLE-1 and Medusa read only the final state, which EAGLE-3's cache keeps too: after EAGLE-3, they run no
    target forward and train exactly as on their own features; a cache they fill stays whole for EAGLE-3."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(random_checkpoint, tmp_path / "target")
    eagle3 = config({"type": "eagle3", "config": {"ttt_steps": 2, "draft_vocab_size": 64}})
    eagle1 = config({"type": "eagle1", "config": {}})
    medusa = config({"type": "medusa", "config": {"num_heads": 2}})
    alone = {name: train_once(cfg, "target", write_data(tmp_path / f"alone-{name}", 320, seed=0))
             for name, cfg in (("eagle1", eagle1), ("medusa", medusa))}
    assert all(forwards == 3 for _, forwards in alone.values())

    shared = write_data(tmp_path / "shared", 320, seed=0)
    assert train_once(eagle3, "target", shared)[1] == 3
    for name, cfg in (("eagle1", eagle1), ("medusa", medusa)):
        losses, forwards = train_once(cfg, "target", shared)
        assert forwards == 0
        assert losses == pytest.approx(alone[name][0], abs=1e-5)
    assert len(list((shared / "features").iterdir())) == 1  # eagle3's cache (train and held-out), nothing new

    first = write_data(tmp_path / "first", 320, seed=0)  # EAGLE-1 first: its cache lacks EAGLE-3's taps
    assert train_once(eagle1, "target", first)[1] == 3
    assert train_once(eagle3, "target", first)[1] == 3
    assert train_once(medusa, "target", first)[1] == 0  # either cache serves it


def test_a_grown_or_reordered_data_set_computes_only_its_new_sequences(random_checkpoint, tmp_path, monkeypatch):
    """Rows are named by their token ids, not their index: jobs.generate_data with more prompts appends shards,
    and the next training runs the target on the appended sequences only."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(random_checkpoint, tmp_path / "target")
    eagle3 = config({"type": "eagle3", "config": {"ttt_steps": 2, "draft_vocab_size": 64}})
    data_dir = write_data(tmp_path / "chat", 320, seed=0)
    first = []
    train_once(eagle3, "target", data_dir, first)
    assert sum(first) == 8 + 2

    grown = read_shard(shard_path(write_data(tmp_path / "more", 320, seed=2), "train", 0))[:4]
    write_shard(shard_path(data_dir, "train", 1), grown)
    computed = []
    assert len(train_once(eagle3, "target", data_dir, computed)[0]) == 3 + 1  # 12 sequences: 3 steps, then eval
    assert sum(computed) == 4  # the appended sequences, in whichever batches they fell

    old = read_shard(shard_path(data_dir, "train", 0))
    write_shard(shard_path(data_dir, "train", 0), grown + old[::-1])  # another order, every sequence seen
    shard_path(data_dir, "train", 1).unlink()
    again = []
    train_once(eagle3, "target", data_dir, again)
    assert again == []


def test_bfloat16_features_come_from_a_bfloat16_copy_and_read_float32_caches(random_checkpoint, tmp_path,
                                                                              monkeypatch):
    """train.feature_dtype bfloat16: the features come from a bfloat16 copy of the target (the float32 target runs
    no forward), are stored in bfloat16 in a cache of their own and train the drafter as float32's do, to bfloat16's
    rounding; a bfloat16 run reads a float32 cache of its taps, a float32 run never reads a bfloat16 one."""
    import dataclasses
    import json

    from safetensors.torch import load_file

    from eyas.models.decoder import Decoder

    monkeypatch.chdir(tmp_path)
    shutil.copytree(random_checkpoint, tmp_path / "target")
    fp32 = config({"type": "eagle3", "config": {"ttt_steps": 2, "draft_vocab_size": 64}})
    bf16 = dataclasses.replace(fp32, train=dataclasses.replace(fp32.train, feature_dtype="bfloat16"))
    forwards: list[torch.dtype] = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: forwards.append(module.embed_tokens.weight.dtype)
        if isinstance(module, Decoder) else None)
    try:
        in_bf16 = write_data(tmp_path / "bf16", 320, seed=0)
        bf16_losses, _ = train_once(bf16, "target", in_bf16)
        assert forwards == [torch.bfloat16] * 3  # two train batches, one held-out batch: all by the copy
        (cache,) = (in_bf16 / "features").iterdir()
        assert json.loads((cache / "cache.json").read_text())["dtype"] == "bfloat16"
        assert all(t.dtype in (torch.bfloat16, torch.int64) for file in cache.glob("*.safetensors")
                   for t in load_file(str(file)).values())

        in_fp32 = write_data(tmp_path / "fp32", 320, seed=0)
        forwards.clear()
        fp32_losses, _ = train_once(fp32, "target", in_fp32)
        assert forwards == [torch.float32] * 3
        assert bf16_losses == pytest.approx(fp32_losses, rel=2e-2)

        forwards.clear()
        reread, _ = train_once(bf16, "target", in_fp32)
        assert forwards == [] and reread == pytest.approx(fp32_losses, abs=1e-5)  # float32 features serve it
        forwards.clear()
        train_once(fp32, "target", in_bf16)
        assert forwards == [torch.float32] * 3 and len(list((in_bf16 / "features").iterdir())) == 2
    finally:
        handle.remove()


def test_a_bfloat16_feature_forward_needs_the_targets_directory(random_checkpoint, tmp_path):
    import dataclasses

    from eyas.config import ConfigError

    cfg = config({"type": "eagle1", "config": {}})
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, feature_dtype="bfloat16"))
    data_dir = write_data(tmp_path / "chat", 320, seed=0)
    with pytest.raises(ConfigError, match="set train.feature_dtype=float32"):
        Trainer(cfg, load_target(random_checkpoint), SequenceDataset(data_dir, "train", cfg.train.max_len),
                feature_dir=data_dir / "features")
