"""jobs.train_drafter's Ray Train worker loop, shared with the sweep's Train-inside-Tune trials (tune/trials.py):
each worker wraps the library trainer (``eyas.train.trainer.Trainer``) with Ray Train's context, checkpoints
(``ray.train.report``; resumed after a worker failure) and rank 0's MLflow logging (``eyas.track.Tracker``).
jobs/train_drafter.py's docstring describes the checkpoint layout and what is logged.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch

from eyas.config import from_dict
from eyas.progress import Progress
from eyas.threads import configure_threads
from eyas.track import Tracker
from eyas.train.config import TrainConfig
from eyas.train.data import DataPosition
from eyas.train.step import (acceptance_curve, acceptance_figure, calibration_figure, load_training_checkpoint,
                             mean_over_ranks, save_training_checkpoint)
from eyas.train.trainer import Trainer, load_inputs


class Worker:
    """One Ray Train worker: its rank, device and the library Trainer (target, data, drafter, strategy)."""

    def __init__(self, loop: dict[str, Any]) -> None:
        self.loop = loop
        self.cfg = cfg = from_dict(TrainConfig, loop["config"])
        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        os.environ.setdefault("LOCAL_RANK", str(context.get_local_rank()))  # DeepSpeed picks its device by it
        configure_threads(cpu_budget=cfg.scaling.cpus_per_worker)  # the policy within the worker's CPUs
        self.device = ray.train.torch.get_device() if cfg.scaling.use_gpu else torch.device("cpu")
        inputs = load_inputs(cfg, loop["target_dir"], loop["data_dir"], self.device, heldout=self.rank == 0,
                             prompts=self.rank == 0)
        self.trainer = Trainer(cfg, inputs.target, inputs.data, inputs.heldout, prompts=inputs.prompts,
                               eos_token_ids=inputs.eos_token_ids, target_dir=loop["target_dir"], rank=self.rank,
                               world_size=self.world_size, feature_dir=Path(loop["data_dir"]) / "features")
        print(f"[train_drafter] rank {self.rank} of {self.world_size} on node "
              f"{ray.get_runtime_context().get_node_id()}", flush=True)


HOLD_S = 600.0  # train.hold_at_step: how long the rank waits for the test's kill before it goes on


def maybe_fail(worker: Worker, step: int) -> None:
    """Testing hooks, each once per run (a marker file in the run directory guards it; a resumed run skips it):
    rank ``fail_rank`` dies at ``train.fail_at_step`` (os._exit, as a crashed process would), or waits at
    ``train.hold_at_step`` (HOLD_S at most) so that a test can kill the driver or a node at a known step."""
    train = worker.cfg.train
    if worker.rank != train.fail_rank or step not in (train.fail_at_step, train.hold_at_step):
        return
    hook = "fail_at_step" if step == train.fail_at_step else "hold_at_step"
    marker = Path(worker.loop["marker_dir"]) / f"{hook}.done"
    if marker.exists():
        return
    # a crash right after ray.train.report may beat the controller to registering that checkpoint (it polls the
    # workers every few seconds) and the run would resume from an older one; wait, so the test is deterministic
    ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"rank {worker.rank} at step {step}: {hook}\n")
    if hook == "fail_at_step":
        print(f"[train_drafter] rank {worker.rank}: injected failure at step {step} (train.fail_at_step)", flush=True)
        os._exit(1)
    print(f"[train_drafter] rank {worker.rank}: holding at step {step} (train.hold_at_step)", flush=True)
    time.sleep(HOLD_S)


def epoch_end(worker: Worker, tracker: Tracker, step: int, epoch_label: str) -> dict[str, float]:
    """Rank 0: held-out evaluation, tau measured with eyas generate (the live drafter), and the two figures."""
    name, trainer = worker.cfg.name, worker.trainer
    metrics = trainer.evaluate_heldout()
    measured, stats = trainer.measure()
    if stats is not None:
        metrics.update(measured)
        tracker.log_dict(stats.to_dict(), f"spec_stats/{epoch_label}.json")
        tracker.figure(calibration_figure(stats.calibration(), f"{name} calibration ({epoch_label})"),
                       f"calibration/{epoch_label}.png")
    heldout_acc = acceptance_curve({k.removeprefix("heldout_"): v for k, v in metrics.items()})
    tracker.figure(acceptance_figure(heldout_acc, stats.per_depth_accept if stats is not None else [],
                                     f"{name} acceptance ({epoch_label})"), f"acceptance/{epoch_label}.png")
    tracker.metrics(metrics, step)
    return metrics


def save_checkpoint(worker: Worker, step: int, position: DataPosition, metrics: dict[str, float]) -> None:
    """Every rank: its part of the checkpoint into a local directory, then one ``ray.train.report`` (a barrier);
    Ray merges the ranks' directories into one checkpoint in storage."""
    state = {"step": step, "position": position.to_dict(), "metrics": metrics}
    with tempfile.TemporaryDirectory() as tmp:
        save_training_checkpoint(Path(tmp), worker.trainer.strategy, worker.rank, state, worker.loop["target_dir"])
        checkpoint = ray.train.Checkpoint.from_directory(tmp) if any(Path(tmp).iterdir()) else None
        ray.train.report({"step": step, "epoch": position.epoch, **metrics}, checkpoint=checkpoint,
                         checkpoint_dir_name=f"checkpoint-step{step:07d}")


