"""Train a drafter (EAGLE-1, EAGLE-3, Medusa, DFlash) against a frozen target with Ray Train.

    python -m jobs.train_drafter --config jobs/configs/eagle3-tiny.yaml [section.key=value ...]
    ray job submit --working-dir . -- python -m jobs.train_drafter --config jobs/configs/eagle3-micro.yaml

Needs the target (jobs.train_target) and a data set (jobs.generate_data). Output: ``$EYAS_HOME/drafters/<name>/``,
a registry checkpoint (config.json + model.safetensors, loadable by ``eyas.methods.load_drafter``) plus
``training.json``, and MLflow model ``<name>`` with alias ``tracking.alias`` (``models:/<name>@champion``).

Workers: ``TorchTrainer`` with ``scaling.num_workers`` workers (gloo on CPU, NCCL on GPU). Each worker loads the
frozen target and computes its features online for its own batches (``train.feature_cache`` memory / disk reuses
them across epochs). ``scaling.strategy``: ``ddp`` (DistributedDataParallel) or ``zero1`` / ``zero2``
(``deepspeed.initialize`` with that ZeRO stage: optimizer state, and gradients for stage 2, partitioned over ranks).

Checkpoints (every epoch, and every ``train.checkpoint_every`` steps): ``ray.train.report`` with a directory of
  drafter/     the registry checkpoint (rank 0)
  state.json   step, data position (epoch, next batch), last metrics (rank 0)
  trainer.pt   optimizer + scheduler (ddp, rank 0)   |   deepspeed/  every rank's ZeRO partition (zero1/zero2)
A worker failure restarts the group (``scaling.max_failures``) from the last checkpoint: weights, optimizer,
schedule, step count and data position continue where they were.

MLflow (``eyas.track``): the driver opens the run (params = the flattened config) and, once training succeeded,
registers the final drafter; inside training rank 0 alone logs (it re-attaches to the driver's run after a restart):
per-step losses and acc_j, held-out acc_j and simulated acceptance length every ``train.eval_every`` steps, and at
each epoch end tau measured by eyas generate on held-out prompts plus the acceptance-by-position and calibration
figures. Registration happens on the driver because only there is it known that no retry will follow.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from eyas.config import ConfigError, flatten, from_dict, resolve_path, to_dict
from eyas.decoding.tree import MAX_TREE_NODES
from eyas.train.config import TrainConfig, data_path, target_path
from eyas.train.data import DataPosition, to_device


# ---------------------------------------------------------------- the worker


class Tracker:
    """Rank 0's MLflow logging into the driver's run; a no-op on other ranks or with tracking disabled."""

    def __init__(self, enabled: bool, loop: dict[str, Any], experiment: str) -> None:
        self.enabled, self.loop, self.experiment, self.context = enabled, loop, experiment, None

    def __enter__(self) -> "Tracker":
        if self.enabled:
            from eyas import track

            os.environ["MLFLOW_TRACKING_URI"] = self.loop["tracking_uri"]
            os.environ["EYAS_MLFLOW_ARTIFACTS"] = self.loop["artifact_root"]
            os.environ["MLFLOW_RUN_ID"] = self.loop["run_id"]  # start_run resumes it (and consumes the variable)
            self.context = track.start_run(self.experiment)
            self.context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.context is not None:
            self.context.__exit__(*exc)

    def metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.enabled:
            from eyas import track

            track.log_metrics(metrics, step=step)

    def figure(self, figure, name: str) -> None:
        if self.enabled:
            from eyas import track

            track.log_figure(figure, name)

    def log_dict(self, data: dict[str, Any], name: str) -> None:
        if self.enabled:
            from eyas import track

            track.log_dict(data, name)


class Worker:
    """Everything one Ray Train worker holds: target, data, drafter, strategy, and (rank 0) evaluation inputs."""

    def __init__(self, loop: dict[str, Any]) -> None:
        import ray.train
        import ray.train.torch
        import torch

        from eyas.models import load_target, load_tokenizer
        from eyas.train.data import FeatureCache, SequenceDataset, feature_cache_key
        from eyas.train.step import build_drafter, make_strategy

        self.loop = loop
        self.cfg = cfg = from_dict(TrainConfig, loop["config"])
        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        os.environ.setdefault("LOCAL_RANK", str(context.get_local_rank()))  # DeepSpeed picks its device by it
        torch.set_num_threads(cfg.scaling.cpus_per_worker)
        self.device = ray.train.torch.get_device() if cfg.scaling.use_gpu else torch.device("cpu")
        self.target = load_target(loop["target_dir"], device=self.device)
        self.tokenizer = load_tokenizer(loop["target_dir"])
        self.tokenizer.model_max_length = 10**9
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.data = SequenceDataset(loop["data_dir"], "train", cfg.train.max_len, pad_id)
        torch.manual_seed(cfg.train.seed)  # the same initial drafter on every rank
        self.drafter = build_drafter(cfg, self.target, self.data.rows)
        self.taps = tuple(self.drafter.target_taps)
        self.steps_per_epoch = self.data.num_batches(self.world_size, cfg.train.batch_size)
        self.total_steps = cfg.train.num_epochs * self.steps_per_epoch
        if cfg.train.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.train.max_steps)
        self.strategy = make_strategy(cfg.scaling.strategy, self.drafter, cfg.optim, cfg.train.batch_size,
                                      self.total_steps, self.world_size, self.device)
        cache_dir = None
        if cfg.train.feature_cache == "disk":
            key = feature_cache_key(Path(loop["target_dir"]), self.taps, cfg.train.max_len)
            cache_dir = Path(loop["data_dir"]) / "features" / key
        self.features = FeatureCache(self.target, self.taps, cfg.train.feature_cache, cache_dir)
        self.heldout = self._heldout(pad_id) if self.rank == 0 else []
        self.prompts = self._prompts() if self.rank == 0 else []
        self.vanilla: list[list[int]] | None = None

    def _heldout(self, pad_id: int) -> list:
        """(batch, features) pairs of the held-out split, features computed once (rank 0 evaluates)."""
        from eyas.train.data import FeatureCache, SequenceDataset

        cfg = self.cfg
        try:
            data = SequenceDataset(self.loop["data_dir"], "heldout", cfg.train.max_len, pad_id,
                                   limit=cfg.train.eval_sequences)
        except FileNotFoundError:
            print(f"[train_drafter] {self.loop['data_dir']}/heldout has no shards: held-out evaluation is off "
                  "(set num_heldout_prompts > 0 in the data config)", flush=True)
            return []
        cache = FeatureCache(self.target, self.taps, "memory")
        out = []
        for start in range(0, len(data), cfg.train.batch_size):
            indices = list(range(start, min(start + cfg.train.batch_size, len(data))))
            batch = to_device(data.batch(indices), self.device)
            out.append((batch, cache.features(indices, batch)))
        return out

    def _prompts(self) -> list[list[int]]:
        """Held-out prompts, cut so prompt + max_new_tokens + a draft tree fit the target's context."""
        from eyas import corpus

        measure = self.cfg.measure
        room = self.target.config.max_position_embeddings - measure.max_new_tokens - MAX_TREE_NODES
        if measure.num_prompts and room < 1:
            raise ConfigError(f"measure.max_new_tokens={measure.max_new_tokens} leaves no room for a prompt in the "
                              f"target's context of {self.target.config.max_position_embeddings} tokens")
        texts = corpus.heldout_prompts(measure.suite, measure.num_prompts) if measure.num_prompts else []
        return [self.tokenizer(text).input_ids[:room] for text in texts]

    @property
    def eos(self) -> list[int]:
        eos = set(self.target.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return sorted(eos)


def maybe_fail(worker: Worker, step: int) -> None:
    """Testing hook: rank ``fail_rank`` dies (os._exit, as a crashed process would) at ``fail_at_step``, once."""
    train = worker.cfg.train
    if train.fail_at_step != step or worker.rank != train.fail_rank:
        return
    marker = Path(worker.loop["marker_dir"]) / "fail_at_step.done"
    if marker.exists():
        return
    import ray.train

    # a crash right after ray.train.report may beat the controller to registering that checkpoint (it polls the
    # workers every few seconds) and the run would resume from an older one; wait, so the test is deterministic
    ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"rank {worker.rank} failed at step {step}\n")
    print(f"[train_drafter] rank {worker.rank}: injected failure at step {step} (train.fail_at_step)", flush=True)
    os._exit(1)


