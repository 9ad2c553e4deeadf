"""jobs.generate_data without Ray: corpus chunks as shards, reruns skip finished shards, changed settings refuse;
mixes of built data sets."""
from __future__ import annotations

import json

import pytest
from train_testing import data_config

from eyas.config import ConfigError
from eyas.train.config import DataConfig
from eyas.train.data import SequenceDataset, ShardError


def corpus_config(**changes) -> DataConfig:
    return data_config({"name": "rand-corpus", "target": "target-rand", "source": "corpus", "num_prompts": 10,
                        "num_heldout_prompts": 3, "chunk_tokens": 32, "shard_size": 4}, **changes)


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


def test_a_data_set_grows_whole_past_a_shard_its_last_plan_cut_short_and_keeps_rows_when_asked_for_fewer(home, capsys):
    from jobs.generate_data import build, covered_plan

    build(corpus_config(num_prompts=10))  # shards of 4, 4 and 2 rows
    capsys.readouterr()
    out = build(corpus_config(num_prompts=14))
    assert "shard-00002.parquet: the end of the earlier 10 train prompts" in capsys.readouterr().out
    fresh = build(corpus_config(name="rand-fresh", num_prompts=14))
    assert SequenceDataset(out, "train").rows == SequenceDataset(fresh, "train").rows
    assert len(SequenceDataset(out, "train")) == 14

    build(corpus_config(num_prompts=6))
    assert "14 train sequences, more than the 6 asked for" in capsys.readouterr().out
    stamp = json.loads((out / "data.json").read_text())
    assert stamp["rows"]["train"] == 14 and stamp["covered"] == {"train": 14, "heldout": 3}
    del stamp["covered"]  # as stamped before data.json kept it: the rows on disk say what the shards cover
    (out / "data.json").write_text(json.dumps(stamp))
    assert covered_plan(out, stamp) == {"train": 14, "heldout": 3}
    build(corpus_config(num_prompts=16))  # 14 -> 16: shard 3 (rows 12-13) is rebuilt with rows 14-15
    assert SequenceDataset(out, "train").rows == SequenceDataset(build(corpus_config(name="rand-16", num_prompts=16)),
                                                                 "train").rows


def test_a_growing_data_set_keeps_its_held_out_split_readable(home, monkeypatch):
    """While a build adds train shards, readers refuse the train split (it is changing) but not the held-out one,
    which the build leaves as it is: a sweep evaluating on it goes on."""
    import jobs.generate_data as job

    out = job.build(corpus_config(num_prompts=4))
    seen = {}
    corpus_shards = job.corpus_shards

    def checking(cfg, out_dir, target_dir, todo):
        seen["todo"] = sorted({split for split, _ in todo})
        seen["heldout"] = len(SequenceDataset(out_dir, "heldout"))
        with pytest.raises(ShardError, match="has not finished"):
            SequenceDataset(out_dir, "train")
        return corpus_shards(cfg, out_dir, target_dir, todo)

    monkeypatch.setattr(job, "corpus_shards", checking)
    job.build(corpus_config(num_prompts=10))
    assert seen == {"todo": ["train"], "heldout": 3}
    assert json.loads((out / "data.json").read_text())["rows"] == {"train": 10, "heldout": 3}


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


def test_a_truncated_shard_or_an_unfinished_build_is_refused_and_a_rerun_redoes_it(home, capsys):
    from jobs.generate_data import build

    out = build(corpus_config())
    rows = SequenceDataset(out, "train").rows
    shard = out / "train" / "shard-00001.parquet"
    shard.write_bytes(shard.read_bytes()[:100])  # a bad copy, or a disk that lost the file's end
    with pytest.raises(ShardError, match=f"{shard}: cannot read this parquet shard .* rerun python -m jobs.generate"):
        SequenceDataset(out, "train")
    capsys.readouterr()
    build(corpus_config())
    printed = capsys.readouterr().out
    assert f"{shard}: unreadable (truncated or corrupt); building it again" in printed
    assert "1 shards to build (3 already done)" in printed and SequenceDataset(out, "train").rows == rows

    meta = json.loads((out / "data.json").read_text())
    (out / "data.json").write_text(json.dumps({**meta, "complete": False}))  # as a build killed midway leaves it
    with pytest.raises(ShardError, match="data.json: this data set's build has not finished"):
        SequenceDataset(out, "train")
    (out / "data.json").write_text(json.dumps({**meta, "rows": {"train": 11, "heldout": 3}}))
    with pytest.raises(ShardError, match="its shards hold 10 rows but .*data.json records 11"):
        SequenceDataset(out, "train")


def mix_config(**changes) -> DataConfig:
    return data_config({"name": "rand-mix", "target": "target-rand", "source": "mix",
                        "parts": "[rand-corpus, rand-short]", "shard_size": 5}, **changes)


def test_a_mix_joins_its_parts_and_follows_them_when_they_grow(home, capsys):
    from jobs.generate_data import build

    first = SequenceDataset(build(corpus_config()), "train").rows
    short = build(corpus_config(name="rand-short", num_prompts=4, chunk_tokens=16))
    part_cache = short / "features" / "c0ffee"  # a part's feature cache (kept by its build, or a training's)
    part_cache.mkdir(parents=True)
    for name in ("cache.json", "row.safetensors"):
        (part_cache / name).write_text(name)
    out = build(mix_config())
    assert (out / "features" / "c0ffee" / "row.safetensors").samefile(part_cache / "row.safetensors")
    assert SequenceDataset(out, "train").rows == first + SequenceDataset(short, "train").rows
    assert len(SequenceDataset(out, "heldout")) == 3 + 3
    meta = json.loads((out / "data.json").read_text())
    assert meta["complete"] is True and meta["rows"] == {"train": 14, "heldout": 6}
    assert sorted(meta["last_run"]["parts"]) == ["rand-corpus", "rand-short"]
    assert sorted(p.name for p in (out / "train").iterdir()) == [f"shard-0000{i}.parquet" for i in range(3)]

    (out / "features" / "kept").mkdir(parents=True)  # a feature cache (named by sequence) survives a rebuild
    build(corpus_config(name="rand-short", num_prompts=9, chunk_tokens=16))
    assert len(SequenceDataset(build(mix_config()), "train")) == 10 + 9
    assert (out / "features" / "kept").is_dir()
    assert not list(home.joinpath("data").glob(".rand-mix.*"))  # no temp directory left behind


def test_a_mix_refuses_parts_it_cannot_join(home, eyas_home):
    from jobs.generate_data import build

    with pytest.raises(FileNotFoundError, match="rand-corpus.*not a built data set"):
        build(mix_config())
    build(corpus_config())
    build(corpus_config(name="rand-short"))
    meta_file = eyas_home / "data" / "rand-short" / "data.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "content_key": {**meta["content_key"], "target": "/elsewhere"}}))
    with pytest.raises(ConfigError, match="rand-short.*answers of /elsewhere"):
        build(mix_config())
    meta_file.write_text(json.dumps({**meta, "complete": False}))
    with pytest.raises(ShardError, match="has not finished"):
        build(mix_config())
    with pytest.raises(ConfigError, match="source: mix needs"):
        mix_config(parts="[]")
    with pytest.raises(ConfigError, match="only source: mix takes them"):
        corpus_config(parts="[rand-short]")
    with pytest.raises(ConfigError, match="must not include the mix itself"):
        mix_config(parts="[rand-mix, rand-short]")
