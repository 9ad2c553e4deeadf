"""Train a drafter (EAGLE-1, EAGLE-3, Medusa, DFlash) against a frozen target with Ray Train.

    python -m jobs.train_drafter --config jobs/configs/eagle3-tiny.yaml [section.key=value ...]
    ray job submit --working-dir . -- python -m jobs.train_drafter --config jobs/configs/eagle3-micro.yaml

Needs the target (jobs.train_target) and a data set (jobs.generate_data). ``drafter.init_from`` starts from a
trained drafter of the same family instead of a fresh one (a warm start: more data or steps on top of an earlier
run, or fine-tuning a drafter brought in from SGLang / vLLM / speculators on your own data).
Output: ``$EYAS_HOME/drafters/<name>/``, a registry checkpoint (config.json + model.safetensors, loadable by
``eyas.methods.load_drafter``) plus ``training.json``, and MLflow model ``<name>`` with alias ``tracking.alias`` (``models:/<name>@champion``).

Workers: ``TorchTrainer`` with ``scaling.num_workers`` workers (gloo on CPU, NCCL on GPU), each running
``eyas_ray.train_worker`` around the library trainer ``eyas.train.trainer.Trainer``. Each worker loads the
frozen target and computes its features online for its own batches (``train.feature_cache`` memory / disk reuses
them across epochs). ``scaling.strategy``: ``ddp`` (DistributedDataParallel) or ``zero1`` / ``zero2``
(``deepspeed.initialize`` with that ZeRO stage: optimizer state, and gradients for stage 2, partitioned over ranks).

Checkpoints (every epoch, and every ``train.checkpoint_every`` steps): ``ray.train.report`` with a directory of
  drafter/     the registry checkpoint (rank 0)
  state.json   step, data position (epoch, next batch), last metrics (rank 0)
  trainer.pt   optimizer + scheduler (ddp, rank 0)   |   deepspeed/  every rank's ZeRO partition (zero1/zero2)
A worker failure restarts the group (``scaling.max_failures``) from the last checkpoint: weights, optimizer,
schedule, step count and data position continue where they were. ``scaling.placement_strategy: SPREAD`` puts the
workers on different nodes (and restarts them on the nodes left when one is lost).

A killed driver (or a lost head of a job) resumes too: the Ray Train run is named after the whole config
(``train_drafter-<name>-<config hash>`` under ``scaling.storage_path``, eyas_ray.resume), so submitting the same
command again restores that run's last checkpoint, prints ``resuming from checkpoint ... at step k`` and continues
the same MLflow run. A finished run is moved aside (``...-done-<time>``); the next submission trains afresh.

MLflow (``eyas.track``): the driver opens the run (params = the flattened config) and, once training succeeded,
registers the final drafter; inside training rank 0 alone logs (it re-attaches to the driver's run after a restart):
per-step losses and acc_j, held-out acc_j and simulated acceptance length every ``train.eval_every`` steps, and at
each epoch end tau measured by eyas generate on held-out prompts plus the acceptance-by-position and calibration
figures. Registration happens on the driver because only there is it known that no retry will follow.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from eyas import track
from eyas.config import ConfigError, flatten, from_dict, resolve_path, to_dict
from eyas.drafters import registry
from eyas.methods import resolve_checkpoint
from eyas.train.config import TrainConfig, data_path, drafter_path, target_path
from eyas.train.step import read_state
from eyas_ray.cluster import init_ray
from eyas_ray.resume import ResumableRun
from eyas_ray.train_worker import train_loop_per_worker
from jobs.common import job_argparser, load_job_config


# ---------------------------------------------------------------- driver


def check_inputs(cfg: TrainConfig) -> tuple[Path, Path]:
    target_dir, data_dir = target_path(cfg.target), data_path(cfg.data)
    if not (target_dir / "config.json").is_file():
        raise FileNotFoundError(f"target={cfg.target!r}: {target_dir} holds no checkpoint; build it with "
                                "`python -m jobs.train_target --config jobs/configs/target-tiny.yaml`")
    if not any((data_dir / "train").glob("shard-*.parquet")):
        raise FileNotFoundError(f"data={cfg.data!r}: {data_dir}/train holds no shards; build them with "
                                "`python -m jobs.generate_data --config jobs/configs/data-tiny.yaml`")
    for name in cfg.drafter.vocab_data:
        if not any((data_path(name) / "train").glob("shard-*.parquet")):
            raise FileNotFoundError(f"drafter.vocab_data {name!r}: {data_path(name)}/train holds no shards; build "
                                    "them with `python -m jobs.generate_data`")
    family = registry.family(cfg.drafter.type)  # unknown types and bad fields fail here, before Ray starts
    if not cfg.drafter.init_from:  # a warm start's config is its checkpoint's, overridden: local_init checks it
        from_dict(family.config_cls, dict(cfg.drafter.config), prefix="drafter.config.")
    return target_dir, data_dir


def local_init(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with ``drafter.init_from`` as a local checkpoint directory (an MLflow URI downloaded once), checked
    before Ray starts to hold a drafter of ``drafter.type`` whose config, with ``drafter.config`` over it, is valid;
    the workers load it (registry.load_model)."""
    ref = cfg.drafter.init_from
    if not ref:
        return cfg
    if ref.startswith(("models:/", "runs:/")):
        where = resolve_checkpoint(ref, "drafter.init_from")
    else:
        where = drafter_path(ref)
        if not where.exists():
            raise ConfigError(f"drafter.init_from={ref}: no drafter checkpoint at {where} (a bare name is looked "
                              "up under $EYAS_HOME/drafters, where jobs.train_drafter publishes, then among the shipped drafters "
                              "in serving/drafters)")
    directory, meta = registry.read_meta(where)
    if meta["drafter_type"] != cfg.drafter.type:
        raise ConfigError(f"drafter.init_from={ref}: {directory} holds a {meta['drafter_type']} drafter but "
                          f"drafter.type is {cfg.drafter.type}; train the family it holds or start from another")
    from_dict(registry.family(cfg.drafter.type).config_cls, {**meta["config"], **cfg.drafter.config},
              prefix="drafter.config.")
    changed = [f"{key} {meta['config'].get(key)!r} -> {value!r}" for key, value in sorted(cfg.drafter.config.items())
               if meta["config"].get(key) != value]
    if changed:  # a family YAML's drafter.config overrides the checkpoint's: say so (block_size 4 -> 16 is a new task)
        print(f"[train_drafter] drafter.init_from={ref}: drafter.config changes the checkpoint's "
              f"{', '.join(changed)}", flush=True)
    return replace(cfg, drafter=replace(cfg.drafter, init_from=str(directory.resolve())))


