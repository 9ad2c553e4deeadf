"""MLflow helpers: runs, flat params, step series, figures and a model registry for directories. This is the only
eyas module that imports ``mlflow`` (imported lazily, so ``import eyas.track`` is cheap).

Defaults (DESIGN.md): the tracking store is ``sqlite:///<repo root>/mlruns.db`` (MLflow >= 3.13 refuses a plain
file store) and a new experiment keeps its artifacts in ``mlartifacts/<experiment>`` beside the sqlite file;
``MLFLOW_TRACKING_URI`` overrides the store (an ``http://`` server chooses its own artifact store) and
``EYAS_MLFLOW_ARTIFACTS`` the artifact root. The repo root is the nearest directory above the working directory
holding ``pyproject.toml`` and ``jobs/``, else the working directory. Under ``ray job submit`` the driver runs in
an unpacked copy of the working dir, so pass ``MLFLOW_TRACKING_URI`` (an absolute sqlite path or a server) in the
job's ``env_vars`` to keep runs.

A tracking server that goes away mid-run does not stop the work: each logging call (params, metrics, figures,
dicts, artifacts, tags, registration, the run's end) is tried ``LOG_ATTEMPTS`` times, then its values are dropped
with one warning naming what was not logged; later drops are counted, and the run's end warns with the whole gap
(``gap()`` has the counts). MLflow's own HTTP retries default to minutes per call against a dead server (7 retries,
backoff factor 2, 120 s timeout); eyas sets short defaults (``HTTP_RETRY_DEFAULTS``), and the variables, when set,
win. Starting a run still needs the server: a job that cannot track from the start fails at once.

Registry: any directory (a drafter, a target) is logged as run artifacts and registered as a model version whose
source is that artifact location; ``download_model("models:/NAME@ALIAS")`` (or ``models:/NAME/3``) brings it back.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from eyas.config import flatten

MAX_PARAM_CHARS = 6000  # MLflow's param value limit; longer values are truncated
# per HTTP call: 2 retries about 1 s and 2 s apart (the factor is an integer), 10 s to connect and answer: a dead
# server costs seconds per call, not minutes
HTTP_RETRY_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                       "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
LOG_ATTEMPTS = 2  # eyas's tries of one logging call (each with MLflow's HTTP retries) before its values are dropped
RETRY_PAUSE_S = 1.0
# MLflow error codes of a store that is down or overloaded (a refused connection is INTERNAL_ERROR); any other
# MlflowException (a bad value, a missing run) is a bug and raises
TRANSIENT_CODES = ("INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED")
log = logging.getLogger(__name__)


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

    for key, value in HTTP_RETRY_DEFAULTS.items():
        os.environ.setdefault(key, value)
    mlflow.set_tracking_uri(tracking_uri())
    mlflow.set_registry_uri(tracking_uri())
    return mlflow


def client():
    """An ``MlflowClient`` on ``tracking_uri()``."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri(), registry_uri=tracking_uri())


# eyas experiments are model training and say so (mlflow.experimentKind). MLflow 3.17's UI still opens them in its
# GenAI view unless its sidebar switch says "Model training": links carry the switch's fragment.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
MODEL_TRAINING_VIEW = "#/experiments?workflowType=machine_learning"


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
    resume_run_id: str | None = None,
) -> Iterator[Any]:
    """Start (and end) an MLflow run in ``experiment``; yields the ``mlflow.ActiveRun`` (``.info.run_id``).

    ``params`` may be nested (a config dict or dataclass): it is flattened to dotted keys. A child run of
    ``parent_run_id`` is nested under it in the UI. An exception inside the block marks the run FAILED.
    ``resume_run_id`` continues that run (a resubmitted job), or starts a new one, with a warning, when the
    tracking store does not have it.
    """
    mlflow = _mlflow()
    experiment_id = ensure_experiment(experiment)
    all_tags = {**(tags or {}), **({"mlflow.parentRunId": parent_run_id} if parent_run_id is not None else {})}
    run = None
    if resume_run_id is not None:
        try:
            client().get_run(resume_run_id)
            run = mlflow.start_run(run_id=resume_run_id)
        except mlflow.exceptions.MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            log.warning("MLflow run %s (to be continued) is not in %s: starting a new run", resume_run_id,
                        tracking_uri())
    if run is None:
        run = mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=all_tags or None)
    status = "FAILED"
    try:
        if params:
            log_params_flat(params)
        yield run
        status = "FINISHED"
    finally:
        # end_run leaves the run first, then tells the store: a dead store keeps the run RUNNING there, no more
        _tolerant("run status", [f"{run.info.run_id} {status}"], lambda: mlflow.end_run(status))
        _GAP.report_end(run.info.run_id)


