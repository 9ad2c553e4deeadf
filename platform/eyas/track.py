"""MLflow helpers: runs, flat params, step series, figures and a model registry for directories.

This is the only eyas module that imports ``mlflow`` (imported lazily, so ``import eyas.track`` is cheap).

Defaults (DESIGN.md): the tracking store is ``sqlite:///<repo root>/mlruns.db`` (MLflow >= 3.13 refuses a plain
file store) and a new experiment keeps its artifacts in ``mlartifacts/<experiment>`` beside the sqlite file;
``MLFLOW_TRACKING_URI`` overrides the store (an ``http://`` server chooses its own artifact store) and
``EYAS_MLFLOW_ARTIFACTS`` the artifact root. The repo root is the nearest directory above the working directory
holding ``pyproject.toml`` and ``jobs/``, else the working directory. Under ``ray job submit`` the driver runs in
an unpacked copy of the working dir, so pass ``MLFLOW_TRACKING_URI`` (an absolute sqlite path or a server) in the
job's ``env_vars`` to keep runs.

Registry: any directory (a drafter, a target) is logged as run artifacts and registered as a model version whose
source is that artifact location; ``download_model("models:/NAME@ALIAS")`` (or ``models:/NAME/3``) brings it back.
"""
from __future__ import annotations

import contextlib
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

MAX_PARAM_CHARS = 6000  # MLflow's param value limit; longer values are truncated


def repo_root() -> Path:
    """The eyas checkout the process runs in (``pyproject.toml`` + ``jobs/``), else the working directory."""
    cwd = Path.cwd().resolve()
    for folder in (cwd, *cwd.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "jobs").is_dir():
            return folder
    return cwd


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / 'mlruns.db'}"


def artifact_root() -> Path | None:
    """Where new experiments keep artifacts: ``EYAS_MLFLOW_ARTIFACTS``, else ``mlartifacts/`` beside a sqlite
    store (the repo root by default, a test's tmp dir in tests); None for a tracking server (it decides)."""
    if os.environ.get("EYAS_MLFLOW_ARTIFACTS"):
        return Path(os.environ["EYAS_MLFLOW_ARTIFACTS"])
    uri = tracking_uri()
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):]).parent / "mlartifacts"
    return None


def _mlflow():
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    mlflow.set_registry_uri(tracking_uri())
    return mlflow


