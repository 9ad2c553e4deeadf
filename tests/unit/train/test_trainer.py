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
    for batch in trainer.batches(0):
        trainer.train_step(batch)
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
    for batch in trainer.batches(1):  # training after drafting with the live model
        trainer.train_step(batch)
    assert trainer.step > step


def test_a_warm_start_trains_on_from_a_saved_drafter(data_dir, tmp_path, monkeypatch, capsys):
    """``drafter.init_from``: the trainer starts from the checkpoint's weights and draft vocabulary (``config``
    overriding a training-only field), trains on, and a checkpoint of another family or shape is refused by name;
    jobs.train_drafter resolves a bare name under $EYAS_HOME/drafters before Ray starts."""
    from dataclasses import replace

    import torch

    from eyas.config import ConfigError
    from eyas.models.config import CheckpointError
    from jobs.train_drafter import local_init

    cfg = config("eagle3", Path("unused-target"), data_dir)
    target = build_target()
    data = SequenceDataset(data_dir, "train", cfg.train.max_len)
    heldout = SequenceDataset(data_dir, "heldout", cfg.train.max_len)
    first = Trainer(cfg, target, data, heldout)
    for batch in first.batches(0):
        first.train_step(batch)
    monkeypatch.setenv("EYAS_HOME", str(tmp_path))
    first.save(tmp_path / "drafters" / "first")

    def warm(**drafter) -> Trainer:
        return Trainer(replace(cfg, drafter=replace(cfg.drafter, **drafter)), target, data, heldout)

    trainer = warm(init_from="first", config={"ttt_steps": 2})
    assert trainer.drafter.training and trainer.drafter.config.ttt_steps == 2
    assert trainer.drafter.draft_vocab == first.drafter.draft_vocab
    saved = first.drafter.state_dict()
    assert all(torch.equal(tensor, saved[name]) for name, tensor in trainer.drafter.state_dict().items())
    # it picks up where the first left off (same held-out loss at its first two steps, as ttt_steps=2 reads)
    fresh = Trainer(replace(cfg, drafter=replace(cfg.drafter, config={**cfg.drafter.config, "ttt_steps": 2})),
                    target, data, heldout)
    warm_eval, first_eval = trainer.evaluate_heldout(), first.evaluate_heldout()
    assert warm_eval["heldout_acc_1"] == first_eval["heldout_acc_1"]
    assert warm_eval["heldout_ce_1"] < fresh.evaluate_heldout()["heldout_ce_1"]  # trained, not fresh
    batch = next(trainer.batches(0))
    trainer.train_step(batch)
    assert trainer.step == 1 and trainer.evaluate_heldout() != warm_eval
    with pytest.raises(CheckpointError, match="holds a eagle3 drafter, not dflash"):
        warm(type="dflash", init_from="first", config={})
    with pytest.raises(CheckpointError, match="shape mismatch|do not match"):
        warm(init_from="first", config={"layer": {"intermediate_size": 40}})

    assert local_init(replace(cfg, drafter=replace(cfg.drafter, init_from="first"))).drafter.init_from == str(
        (tmp_path / "drafters" / "first").resolve())
    assert "changes the checkpoint's" not in capsys.readouterr().out  # the YAML's config is the checkpoint's
    local_init(replace(cfg, drafter=replace(cfg.drafter, init_from="first",
                                            config={**cfg.drafter.config, "ttt_steps": 2})))
    said = capsys.readouterr().out
    assert "changes the checkpoint's ttt_steps 3 -> 2" in said
    with pytest.raises(ConfigError, match="no drafter checkpoint at .*drafters/missing"):
        local_init(replace(cfg, drafter=replace(cfg.drafter, init_from="missing")))
    with pytest.raises(ConfigError, match="holds a eagle3 drafter but drafter.type is medusa"):
        local_init(replace(cfg, drafter=replace(cfg.drafter, type="medusa", init_from="first")))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['drafter.config.ttt_step'\]"):
        local_init(replace(cfg, drafter=replace(cfg.drafter, init_from="first", config={"ttt_step": 2})))


