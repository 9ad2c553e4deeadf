"""`make demo`'s pipeline end to end on the micro configs: a real local Ray (token auth), `ray job submit` for every
build and training step, a Tune sweep, a Serve deployment answering over HTTP, the bench table, MLflow on sqlite."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eyas_ray.local_head import free_ports
from integration_testing import assert_loadable_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_demo_micro_profile_end_to_end(tmp_path):
    home, out = tmp_path / "eyas-home", tmp_path / "out"
    serve_config = yaml.safe_load((REPO_ROOT / "serving" / "configs" / "micro.yaml").read_text())
    serve_config["http_options"]["port"] = free_ports(1)[0]  # never collide with a Serve on 8000
    serve_path = tmp_path / "serve-micro.yaml"
    serve_path.write_text(yaml.safe_dump(serve_config))
    env = {**os.environ, "EYAS_HOME": str(home), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "jobs.demo", "--profile", "micro", "--num-cpus", "2",
                           "--out", str(out), "--serve-config", str(serve_path)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1500)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    for step in ("build or reuse the target", "train drafter eagle3-micro", "Tune sweep", "answer one request",
                 "bench every method"):
        assert step in log, f"step {step!r} missing from the demo output"
    assert "POST http://127.0.0.1" in log and "make mlflow-ui" in log
    report = json.loads((out / "bench.json").read_text())
    rows = {r["method"]: r for r in report["results"]}
    assert {"vanilla", "hf", "ngram", "draft-lm", "eagle3", "dflash", "dflash-ddtree"} <= set(rows)
    # trained drafters speculate (a tau), vanilla does not (null); their tau values are measured, not asserted
    assert rows["eagle3"]["tau"] is not None and rows["dflash"]["tau"] is not None and rows["vanilla"]["tau"] is None
    assert (out / "sweep" / "best.yaml").is_file()
    assert (home / "drafters" / "eagle3-micro" / "config.json").is_file()
    # the target built through `ray job submit` loads in transformers, and its MLflow run finished
    from mlflow import MlflowClient

    meta = assert_loadable_checkpoint(home / "targets" / "micro", vocab_size=512)
    assert MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(meta["mlflow_run_id"]).info.status == "FINISHED"
    # the printed table names every method the bench ran
    assert all(method in proc.stdout for method in rows)
