"""The Tune trial functions. Each receives its searched point from Tune and everything else from ``context`` (the
sweep's fixed settings, put in the object store once by ``tune.with_parameters``).

  inference_trial   build the drafters for the point's SpecConfig, time them against vanilla (tune.measure), report
                    once; a schedule sweep's point also sets the concurrent requests and the draft-node cap
  training_trial    train a drafter in the trial (tune.measure.TrialTrainer), report every epoch with a training
                    checkpoint (drafter/, optimizer and schedule, step); a retried trial resumes from it
  ray_train_trial   launch a TorchTrainer (jobs.train_drafter's worker loop, eyas_ray.train_worker) from the trial, as Ray Train V2
                    documents Train inside Tune; the workers' epoch reports reach Tune through TuneReportCallback
"""
from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import ray.train
import torch
from ray import tune
from ray.train.torch import TorchConfig, TorchTrainer
from ray.tune.integration.ray_train import TuneReportCallback

from eyas import track
from eyas.config import from_dict, to_dict
from eyas.methods import SpecConfig, drafter_factory
from eyas.models import load_target, torch_dtype
from eyas.threads import configure_threads
from eyas.train.config import TrainConfig
from eyas.train.data import DataPosition
from eyas.train.step import load_training_checkpoint, save_training_checkpoint
from eyas_ray.train_worker import train_loop_per_worker
from tune.config import SCHEDULE_KEYS, point_of, set_dotted
from tune.measure import TrialTrainer, heldout_prompt_ids, measure_speed

# the target stays loaded in a reused trial actor (Tune reuses actors between function trials)
_TARGETS: dict[tuple[str, str, str], Any] = {}


def setup_torch(context: dict[str, Any]) -> str:
    # resources.torch_threads, else the policy within the trial's CPUs (eyas.threads)
    configure_threads(context["torch_threads"], cpu_budget=context["cpus_per_trial"] or None)
    return "cuda" if context["use_gpu"] and torch.cuda.is_available() else "cpu"


def cached_target(target_dir: str, device: str, dtype: str):
    key = (target_dir, device, dtype)
    if key not in _TARGETS:
        _TARGETS.clear()
        _TARGETS[key] = load_target(target_dir, dtype=torch_dtype(dtype), device=device)
    return _TARGETS[key]


def inference_trial(config: dict[str, Any], context: dict[str, Any]) -> None:
    """Inference and schedule sweeps: the point's spec settings build the drafters, its SCHEDULE_KEYS (if any)
    set the concurrent requests and the draft-node cap of the measurement."""
    device = setup_torch(context)
    point = point_of(config, context["keys"])
    batch = {key: point.pop(key) for key in SCHEDULE_KEYS if key in point}
    spec = from_dict(SpecConfig, {**context["spec"], **point}, prefix="spec.")
    target = cached_target(context["target_dir"], device, context["dtype"])
    measure = context["measure"]
    metrics = measure_speed(target, drafter_factory(target, spec), context["prompts"], measure["max_new_tokens"],
                            context["eos"], measure["warmup_prompts"], measure["repeats"], **batch)
    tune.report(metrics)


def training_trial(config: dict[str, Any], context: dict[str, Any]) -> None:
    device = setup_torch(context)
    point = point_of(config, context["keys"])
    trial_id = tune.get_context().get_trial_id()
    cfg = trial_train_config(context, point, trial_id)
    trainer = TrialTrainer(cfg, context["target_dir"], context["data_dir"], device)
    first_epoch = resume_trial(trainer, trial_id)
    measure = context["measure"]
    prompts = []
    if measure["num_prompts"]:
        prompts = heldout_prompt_ids(trainer.tokenizer, measure["suite"], measure["num_prompts"],
                                     measure["max_prompt_tokens"], trainer.target.config.max_position_embeddings,
                                     measure["max_new_tokens"])
    for epoch in range(first_epoch, cfg.train.num_epochs):
        metrics = trainer.run_epoch(epoch, before_step=lambda step: maybe_fail(cfg, step, epoch, context))
        metrics.update(trainer.evaluate())
        if prompts:
            with trainer.evaluating():
                drafter = trainer.spec_drafter()
                metrics.update(measure_speed(trainer.target, lambda: drafter, prompts,
                                             measure["max_new_tokens"], trainer.eos_token_ids,
                                             measure["warmup_prompts"], measure["repeats"]))
        state = {"step": trainer.step, "position": DataPosition(epoch + 1, 0).to_dict(), "metrics": metrics}
        with tempfile.TemporaryDirectory() as tmp:
            save_training_checkpoint(Path(tmp), trainer.strategy, 0, state, context["target_dir"])
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(tmp))
        if trainer.done:
            break


def resume_trial(trainer: TrialTrainer, trial_id: str) -> int:
    """The epoch to start with: 0, or, for a trial retried after its process died (resources.max_failures), the
    one after its last checkpoint, with the weights, optimizer, schedule and step restored from it."""
    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as directory:
        state = load_training_checkpoint(Path(directory), trainer.strategy)
    trainer.step = int(state["step"])
    position = DataPosition.from_dict(state["position"])
    print(f"[sweep] trial {trial_id}: resuming from checkpoint {checkpoint.path} at step {trainer.step} "
          f"(epoch {position.epoch + 1})", flush=True)
    return position.epoch


def maybe_fail(cfg: TrainConfig, step: int, epoch: int, context: dict[str, Any]) -> None:
    """Testing hook (``training.train.fail_at_step``): the first trial of the sweep to reach that step dies of
    SIGKILL, once (a marker file in the sweep's directory claims it), as a killed trial process would.

    It waits until the driver has logged the trial's reports so far (its result.json), so that the retry resumes
    from the checkpoint of the epoch before, deterministically; a kill right after ``tune.report`` could beat the
    report to the driver, and the retry would start one checkpoint earlier."""
    if cfg.train.fail_at_step != step:
        return
    trial = tune.get_context()
    marker = Path(context["storage_path"]) / trial.get_experiment_name() / "fail_at_step.done"
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return  # another trial died already, or this one did before its retry
    with os.fdopen(fd, "w") as handle:
        handle.write(f"{trial.get_trial_id()} killed at step {step}\n")
    results = Path(trial.get_trial_dir()) / "result.json"
    deadline = time.monotonic() + 120
    while epoch and (not results.is_file() or len(results.read_text().splitlines()) < epoch):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{results}: the driver never logged this trial's {epoch} report(s)")
        time.sleep(0.2)
    print(f"[sweep] trial {trial.get_trial_id()}: SIGKILL at step {step} (training.train.fail_at_step)", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


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
                                               resources_per_worker=resources,
                                               placement_strategy=scaling.placement_strategy),
        torch_config=TorchConfig(backend="nccl" if scaling.use_gpu else "gloo"),
        # the run name carries the trial id: Train restores a restarted trial's run from (storage, name)
        run_config=ray.train.RunConfig(name=f"{cfg.name}-trial_id={trial_id}", storage_path=storage,
                                       callbacks=[RenamedReport()],
                                       # a worker lost: Train restarts the group from its last checkpoint first
                                       failure_config=ray.train.FailureConfig(max_failures=scaling.max_failures),
                                       checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
                                       worker_runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}}))
    trainer.fit()
