"""A finding as a Ray job: ``ray job submit -- python -m jobs.findings --finding dflash-vs-eagle3`` on a throwaway
token-auth head, its four drafters trained by jobs.train_drafter on Ray Train (runner ray-train, launched as Ray
tasks), the verdict run and the drafters' own runs in MLflow, and the training curves read back from those runs.

The workspace (micro target, data, hand-built drafters) is the findings tests' (tests/findings_workspace.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from findings_workspace import findings_workspace
from mlflow import MlflowClient

from eyas_ray.local_head import LocalRayHead

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_ray_job_submit_trains_on_ray_train(tmp_path, random_checkpoint):
    with findings_workspace(tmp_path / "ws", random_checkpoint) as workspace:
        run_on_a_head(workspace, tmp_path / "out")


def run_on_a_head(workspace: dict, out: Path) -> None:
    env = workspace["env"]
    args = ["--finding", "dflash-vs-eagle3", "--scale", "micro", "--out", str(out), "runner=ray-train", "num_steps=2",
            "train_overrides=[train.max_len=48, train.eval_sequences=4, scaling.num_workers=1]"]
    with LocalRayHead(num_cpus=2) as head:
        head.submit("jobs.findings", args, env_vars=env, working_dir=str(REPO), timeout_s=600)
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"]["outcome"] in ("reproduced", "partly", "refuted")
    rows = {r["variant"]: r for r in json.loads((out / "table.json").read_text())}
    assert set(rows) == {"eagle3", "dflash", "dflash-gamma-off", "dflash-3taps"}
    assert all(r["steps"] == 2 and not r["reused"] for r in rows.values())
    curves = json.loads((out / "curves.json").read_text())
    assert all(any("heldout_sim_tau" in p for p in curve) for curve in curves.values())  # read back from MLflow
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    drafters = client.get_experiment_by_name("eyas-findings-drafters")
    names = {r.info.run_name for r in client.search_runs([drafters.experiment_id])}
    assert {f"findings-dflash-vs-eagle3-{v}-micro" for v in rows} <= names
