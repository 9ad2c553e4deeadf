"""The Ray-free part of jobs.train_target (eyas.train.target_lm): every target/draft YAML is a TargetJobConfig, the
job re-exports the config it documents, and the schedule warms up, decays by steps or by wall time, and ends at
lr * min_lr_ratio."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eyas.config import load_config
from eyas.train.target_lm import TargetJobConfig, TrainConfig, eval_windows, lr_at, sample_windows

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "jobs" / "configs").glob("*.yaml"))
TARGET_CONFIGS = [p for p in CONFIGS if p.name.startswith(("target-", "draft-"))]


@pytest.mark.parametrize("path", TARGET_CONFIGS, ids=lambda p: p.name)
def test_target_and_draft_configs_load(path):
    cfg = load_config(TargetJobConfig, path, [])
    assert cfg.train.seq_len <= cfg.model.max_position_embeddings


def test_the_job_names_the_library_config():
    import jobs.train_target

    assert jobs.train_target.TargetJobConfig is TargetJobConfig


def test_lr_schedule():
    train = TrainConfig(lr=1.0, warmup_steps=4, num_steps=14, min_lr_ratio=0.1)
    assert [lr_at(s, train) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, train) == 1.0 and lr_at(14, train) == pytest.approx(0.1)
    assert lr_at(9, train) == pytest.approx(0.55)  # half way: the cosine's middle
    assert lr_at(5, train, time_fraction=1.0) == pytest.approx(0.1)  # the wall-time budget is spent


def test_windows():
    stream_N = np.arange(20, dtype=np.int32)
    inputs_BT, labels_BT = sample_windows(stream_N, np.random.default_rng(0), 3, 5)
    assert inputs_BT.shape == (3, 5) and (labels_BT == inputs_BT + 1).all()
    assert eval_windows(stream_N, 5, 100).tolist()[:2] == [[0, 1, 2, 3, 4, 5], [5, 6, 7, 8, 9, 10]]
