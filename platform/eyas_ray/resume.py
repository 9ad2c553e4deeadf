"""A training job that can be killed and resubmitted: one Ray Train run directory per configuration.

jobs.train_drafter names its Ray Train run after the whole configuration, ``train_drafter-<name>-<fingerprint>``
under ``scaling.storage_path`` (the fingerprint: a hash of the config). A driver that dies (killed, OOM, its node
lost) leaves that directory behind; submitting the same command again finds it, and Ray Train restores the run's
last checkpoint, which every worker reads through ``ray.train.get_checkpoint()`` (eyas_ray.train_worker.resume):
weights, optimizer, lr schedule, step and data position. The driver says so before it starts ("resuming from
checkpoint ... at step k") and continues the same MLflow run (its id is kept in the run directory).

A run that finished is moved aside (``<run name>-done-<time>``), so the next submission of the same config trains
afresh; a changed config has another fingerprint and never resumes a checkpoint that is not its own.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

# Ray Train V2 keeps the run's checkpoint list here (ray.train.v2._internal.constants); it restores the latest one
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"
RUN_FILE = "eyas-run.json"  # ours: the MLflow run this Ray Train run logs to


def fingerprint(config: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:10]


@dataclass(frozen=True)
class Checkpoint:
    """The checkpoint a resumed run starts from, as Ray Train's snapshot lists it."""

    path: Path
    metrics: dict[str, Any]

    @property
    def step(self) -> int | None:
        step = self.metrics.get("step")
        return int(step) if step is not None else None


@dataclass(frozen=True)
class ResumableRun:
    """The Ray Train run of one configuration: ``storage / name``."""

    storage: Path
    name: str
    kind: str = "train_drafter"  # the job, in log lines

    @classmethod
    def for_config(cls, kind: str, name: str, config: Mapping[str, Any], storage: Path) -> "ResumableRun":
        return cls(Path(storage), f"{kind}-{name}-{fingerprint(config)}", kind)

    @property
    def dir(self) -> Path:
        return self.storage / self.name

    def last_checkpoint(self) -> Checkpoint | None:
        """The checkpoint Ray Train will restore, or None when this config has no unfinished run."""
        snapshot = self.dir / SNAPSHOT_FILE
        if not snapshot.is_file():
            return None
        latest = json.loads(snapshot.read_text()).get("latest_checkpoint_result") or None
        if latest is None:
            return None
        return Checkpoint(self.dir / latest["checkpoint_dir_name"], dict(latest.get("metrics") or {}))

    def mlflow_run_id(self) -> str | None:
        file = self.dir / RUN_FILE
        return json.loads(file.read_text()).get("mlflow_run_id") if file.is_file() else None

    def remember(self, mlflow_run_id: str | None) -> None:
        """Keep the MLflow run id in the run directory (written whole or not at all)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        partial = self.dir / f".{RUN_FILE}.{os.getpid()}.partial"
        partial.write_text(json.dumps({"mlflow_run_id": mlflow_run_id}) + "\n")
        partial.replace(self.dir / RUN_FILE)

    def done_dir(self) -> Path:
        """Where ``finish`` moves the run."""
        return self.storage / f"{self.name}-done-{time.strftime('%Y%m%d-%H%M%S')}"

    def finish(self, done_dir: Path) -> None:
        """Move the finished run aside, so the next submission of this config starts afresh."""
        self.dir.replace(done_dir)

    def announce(self) -> Checkpoint | None:
        """Print what this submission does (resume, or a fresh run) and return the checkpoint it resumes from."""
        checkpoint = self.last_checkpoint()
        if checkpoint is None:
            print(f"[{self.kind}] a fresh run: {self.dir}", flush=True)
            return None
        print(f"[{self.kind}] resuming from checkpoint {checkpoint.path} at step {checkpoint.step} (a run of this "
              f"same config stopped there; delete {self.dir} to start over)", flush=True)
        return checkpoint
