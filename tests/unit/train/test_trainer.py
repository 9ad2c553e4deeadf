"""The library trainer: tau measured with the live drafter equals tau of the same weights saved and loaded back (what
training-time evaluation did before), and training goes on after a measurement."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eyas.decoding.generate import generate
from eyas.methods import load_drafter
from eyas.train.data import SequenceDataset
from eyas.train.step import measure_tau
from eyas.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "golden"))
from golden_cases import VOCAB, build_target  # noqa: E402  (the golden tests' random target, no tokenizer needed)
from train_cases import CASES, config, write_data  # noqa: E402

PROMPTS = [[5, 9, 31, 7, 10], [17, 3, 44]]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("trainer") / "data", VOCAB)


@pytest.mark.parametrize("case", sorted(CASES))
def test_live_drafter_measures_like_its_checkpoint(case, data_dir, tmp_path):
    cfg = config(case, Path("unused-target"), data_dir)
    target = build_target()
    trainer = Trainer(cfg, target, SequenceDataset(data_dir, "train", cfg.train.max_len), prompts=PROMPTS)
    for indices, batch in trainer.batches(0):
        trainer.train_step(indices, batch)
    metrics, stats = trainer.measure()
    trainer.save(tmp_path / "drafter")
    saved = load_drafter(tmp_path / "drafter", target)
    saved_stats, saved_outputs = measure_tau(target, saved, PROMPTS, cfg.measure.max_new_tokens)
    assert stats.accepted_per_cycle == saved_stats.accepted_per_cycle
    assert metrics["tau"] == saved_stats.tau
    vanilla = [generate(target, p, cfg.measure.max_new_tokens).token_ids for p in PROMPTS]
    assert saved_outputs == vanilla and metrics["greedy_identical"] == 1.0
    assert trainer.drafter.training
    step = trainer.step
    for indices, batch in trainer.batches(1):  # training after drafting with the live model
        trainer.train_step(indices, batch)
    assert trainer.step > step
