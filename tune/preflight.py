"""Before a sweep starts: the files it needs exist, and the spec's paths are absolute (trials run elsewhere)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from eyas.config import ConfigError, resolve_path, to_dict
from eyas.methods import METHODS, SpecConfig, resolve_checkpoint
from eyas.train.config import data_path, drafter_path
from tune.config import SweepConfig


def preflight(sweep: SweepConfig) -> None:
    """The files a sweep needs exist: target, drafter checkpoint (inference, schedule), data set (training)."""
    target_dir = sweep.target_dir
    where = "training.target" if sweep.kind == "training" else "target"
    if not (target_dir / "config.json").is_file():
        raise ConfigError(f"{where}={target_dir}: no checkpoint there (config.json missing); build it with "
                          "`python -m jobs.train_target --config jobs/configs/target-tiny.yaml`")
    if sweep.kind != "training":
        check_spec_files(sweep.spec)
        return
    data_dir = data_path(sweep.training.data)
    if not any((data_dir / "train").glob("shard-*.parquet")):
        raise ConfigError(f"training.data={sweep.training.data!r}: {data_dir}/train holds no shards; build them with "
                          "`python -m jobs.generate_data --config jobs/configs/data-tiny.yaml`")
    if sweep.search.objective == "sim_tau" and not any((data_dir / "heldout").glob("shard-*.parquet")):
        raise ConfigError(f"search.objective=sim_tau needs held-out data: {data_dir}/heldout holds no shards "
                          "(set num_heldout_prompts > 0 in the data config)")


def absolute_spec(spec: SpecConfig) -> dict[str, Any]:
    """``to_dict(spec)`` with drafter / draft_model paths made absolute (trials run in their own directories;
    a best-config YAML must not depend on the directory it is read from); a bare drafter name becomes the
    directory it names ($EYAS_HOME/drafters, else the shipped one)."""
    data = to_dict(spec)
    for key in ("drafter", "draft_model"):
        text = str(data.get(key) or "")
        if text and not text.startswith(("models:/", "runs:/")):
            bare = key == "drafter" and "/" not in text and not Path(text).is_dir()
            data[key] = str((drafter_path(text) if bare else resolve_path(text)).resolve())
    return data


def check_spec_files(spec: SpecConfig) -> None:
    """The checkpoints the spec names exist (registry URIs are fetched by the trials, not here)."""
    if METHODS[spec.method].trained and not spec.drafter:
        raise ConfigError(f"spec.method={spec.method} needs a trained drafter: set spec.drafter to a checkpoint "
                          "directory or models:/NAME@ALIAS")
    for field in ("drafter", "draft_model"):
        location = getattr(spec, field)
        if location and not str(location).startswith(("models:/", "runs:/")):
            directory = resolve_checkpoint(location, f"spec.{field}", drafter=field == "drafter")
            if not (directory / "config.json").is_file():
                raise ConfigError(f"spec.{field}={location}: no checkpoint at {directory} (config.json missing); "
                                  "train one with `python -m jobs.train_drafter --config ...`")
