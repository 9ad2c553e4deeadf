"""jobs.train_target: a draft LM without its built target says what to do. The micro target built through Ray Train
(2 workers) and its checks (transformers loads it, meta.json, MLflow, reuse, greedy identity on the trained target)
are tests/integration/test_demo.py's: the demo builds it with this job through `ray job submit`.

Everything lands in tmp dirs (EYAS_HOME, the MLflow sqlite store).
"""
from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DRAFT_MICRO = REPO_ROOT / "jobs" / "configs" / "draft-micro.yaml"

pytestmark = pytest.mark.slow


@pytest.fixture()
def job_env(tmp_path, monkeypatch):
    """Tmp EYAS_HOME and MLflow store for this test; no inherited RAY_ADDRESS (a fresh local Ray)."""
    home, uri = tmp_path / "eyas-home", f"sqlite:///{tmp_path / 'mlruns.db'}"
    monkeypatch.setenv("EYAS_HOME", str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("EYAS_MLFLOW_ARTIFACTS", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return home, uri


def test_draft_without_built_target_says_what_to_do(job_env):
    from eyas.config import load_config
    from jobs.train_target import TargetJobConfig, build

    with pytest.raises(FileNotFoundError, match="jobs/configs/target-micro.yaml"):
        build(load_config(TargetJobConfig, DRAFT_MICRO))