def test_vocab_data_joins_the_training_data_in_choosing_the_draft_vocabulary(data_dir, tmp_path):
    """``drafter.vocab_data``: a draft vocabulary from the training data's prediction targets and another set's,
    each set weighted equally, so tokens only the other set uses make it in."""
    from dataclasses import replace

    from eyas.train.data import response_row, shard_path, write_shard

    code_dir = tmp_path / "code"
    code_tokens = [VOCAB - 1, VOCAB - 2]  # what the training data's random tokens rarely hold
    write_shard(shard_path(code_dir, "train", 0), [response_row([5], code_tokens * 40)])
    cfg = config("eagle3", Path("unused-target"), data_dir)
    cfg = replace(cfg, drafter=replace(cfg.drafter, config={**cfg.drafter.config, "draft_vocab_size": 8}))
    target, data = build_target(), SequenceDataset(data_dir, "train", cfg.train.max_len)
    alone = Trainer(cfg, target, data).drafter.draft_vocab
    joined = Trainer(replace(cfg, drafter=replace(cfg.drafter, vocab_data=(str(code_dir),))), target, data)
    assert len(joined.drafter.draft_vocab) == 8 and not set(code_tokens) <= set(alone)
    assert set(code_tokens) <= set(joined.drafter.draft_vocab)


def test_a_missing_vocab_data_set_fails_before_ray_starts(data_dir, tmp_path, monkeypatch):
    from dataclasses import replace

    from jobs.train_drafter import check_inputs

    monkeypatch.setenv("EYAS_HOME", str(tmp_path))
    target_dir = tmp_path / "targets" / "t"
    target_dir.mkdir(parents=True)
    (target_dir / "config.json").write_text("{}")
    cfg = config("eagle3", target_dir, data_dir)
    assert check_inputs(cfg) == (target_dir, data_dir)
    with pytest.raises(FileNotFoundError, match="drafter.vocab_data 'data-code': .*data-code/train holds no shards"):
        check_inputs(replace(cfg, drafter=replace(cfg.drafter, vocab_data=("data-code",))))


def test_heldout_and_tau_are_reported_per_suite(data_dir):
    """``train.heldout_data`` / ``measure.suite: a,b``: each suite's held-out split and tau prompts are evaluated
    apart (heldout_<label>_*, tau_<suite>) and summarised over the suites (heldout_* the mean, tau over all)."""
    cfg = config("eagle3", Path("unused-target"), data_dir)
    target = build_target()
    data = SequenceDataset(data_dir, "train", cfg.train.max_len)
    heldout = {"code": SequenceDataset(data_dir, "heldout", cfg.train.max_len),
               "chat": SequenceDataset(data_dir, "train", cfg.train.max_len, limit=3)}
    trainer = Trainer(cfg, target, data, heldout, prompts={"code": PROMPTS[:1], "chat": PROMPTS[1:]})
    trainer.train_step(next(trainer.batches(0)))
    metrics = trainer.evaluate_heldout()
    alone = {label: Trainer(cfg, target, data, split) for label, split in heldout.items()}
    for label, other in alone.items():  # the same weights: start both from the trained drafter
        other.drafter.load_state_dict(trainer.drafter.state_dict())
        for key, value in other.evaluate_heldout().items():
            assert metrics[key.replace("heldout_", f"heldout_{label}_")] == pytest.approx(value)
    assert metrics["heldout_code_acc_1"] != metrics["heldout_chat_acc_1"]
    assert metrics["heldout_acc_1"] == pytest.approx((metrics["heldout_code_acc_1"] + metrics["heldout_chat_acc_1"]) / 2)
    measured, stats = trainer.measure()
    code_stats, _ = measure_tau(target, trainer.spec_drafter(), PROMPTS[:1], cfg.measure.max_new_tokens)
    assert measured["tau_code"] == pytest.approx(code_stats.tau) and "tau_chat" in measured
    assert measured["greedy_identical"] == 1.0 and stats.cycles >= code_stats.cycles


def test_epoch_steps_caps_an_epoch(data_dir):
    """``train.epoch_steps``: an epoch is its first N batches (a new draw each epoch), so a sweep's rung is short."""
    from dataclasses import replace

    import torch

    cfg = config("eagle3", Path("unused-target"), data_dir)
    full = Trainer(cfg, build_target(), SequenceDataset(data_dir, "train", cfg.train.max_len))
    capped_cfg = replace(cfg, train=replace(cfg.train, epoch_steps=2))
    capped = Trainer(capped_cfg, build_target(), SequenceDataset(data_dir, "train", cfg.train.max_len))
    assert full.steps_per_epoch == 3 and capped.steps_per_epoch == 2
    assert capped.total_steps == 2 * cfg.train.num_epochs
    first = [b.input_ids_BT for b in full.batches(1)]
    kept = [b.input_ids_BT for b in capped.batches(1)]
    assert len(kept) == 2 and all(torch.equal(a, b) for a, b in zip(kept, first))
    assert len(list(capped.batches(1, start=1))) == 1 and not list(capped.batches(1, start=2))
