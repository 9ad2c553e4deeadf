"""The Tune trial functions. Each receives its searched point from Tune and everything else from ``context`` (the
sweep's fixed settings, put in the object store once by ``tune.with_parameters``).

  inference_trial   build the drafter for the point's SpecConfig, time it against vanilla (tune.measure), report once
  training_trial    train a drafter in the trial (tune.measure.TrialTrainer), report every epoch with a checkpoint
  ray_train_trial   launch a TorchTrainer (jobs.train_drafter's worker loop, eyas_ray.train_worker) from the trial, as Ray Train V2
                    documents Train inside Tune; the workers' epoch reports reach Tune through TuneReportCallback
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import ray.train
import torch
from ray import tune
from ray.train.torch import TorchConfig, TorchTrainer
from ray.tune.integration.ray_train import TuneReportCallback

from eyas import track
from eyas.config import from_dict, to_dict
from eyas.methods import SpecConfig, build_drafter
from eyas.models import load_target
from eyas.train.config import TrainConfig
from eyas_ray.train_worker import train_loop_per_worker
from tune.config import point_of, set_dotted
from tune.measure import TrialTrainer, heldout_prompt_ids, measure_speed

# the target stays loaded in a reused trial actor (Tune reuses actors between function trials)
_TARGETS: dict[tuple[str, str], Any] = {}


def setup_torch(context: dict[str, Any]) -> str:
    torch.set_num_threads(context["threads"])
    return "cuda" if context["use_gpu"] and torch.cuda.is_available() else "cpu"


def cached_target(target_dir: str, device: str):
    key = (target_dir, device)
    if key not in _TARGETS:
        _TARGETS.clear()
        _TARGETS[key] = load_target(target_dir, device=device)
    return _TARGETS[key]


def inference_trial(config: dict[str, Any], context: dict[str, Any]) -> None:
    device = setup_torch(context)
    point = point_of(config, context["keys"])
    spec = from_dict(SpecConfig, {**context["spec"], **point}, prefix="spec.")
    target = cached_target(context["target_dir"], device)
    drafter = build_drafter(target, spec)
    measure = context["measure"]
    metrics = measure_speed(target, drafter, context["prompts"], measure["max_new_tokens"], context["eos"],
                            measure["warmup_prompts"], measure["repeats"])
    tune.report(metrics)


def training_trial(config: dict[str, Any], context: dict[str, Any]) -> None:
    device = setup_torch(context)
    point = point_of(config, context["keys"])
    cfg = trial_train_config(context, point, tune.get_context().get_trial_id())
    trainer = TrialTrainer(cfg, context["target_dir"], context["data_dir"], device)
    measure = context["measure"]
    prompts = []
    if measure["num_prompts"]:
        prompts = heldout_prompt_ids(trainer.tokenizer, measure["suite"], measure["num_prompts"],
                                     measure["max_prompt_tokens"], trainer.target.config.max_position_embeddings,
                                     measure["max_new_tokens"])
    for epoch in range(cfg.train.num_epochs):
        metrics = trainer.run_epoch(epoch)
        metrics.update(trainer.evaluate())
        if prompts:
            with trainer.evaluating():
                metrics.update(measure_speed(trainer.target, trainer.spec_drafter(), prompts,
                                             measure["max_new_tokens"], trainer.eos_token_ids,
                                             measure["warmup_prompts"], measure["repeats"]))
        with tempfile.TemporaryDirectory() as tmp:
            trainer.save(Path(tmp) / "drafter")
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(tmp))
        if trainer.done:
            break


def trial_train_config(context: dict[str, Any], point: dict[str, Any], trial_id: str):
    """The TrainConfig of this trial: the sweep's base with the point applied, its own name, tracking off."""
    data = _deep_copy(context["training"])
    for key, value in point.items():
        set_dotted(data, key, value)
    data["name"] = f"{data['name']}-{trial_id}"
    data.setdefault("tracking", {})["enabled"] = False  # the sweep's MLflow callback logs the trial
    data["tracking"]["register"] = False
    return from_dict(TrainConfig, data, prefix="training.")


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


# ---------------------------------------------------------------- Ray Train inside a Tune trial


# jobs.train_drafter reports held-out metrics with a heldout_ prefix; the sweep's objectives use these names
RENAMED = {"heldout_sim_tau": "sim_tau", "heldout_sim_accept_len": "sim_accept_len"}


def ray_train_trial(config: dict[str, Any], context: dict[str, Any]) -> None:
    class RenamedReport(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            renamed = [{RENAMED.get(k, k): v for k, v in m.items()} for m in metrics]
            super().after_report(run_context, renamed, checkpoint)

    trial_id = tune.get_context().get_trial_id()
    cfg = trial_train_config(context, point_of(config, context["keys"]), trial_id)
    scaling = cfg.scaling
    storage = context["storage_path"]
    loop = {"config": to_dict(cfg), "target_dir": context["target_dir"], "data_dir": context["data_dir"],
            "run_id": None, "tracking_uri": track.tracking_uri(), "artifact_root": "",
            "marker_dir": os.path.join(storage, f"{cfg.name}-markers")}
    resources = {"CPU": scaling.cpus_per_worker, **({"GPU": 1} if scaling.use_gpu else {})}
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=loop,
        scaling_config=ray.train.ScalingConfig(num_workers=scaling.num_workers, use_gpu=scaling.use_gpu,
                                               resources_per_worker=resources),
        torch_config=TorchConfig(backend="nccl" if scaling.use_gpu else "gloo"),
        # the run name carries the trial id: Train restores a restarted trial's run from (storage, name)
        run_config=ray.train.RunConfig(name=f"{cfg.name}-trial_id={trial_id}", storage_path=storage,
                                       callbacks=[RenamedReport()],
                                       checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
                                       worker_runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}}))
    trainer.fit()
