"""The golden training cases: per-step losses and the held-out evaluation of a few seeded steps of micro drafter
training (EAGLE-3 with the memory feature cache over two epochs, DFlash with none; EAGLE-3.1 and P-EAGLE, recorded
later with ``--only eagle3.1,peagle``, which leaves the other records as they were), one worker, no Ray.

``record(data_dir, case)`` runs the library trainer (``eyas.train.trainer.Trainer``) on golden_cases' random
target the way a jobs.train_drafter worker does; the fixture ``train_losses.json`` was recorded before the trainer moved into the
library, through the pieces jobs.train_drafter's workers used then (build_drafter, make_strategy("ddp"),
SequenceDataset, FeatureCache, the per-step seed). Regenerate it only after a deliberate behaviour change:

    .venv/bin/python tests/golden/train_cases.py
"""
from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

from eyas.config import from_dict
from eyas.threads import configure_threads
from eyas.train.config import TrainConfig
from eyas.train.data import SequenceDataset, response_row, shard_path, write_shard
from eyas.train.trainer import Trainer
from golden_cases import VOCAB, build_target

FIXTURE = Path(__file__).with_name("train_losses.json")
CASES = {
    "eagle3": {"drafter": {"type": "eagle3", "config": {"ttt_steps": 3, "draft_vocab_size": 64}},
               "train": {"num_epochs": 2, "batch_size": 4, "max_len": 48, "feature_cache": "memory"}},
    "dflash": {"drafter": {"type": "dflash", "config": {"num_layers": 1, "block_size": 4, "num_taps": 1,
                                                        "num_anchors": 8, "mask_token_id": 3}},
               "train": {"num_epochs": 1, "batch_size": 4, "max_len": 48, "feature_cache": "none"}},
    "eagle3.1": {"drafter": {"type": "eagle3.1", "config": {"ttt_steps": 3, "draft_vocab_size": 64}},
                 "train": {"num_epochs": 1, "batch_size": 4, "max_len": 48, "feature_cache": "memory"}},
    "peagle": {"drafter": {"type": "peagle", "config": {"num_depths": 3, "draft_vocab_size": 64}},
               "train": {"num_epochs": 2, "batch_size": 4, "max_len": 48, "feature_cache": "memory"}},
}


def write_data(directory: Path, vocab_size: int) -> Path:
    """12 train and 4 held-out sequences of seeded random tokens (prompt + response)."""
    rng = random.Random(0)
    for split, count in (("train", 12), ("heldout", 4)):
        rows = [response_row([rng.randrange(4, vocab_size) for _ in range(rng.randrange(3, 8))],
                             [rng.randrange(4, vocab_size) for _ in range(rng.randrange(10, 30))])
                for _ in range(count)]
        path = shard_path(directory, split, 0)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_shard(path, rows)
    return directory


def config(case: str, target_dir: Path, data_dir: Path) -> TrainConfig:
    raw = {"name": f"golden-{case}", "target": str(target_dir), "data": str(data_dir),
           "optim": {"lr": 3e-3, "warmup_steps": 2}, "scaling": {"num_workers": 1},
           "measure": {"num_prompts": 0}, "tracking": {"enabled": False}, **CASES[case]}
    raw["train"] = {**raw["train"], "eval_sequences": 4}
    return from_dict(TrainConfig, raw)


def record(data_dir: Path, case: str) -> dict:
    """Every step's training metrics, then the held-out evaluation of the trained drafter."""
    configure_threads(1)  # recorded with one thread (reductions split differently across threads)
    cfg = config(case, Path("unused-target"), data_dir)
    data = SequenceDataset(data_dir, "train", cfg.train.max_len)
    heldout = SequenceDataset(data_dir, "heldout", cfg.train.max_len, limit=cfg.train.eval_sequences)
    trainer = Trainer(cfg, build_target(), data, heldout)
    steps = []
    for epoch in range(cfg.train.num_epochs):
        for batch in trainer.batches(epoch):
            steps.append(trainer.train_step(batch))
    return {"steps": steps, "heldout": trainer.evaluate_heldout()}


def record_all(work_dir: Path) -> dict:
    data_dir = write_data(work_dir / "data", VOCAB)
    return {case: record(data_dir, case) for case in CASES}


if __name__ == "__main__":
    import sys

    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
    with tempfile.TemporaryDirectory() as tmp:
        if only is None:
            recorded = record_all(Path(tmp))
        else:  # add or rewrite these cases only; every other record stays byte for byte
            data_dir = write_data(Path(tmp) / "data", VOCAB)
            recorded = {**json.loads(FIXTURE.read_text()), **{case: record(data_dir, case) for case in only}}
        FIXTURE.write_text(json.dumps(recorded, indent=1) + "\n")
    print(f"wrote {FIXTURE}")
