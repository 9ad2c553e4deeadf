"""What a sweep leaves behind: MLflow runs (a parent per sweep, a child per trial), the curve figure, results.json and
the best configuration as YAML.

MLflow is written from the driver only: a Tune callback opens a child run when a trial starts and logs each result
as it arrives (step = the trial's report count, i.e. its epoch in a training sweep), so trials never touch the
tracking store and a cluster needs no shared MLflow path. The figure plots each panel metric (speedup and tau; a
training sweep: the held-out simulated tau too) against the node budget, or the first searched number when the node
budget is fixed, one line per combination of the other searched keys (depth and top_k, say).
"""
from __future__ import annotations

import json
import math
import shutil
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from eyas import track
from eyas.config import flatten, to_dict
from eyas.files import write_text_atomic
from tune.config import SweepConfig, point_of
from tune.preflight import absolute_spec

# Tune's own result entries: not our metrics
TUNE_KEYS = {"timestamp", "training_iteration", "time_this_iter_s", "time_total_s", "pid", "date", "hostname",
             "node_ip", "done", "trial_id", "experiment_tag", "time_since_restore", "iterations_since_restore",
             "checkpoint_dir_name", "should_checkpoint", "config", "checkpoint_path"}
X_PREFERENCE = ("max_draft_nodes", "num_nodes", "depth", "num_draft", "max_matches", "top_k",
                "drafter.config.block_size", "drafter.config.loss_decay", "drafter.config.num_layers", "optim.lr")


def numeric_metrics(result: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in result.items()
            if key not in TUNE_KEYS and "/" not in key and isinstance(value, (int, float))
            and not isinstance(value, bool) and math.isfinite(float(value))}


def point_label(point: dict[str, Any]) -> str:
    """``{"drafter.config.loss_decay": 6.5420, "top_k": 4}`` -> ``loss_decay=6.542, top_k=4``."""
    shown = (f"{v:.4g}" if isinstance(v, float) else str(v) for v in point.values())
    return ", ".join(f"{key.split('.')[-1]}={value}" for key, value in zip(point, shown)) or "all trials"


# ---------------------------------------------------------------- MLflow: a child run per trial


def make_tracker(sweep: SweepConfig, parent_run_id: str, keys: list[str]):
    """A Tune callback logging each trial into its own MLflow child run of ``parent_run_id``."""
    from ray import tune

    class TrialTracker(tune.Callback):
        def __init__(self) -> None:
            self.client = track.client()
            self.experiment_id = track.ensure_experiment(sweep.tracking.experiment)
            self.runs: dict[str, str] = {}
            self.history: dict[str, list[dict[str, float]]] = defaultdict(list)

        def on_trial_start(self, iteration, trials, trial, **info) -> None:
            point = point_of(trial.config, keys)
            section = sweep.trial_section(point)
            run = self.client.create_run(self.experiment_id, run_name=f"{sweep.name}-{trial.trial_id}",
                                         tags={"mlflow.parentRunId": parent_run_id, "eyas.kind": "sweep-trial",
                                               "eyas.sweep": sweep.name, "eyas.trial_id": trial.trial_id,
                                               "eyas.point": point_label(point)})
            self.runs[trial.trial_id] = run.info.run_id
            prefix = "training" if sweep.kind == "training" else "spec"
            params = {**flatten(to_dict(section), prefix + "."), **{f"point.{k}": v for k, v in point.items()}}
            for key, value in params.items():
                self.client.log_param(run.info.run_id, key, "null" if value is None else str(value)[:6000])

        def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
            run_id = self.runs.get(trial.trial_id)
            if run_id is None:
                return
            step = int(result.get("training_iteration", 1))
            metrics = numeric_metrics(result)
            self.history[trial.trial_id].append(metrics)
            timestamp = int(time.time() * 1000)
            for key, value in metrics.items():
                self.client.log_metric(run_id, key, value, timestamp=timestamp, step=step)

        def on_trial_complete(self, iteration, trials, trial, **info) -> None:
            self._finish(trial, "FINISHED")

        def on_trial_error(self, iteration, trials, trial, **info) -> None:
            self._finish(trial, "FAILED")

        def _finish(self, trial, status: str) -> None:
            run_id = self.runs.pop(trial.trial_id, None)
            if run_id is None:
                return
            history = self.history.get(trial.trial_id, [])
            if sweep.kind == "training":
                stopped = status == "FINISHED" and len(history) < sweep.max_epochs
                self.client.set_tag(run_id, "eyas.early_stopped", str(stopped).lower())
                if history:
                    label = point_label(point_of(trial.config, keys))
                    self.client.log_figure(run_id, epoch_figure({label: history}, sweep), "curve.png")
            self.client.set_terminated(run_id, status)

    return TrialTracker()


