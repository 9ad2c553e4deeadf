"""SweepConfig: what ``python -m tune.sweep --config tune/configs/X.yaml`` reads, and every check run before a trial.

An inference sweep has a ``spec:`` section (the base ``eyas.methods.SpecConfig``: method, drafter, tree); a training
sweep has a ``training:`` section (the base ``eyas.train.config.TrainConfig``, as in ``jobs/configs/<family>-*.yaml``).
The search space names fields of that section and lists their values or ranges:

    name: eagle3-tree
    target: tiny                          # inference: a name under $EYAS_HOME/targets/ or a checkpoint path
    spec: {method: eagle3, drafter: $EYAS_HOME/drafters/eagle3-tiny}
    search:
      algorithm: grid                     # grid | optuna
      objective: speedup                  # speedup | tau | sim_tau (training: held-out simulated tau)
      space:
        num_nodes: [8, 16, 32, 48]        # a list: exactly these values
        top_k: {low: 2, high: 8, step: 2} # a range: ints step through it; floats need optuna (or a step)
        depth: [4, 6]

Training keys are dotted paths into the training section: ``drafter.config.block_size``,
``drafter.config.loss_decay``, ``optim.lr``, ``drafter.config.num_layers``.

A schedule sweep (a ``spec:`` section, the search space ``batch_size`` x ``max_draft_nodes``) chooses serving's
``speculation_by_batch``: each trial times B concurrent greedy requests through the batched engine at a draft-node
budget against vanilla at the same B; per batch size the budget with the best speedup wins (0: no speculation).

Every combination the search can produce is built and validated here (grid: all of them; optuna: the product of
each parameter's values or range ends), so an impossible one (top_k > num_nodes, block_size < 2) is a ConfigError
before Ray starts. ``search.skip_invalid: true`` drops impossible grid points instead (the sweep prints them).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from eyas.config import (ConfigError, apply_overrides, eyas_home, from_dict, read_yaml_mapping, require,
                         resolve_path, to_dict)
from eyas.decoding.tree import MAX_TREE_NODES
from eyas.drafters import registry
from eyas.methods import METHODS, SpecConfig
from eyas.models.dtypes import DTYPES
from eyas.train.config import SUITES, TrainConfig, target_path
from tune.space import Param, parse_param

MEASURE_SUITES = SUITES + ("humaneval", "chat")  # what jobs.bench measures on, too

# SpecConfig fields an inference sweep may search (method / drafter / draft_model are fixed per sweep)
SPEC_KEYS = ("tree", "depth", "top_k", "num_nodes", "num_draft", "max_matches", "datastore", "min_match", "min_prob",
             "retrieval_prior", "learned_below", "cost_cut")
# a schedule sweep's grid: concurrent requests x the most drafted nodes per sequence (serving's speculation_by_batch)
SCHEDULE_KEYS = ("batch_size", "max_draft_nodes")
# TrainConfig sections a training sweep may search (drafter.config.* is checked against the family's config)
TRAIN_SECTIONS = ("optim", "train", "drafter.config")
MAX_CHECKED_COMBINATIONS = 20_000
SPACE_PREFIX = "search.space."


# ---------------------------------------------------------------- sections


@dataclass(frozen=True)
class SearchConfig:
    algorithm: Literal["grid", "optuna"] = "grid"  # every point of the space, or Optuna's TPE over it
    objective: Literal["speedup", "tau", "sim_tau"] = "speedup"  # maximised; sim_tau: held-out, training only
    space: dict[str, Any] = field(default_factory=dict)  # key -> [values] | {low, high, step?, log?}
    num_samples: int = 1        # grid: passes over the whole grid; optuna: trials
    skip_invalid: bool = False  # grid: drop impossible points (e.g. top_k > num_nodes) instead of failing
    seed: int = 0               # optuna's sampler

    def __post_init__(self) -> None:
        require(bool(self.space), "search.space", self.space, "is empty: name at least one key to search")
        require(self.num_samples >= 1, "search.num_samples", self.num_samples, "must be >= 1")
        if self.algorithm == "grid":
            for param in self.params:
                param.grid_values()  # raises for a continuous range
        require(not (self.skip_invalid and self.algorithm == "optuna"), "search.skip_invalid", True,
                "only a grid can drop impossible points; with optuna narrow the ranges instead")

    @property
    def params(self) -> tuple[Param, ...]:
        return tuple(parse_param(key, raw) for key, raw in self.space.items())


@dataclass(frozen=True)
class MeasureConfig:
    """How a trial measures speed: greedy generation on held-out prompts, vanilla and speculative interleaved."""

    suite: str = "all"           # held-out prompts: code, prose, all (eyas.corpus), humaneval or chat (eyas.datasets)
    num_prompts: int = 8         # 0: no speed measurement (training on sim_tau); schedule: cycled to fill batches
    max_new_tokens: int = 64      # greedy tokens per prompt and method
    max_prompt_tokens: int = 192  # prompts are cut to their first tokens (and to what the context leaves)
    warmup_prompts: int = 1      # untimed batches first (allocations, lazy init); schedule: batch_size prompts each
    repeats: int = 1             # timed passes over the prompts

    def __post_init__(self) -> None:
        require(self.suite in MEASURE_SUITES, "measure.suite", self.suite, f"must be one of {list(MEASURE_SUITES)}")
        require(self.num_prompts >= 0, "measure.num_prompts", self.num_prompts, "must be >= 0")
        for key in ("max_new_tokens", "max_prompt_tokens", "repeats"):
            require(getattr(self, key) >= 1, f"measure.{key}", getattr(self, key), "must be >= 1")
        require(self.warmup_prompts >= 0, "measure.warmup_prompts", self.warmup_prompts, "must be >= 0")


@dataclass(frozen=True)
class SchedulerConfig:
    """ASHA on the objective, reported once per epoch (training sweeps; an inference trial reports once)."""

    asha: bool = True            # off: every trial runs all its epochs
    grace_period: int = 1        # epochs every trial runs before it can be stopped
    reduction_factor: int = 2    # keep the top 1/reduction_factor at each rung

    def __post_init__(self) -> None:
        require(self.grace_period >= 1, "scheduler.grace_period", self.grace_period, "must be >= 1")
        require(self.reduction_factor >= 2, "scheduler.reduction_factor", self.reduction_factor, "must be >= 2")


@dataclass(frozen=True)
class ResourcesConfig:
    """What one trial holds (tune.with_resources); Tune runs as many at once as the cluster fits."""

    cpus_per_trial: float = 1.0   # tune.with_resources; a trial loads its own target copy
    gpus_per_trial: float = 0.0   # > 0: the trial runs on CUDA (0.5: two trials share a GPU)
    max_concurrent_trials: int | None = None  # a cap below what the cluster fits (null: no cap)
    # memory one trial reserves in Ray's accounting (its "memory" resource), so Tune starts no more trials than a
    # node's memory holds (null: none reserved; a smollm2 EAGLE-3 training trial peaked at 12.6 GB)
    memory_gb_per_trial: float | None = None
    torch_threads: int | None = None          # per trial; default: its whole CPUs (at least 1)
    # a trial whose process dies (killed, out of memory, its node lost); past the retries it is reported failed
    max_failures: int = 1                     # retries of a dead trial from its last checkpoint (-1: forever)

    def __post_init__(self) -> None:
        require(self.cpus_per_trial >= 0, "resources.cpus_per_trial", self.cpus_per_trial, "must be >= 0")
        require(self.gpus_per_trial >= 0, "resources.gpus_per_trial", self.gpus_per_trial, "must be >= 0")
        require(self.cpus_per_trial > 0 or self.gpus_per_trial > 0, "resources.cpus_per_trial",
                self.cpus_per_trial, "a trial needs some CPU or GPU")
        require(self.max_concurrent_trials is None or self.max_concurrent_trials >= 1,
                "resources.max_concurrent_trials", self.max_concurrent_trials, "must be >= 1 or null")
        require(self.torch_threads is None or self.torch_threads >= 1, "resources.torch_threads",
                self.torch_threads, "must be >= 1 or null")
        require(self.max_failures >= -1, "resources.max_failures", self.max_failures, "must be >= -1 (-1 = forever)")
        require(self.memory_gb_per_trial is None or self.memory_gb_per_trial > 0, "resources.memory_gb_per_trial",
                self.memory_gb_per_trial, "must be > 0 or null")

    @property
    def memory_bytes(self) -> float:
        return (self.memory_gb_per_trial or 0.0) * 1e9

    def tune_resources(self) -> dict[str, float]:
        return {"cpu": self.cpus_per_trial, **({"gpu": self.gpus_per_trial} if self.gpus_per_trial else {}),
                **({"memory": self.memory_bytes} if self.memory_bytes else {})}


@dataclass(frozen=True)
class TrackingConfig:
    enabled: bool = True             # a parent MLflow run per sweep, a child per trial
    experiment: str = "eyas-sweeps"  # MLflow experiment


@dataclass(frozen=True)
class OutputConfig:
    dir: str | None = None  # best.yaml (schedule.yaml), results.json, curve.png; default $EYAS_HOME/sweeps/<name>
    storage_path: str = "$EYAS_HOME/ray_results"  # Tune's trial dirs and checkpoints (shared storage on a cluster)


# ---------------------------------------------------------------- the sweep


@dataclass(frozen=True)
class SweepConfig:
    name: str                             # names the output dir and the MLflow parent run
    search: SearchConfig                  # what to search and the objective
    target: str | None = None             # inference, schedule: target checkpoint (training: training.target)
    dtype: str = "float32"                # inference, schedule: the target's weights, as serving's dtype
    spec: SpecConfig | None = None        # inference, schedule sweep: the base speculative settings
    training: TrainConfig | None = None   # training sweep: the base drafter training config
    runner: Literal["trial", "ray-train"] = "trial"  # training: a loop inside the trial, or a TorchTrainer per trial
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def __post_init__(self) -> None:
        require(bool(self.name) and "/" not in self.name and not self.name.startswith("."), "name", self.name,
                "must be a plain name (it names the output directory and the MLflow run)")
        require((self.spec is None) != (self.training is None), "spec", self.spec,
                "give exactly one of `spec:` (an inference sweep) or `training:` (a training sweep)")
        if self.kind == "training":
            self._check_training()
        else:
            self._check_inference()
        for param in self.search.params:
            check_key(self, param.key)
        points, invalid = self.points()
        if invalid and not self.search.skip_invalid:
            shown = "; ".join(f"{point}: {why}" for point, why in invalid[:5])
            more = f" (and {len(invalid) - 5} more)" if len(invalid) > 5 else ""
            hint = ("narrow the ranges" if self.search.algorithm == "optuna" else
                    "drop those values, or set search.skip_invalid=true to skip impossible grid points")
            raise ConfigError(f"search.space: {len(invalid)} impossible combination(s): {shown}{more}; {hint}")
        require(bool(points), "search.space", self.search.space, "every combination is impossible")

    def _check_inference(self) -> None:
        require(self.target is not None, "target", self.target,
                "an inference sweep needs the target checkpoint (a name under $EYAS_HOME/targets/ or a path)")
        require(self.search.objective != "sim_tau", "search.objective", self.search.objective,
                "sim_tau is a training metric; an inference sweep measures speedup or tau")
        require(METHODS[self.spec.method].speculates, "spec.method", self.spec.method,
                "vanilla does not speculate: pick a speculative method")
        require(self.measure.num_prompts >= 1, "measure.num_prompts", self.measure.num_prompts,
                "an inference sweep measures on at least one prompt")
        require(self.runner == "trial", "runner", self.runner, "ray-train runs training sweeps only")
        require(self.dtype in DTYPES, "dtype", self.dtype, f"must be one of {list(DTYPES)}")
        if self.kind == "schedule":
            self._check_schedule()

    def _check_schedule(self) -> None:
        """A grid of whole numbers over both keys: every (batch size, budget) cell of the table gets measured."""
        space, search = self.search.space, self.search
        require(set(space) == set(SCHEDULE_KEYS), "search.space", space, f"a schedule sweep searches exactly "
                f"{list(SCHEDULE_KEYS)} (lists); the method and its tree stay fixed in spec:")
        require(search.algorithm == "grid", "search.algorithm", search.algorithm,
                "a schedule sweep measures every (batch_size, max_draft_nodes) cell: use grid")
        require(search.objective == "speedup", "search.objective", search.objective, "a schedule sweep picks per "
                "batch size the budget with the best throughput against vanilla at that size: use speedup")
        for key, low, high in (("batch_size", 1, None), ("max_draft_nodes", 0, MAX_TREE_NODES - 1)):
            values = space[key]
            whole = isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= low
                                                     and (high is None or v <= high) for v in values)
            require(whole, f"search.space.{key}", values, f"expected a list of whole numbers >= {low}"
                    + (f" and <= {high}" if high else ""))
        require(1 in space["batch_size"], "search.space.batch_size", space["batch_size"],
                "needs 1: speculation_by_batch starts at batch size 1")

    def _check_training(self) -> None:
        objective = self.search.objective
        drafter_config_class(self.training.drafter.type)  # an unknown family fails here, not per point
        require(self.target is None, "target", self.target,
                "a training sweep reads its target from training.target; drop the top-level target")
        require(self.dtype == "float32", "dtype", self.dtype,
                "a training sweep trains in float32 (its drafter's weights); drop the top-level dtype")
        if self.runner == "ray-train":  # jobs.train_drafter's workers report sim_tau and (measured) tau
            require(objective != "speedup", "search.objective", objective,
                    "runner ray-train reports sim_tau and tau (training.measure), not speedup")
            require(objective != "tau" or self.training.measure.num_prompts >= 1, "search.objective", objective,
                    "tau under runner ray-train needs training.measure.num_prompts >= 1")
        else:
            require(objective == "sim_tau" or self.measure.num_prompts >= 1, "search.objective", objective,
                    "measuring speedup or tau needs measure.num_prompts >= 1 (or use objective sim_tau)")

    @property
    def kind(self) -> Literal["inference", "schedule", "training"]:
        """training: a ``training:`` section; schedule: ``spec:`` and a search over SCHEDULE_KEYS; else inference."""
        if self.spec is None:
            return "training"
        return "schedule" if set(self.search.space) & set(SCHEDULE_KEYS) else "inference"

    @property
    def metric(self) -> str:
        """The reported metric Tune optimises (mode max)."""
        return self.search.objective

    @property
    def output_dir(self) -> Path:
        return resolve_path(self.output.dir) if self.output.dir else eyas_home() / "sweeps" / self.name

    @property
    def target_dir(self) -> Path:
        return target_path(self.training.target if self.kind == "training" else self.target)

    @property
    def max_epochs(self) -> int:
        return self.training.train.num_epochs if self.training is not None else 1

    def points(self) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], str]]]:
        """(valid points, [(impossible point, why)]): every grid point, or for optuna the checked corners."""
        params = self.search.params
        grid = self.search.algorithm == "grid"
        choices = [p.grid_values() if grid else p.check_values() for p in params]
        total = math.prod(len(c) for c in choices)
        if total > MAX_CHECKED_COMBINATIONS:
            if grid:
                raise ConfigError(f"search.space: the grid has {total} points (more than "
                                  f"{MAX_CHECKED_COMBINATIONS}); use fewer values or search.algorithm=optuna")
            choices = [[c[0], c[-1]] for c in choices]
        valid, invalid = [], []
        for values in itertools.product(*choices):
            point = dict(zip((p.key for p in params), values))
            try:
                self.trial_section(point)
            except ConfigError as err:
                invalid.append((point, str(err)))
            else:
                valid.append(point)
        return valid, invalid

    def trial_section(self, point: dict[str, Any]) -> SpecConfig | TrainConfig:
        """The SpecConfig (inference) or TrainConfig (training) a trial runs at ``point``; ConfigError if impossible."""
        if self.kind != "training":
            # SpecConfig refuses trees over the one size cap (MAX_TREE_NODES) and settings the method does not read;
            # a schedule sweep's keys are the engine's, not the spec's
            spec_point = {k: v for k, v in point.items() if k not in SCHEDULE_KEYS}
            return from_dict(SpecConfig, {**to_dict(self.spec), **spec_point}, prefix="spec.")
        data = to_dict(self.training)
        for key, value in point.items():
            set_dotted(data, key, value)
        train_config = from_dict(TrainConfig, data, prefix="training.")
        from_dict(drafter_config_class(train_config.drafter.type), dict(train_config.drafter.config),
                  prefix="training.drafter.config.")
        return train_config


def point_of(config: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """A trial's searched values: a grid passes them as one ``point`` dict, optuna as flat keys."""
    return dict(config["point"]) if "point" in config else {key: config[key] for key in keys}


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """``set_dotted(d, "optim.lr", 1e-3)``: d["optim"]["lr"] = 1e-3 (sections created as needed)."""
    *sections, leaf = key.split(".")
    for section in sections:
        data = data.setdefault(section, {})
    data[leaf] = value