def evaluate_heldout(worker: Worker) -> dict[str, float]:
    from eyas.train.step import evaluate

    if not worker.heldout:
        return {}
    return {f"heldout_{k}": v for k, v in evaluate(worker.drafter, worker.heldout).items()}


def epoch_end(worker: Worker, tracker: Tracker, step: int, epoch_label: str) -> dict[str, float]:
    """Rank 0: held-out evaluation, tau measured with eyas generate, and the two figures."""
    from eyas.drafters import registry
    from eyas.decoding.generate import generate
    from eyas.methods import load_drafter
    from eyas.train.step import acceptance_curve, acceptance_figure, calibration_figure, measure_tau

    cfg = worker.cfg
    metrics = evaluate_heldout(worker)
    measured: list[float] = []
    if worker.prompts:
        worker.drafter.eval()
        with tempfile.TemporaryDirectory() as tmp:
            registry.save_drafter(worker.drafter, tmp, worker.loop["target_dir"])
            drafter = load_drafter(tmp, worker.target, method=cfg.measure.method, tree=cfg.measure.tree,
                                   where="measure.tree.")
        stats, outputs = measure_tau(worker.target, drafter, worker.prompts, cfg.measure.max_new_tokens,
                                     worker.eos)
        worker.drafter.train()
        if worker.vanilla is None:  # plain greedy decoding: speculative output must equal it token for token
            worker.vanilla = [generate(worker.target, p, cfg.measure.max_new_tokens, eos_token_ids=worker.eos
                                       ).token_ids for p in worker.prompts]
        measured = stats.per_depth_accept
        metrics.update({"tau": stats.tau or 0.0,
                        "draft_nodes_per_cycle": stats.num_draft_nodes / max(stats.cycles, 1),
                        "greedy_identical": sum(a == b for a, b in zip(outputs, worker.vanilla)) / len(outputs),
                        **{f"accept_depth_{d + 1}": rate for d, rate in enumerate(measured)}})
        tracker.log_dict(stats.to_dict(), f"spec_stats/{epoch_label}.json")
        tracker.figure(calibration_figure(stats.calibration(), f"{cfg.name} calibration ({epoch_label})"),
                       f"calibration/{epoch_label}.png")
    heldout_acc = acceptance_curve({k.removeprefix("heldout_"): v for k, v in metrics.items()})
    tracker.figure(acceptance_figure(heldout_acc, measured, f"{cfg.name} acceptance ({epoch_label})"),
                   f"acceptance/{epoch_label}.png")
    tracker.metrics(metrics, step)
    return metrics


