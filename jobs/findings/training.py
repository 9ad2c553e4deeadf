"""Drafters a finding trains: variants of one training config (jobs/configs/<family>-*.yaml plus dotted overrides),
trained by the one library trainer and kept in ``$EYAS_HOME/drafters/<variant name>`` with their training curve.

Two runners, one trainer (``eyas.train.trainer.Trainer``):
  local      the Trainer in this process, the variants one after another: no Ray start-up, which is most of the
             time at the sizes a 2-core machine affords (the default scales and CI).
  ray-train  every variant is ``jobs.train_drafter.train`` (Ray Train: ``scaling.num_workers`` workers, DDP or
             ZeRO, checkpoints, its own MLflow run and registered model) launched as a Ray task, all at once: the
             cluster runs as many side by side as it fits (each TorchTrainer waits for its workers' resources).
             Under ``ray job submit`` they run on the cluster the job was submitted to.
A variant whose directory already holds a drafter trained from the same config is reused, not trained again.
Features come as ``train.feature_cache`` says, in both runners: ``disk`` reads (and adds to) the data set's
feature cache (``<data>/features``, shared with jobs.train_drafter and jobs.generate_data), so variants whose taps
the data set already cached skip the target forward; ``memory`` and ``none`` keep them in the process.

The curve: a point every ``train.log_every`` steps (training loss and acc_j) and every ``train.eval_every`` steps
and at the end (held-out loss, acc_j, sim_tau); with ray-train it is read back from the variant's MLflow run.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from eyas import track
from eyas.config import apply_overrides, from_dict, read_yaml_mapping, to_dict
from eyas.train.config import TrainConfig, data_path, target_path
from eyas.train.trainer import Trainer, load_inputs
from eyas_ray.cluster import init_ray

RUNNERS = ("local", "ray-train")
CURVE_FILE = "curve.json"


@dataclass(frozen=True)
class Variant:
    label: str                   # e.g. "dflash-gamma-off"
    config: TrainConfig


@dataclass
class Trained:
    label: str
    path: Path
    steps: int
    seconds: float
    reused: bool
    final: dict[str, float] = field(default_factory=dict)   # held-out metrics at the end
    curve: list[dict[str, float]] = field(default_factory=list)


def variant_config(base: str | Path, name: str, target: str, data: str, overrides: Sequence[str]) -> TrainConfig:
    """The TrainConfig of ``base`` (a jobs/configs YAML) named ``name``, on ``target`` and ``data``, with
    ``overrides``; the epoch-end tau measurement is off (the finding measures tau itself) and nothing is
    registered (tracking stays on for ray-train runs, so their curves can be read back)."""
    raw = apply_overrides(read_yaml_mapping(base), [f"name={name}", f"target={target}", f"data={data}",
                                                    "measure.num_prompts=0", "tracking.register=false",
                                                    "tracking.experiment=eyas-findings-drafters", *overrides])
    return from_dict(TrainConfig, raw)


def train_variants(variants: Sequence[Variant], runner: str) -> dict[str, Trained]:
    """Every variant trained (or reused), by label."""
    if runner not in RUNNERS:
        raise ValueError(f"runner={runner!r}: must be one of {list(RUNNERS)}")
    done = {v.label: reuse(v) for v in variants}
    todo = [v for v in variants if done[v.label] is None]
    if todo:
        print(f"[findings] training {[v.label for v in todo]} ({runner})", flush=True)
        trained = train_ray(todo) if runner == "ray-train" else [train_local(v) for v in todo]
        done.update({t.label: t for t in trained})
    return done  # type: ignore[return-value]


def reuse(variant: Variant) -> Trained | None:
    path = variant.config.output_dir
    summary_file, curve_file = path / "training.json", path / CURVE_FILE
    if not (summary_file.is_file() and curve_file.is_file()):
        return None
    summary = json.loads(summary_file.read_text())
    if summary.get("config") != to_dict(variant.config):
        return None
    curve = json.loads(curve_file.read_text())
    print(f"[findings] {variant.label}: reusing {path} (trained from the same config)", flush=True)
    return Trained(variant.label, path, int(summary["step"]), float(summary.get("seconds", 0.0)), True,
                   heldout(summary.get("metrics", {})), curve)


def heldout(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if k.startswith("heldout_")}


# ---------------------------------------------------------------- local: the Trainer in this process


def train_local(variant: Variant) -> Trained:
    cfg = variant.config
    target_dir, data_dir = target_path(cfg.target), data_path(cfg.data)
    device = torch.device("cuda" if cfg.scaling.use_gpu and torch.cuda.is_available() else "cpu")
    inputs = load_inputs(cfg, target_dir, data_dir, device, prompts=False)
    trainer = Trainer(cfg, inputs.target, inputs.data, inputs.heldout, eos_token_ids=inputs.eos_token_ids,
                      target_dir=target_dir, strategy="ddp", feature_cache=cfg.train.feature_cache,
                      feature_dir=data_dir / "features")
    start, curve, train = time.monotonic(), [], cfg.train
    for epoch in range(train.num_epochs):
        for batch in trainer.batches(epoch):
            if trainer.done:
                break
            metrics = trainer.train_step(batch)
            step = trainer.step
            point: dict[str, float] = {}
            if step % train.log_every == 0 or trainer.done:
                point.update(metrics)
            if step % train.eval_every == 0 or trainer.done:
                point.update(trainer.evaluate_heldout())
            if point:
                curve.append({"step": step, **point})
        if trainer.done:
            break
    seconds = time.monotonic() - start
    final = heldout(curve[-1]) if curve else {}
    print(f"[findings] {variant.label}: {trainer.step} steps in {seconds:.0f}s "
          + " ".join(f"{k}={v:.3f}" for k, v in final.items() if k in ("heldout_acc_1", "heldout_sim_tau")),
          flush=True)
    summary = {"name": cfg.name, "config": to_dict(cfg), "step": trainer.step, "seconds": seconds,
               "metrics": curve[-1] if curve else {}, "runner": "local",
               "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    publish(cfg.output_dir, lambda staging: trainer.save(staging), summary, curve)
    return Trained(variant.label, cfg.output_dir, trainer.step, seconds, False, final, curve)


def publish(out: Path, save, summary: dict[str, Any], curve: list[dict[str, float]]) -> None:
    """The drafter, training.json and curve.json staged beside ``out``, then swapped in."""
    staging = out.with_name(f".{out.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    save(staging)
    (staging / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    (staging / CURVE_FILE).write_text(json.dumps(curve, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging.replace(out)


# ---------------------------------------------------------------- ray-train: jobs.train_drafter as Ray tasks


def _train_job(config: dict[str, Any]) -> float:
    """A Ray task: one jobs.train_drafter run (its own TorchTrainer and MLflow run); returns its seconds."""
    # here, not at the top: jobs.train_drafter imports Ray Train (seconds), which only this runner needs
    from jobs.train_drafter import train

    start = time.monotonic()
    train(from_dict(TrainConfig, config))
    return time.monotonic() - start


def train_ray(variants: Sequence[Variant]) -> list[Trained]:
    import ray

    init_ray(preload_allocator=True)
    env = {k: v for k, v in {"EYAS_HOME": os.environ.get("EYAS_HOME"), "MLFLOW_TRACKING_URI": track.tracking_uri(),
                             "EYAS_MLFLOW_ARTIFACTS": str(track.artifact_root() or "")}.items() if v}
    task = ray.remote(num_cpus=0)(_train_job).options(runtime_env={"env_vars": env})  # the workers hold the CPUs
    seconds = ray.get([task.remote(to_dict(v.config)) for v in variants])
    out = []
    for variant, took in zip(variants, seconds):
        cfg = variant.config
        summary = json.loads((cfg.output_dir / "training.json").read_text())
        curve = mlflow_curve(cfg)
        summary["seconds"] = took
        (cfg.output_dir / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
        (cfg.output_dir / CURVE_FILE).write_text(json.dumps(curve, indent=2) + "\n")
        out.append(Trained(variant.label, cfg.output_dir, int(summary["step"]), took, False,
                           heldout(summary["metrics"]), curve))
    return out


def mlflow_curve(cfg: TrainConfig) -> list[dict[str, float]]:
    """The per-step metrics of the variant's latest jobs.train_drafter run (its MLflow run is named cfg.name)."""
    client = track.client()
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs([experiment.experiment_id], f"attributes.run_name = '{cfg.name}'",
                              order_by=["attributes.start_time DESC"], max_results=1) if experiment else []
    if not runs:
        return []
    points: dict[int, dict[str, float]] = {}
    for key in runs[0].data.metrics:
        for metric in client.get_metric_history(runs[0].info.run_id, key):
            points.setdefault(metric.step, {"step": metric.step})[key] = metric.value
    return [points[s] for s in sorted(points)]