def drafter_config_class(drafter_type: str) -> type:
    try:
        return registry.family(drafter_type).config_cls
    except ValueError as err:
        raise ConfigError(f"training.drafter.type: {err}") from None


def check_key(sweep: SweepConfig, key: str) -> None:
    """A search key must name a field the trial's section has (inference: SPEC_KEYS; training: TRAIN_SECTIONS)."""
    if sweep.kind == "schedule":
        return  # _check_schedule: exactly SCHEDULE_KEYS
    if sweep.kind == "inference":
        require(key in SPEC_KEYS, f"search.space.{key}", sweep.search.space[key],
                f"unknown key for an inference sweep; searchable spec fields: {list(SPEC_KEYS)} "
                f"(a schedule sweep: {list(SCHEDULE_KEYS)})")
        return
    section = next((s for s in sorted(TRAIN_SECTIONS, key=len, reverse=True) if key.startswith(s + ".")), None)
    require(section is not None, f"search.space.{key}", sweep.search.space[key],
            f"unknown key for a training sweep; search fields of {list(TRAIN_SECTIONS)}, "
            "e.g. drafter.config.block_size, drafter.config.loss_decay, optim.lr")
    leaf = key[len(section) + 1:]
    if section == "drafter.config":
        known = [f.name for f in dataclasses.fields(drafter_config_class(sweep.training.drafter.type))]
    else:
        known = [f.name for f in dataclasses.fields(type(getattr(sweep.training, section)))]
    require(leaf in known, f"search.space.{key}", sweep.search.space[key],
            f"unknown key; {section} has {known}")