class Gap:
    """What this process could not log: per kind (metrics, figure, ...) the dropped calls, the names they carried
    (metric keys, artifact names) and, for step series, the steps."""

    MAX_NAMES = 10

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.names: dict[str, list[str]] = {}
        self.steps: dict[str, list[int]] = {}
        self.down_since: float | None = None  # the store failed and has not answered since
        self.error = ""

    def drop(self, kind: str, names: list[str], step: int | None, err: BaseException) -> None:
        first = not self.calls
        self.calls[kind] = self.calls.get(kind, 0) + 1
        known = self.names.setdefault(kind, [])
        known.extend(n for n in names if n not in known)
        if step is not None:
            self.steps.setdefault(kind, []).append(step)
        self.error = f"{type(err).__name__}: {str(err)[:300]}"
        if self.down_since is None:
            self.down_since = time.monotonic()
            at = "" if step is None else f" at step {step}"
            log.warning("MLflow tracking store %s is unreachable (%s): %s %s%s NOT logged. Work goes on; what cannot "
                        "be logged is dropped and counted, and the run's end lists the gap.%s", tracking_uri(),
                        self.error, kind, _shorten(names), at, "" if first else f" Dropped so far: {self.summary()}")

    def recovered(self) -> None:
        if self.down_since is not None:
            log.warning("MLflow tracking store %s answers again after %.0f s; dropped while it was down: %s",
                        tracking_uri(), time.monotonic() - self.down_since, self.summary())
            self.down_since = None

    def summary(self) -> str:
        parts = []
        for kind, count in self.calls.items():
            steps = self.steps.get(kind)
            at = f", steps {min(steps)}..{max(steps)}" if steps else ""
            parts.append(f"{kind}: {count} call(s){at} ({_shorten(self.names[kind], self.MAX_NAMES)})")
        return "; ".join(parts)

    def report_end(self, run_id: str) -> None:
        if self.calls:
            log.warning("MLflow run %s ended with a gap: this process could NOT log to %s: %s (last error: %s)",
                        run_id, tracking_uri(), self.summary(), self.error)