def save_checkpoint(worker: Worker, step: int, position: DataPosition, metrics: dict[str, float]) -> None:
    """Every rank: its part of the checkpoint into a local directory, then one ``ray.train.report`` (a barrier);
    Ray merges the ranks' directories into one checkpoint in storage."""
    import ray.train

    from eyas.train.step import save_training_checkpoint

    state = {"step": step, "position": position.to_dict(), "metrics": metrics}
    with tempfile.TemporaryDirectory() as tmp:
        save_training_checkpoint(Path(tmp), worker.strategy, worker.rank, state, worker.loop["target_dir"])
        checkpoint = ray.train.Checkpoint.from_directory(tmp) if any(Path(tmp).iterdir()) else None
        ray.train.report({"step": step, "epoch": position.epoch, **metrics}, checkpoint=checkpoint,
                         checkpoint_dir_name=f"checkpoint-step{step:07d}")


def after_step(worker: Worker, tracker: Tracker, step: int, epoch: int, index: int,
               last_metrics: dict[str, float]) -> None:
    """Epoch end (or the last step): evaluation, measured tau and figures on rank 0, then a checkpoint. Otherwise
    the periodic held-out evaluation and the optional mid-epoch checkpoint."""
    cfg, rank = worker.cfg, worker.rank
    epoch_done = index + 1 == worker.steps_per_epoch
    if epoch_done or step >= worker.total_steps:
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
        tracker.metrics(evaluate_heldout(worker), step)
    if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0:
        save_checkpoint(worker, step, DataPosition(epoch, index + 1), last_metrics)