# ---------------------------------------------------------------- rows, figures


def collect_rows(sweep: SweepConfig, results, keys: list[str]) -> list[dict[str, Any]]:
    """One row per trial: its point, last metrics, epochs run, whether ASHA stopped it, error, checkpoint."""
    rows = []
    for result in results:
        trial_id = result.metrics.get("trial_id") or Path(result.path).name
        metrics = numeric_metrics(result.metrics or {})
        epochs = int((result.metrics or {}).get("training_iteration", 0))
        checkpoint = None
        if result.checkpoint is not None:
            checkpoint = result.checkpoint.path
        elif (result.metrics or {}).get("checkpoint_path"):
            checkpoint = result.metrics["checkpoint_path"]
        frame = result.metrics_dataframe
        history = [numeric_metrics(r) for r in frame.to_dict("records")] if frame is not None else []
        rows.append({"trial_id": trial_id, "point": point_of(result.config, keys), "metrics": metrics,
                     "epochs": epochs, "history": history,
                     "early_stopped": result.error is None and sweep.kind == "training" and epochs < sweep.max_epochs,
                     "error": None if result.error is None else f"{type(result.error).__name__}: {result.error}",
                     "checkpoint": checkpoint})
    return rows


def x_key(sweep: SweepConfig) -> str:
    keys = list(sweep.search.space)
    for key in X_PREFERENCE:
        if key in keys:
            return key
    return keys[0]


def panel_metrics(sweep: SweepConfig, rows: list[dict[str, Any]]) -> list[str]:
    wanted = {"inference": ["speedup", "tau"], "schedule": ["speedup", "tokens_per_s"],
              "training": ["sim_tau", "speedup", "tau"]}[sweep.kind]
    return [m for m in wanted if any(m in row["metrics"] for row in rows)]