# ---------------------------------------------------------------- loading and pre-flight checks


def load_sweep(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> SweepConfig:
    """Read the YAML, apply ``section.key=value`` overrides, validate. ``training.name`` defaults to the sweep's.

    ``search.space.KEY=[values]`` sets one search key, dots in KEY included (``search.space.optim.lr=[1e-3]``)."""
    data = read_yaml_mapping(path)
    # a search key may hold dots itself (drafter.config.block_size): everything after `search.space.` is the key
    space_overrides = [o for o in overrides if o.startswith(SPACE_PREFIX) and "=" in o]
    data = apply_overrides(data, [o for o in overrides if o not in space_overrides])
    for item in space_overrides:
        key, raw = item[len(SPACE_PREFIX):].split("=", 1)
        space = data.setdefault("search", {}).setdefault("space", {})
        if not isinstance(space, dict):
            raise ConfigError(f"override {item!r}: search.space is not a mapping")
        space[key.strip()] = yaml.safe_load(raw)
    if isinstance(data.get("training"), dict) and "name" not in data["training"]:
        data["training"]["name"] = str(data.get("name", "sweep"))
    where = f" in {path}" if path else ""
    try:
        return from_dict(SweepConfig, data)
    except ConfigError as err:
        raise ConfigError(f"{err}{where}") from None