def run_trainer(cfg: TrainConfig, target_dir: Path, data_dir: Path, run_id: str | None, run: ResumableRun):
    scaling = cfg.scaling
    resource = "GPU" if scaling.use_gpu else "CPU"
    needed = scaling.num_workers * (1 if scaling.use_gpu else scaling.cpus_per_worker)
    available = ray.cluster_resources().get(resource, 0)
    if available < needed:
        raise RuntimeError(f"scaling.num_workers={scaling.num_workers} needs {needed} {resource}s but the Ray "
                           f"cluster has {available:g}; lower it, e.g. scaling.num_workers=1")
    loop = {"config": to_dict(cfg), "target_dir": str(target_dir), "data_dir": str(data_dir), "run_id": run_id,
            "tracking_uri": track.tracking_uri(),
            "artifact_root": str(root.resolve()) if (root := track.artifact_root()) else "",  # none: a server's
            "marker_dir": str(run.dir)}
    resources = {"CPU": scaling.cpus_per_worker, **({"GPU": 1} if scaling.use_gpu else {})}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop,
        scaling_config=ScalingConfig(num_workers=scaling.num_workers, use_gpu=scaling.use_gpu,
                                     resources_per_worker=resources,
                                     placement_strategy=scaling.placement_strategy),
        torch_config=TorchConfig(backend="nccl" if scaling.use_gpu else "gloo"),
        # the same config, the same run: a resubmitted job restores its last checkpoint (eyas_ray.resume)
        run_config=RunConfig(name=run.name, storage_path=str(run.storage),
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
    return result


def publish(cfg: TrainConfig, result, run_dir: Path) -> tuple[Path, dict[str, Any]]:
    """Copy the last checkpoint's drafter to ``$EYAS_HOME/drafters/<name>`` (staged, then swapped in)."""
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
    target_dir, data_dir = check_inputs(cfg)
    cfg = local_init(cfg)
    init_ray(preload_allocator=True)
    start = time.monotonic()
    tracking = cfg.tracking
    run = ResumableRun.for_config("train_drafter", cfg.name, to_dict(cfg), resolve_path(cfg.scaling.storage_path))
    resumed = run.announce()
    context = (track.start_run(tracking.experiment, run_name=cfg.name, params=flatten(cfg),
                               tags={"eyas.kind": "drafter", "eyas.drafter_type": cfg.drafter.type,
                                     "eyas.strategy": cfg.scaling.strategy},
                               resume_run_id=run.mlflow_run_id() if resumed else None)
               if tracking.enabled else contextlib.nullcontext())
    with context as mlflow_run:
        run_id = mlflow_run.info.run_id if tracking.enabled else None
        run.remember(run_id)
        result = run_trainer(cfg, target_dir, data_dir, run_id, run)
        done_dir = run.done_dir()
        out, summary = publish(cfg, result, done_dir)
        run.finish(done_dir)
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
    parser = job_argparser(__doc__.split("\n\n")[0])
    args = parser.parse_args(argv)
    if args.config is None:
        parser.error("--config is required, e.g. --config jobs/configs/eagle3-tiny.yaml")
    train(load_job_config(TrainConfig, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
