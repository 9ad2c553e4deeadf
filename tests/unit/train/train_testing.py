"""Helpers of the training tests: configs as the jobs read them, and one small training epoch run the way a
jobs.train_drafter worker runs it."""
from __future__ import annotations

from pathlib import Path

import torch

from eyas.config import from_dict, load_config
from eyas.models import load_target
from eyas.train.config import DataConfig, TrainConfig
from eyas.train.data import SequenceDataset
from eyas.train.trainer import Trainer


def data_config(fields: dict, **changes) -> DataConfig:
    """``fields`` with ``changes`` over them as jobs.generate_data's dotted overrides (typed and checked as there)."""
    return load_config(DataConfig, overrides=[f"{k}={v}" for k, v in {**fields, **changes}.items()])


def epoch_config(drafter: dict, name: str, target: str, data: str, max_len: int) -> TrainConfig:
    """One epoch of batches of 4 on one worker, features in the disk cache, 2 held-out sequences, nothing tracked."""
    return from_dict(TrainConfig, {
        "name": name, "target": target, "data": data, "drafter": drafter,
        "train": {"num_epochs": 1, "batch_size": 4, "max_len": max_len, "feature_cache": "disk", "eval_sequences": 2},
        "optim": {"lr": 3e-3, "warmup_steps": 1}, "scaling": {"num_workers": 1},
        "measure": {"num_prompts": 0}, "tracking": {"enabled": False}})


def train_once(cfg: TrainConfig, target_dir: str, data_dir: Path, rows: list[int] | None = None
               ) -> tuple[list[float], int]:
    """(per-step losses then the held-out loss, target forwards) of one training epoch run the way a
    jobs.train_drafter worker runs it (features in data_dir/features); ``rows`` collects the number of sequences
    of each target forward."""
    torch.manual_seed(0)
    target = load_target(target_dir)
    forwards = [] if rows is None else rows
    target.register_forward_hook(lambda module, args, output: forwards.append(args[0].shape[0]))
    trainer = Trainer(cfg, target, SequenceDataset(data_dir, "train", cfg.train.max_len),
                      SequenceDataset(data_dir, "heldout", cfg.train.max_len, limit=cfg.train.eval_sequences),
                      target_dir=target_dir, feature_dir=data_dir / "features")
    losses = [trainer.train_step(batch)["loss"] for batch in trainer.batches(0)]
    losses.append(trainer.evaluate_heldout()["heldout_loss"])
    return losses, len(forwards)