def train_loop_per_worker(loop: dict[str, Any]) -> None:
    import ray.train
    import torch

    from eyas.train.step import load_training_checkpoint, mean_over_ranks
    from jobs.common import Progress

    worker = Worker(loop)
    cfg, rank = worker.cfg, worker.rank
    step, position = 0, DataPosition()
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = load_training_checkpoint(Path(directory), worker.strategy)
        step, position = int(state["step"]), DataPosition.from_dict(state["position"])
        print(f"[train_drafter] rank {rank}: resumed at step {step}, epoch {position.epoch}, "
              f"batch {position.batch}", flush=True)
    tracker = Tracker(cfg.tracking.enabled and rank == 0, loop, cfg.tracking.experiment)
    progress = Progress(f"train_drafter {cfg.name}", total=worker.total_steps, every_s=15.0)
    with tracker:
        if checkpoint is not None:
            tracker.metrics({"resumed_from_step": step}, step)
        elif rank == 0:
            tracker.metrics({"steps_per_epoch": worker.steps_per_epoch, "total_steps": worker.total_steps,
                             "train_sequences": len(worker.data)}, 0)
        last_metrics: dict[str, float] = {}
        for epoch in range(position.epoch, cfg.train.num_epochs):
            start = position.batch if epoch == position.epoch else 0
            for index, (indices, batch) in enumerate(
                    worker.data.batches(epoch, cfg.train.seed, rank, worker.world_size, cfg.train.batch_size, start,
                                        fixed_ranks=cfg.train.feature_cache == "memory"),
                    start=start):
                if step >= worker.total_steps:
                    break
                maybe_fail(worker, step)
                # randomness (feature noise, DFlash anchors) as a function of (seed, step, rank): a resumed run
                # draws exactly what the uninterrupted run would have
                torch.manual_seed(cfg.train.seed * 1_000_003 + step * 1_009 + rank)
                batch = to_device(batch, worker.device)
                metrics = worker.strategy.step(batch, worker.features.features(indices, batch))
                step += 1
                if step % cfg.train.log_every == 0 or step == worker.total_steps:
                    last_metrics = mean_over_ranks(metrics, worker.device)
                    if rank == 0:
                        tracker.metrics({**last_metrics, "epoch": epoch + (index + 1) / worker.steps_per_epoch},
                                        step)
                        progress.update(step, loss=last_metrics["loss"], acc_1=last_metrics.get("acc_1", 0.0))
                after_step(worker, tracker, step, epoch, index, last_metrics)
            if step >= worker.total_steps:
                break
        if rank == 0 and worker.features.mode != "none":
            print(f"[train_drafter] feature cache: {worker.features.hits} hits, {worker.features.misses} misses",
                  flush=True)


# ---------------------------------------------------------------- driver


def check_inputs(cfg: TrainConfig) -> tuple[Path, Path]:
    from eyas.drafters import registry

    target_dir, data_dir = target_path(cfg.target), data_path(cfg.data)
    if not (target_dir / "config.json").is_file():
        raise FileNotFoundError(f"target={cfg.target!r}: {target_dir} holds no checkpoint; build it with "
                                "`python -m jobs.train_target --config jobs/configs/target-tiny.yaml`")
    if not any((data_dir / "train").glob("shard-*.parquet")):
        raise FileNotFoundError(f"data={cfg.data!r}: {data_dir}/train holds no shards; build them with "
                                "`python -m jobs.generate_data --config jobs/configs/data-tiny.yaml`")
    family = registry.family(cfg.drafter.type)  # unknown types and bad fields fail here, before Ray starts
    from_dict(family.config_cls, dict(cfg.drafter.config), prefix="drafter.config.")
    return target_dir, data_dir