def _shorten(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


_GAP = Gap()


def gap() -> dict[str, int]:
    """Dropped logging calls in this process, per kind (``metrics``, ``figure``, ...); empty when none."""
    return dict(_GAP.calls)


def _is_transient(err: BaseException) -> bool:
    from mlflow.exceptions import MlflowException

    return not isinstance(err, MlflowException) or err.error_code in TRANSIENT_CODES


def _tolerant(kind: str, names: list[str], call: Callable[[], Any], step: int | None = None) -> Any:
    """``call()``, tried LOG_ATTEMPTS times (once while the store is known down); on a store failure the call's
    values are dropped into the gap and None returned. Errors of the caller's own making raise."""
    import requests
    from mlflow.exceptions import MlflowException

    down = _GAP.down_since is not None
    attempts = 1 if down else LOG_ATTEMPTS
    # while the store is known down, urllib3's "Retrying ..." line per HTTP retry would bury the one warning
    quiet = logging.getLogger("urllib3.connectionpool")
    level = quiet.level
    if down:
        quiet.setLevel(logging.ERROR)
    try:
        for attempt in range(attempts):
            try:
                result = call()
            except (MlflowException, requests.exceptions.RequestException, ConnectionError, TimeoutError) as err:
                if not _is_transient(err):
                    raise
                if attempt + 1 == attempts:
                    _GAP.drop(kind, names, step, err)
                    return None
                time.sleep(RETRY_PAUSE_S)
            else:
                _GAP.recovered()
                return result
    finally:
        quiet.setLevel(level)
    return None


def log_params_flat(params: Mapping[str, Any] | Any, prefix: str = "") -> None:
    """Log a nested mapping / dataclass as dotted params (``train.lr``); values become strings."""
    flat = flatten(params, prefix) if not isinstance(params, Mapping) else flatten(dict(params), prefix)
    texts = {key: _param_text(value) for key, value in flat.items()}
    _tolerant("params", list(texts), lambda: _mlflow().log_params(texts))


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
        _tolerant("metrics", list(numeric), lambda: _mlflow().log_metrics(numeric, step=step), step)


def log_figure(figure: Any, name: str) -> None:
    """Log a matplotlib figure as an artifact file ``name`` (e.g. ``acceptance/epoch_3.png``)."""
    _tolerant("figure", [name], lambda: _mlflow().log_figure(figure, name))


def log_dict(data: Mapping[str, Any], name: str) -> None:
    """Log a JSON/YAML-able mapping as an artifact file ``name`` (``.json`` or ``.yaml``)."""
    _tolerant("dict", [name], lambda: _mlflow().log_dict(dict(data), name))


def log_artifacts(directory: str | Path, artifact_path: str | None = None) -> None:
    _tolerant("artifacts", [f"{directory} -> {artifact_path or '/'}"],
              lambda: _mlflow().log_artifacts(str(directory), artifact_path))


def set_tags(tags: Mapping[str, Any]) -> None:
    texts = {key: str(value) for key, value in tags.items()}
    _tolerant("tags", list(texts), lambda: _mlflow().set_tags(texts))


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
) -> str | None:
    """Log ``directory`` as artifacts of a run and register it as a new version of model ``name``.

    Uses the active run, else ``run_id``, else a fresh run in experiment ``eyas-registry``. ``alias`` (e.g.
    ``latest`` or ``champion``) is moved to the new version. Returns the version number as a string, or None when
    the tracking store could not be reached (warned, and in the gap: the directory itself is untouched).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"cannot register {directory}: not a directory")
    return _tolerant("registration", [f"model {name} from {directory}"],
                     lambda: _register(directory, name, alias, artifact_path, run_id, description))


def _register(directory: Path, name: str, alias: str | None, artifact_path: str, run_id: str | None,
              description: str | None) -> str:
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


class Tracker:
    """Rank 0's logging into the driver's run (a distributed trainer's worker re-attaches to it by id, also after a
    restart); a no-op on other ranks or with tracking disabled. ``loop`` carries the driver's ``tracking_uri``,
    ``artifact_root`` and ``run_id``."""

    def __init__(self, enabled: bool, loop: Mapping[str, Any], experiment: str) -> None:
        self.enabled, self.loop, self.experiment, self.context = enabled, loop, experiment, None

    def __enter__(self) -> "Tracker":
        if self.enabled:
            os.environ["MLFLOW_TRACKING_URI"] = self.loop["tracking_uri"]
            os.environ["EYAS_MLFLOW_ARTIFACTS"] = self.loop["artifact_root"]
            os.environ["MLFLOW_RUN_ID"] = self.loop["run_id"]  # start_run resumes it (and consumes the variable)
            self.context = start_run(self.experiment)
            self.context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.context is not None:
            self.context.__exit__(*exc)

    def metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self.enabled:
            log_metrics(metrics, step=step)

    def figure(self, figure: Any, name: str) -> None:
        if self.enabled:
            log_figure(figure, name)

    def log_dict(self, data: Mapping[str, Any], name: str) -> None:
        if self.enabled:
            log_dict(data, name)