def after_step(worker: Worker, tracker: Tracker, step: int, epoch: int, index: int,
               last_metrics: dict[str, float]) -> None:
    """Epoch end (or the last step): evaluation, measured tau and figures on rank 0, then a checkpoint. Otherwise
    the periodic held-out evaluation and the optional mid-epoch checkpoint."""
    cfg, rank, trainer = worker.cfg, worker.rank, worker.trainer
    epoch_done = index + 1 == trainer.steps_per_epoch
    if epoch_done or step >= trainer.total_steps:
        label = f"epoch_{epoch + 1}" if epoch_done else f"step_{step}"
        summary = epoch_end(worker, tracker, step, label) if rank == 0 else {}
        position = DataPosition(epoch + 1, 0) if epoch_done else DataPosition(epoch, index + 1)
        save_checkpoint(worker, step, position, {**last_metrics, **summary})
        if rank == 0 and summary:
            shown = ("heldout_loss", "heldout_acc_1", "heldout_sim_tau", "tau", "greedy_identical")
            print(f"[train_drafter] {label}: step {step} "
                  + " ".join(f"{k}={summary[k]:.3f}" for k in shown if k in summary), flush=True)
        return
    if rank == 0 and step % cfg.train.eval_every == 0:
        tracker.metrics(trainer.evaluate_heldout(), step)
    if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0:
        save_checkpoint(worker, step, DataPosition(epoch, index + 1), last_metrics)


def resume(worker: Worker) -> tuple[bool, DataPosition]:
    """Weights, optimizer, schedule, step and data position from Ray Train's last checkpoint, if there is one."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return False, DataPosition()
    with checkpoint.as_directory() as directory:
        state = load_training_checkpoint(Path(directory), worker.trainer.strategy)
    worker.trainer.step, position = int(state["step"]), DataPosition.from_dict(state["position"])
    print(f"[train_drafter] rank {worker.rank}: resumed at step {worker.trainer.step}, epoch {position.epoch}, "
          f"batch {position.batch}", flush=True)
    return True, position


def train_loop_per_worker(loop: dict[str, Any]) -> None:
    worker = Worker(loop)
    cfg, rank, trainer = worker.cfg, worker.rank, worker.trainer
    resumed, position = resume(worker)
    tracker = Tracker(cfg.tracking.enabled and rank == 0, loop, cfg.tracking.experiment)
    progress = Progress(f"train_drafter {cfg.name}", total=trainer.total_steps, every_s=15.0)
    with tracker:
        if resumed:
            tracker.metrics({"resumed_from_step": trainer.step}, trainer.step)
        elif rank == 0:
            tracker.metrics({"steps_per_epoch": trainer.steps_per_epoch, "total_steps": trainer.total_steps,
                             "train_sequences": len(trainer.data)}, 0)
        last_metrics: dict[str, float] = {}
        for epoch in range(position.epoch, cfg.train.num_epochs):
            start = position.batch if epoch == position.epoch else 0
            for index, batch in enumerate(trainer.batches(epoch, start), start=start):
                if trainer.done:
                    break
                maybe_fail(worker, trainer.step)
                metrics = trainer.train_step(batch)
                step = trainer.step
                if step % cfg.train.log_every == 0 or step == trainer.total_steps:
                    last_metrics = mean_over_ranks(metrics, worker.device)
                    if rank == 0:
                        tracker.metrics({**last_metrics, "epoch": epoch + (index + 1) / trainer.steps_per_epoch},
                                        step)
                        progress.update(step, loss=last_metrics["loss"], acc_1=last_metrics.get("acc_1", 0.0))
                after_step(worker, tracker, step, epoch, index, last_metrics)
            if trainer.done:
                break
        features = trainer.features
        if rank == 0 and features.mode != "none":
            print(f"[train_drafter] feature cache: {features.hits} hits, {features.misses} misses", flush=True)