def run_trainer(cfg: TrainConfig, target_dir: Path, data_dir: Path, run_id: str | None):
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from eyas import track

    scaling = cfg.scaling
    resource = "GPU" if scaling.use_gpu else "CPU"
    needed = scaling.num_workers * (1 if scaling.use_gpu else scaling.cpus_per_worker)
    available = ray.cluster_resources().get(resource, 0)
    if available < needed:
        raise RuntimeError(f"scaling.num_workers={scaling.num_workers} needs {needed} {resource}s but the Ray "
                           f"cluster has {available:g}; lower it, e.g. scaling.num_workers=1")
    storage = resolve_path(scaling.storage_path)
    run_name = f"train_drafter-{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    loop = {"config": to_dict(cfg), "target_dir": str(target_dir), "data_dir": str(data_dir), "run_id": run_id,
            "tracking_uri": track.tracking_uri(),
            "artifact_root": str(root.resolve()) if (root := track.artifact_root()) else "",  # none: a server's
            "marker_dir": str(storage / run_name)}
    resources = {"CPU": scaling.cpus_per_worker, **({"GPU": 1} if scaling.use_gpu else {})}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop,
        scaling_config=ScalingConfig(num_workers=scaling.num_workers, use_gpu=scaling.use_gpu,
                                     resources_per_worker=resources),
        torch_config=TorchConfig(backend="nccl" if scaling.use_gpu else "gloo"),
        run_config=RunConfig(name=run_name, storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=scaling.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=scaling.num_to_keep),
                             # plain prints: Train's print patch would echo every progress line twice
                             worker_runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}}),
    )
    result = trainer.fit()
    if getattr(result, "error", None) is not None:
        raise result.error
    if result.checkpoint is None:
        raise RuntimeError(f"training {cfg.name} finished without a checkpoint (see the worker logs above)")
    return result, storage / run_name


def publish(cfg: TrainConfig, result, run_dir: Path) -> tuple[Path, dict[str, Any]]:
    """Copy the last checkpoint's drafter to ``$EYAS_HOME/drafters/<name>`` (staged, then swapped in)."""
    from eyas.train.step import read_state

    out = cfg.output_dir
    staging = out.with_name(f".{cfg.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    with result.checkpoint.as_directory() as directory:
        shutil.copytree(Path(directory) / "drafter", staging)
        state = read_state(Path(directory))
    summary = {"name": cfg.name, "config": to_dict(cfg), "step": state["step"], "position": state["position"],
               "metrics": state["metrics"], "ray_run_dir": str(run_dir),
               "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (staging / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging.replace(out)
    return out, summary


def train(cfg: TrainConfig) -> Path:
    import contextlib

    from eyas import track
    from jobs.common import init_ray

    target_dir, data_dir = check_inputs(cfg)
    init_ray()
    start = time.monotonic()
    tracking = cfg.tracking
    context = (track.start_run(tracking.experiment, run_name=cfg.name, params=flatten(cfg),
                               tags={"eyas.kind": "drafter", "eyas.drafter_type": cfg.drafter.type,
                                     "eyas.strategy": cfg.scaling.strategy})
               if tracking.enabled else contextlib.nullcontext())
    with context as run:
        run_id = run.info.run_id if tracking.enabled else None
        result, run_dir = run_trainer(cfg, target_dir, data_dir, run_id)
        out, summary = publish(cfg, result, run_dir)
        seconds = time.monotonic() - start
        if tracking.enabled:
            track.log_metrics({"train_seconds": seconds}, step=int(summary["step"]))
            track.log_dict(summary, "training.json")
            if tracking.register:
                version = track.register_directory(out, cfg.name, alias=tracking.alias, artifact_path="drafter")
                if version is not None:  # None: the tracking store was down (track warned with the gap)
                    print(f"[train_drafter] registered {track.model_uri(cfg.name, tracking.alias)} "
                          f"(version {version})", flush=True)
    metrics = summary["metrics"]
    shown = " ".join(f"{k}={metrics[k]:.3f}" for k in ("loss", "heldout_acc_1", "heldout_sim_tau", "tau")
                     if k in metrics)
    print(f"[train_drafter] {cfg.name}: {summary['step']} steps in {seconds:.0f}s -> {out} {shown}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from jobs.common import job_argparser, load_job_config

    parser = job_argparser(__doc__.split("\n\n")[0])
    args = parser.parse_args(argv)
    if args.config is None:
        parser.error("--config is required, e.g. --config jobs/configs/eagle3-tiny.yaml")
    train(load_job_config(TrainConfig, args))
    return 0


if __name__ == "__main__":
    # Through the importable module: Ray workers import train_loop_per_worker by name, not from __main__.
    from jobs.train_drafter import main as importable_main

    raise SystemExit(importable_main())