def curve_table(sweep: SweepConfig, rows: list[dict[str, Any]]) -> dict[str, dict[Any, dict[str, float]]]:
    """{line label: {x: {metric: mean over the trials at that point}}}, failed trials left out."""
    x = x_key(sweep)
    sums: dict[str, dict[Any, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for row in rows:
        if row["error"] is not None:
            continue
        others = {k: v for k, v in row["point"].items() if k != x}
        for metric, value in row["metrics"].items():
            sums[point_label(others)][row["point"][x]][metric].append(value)
    return {line: {xv: {m: sum(v) / len(v) for m, v in metrics.items()} for xv, metrics in sorted(points.items())}
            for line, points in sorted(sums.items())}


def curve_figure(sweep: SweepConfig, rows: list[dict[str, Any]]):
    """Each panel metric against the x key, one line per combination of the other searched keys."""
    from matplotlib.figure import Figure

    metrics = panel_metrics(sweep, rows)
    table = curve_table(sweep, rows)
    x = x_key(sweep)
    figure = Figure(figsize=(5.2 * max(len(metrics), 1), 4.0), layout="constrained")
    axes = figure.subplots(1, max(len(metrics), 1), squeeze=False)[0]
    for ax, metric in zip(axes, metrics):
        for line, points in table.items():
            xs = [xv for xv, values in points.items() if metric in values]
            ax.plot([str(v) if isinstance(v, str) else v for v in xs], [points[xv][metric] for xv in xs],
                    marker="o", label=line)
        if metric == "speedup":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel(x)
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} vs {x.split('.')[-1]}")
        ax.legend(fontsize=7)
    figure.suptitle(f"sweep {sweep.name}: {fixed_settings(sweep)} ({sweep.search.algorithm}, objective "
                    f"{sweep.metric})")
    return figure


def fixed_settings(sweep: SweepConfig) -> str:
    """What the lines share: the method and the tree settings the search leaves fixed."""
    if sweep.kind == "training":
        return f"{sweep.training.drafter.type} training"
    fixed = {k: getattr(sweep.spec, k) for k in ("depth", "top_k", "num_nodes") if k not in sweep.search.space}
    return f"{sweep.spec.method} {point_label(fixed)}".strip()


def epoch_figure(histories: dict[str, list[dict[str, float]]], sweep: SweepConfig):
    """Training: the objective (and simulated tau) per epoch, one line per trial (labelled by its point)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    metrics = [m for m in dict.fromkeys([sweep.metric, "sim_tau"])
               if any(m in h for hist in histories.values() for h in hist)]
    figure = Figure(figsize=(5.0 * max(len(metrics), 1), 3.8), layout="constrained")
    axes = figure.subplots(1, max(len(metrics), 1), squeeze=False)[0]
    for ax, metric in zip(axes, metrics):
        for label, history in histories.items():
            ax.plot(range(1, len(history) + 1), [h.get(metric, float("nan")) for h in history], marker="o",
                    label=label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
        ax.set_ylabel(metric)
        ax.legend(fontsize=7)
    return figure


# ---------------------------------------------------------------- the best configuration


def best_row(sweep: SweepConfig, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    scored = [r for r in rows if r["error"] is None and sweep.metric in r["metrics"]]
    if sweep.kind == "training":  # a trial ASHA stopped early is not a finished candidate when others finished
        finished = [r for r in scored if not r["early_stopped"]]
        scored = finished or scored
    return max(scored, key=lambda r: r["metrics"][sweep.metric], default=None)


SCHEDULE_SHOWN = ("speedup", "tokens_per_s", "vanilla_tokens_per_s", "tau", "greedy_identical")


def choose_schedule(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """A schedule sweep's choice: per batch size, the draft-node budget whose trials' mean speedup (tokens/s over
    vanilla at that batch size, measured interleaved) is highest; a tie goes to the smaller budget, failed trials
    are left out. {batch_size: {"max_draft_nodes": n, "speedup": ..., "tokens_per_s": ..., ...}}."""
    cells: dict[tuple[int, int], list[dict[str, float]]] = defaultdict(list)
    for row in rows:
        if row["error"] is None and "speedup" in row["metrics"]:
            cells[(row["point"]["batch_size"], row["point"]["max_draft_nodes"])].append(row["metrics"])
    choice: dict[int, dict[str, Any]] = {}
    for (size, budget), samples in sorted(cells.items()):
        means = {m: sum(s[m] for s in samples) / len(samples) for m in SCHEDULE_SHOWN if m in samples[0]}
        if size not in choice or means["speedup"] > choice[size]["speedup"]:
            choice[size] = {"max_draft_nodes": budget, **means}
    return choice


def schedule_usage(sweep: SweepConfig, schedule: dict[int, int]) -> str:
    """How to serve the chosen schedule (the fragment's header and the sweep's summary)."""
    inline = "{" + ", ".join(f"{size}: {budget}" for size, budget in schedule.items()) + "}"
    best = sweep.output_dir.resolve() / "best.yaml"
    return (f"paste it under applications[].args of a Serve config that serves this spec (best.yaml's spec:, e.g.\n"
            f"spec_file: {best} with no spec: keys of its own), or load-test it:\n"
            f"  python -m jobs.load --config serving/configs/X.yaml --arg 'spec={{}}' --arg spec_file={best} "
            f"--arg dtype={sweep.dtype} --arg 'speculation_by_batch={inline}'")


def best_documents(sweep: SweepConfig, best: dict[str, Any], output_dir: Path,
                   rows: list[dict[str, Any]] = ()) -> dict[str, dict[str, Any]]:
    """{file name: YAML document}: best.yaml (``spec:`` + ``target:``, read by jobs.generate --config,
    jobs.bench --spec and serving's spec_file), for a training sweep best-train.yaml (jobs.train_drafter), for a
    schedule sweep schedule.yaml (``speculation_by_batch:``, a serving config's args fragment, from ``rows``)."""
    summary = {"name": sweep.name, "objective": sweep.metric, "value": best["metrics"][sweep.metric],
               "point": best["point"], "trial_id": best["trial_id"],
               "metrics": {k: round(v, 6) for k, v in best["metrics"].items()}}
    if sweep.kind != "training":
        spec = absolute_spec(sweep.trial_section(best["point"]))
        docs = {"best.yaml": {"target": str(sweep.target_dir.resolve()), "spec": spec, "sweep": summary}}
        if sweep.kind == "schedule":
            choice = choose_schedule(list(rows))
            summary["schedule"] = {size: {k: round(v, 4) if isinstance(v, float) else v for k, v in cell.items()}
                                   for size, cell in choice.items()}
            # the dtype it was measured in goes with it: a bfloat16 forward's t(N)/t(1) is not float32's
            docs["schedule.yaml"] = {"dtype": sweep.dtype,
                                     "speculation_by_batch": {s: c["max_draft_nodes"] for s, c in choice.items()}}
        return docs
    train_config = to_dict(sweep.trial_section(best["point"]))
    docs = {"best-train.yaml": train_config}
    if best["checkpoint"]:
        drafter_dir = output_dir / "best-drafter"
        shutil.rmtree(drafter_dir, ignore_errors=True)
        shutil.copytree(Path(best["checkpoint"]) / "drafter", drafter_dir)
        method = sweep.training.measure.method or sweep.training.drafter.type
        spec = {"method": method, "drafter": str(drafter_dir.resolve())}
        spec.update({k: v for k, v in sweep.training.measure.tree.items() if k in ("depth", "top_k", "num_nodes")})
        docs["best.yaml"] = {"target": str(sweep.target_dir.resolve()), "spec": spec, "sweep": summary}
    return docs


def write_outputs(sweep: SweepConfig, rows: list[dict[str, Any]], best: dict[str, Any] | None,
                  command: str) -> dict[str, Path]:
    """results.json, curve.png (+ epochs.png), best.yaml (+ best-train.yaml) under the sweep's output dir."""
    out = sweep.output_dir
    out.mkdir(parents=True, exist_ok=True)
    files = {"results": out / "results.json", "curve": out / "curve.png"}
    extra = {"schedule": choose_schedule(rows)} if sweep.kind == "schedule" else {}
    write_text_atomic(files["results"], json.dumps({"sweep": to_dict(sweep), "command": command, "x": x_key(sweep),
                                               "curve": curve_table(sweep, rows), "trials": rows, "best": best,
                                               **extra}, indent=2, default=str))
    curve_figure(sweep, rows).savefig(files["curve"], dpi=110)
    if sweep.kind == "training":
        files["epochs"] = out / "epochs.png"
        histories = {f"{point_label(r['point'])} ({r['trial_id']})": r["history"] for r in rows if r["history"]}
        epoch_figure(histories, sweep).savefig(files["epochs"], dpi=110)
    if best is not None:
        header = (f"# Best of sweep {sweep.name}: {sweep.metric} = {best['metrics'][sweep.metric]:.4g} at "
                  f"{point_label(best['point'])}\n# {command}\n")
        for name, document in best_documents(sweep, best, out, rows).items():
            text = header
            if name == "schedule.yaml":
                usage = schedule_usage(sweep, document["speculation_by_batch"]).replace("\n", "\n# ")
                text = (f"# speculation_by_batch of sweep {sweep.name}: per batch size the draft-node budget with "
                        f"the best measured speedup over vanilla (0: no speculation)\n# {command}\n# Use: {usage}\n")
            files[name] = out / name
            write_text_atomic(files[name], text + yaml.safe_dump(document, sort_keys=False))
    return files


def log_parent(sweep: SweepConfig, rows: list[dict[str, Any]], best: dict[str, Any] | None,
               files: dict[str, Path], seconds: float) -> None:
    """On the active (parent) run: summary metrics, the best point as params, the files as artifacts."""
    summary = {"num_trials": len(rows), "num_failed": sum(r["error"] is not None for r in rows),
               "num_early_stopped": sum(bool(r["early_stopped"]) for r in rows), "sweep_seconds": seconds}
    if best is not None:
        summary.update({f"best_{k}": v for k, v in best["metrics"].items()})
        track.log_params_flat({"best": best["point"]})
        if sweep.kind == "schedule":
            chosen = {size: cell["max_draft_nodes"] for size, cell in choose_schedule(rows).items()}
            track.log_params_flat({"speculation_by_batch": chosen})
        track.set_tags({"eyas.best_trial": best["trial_id"]})
    track.log_metrics(summary)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # only these files, not the rest of the output dir
        for path in files.values():
            shutil.copy(path, Path(tmp) / path.name)
        track.log_artifacts(tmp)
