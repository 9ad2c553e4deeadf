"""jobs.generate_data without Ray: corpus chunks as shards, reruns skip finished shards, changed settings refuse."""
from __future__ import annotations

import json
import shutil

import pytest

from eyas.config import ConfigError, load_config
from eyas.train.config import DataConfig
from eyas.train.data import SequenceDataset


@pytest.fixture()
def home(eyas_home, random_checkpoint):
    shutil.copytree(random_checkpoint, eyas_home / "targets" / "target-rand")
    return eyas_home


def corpus_config(**changes) -> DataConfig:
    fields = {"name": "rand-corpus", "target": "target-rand", "source": "corpus", "num_prompts": 10,
              "num_heldout_prompts": 3, "chunk_tokens": 32, "shard_size": 4, **changes}
    return load_config(DataConfig, overrides=[f"{k}={v}" for k, v in fields.items()])


def test_corpus_source_writes_chunks_and_reruns_skip_done_shards(home, capsys):
    from jobs.generate_data import build

    out = build(corpus_config())
    train, heldout = SequenceDataset(out, "train"), SequenceDataset(out, "heldout")
    assert len(train) == 10 and len(heldout) == 3
    assert sorted(p.name for p in (out / "train").iterdir()) == [f"shard-0000{i}.parquet" for i in range(3)]
    row = train.rows[0]
    assert row["prompt_ids"] == [] and len(row["response_ids"]) == 32 and row["loss_mask"] == [0] + [1] * 31
    assert json.loads((out / "data.json").read_text())["rows"] == {"train": 10, "heldout": 3}

    (out / "train" / "shard-00001.parquet").unlink()  # as if the job had died before this shard
    capsys.readouterr()
    build(corpus_config())
    assert "1 shards to build (3 already done)" in capsys.readouterr().out  # 3 train + 1 held-out shards
    assert SequenceDataset(out, "train").rows == train.rows


def test_changed_settings_need_force(home):
    from jobs.generate_data import build

    build(corpus_config())
    with pytest.raises(ConfigError, match="chunk_tokens"):
        build(corpus_config(chunk_tokens=16))
    out = build(corpus_config(chunk_tokens=16), force=True)
    assert len(SequenceDataset(out, "train").rows[0]["response_ids"]) == 16


def test_missing_target_says_how_to_build_it(eyas_home):
    from jobs.generate_data import build

    with pytest.raises(FileNotFoundError, match="jobs.train_target"):
        build(corpus_config(target="nowhere"))
