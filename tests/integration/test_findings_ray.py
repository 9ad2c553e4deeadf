"""A training finding as a Ray job: ``ray job submit -- python -m jobs.findings --finding dflash-vs-eagle3
--train-only eagle3 runner=ray-train`` on a throwaway token-auth head. The variant is trained by jobs.train_drafter
on Ray Train (launched as a Ray task from the job's driver), has its own MLflow run, and its training curve is read
back from that run. (The full finding, measurement and verdict included, is tests/unit/jobs/findings, runner local:
one Ray Train run here keeps this test near a minute.)

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
        env = workspace["env"]
        args = ["--finding", "dflash-vs-eagle3", "--scale", "micro", "--train-only", "eagle3", "runner=ray-train",
                "num_steps=2", "train_overrides=[train.max_len=48, train.eval_sequences=4, scaling.num_workers=1]"]
        with LocalRayHead(num_cpus=2) as head:
            done = head.submit("jobs.findings", args, env_vars=env, working_dir=str(REPO), timeout_s=600,
                               capture=True)
        drafter = workspace["home"] / "drafters" / "findings-dflash-vs-eagle3-eagle3-micro"
        assert f"eagle3: {drafter} (2 steps, trained)" in done.stdout
        assert json.loads((drafter / "training.json").read_text())["step"] == 2
        curve = json.loads((drafter / "curve.json").read_text())  # read back from the variant's MLflow run
        assert curve[-1]["step"] == 2 and "heldout_sim_tau" in curve[-1] and "loss" in curve[-1]
        client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
        experiment = client.get_experiment_by_name("eyas-findings-drafters")
        runs = client.search_runs([experiment.experiment_id], "attributes.run_name = "
                                  "'findings-dflash-vs-eagle3-eagle3-micro'")
        assert [r.info.status for r in runs] == ["FINISHED"]
