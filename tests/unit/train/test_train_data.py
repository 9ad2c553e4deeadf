"""Training data: batched regeneration equals plain greedy generation, shards, per-rank batches, feature caching."""
from __future__ import annotations

import pytest
import torch

from eyas.models import load_target
from eyas.decoding.generate import generate
from eyas.train.data import (DataPosition, SequenceDataset, collate, corpus_chunks, regenerate,
                             response_row, shard_path, slot_window, write_shard)
from eyas.models.features import TargetFeatures, target_features
from eyas.train.feature_cache import FeatureCache


@pytest.fixture(scope="module")
def target(random_checkpoint):
    torch.manual_seed(0)
    return load_target(random_checkpoint)


def test_batched_regeneration_equals_greedy_generate(target):
    prompts = [[0, 5, 9, 31, 7, 100], [0, 17], [0, 3, 3, 8, 250, 12, 60, 61, 90], [0, 44, 45]]
    batched = regenerate(target, prompts, max_new_tokens=12)
    for prompt, got in zip(prompts, batched):
        assert got == generate(target, prompt, 12).token_ids


@pytest.fixture(scope="module")
def windowed_target(tmp_path_factory):
    """A random Mistral-type target whose layers all see only the last 4 positions."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           sliding_window=4, tie_word_embeddings=False)
    model = MistralForCausalLM(config)
    with torch.no_grad():  # sharper logits: a wrong key in the window changes the argmax
        model.lm_head.weight.mul_(8.0)
    directory = tmp_path_factory.mktemp("mistral-window4")
    model.save_pretrained(str(directory))
    return load_target(directory)


def test_slot_window():
    assert slot_window(5, 3, torch.device("cpu")).int().tolist() == [
        [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert slot_window(3, None, torch.device("cpu")).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_left_padded_rows_keep_the_sliding_window(windowed_target):
    """Issue 16: a row padded by 6 once saw 6 keys beyond its window and drifted from the 5th token on."""
    assert windowed_target.config.sliding_window == 4
    long, short = [1, 5, 9, 31, 7, 100, 3, 8, 12], [1, 17, 40]
    batched = regenerate(windowed_target, [long, short], max_new_tokens=12)
    assert batched[0] == generate(windowed_target, long, 12).token_ids
    assert batched[1] == generate(windowed_target, short, 12).token_ids


def test_regeneration_stops_each_row_at_eos(target):
    prompts = [[0, 5, 9, 31], [0, 17, 40]]
    free = regenerate(target, prompts, max_new_tokens=10)
    eos = free[0][3]  # pretend the 4th token of row 0 is EOS
    stopped = regenerate(target, prompts, max_new_tokens=10, eos_token_ids=[eos])
    assert stopped[0] == free[0][:free[0].index(eos) + 1]
    row1 = free[1][:free[1].index(eos) + 1] if eos in free[1] else free[1]
    assert stopped[1] == row1


def test_sampled_regeneration_is_seeded(target):
    prompts = [[0, 5, 9], [0, 17]]
    runs = [regenerate(target, prompts, 8, temperature=1.0, generator=torch.Generator().manual_seed(3))
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_collate_pads_right_and_cuts():
    rows = [response_row([0, 1, 2], [7, 8]), response_row([0], [9, 9, 9, 9, 9, 9])]
    batch = collate(rows, max_len=5, pad_id=2)
    assert batch.input_ids_BT.tolist() == [[0, 1, 2, 7, 8], [0, 9, 9, 9, 9]]
    assert batch.loss_mask_BT.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]
    assert batch.valid_BT.tolist() == [[1] * 5, [1] * 5]
    short = collate(rows[:1] + [response_row([0], [4])], max_len=16, pad_id=2)
    assert short.input_ids_BT[1].tolist() == [0, 4, 2, 2, 2] and short.valid_BT[1].tolist() == [1, 1, 0, 0, 0]


def test_corpus_chunks():
    rows = corpus_chunks(list(range(10)), chunk_tokens=4, num_chunks=5)
    assert [r["response_ids"] for r in rows] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rows[0]["loss_mask"] == [0, 1, 1, 1]


@pytest.fixture()
def dataset_dir(tmp_path):
    rows = [response_row([0, i], [i + 1] * (1 + i % 4)) for i in range(22)]
    write_shard(shard_path(tmp_path, "train", 0), rows[:10])
    write_shard(shard_path(tmp_path, "train", 1), rows[10:])
    return tmp_path


def test_shards_read_back_in_order(dataset_dir):
    data = SequenceDataset(dataset_dir, "train")
    assert len(data) == 22 and data.rows[13]["prompt_ids"] == [0, 13]
    with pytest.raises(FileNotFoundError, match="generate_data"):
        SequenceDataset(dataset_dir, "heldout")


def test_ranks_get_disjoint_equal_batches_and_resume_skips(dataset_dir):
    data = SequenceDataset(dataset_dir, "train")
    per_rank = [data.epoch_indices(epoch=0, seed=1, rank=r, world_size=3, batch_size=3) for r in range(3)]
    flat = [sorted(i for b in batches for i in b) for batches in per_rank]
    assert [len(f) for f in flat] == [7, 7, 7]  # 22 // 3, the remainder dropped
    assert not set(flat[0]) & set(flat[1]) and not set(flat[1]) & set(flat[2])
    assert data.num_batches(3, 3) == len(per_rank[0]) == 3
    assert per_rank[0] == data.epoch_indices(0, 1, 0, 3, 3)  # deterministic
    assert per_rank[0] != data.epoch_indices(1, 1, 0, 3, 3)  # reshuffled each epoch
    fixed = [[sorted(i for b in data.epoch_indices(e, 1, r, 3, 3, fixed_ranks=True) for i in b) for r in range(3)]
             for e in range(3)]
    assert fixed[0] == fixed[1] == fixed[2] and fixed[0] == flat  # same share per rank, every epoch
    assert data.epoch_indices(1, 1, 0, 3, 3, fixed_ranks=True) != data.epoch_indices(2, 1, 0, 3, 3, fixed_ranks=True)
    resumed = [idx for idx, _ in data.batches(0, 1, 0, 3, 3, start=2)]
    assert resumed == per_rank[0][2:]
    assert DataPosition.from_dict(DataPosition(2, 5).to_dict()) == DataPosition(2, 5)


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_feature_cache_matches_online(target, dataset_dir, tmp_path, mode):
    data = SequenceDataset(dataset_dir, "train")
    taps = (1, target.config.num_layers)
    cache = FeatureCache(target, taps, mode, tmp_path / "features" if mode == "disk" else None)
    for _ in range(2):
        for indices in ([0, 5, 7], [5, 21]):
            batch = data.batch(indices)
            online = target_features(target, batch.input_ids_BT, taps)
            cached = cache.features(batch)
            valid = batch.valid_BT.bool()
            for t in taps:
                torch.testing.assert_close(cached.taps[t][valid], online.taps[t][valid], atol=1e-5, rtol=1e-5)
            assert torch.equal(cached.argmax_BT[valid], online.logits_BTV.argmax(-1)[valid])
            assert cached._logits_BTV is None  # the LM head over every position runs only when a loss reads it
            torch.testing.assert_close(cached.logits_BTV[valid], online.logits_BTV[valid], atol=1e-4, rtol=1e-4)
    assert cache.misses == 4 and cache.hits == 6
    assert len(cache.memory) == (4 if mode == "memory" else 0)  # a disk cache holds no row in the worker
    if mode == "disk":  # a fresh cache (another worker, a resumed run) reads the files
        fresh = FeatureCache(target, taps, "disk", tmp_path / "features")
        fresh.features(data.batch([0, 21]))
        assert fresh.hits == 2 and fresh.misses == 0


def test_feature_cache_reads_files_written_without_the_argmax(target, dataset_dir, tmp_path):
    """A disk cache from before the greedy next tokens were stored still serves its rows (argmax re-derived)."""
    from safetensors.torch import load_file, save_file

    data = SequenceDataset(dataset_dir, "train")
    taps = (1,)
    directory = tmp_path / "features"
    FeatureCache(target, taps, "disk", directory).features(data.batch([0, 5]))
    for file in directory.glob("*.safetensors"):
        row = load_file(str(file))
        assert "argmax" in row
        del row["argmax"]
        save_file(row, str(file))
    old = FeatureCache(target, taps, "disk", directory)
    batch = data.batch([0, 5])
    cached = old.features(batch)
    assert old.hits == 2 and old.misses == 0
    online = target_features(target, batch.input_ids_BT, taps)
    valid = batch.valid_BT.bool()
    assert torch.equal(cached.argmax_BT[valid], online.logits_BTV.argmax(-1)[valid])


def test_target_features_needs_logits_or_an_argmax():
    taps = {1: torch.zeros(1, 2, 4)}
    with pytest.raises(ValueError, match="needs logits_BTV or logits_from"):
        TargetFeatures(taps)
    with pytest.raises(ValueError, match="needs argmax_BT"):
        TargetFeatures(taps, logits_from=lambda index: torch.zeros(1, 2, 8))
    lazy = TargetFeatures(taps, argmax_BT=torch.tensor([[3, 1]]), logits_from=lambda index: torch.ones(1, 2, 8))
    assert lazy.argmax_BT.tolist() == [[3, 1]] and lazy.logits_BTV.shape == (1, 2, 8)


def test_logits_at_reads_only_the_positions_asked_for():
    logits_BTV = torch.randn(2, 5, 8)
    asked = []

    def logits_from(index):
        asked.append(index)
        return logits_BTV if index is None else logits_BTV[index]

    lazy = TargetFeatures({}, argmax_BT=logits_BTV.argmax(-1), logits_from=logits_from)
    b_R, t_R = torch.tensor([1, 0, 1]), torch.tensor([4, 2, 0])
    assert torch.equal(lazy.logits_at(b_R, t_R), logits_BTV[b_R, t_R])
    assert len(asked) == 1 and asked[0][1].tolist() == [4, 2, 0]  # three rows, not the whole [2, 5]
    assert torch.equal(lazy.logits_BTV, logits_BTV) and asked[1] is None
    assert torch.equal(lazy.logits_at(b_R, t_R), logits_BTV[b_R, t_R]) and len(asked) == 2  # held: indexed