def client():
    """An ``MlflowClient`` on ``tracking_uri()``."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri(), registry_uri=tracking_uri())


# MLflow 3's UI files an experiment with no kind under its GenAI views ("Evaluation runs"), where the run comparison
# charts are not offered; eyas experiments are model training, so they say so (the tag the UI reads).
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def ensure_experiment(name: str) -> str:
    """The experiment id of ``name`` (a model-training experiment), created with its artifacts under
    ``artifact_root()/<name>`` if new."""
    mlflow = _mlflow()
    experiment = mlflow.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.tags.get("mlflow.experimentKind") is None:  # made by an older eyas, or by hand
            for key, value in EXPERIMENT_KIND.items():
                client().set_experiment_tag(experiment.experiment_id, key, value)
        return experiment.experiment_id
    root = artifact_root()
    if root is None:
        return mlflow.create_experiment(name, tags=EXPERIMENT_KIND)
    location = (root / name).resolve()
    location.mkdir(parents=True, exist_ok=True)
    return mlflow.create_experiment(name, artifact_location=location.as_uri(), tags=EXPERIMENT_KIND)


@contextlib.contextmanager
def start_run(
    experiment: str,
    run_name: str | None = None,
    params: Mapping[str, Any] | None = None,
    parent_run_id: str | None = None,
    tags: Mapping[str, str] | None = None,
) -> Iterator[Any]:
    """Start (and end) an MLflow run in ``experiment``; yields the ``mlflow.ActiveRun`` (``.info.run_id``).

    ``params`` may be nested (a config dict or dataclass): it is flattened to dotted keys. A child run of
    ``parent_run_id`` is nested under it in the UI. An exception inside the block marks the run FAILED.
    """
    mlflow = _mlflow()
    experiment_id = ensure_experiment(experiment)
    all_tags = dict(tags or {})
    if parent_run_id is not None:
        all_tags["mlflow.parentRunId"] = parent_run_id
    with mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=all_tags or None) as run:
        if params:
            log_params_flat(params)
        yield run


def log_params_flat(params: Mapping[str, Any] | Any, prefix: str = "") -> None:
    """Log a nested mapping / dataclass as dotted params (``train.lr``); values become strings."""
    from eyas.config import flatten

    flat = flatten(params, prefix) if not isinstance(params, Mapping) else flatten(dict(params), prefix)
    _mlflow().log_params({key: _param_text(value) for key, value in flat.items()})


def _param_text(value: Any) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= MAX_PARAM_CHARS else text[: MAX_PARAM_CHARS - 3] + "..."


def log_metrics(metrics: Mapping[str, Any], step: int | None = None) -> None:
    """Log the finite numeric entries of ``metrics`` (others, e.g. strings or NaN, are skipped) at ``step``."""
    numeric = {
        key: float(value)
        for key, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))
    }
    if numeric:
        _mlflow().log_metrics(numeric, step=step)


def log_figure(figure: Any, name: str) -> None:
    """Log a matplotlib figure as an artifact file ``name`` (e.g. ``acceptance/epoch_3.png``)."""
    _mlflow().log_figure(figure, name)


def log_dict(data: Mapping[str, Any], name: str) -> None:
    """Log a JSON/YAML-able mapping as an artifact file ``name`` (``.json`` or ``.yaml``)."""
    _mlflow().log_dict(dict(data), name)


def log_artifacts(directory: str | Path, artifact_path: str | None = None) -> None:
    _mlflow().log_artifacts(str(directory), artifact_path)


def set_tags(tags: Mapping[str, Any]) -> None:
    _mlflow().set_tags({key: str(value) for key, value in tags.items()})


def active_run_id() -> str | None:
    run = _mlflow().active_run()
    return None if run is None else run.info.run_id


def register_directory(
    directory: str | Path,
    name: str,
    alias: str | None = "champion",  # MLflow reserves "latest"
    artifact_path: str = "model",
    run_id: str | None = None,
    description: str | None = None,
) -> str:
    """Log ``directory`` as artifacts of a run and register it as a new version of model ``name``.

    Uses the active run, else ``run_id``, else a fresh run in experiment ``eyas-registry``. ``alias`` (e.g.
    ``latest`` or ``champion``) is moved to the new version. Returns the version number as a string.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"cannot register {directory}: not a directory")
    mlflow = _mlflow()
    mlflow_client = client()
    active = mlflow.active_run()
    if active is not None and run_id in (None, active.info.run_id):
        mlflow.log_artifacts(str(directory), artifact_path)
        run_id = active.info.run_id
    elif run_id is not None:
        mlflow_client.log_artifacts(run_id, str(directory), artifact_path)
    else:
        with start_run("eyas-registry", run_name=f"register-{name}") as run:
            mlflow.log_artifacts(str(directory), artifact_path)
            run_id = run.info.run_id
    source = f"{mlflow_client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"
    from mlflow.exceptions import MlflowException

    try:
        mlflow_client.create_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = mlflow_client.create_model_version(name, source, run_id=run_id, description=description)
    if alias:
        mlflow_client.set_registered_model_alias(name, alias, version.version)
    return str(version.version)


def model_uri(name: str, alias: str = "champion") -> str:
    return f"models:/{name}@{alias}"


def download_model(uri: str, dst_dir: str | Path | None = None) -> Path:
    """Download ``models:/NAME@ALIAS`` / ``models:/NAME/VERSION`` / ``runs:/...`` to a local directory.

    ``dst_dir`` defaults to a fresh temporary directory. Returns the directory holding the registered files.
    """
    if not uri.startswith(("models:/", "runs:/")):
        raise ValueError(f"{uri!r} is not an MLflow model URI (models:/NAME@ALIAS, models:/NAME/VERSION, runs:/...)")
    mlflow = _mlflow()
    dst = Path(dst_dir) if dst_dir is not None else Path(tempfile.mkdtemp(prefix="eyas-model-"))
    dst.mkdir(parents=True, exist_ok=True)
    local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst))
    return Path(local)


def resolve_model(path_or_uri: str | Path, dst_dir: str | Path | None = None) -> Path:
    """A local path as is; an MLflow URI (``models:/...``, ``runs:/...``) downloaded first."""
    text = str(path_or_uri)
    if text.startswith(("models:/", "runs:/")):
        return download_model(text, dst_dir)
    path = Path(text).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (expected a directory or a models:/NAME@ALIAS URI)")
    return path
