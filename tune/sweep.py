"""Ray Tune sweeps from the command line.

    python -m tune.sweep --config tune/configs/eagle3-tree.yaml [section.key=value ...] [--dry-run]
    ray job submit --working-dir . -- python -m tune.sweep --config tune/configs/ddtree-budget.yaml

Inference sweeps (a ``spec:`` section) search the node budget, top-k, depth, the DDTree budget or the chain length
of a trained drafter: each trial times greedy generation with the drafter against vanilla on the same held-out
prompts, interleaved, in the same process, and reports tau, tokens/s and speedup. Schedule sweeps (a ``spec:``
section, the space ``batch_size`` x ``max_draft_nodes``) time B concurrent greedy requests through the batched engine
(what a Serve replica runs) at each draft-node budget against vanilla at the same B, and choose serving's
``speculation_by_batch``: per batch size the budget with the best speedup (0: none). Training sweeps (a ``training:``
section) search DFlash's block size and loss decay (and lr, layers, ...): each trial trains a drafter and reports the
held-out simulated tau (and, with ``measure.num_prompts``, tau and speedup) after every epoch; ASHA stops weak
trials. The search is a grid or Optuna; the objective is speedup (default), tau or sim_tau.

Everything is checked before Ray starts (tune/config.py): an unknown key, an empty range, a missing checkpoint or an
impossible combination is an error naming the key. ``--dry-run`` stops after the checks and lists the trials.

Resources: each trial holds ``resources.cpus_per_trial`` / ``gpus_per_trial`` (tune.with_resources) and Tune runs
as many trials at once as the cluster fits (``resources.max_concurrent_trials`` caps it). ``RAY_ADDRESS`` selects a
running cluster (eyas_ray.cluster.init_ray); on a multi-node cluster put ``output.storage_path`` on shared storage.
``runner: ray-train`` (training) launches a TorchTrainer per trial with ``training.scaling`` workers instead of a
loop inside the trial (tune/trials.py); its trials reserve no CPU themselves, so concurrency is capped to the
workers the cluster fits.

Faults: a trial whose process dies (killed, out of memory, its node lost) is retried from its last checkpoint, up
to ``resources.max_failures`` times (default 1); a training trial resumes there with its weights, optimizer, schedule
and step (tune/trials.py). A trial past its retries is reported failed with its error in results.json and the
summary, the other trials go on, the best configuration is chosen among those that finished, and the exit code is 1.

Output in ``output.dir`` (default ``$EYAS_HOME/sweeps/<name>``): ``best.yaml`` (``target:`` + ``spec:``, read as is by
``jobs.generate --config``, ``jobs.bench --spec`` and serving's ``spec_file``), for training sweeps also
``best-train.yaml`` (``jobs.train_drafter --config``) and ``best-drafter/``, for schedule sweeps ``schedule.yaml``
(``speculation_by_batch:``, pasted as is under a Serve config's args; the sweep prints how), ``results.json`` and
``curve.png`` (speedup and tau against the node budget, one line per depth and top-k; a schedule sweep: speedup and
tokens/s against the budget, one line per batch size). MLflow: a parent run per sweep with the
same files and the best point, a child run per trial with its params and per-report metrics.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any

from eyas import track
from eyas.config import ConfigError, flatten, resolve_path, to_dict
from eyas.models import CheckpointError, ModelConfig, load_tokenizer
from eyas.train.config import data_path
from eyas_ray.cluster import init_ray
from tune.config import SweepConfig, load_sweep
from tune.measure import heldout_prompt_ids
from tune.preflight import absolute_spec, preflight
from tune.report import (best_row, choose_schedule, collect_rows, curve_table, log_parent, make_tracker, panel_metrics,
                         schedule_usage, write_outputs, x_key)
from tune.space import Param


# Tune needs a non-empty bundle per trial: a ray-train trial's driver (it only waits on its TorchTrainer) holds this
DRIVER_CPUS = 0.01


def build_context(sweep: SweepConfig) -> dict[str, Any]:
    """The fixed part of every trial (prompts tokenized once here, so every trial times the same ones)."""
    target_dir = sweep.target_dir.resolve()
    context: dict[str, Any] = {
        "keys": list(sweep.search.space), "torch_threads": sweep.resources.torch_threads,
        "cpus_per_trial": sweep.resources.cpus_per_trial,
        "use_gpu": sweep.resources.gpus_per_trial > 0, "measure": to_dict(sweep.measure),
        "target_dir": str(target_dir), "dtype": sweep.dtype,
        "storage_path": str(resolve_path(sweep.output.storage_path).resolve())}
    if sweep.kind == "training":
        context["training"] = to_dict(sweep.training)
        context["data_dir"] = str(data_path(sweep.training.data).resolve())
        return context
    model_config = ModelConfig.from_file(target_dir / "config.json")
    tokenizer = load_tokenizer(target_dir)
    measure = sweep.measure
    context["prompts"] = heldout_prompt_ids(tokenizer, measure.suite, measure.num_prompts, measure.max_prompt_tokens,
                                            model_config.max_position_embeddings, measure.max_new_tokens)
    eos = set(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    context["eos"] = sorted(eos)
    context["spec"] = absolute_spec(sweep.spec)
    return context


# ---------------------------------------------------------------- Tune wiring


def domain(param: Param):
    """An optuna-searchable Tune domain for one parameter."""
    from ray import tune

    if param.values is not None:
        return tune.choice(list(param.values))
    if param.is_int:
        if param.log:
            return tune.lograndint(param.low, param.high + 1)
        if param.step is not None:
            return tune.qrandint(param.low, param.high, param.step)
        return tune.randint(param.low, param.high + 1)
    if param.log:
        return tune.loguniform(param.low, param.high)
    if param.step is not None:
        return tune.quniform(param.low, param.high, param.step)
    return tune.uniform(param.low, param.high)


def param_space(sweep: SweepConfig, points: list[dict[str, Any]]) -> dict[str, Any]:
    """grid: one ``point`` dict per valid grid point; optuna: one domain per key."""
    from ray import tune

    if sweep.search.algorithm == "grid":
        return {"point": tune.grid_search(points)}
    return {param.key: domain(param) for param in sweep.search.params}


def trainable(sweep: SweepConfig, context: dict[str, Any]):
    from ray import tune

    from tune import trials  # imports Ray Train and Tune: the dry run and the config checks run without Ray

    if sweep.kind != "training":  # inference and schedule sweeps
        function = trials.inference_trial
    else:
        function = trials.training_trial if sweep.runner == "trial" else trials.ray_train_trial
    function = tune.with_parameters(function, context=context)
    if sweep.runner == "ray-train":  # the TorchTrainer's workers hold the resources, its driver almost nothing
        return tune.with_resources(function, {"cpu": DRIVER_CPUS})
    return tune.with_resources(function, sweep.resources.tune_resources())


def trial_needs(sweep: SweepConfig) -> dict[str, float]:
    """The resources one trial occupies (ray-train: its driver and all its workers)."""
    if sweep.runner == "ray-train":
        scaling = sweep.training.scaling
        cpus = DRIVER_CPUS + scaling.num_workers * scaling.cpus_per_worker
        return {"CPU": cpus, **({"GPU": float(scaling.num_workers)} if scaling.use_gpu else {})}
    resources = sweep.resources
    return {k: v for k, v in (("CPU", resources.cpus_per_trial), ("GPU", resources.gpus_per_trial),
                              ("memory", resources.memory_bytes)) if v}


def concurrency(sweep: SweepConfig, cluster: dict[str, float]) -> int | None:
    """Check that one trial fits the cluster; the cap on concurrent trials (None: Tune's resource accounting)."""
    needs = trial_needs(sweep)
    for resource, amount in needs.items():
        if cluster.get(resource, 0.0) < amount:
            where = "training.scaling" if sweep.runner == "ray-train" else "resources"
            need, have = ((f"{amount / 1e9:g} GB of memory", f"{cluster.get(resource, 0.0) / 1e9:.1f} GB")
                          if resource == "memory" else (f"{amount:g} {resource}", f"{cluster.get(resource, 0.0):g}"))
            raise ConfigError(f"{where}: a trial needs {need} but the Ray cluster has {have}; lower it or add nodes")
    cap = sweep.resources.max_concurrent_trials
    if sweep.runner == "ray-train":  # Tune cannot see the workers' needs: cap by what the cluster fits
        fits = min(int(cluster.get(r, 0.0) // a) for r, a in needs.items())
        cap = min(cap, fits) if cap else fits
    return cap


def make_tuner(sweep: SweepConfig, context: dict[str, Any], points: list[dict[str, Any]], callbacks: list,
               max_concurrent: int | None):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    search_alg = None
    if sweep.search.algorithm == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        search_alg = OptunaSearch(seed=sweep.search.seed)
    scheduler = None
    ray_train = sweep.runner == "ray-train"
    if sweep.kind == "training" and sweep.scheduler.asha:
        # ray-train: ASHA's STOP at max_t would kill the trial's driver before its TorchTrainer has shut down
        # and released the workers' placement group; one epoch more than the trial runs lets it return by itself
        scheduler = ASHAScheduler(time_attr="training_iteration", max_t=sweep.max_epochs + int(ray_train),
                                  grace_period=min(sweep.scheduler.grace_period, sweep.max_epochs),
                                  reduction_factor=sweep.scheduler.reduction_factor)
    return tune.Tuner(
        trainable(sweep, context), param_space=param_space(sweep, points),
        tune_config=tune.TuneConfig(metric=sweep.metric, mode="max", search_alg=search_alg, scheduler=scheduler,
                                    num_samples=sweep.search.num_samples, max_concurrent_trials=max_concurrent,
                                    # a fresh actor per ray-train trial: its TorchTrainer dies with it
                                    reuse_actors=not ray_train),
        run_config=tune.RunConfig(name=f"sweep-{sweep.name}-{time.strftime('%Y%m%d-%H%M%S')}",
                                  storage_path=context["storage_path"], callbacks=callbacks,
                                  checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
                                  # a dead trial is retried from its last checkpoint (tune/trials.py resumes)
                                  failure_config=tune.FailureConfig(max_failures=sweep.resources.max_failures),
                                  verbose=1))


# ---------------------------------------------------------------- the run


def run_sweep(sweep: SweepConfig, command: str, points: list[dict[str, Any]]) -> int:
    """Start Ray, run every trial, write and log the results. Returns 0, or 1 when some trial failed."""
    import ray

    # a trial checkpoints every epoch; Tune's warning about frequent experiment snapshots is noise here
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    context = build_context(sweep)
    init_ray(preload_allocator=True)
    max_concurrent = concurrency(sweep, ray.cluster_resources())
    start = time.monotonic()
    parent = (track.start_run(sweep.tracking.experiment, run_name=sweep.name, params=flatten(to_dict(sweep)),
                              tags={"eyas.kind": "sweep", "eyas.sweep_kind": sweep.kind, "eyas.command": command})
              if sweep.tracking.enabled else contextlib.nullcontext())
    with parent as run:
        callbacks = [make_tracker(sweep, run.info.run_id, context["keys"])] if sweep.tracking.enabled else []
        results = make_tuner(sweep, context, points, callbacks, max_concurrent).fit()
        rows = collect_rows(sweep, results, context["keys"])
        best = best_row(sweep, rows)
        files = write_outputs(sweep, rows, best, command)
        seconds = time.monotonic() - start
        if sweep.tracking.enabled:
            log_parent(sweep, rows, best, files, seconds)
    print_summary(sweep, rows, best, files, seconds)
    failed = [r for r in rows if r["error"] is not None]
    for row in failed:
        print(f"[sweep] trial {row['trial_id']} at {row['point']} failed: {row['error']}", file=sys.stderr)
    if best is None:
        print(f"[sweep] no trial reported {sweep.metric}: no best configuration", file=sys.stderr)
        return 1
    return 1 if failed else 0


def print_summary(sweep: SweepConfig, rows: list[dict[str, Any]], best: dict[str, Any] | None, files: dict,
                  seconds: float) -> None:
    metrics = panel_metrics(sweep, rows)
    x = x_key(sweep)
    print(f"\n[sweep] {sweep.name}: {len(rows)} trials in {seconds:.0f}s; {x} curve (mean per point):")
    for line, points in curve_table(sweep, rows).items():
        print(f"  {line}")
        for xv, values in points.items():
            shown = " ".join(f"{m}={values[m]:.3f}" for m in metrics if m in values)
            print(f"    {x.split('.')[-1]}={xv}: {shown}")
    if best is not None:
        print(f"[sweep] best {sweep.metric}={best['metrics'][sweep.metric]:.3f} at {best['point']} "
              f"(trial {best['trial_id']})")
    if sweep.kind == "schedule":
        choice = choose_schedule(rows)
        print("[sweep] speculation_by_batch (per batch size the budget with the best speedup over vanilla):")
        for size, cell in choice.items():
            print(f"    {size}: {cell['max_draft_nodes']}    speedup {cell['speedup']:.3f}, "
                  f"{cell['tokens_per_s']:.1f} vs vanilla {cell['vanilla_tokens_per_s']:.1f} tok/s, "
                  f"greedy identical {cell['greedy_identical']:.2f}")
        if "schedule.yaml" in files:
            usage = schedule_usage(sweep, {size: cell["max_draft_nodes"] for size, cell in choice.items()})
            print(f"[sweep] {files['schedule.yaml']}: {usage}")
    for name, path in files.items():
        print(f"[sweep] {name}: {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", metavar="PATH", help="sweep YAML (tune/configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="dotted overrides applied after the file, e.g. search.space.num_nodes=[8,16]")
    parser.add_argument("--dry-run", action="store_true", help="check the config and list the trials; start nothing")
    args = parser.parse_args(argv)
    if args.config is None:
        parser.error("--config is required, e.g. --config tune/configs/eagle3-tree.yaml")
    command = " ".join(["python -m tune.sweep", "--config", args.config, *args.overrides])
    try:
        sweep = load_sweep(args.config, args.overrides)
        preflight(sweep)
        points, invalid = sweep.points()
        for point, why in invalid:
            print(f"[sweep] skipping impossible point {point}: {why}", file=sys.stderr)
        if args.dry_run:
            build_context(sweep)
            grid = sweep.search.algorithm == "grid"
            num_trials = sweep.search.num_samples * (len(points) if grid else 1)
            print(f"[sweep] {sweep.name}: {sweep.kind} sweep, {sweep.search.algorithm}, objective {sweep.metric}; "
                  f"{num_trials} trials over {points if grid else sweep.search.space}")
            return 0
        return run_sweep(sweep, command, points)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # through the importable module: Ray workers import the trial functions by name, not from __main__
    from tune.sweep import main as importable_main

    raise SystemExit(importable_main())
