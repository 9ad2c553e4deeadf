"""Faults in jobs, injected for real on one local Ray of the module's own (``ray.init(address="local")``):

- the MLflow tracking server (a real ``mlflow server`` on 127.0.0.1, sqlite backend) killed in the middle of
  ``jobs.train_drafter``: training goes on and publishes its drafter; the gap is warned, naming what was not logged;
  the end of the run does not crash, and a dead server costs seconds per call, not MLflow's default minutes;
- a ``jobs.generate_data`` Regenerator actor's process killed while it works: the job finishes, and every shard is
  there once, holding exactly its planned prompts, with every one of its kept features (``keep_taps``) whole and
  no temp file left; a rerun finds everything built and writes nothing.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from integration_testing import wait_until, write_regenerated_data

REPO = Path(__file__).resolve().parents[2]
NUM_TRAIN, NUM_HELDOUT = 48, 8
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=True)
    yield
    ray.shutdown()


@pytest.fixture()
def home(tmp_path, random_checkpoint, monkeypatch) -> Path:
    home = tmp_path / "eyas-home"
    shutil.copytree(random_checkpoint, home / "targets" / "target-rand")
    monkeypatch.setenv("EYAS_HOME", str(home))
    return home


# ---------------------------------------------------------------- MLflow server down mid-training


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` (module scope, asked for before local_ray: it boots, migrating its sqlite store,
    while Ray starts)."""
    from eyas.decoding.tp import free_port

    tmp_path = tmp_path_factory.mktemp("mlflow-server")
    port, db = free_port(), tmp_path / "server.db"
    log = open(tmp_path / "mlflow-server.log", "w")
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
               "--backend-store-uri", f"sqlite:///{db}", "--artifacts-destination", str(tmp_path / "served"),
               "--workers", "1"]
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert server.poll() is None, (tmp_path / "mlflow-server.log").read_text()[-3000:]
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    # the test waits for it (wait()) once its own setup is done: the server starts meanwhile
    yield {"url": url, "db": db, "process": server,
           "wait": lambda: wait_until(healthy, 120, every_s=0.25, what=f"mlflow server on {url}")}
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
    log.close()


def regenerated_data(home: Path, num_train: int) -> Path:
    data_dir = home / "data" / "data-rand"
    write_regenerated_data(home / "targets" / "target-rand", data_dir, num_train, NUM_HELDOUT)
    return data_dir


def logged_losses(db: Path) -> list[int]:
    with sqlite3.connect(db) as connection:
        try:
            return [step for (step,) in connection.execute("SELECT step FROM metrics WHERE key = 'loss'")]
        except sqlite3.OperationalError:  # the server is still creating its tables
            return []


def test_mlflow_server_killed_mid_training_training_finishes_and_reports_the_gap(
        mlflow_server, home, local_ray, monkeypatch, caplog):
    from mlflow import MlflowClient

    from eyas import track
    from eyas.config import load_config
    from eyas.train.config import TrainConfig
    from jobs.train_drafter import train

    # one worker, batches of 2: 12 steps, a loss logged every 2. With batches of 4, the 6 steps could all end before
    # the kill landed (CI at 01bdf54 logged all of [2, 4, 6] within a second). Each call while the store is down
    # costs MLflow's HTTP retries (~2 s), so more steps cost CI time
    data_dir = regenerated_data(home, 24)
    mlflow_server["wait"]()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server["url"])
    monkeypatch.delenv("EYAS_MLFLOW_ARTIFACTS", raising=False)
    for key in track.HTTP_RETRY_DEFAULTS:  # eyas's short defaults, not whatever the machine has
        monkeypatch.delenv(key, raising=False)
    cfg = load_config(TrainConfig, REPO / "jobs" / "configs" / "eagle3-micro.yaml", [
        "name=e3-mlflow-down", f"target={home / 'targets' / 'target-rand'}", f"data={data_dir}",
        "scaling.num_workers=1", "scaling.num_to_keep=1", "train.num_epochs=1", "train.batch_size=2",
        "measure.num_prompts=1"])
    num_steps = 12
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["out"] = train(cfg)
        except BaseException as err:  # handed to the test thread below
            outcome["error"] = err
        outcome["end"] = time.monotonic()

    caplog.set_level(logging.WARNING, logger="eyas.track")
    thread = threading.Thread(target=run)
    thread.start()
    # kill the server (SIGKILL, no goodbye) once rank 0 logged its first loss: training is under way
    wait_until(lambda: logged_losses(mlflow_server["db"]) or "end" in outcome, 240, every_s=0.05,
               what="the first logged loss")
    os.killpg(mlflow_server["process"].pid, signal.SIGKILL)
    mlflow_server["process"].wait(30)
    killed = time.monotonic()
    thread.join(240)
    assert not thread.is_alive(), "training hung after the tracking server died"
    assert "error" not in outcome, repr(outcome.get("error"))
    print(f"training ended {outcome['end'] - killed:.0f}s after the tracking server was killed")

    out = outcome["out"]
    assert (out / "model.safetensors").is_file() and (out / "training.json").is_file()  # published all the same
    # the driver's last calls fell into the gap: warned once with what was dropped, listed again at the run's end
    gap = track.gap()
    assert {"metrics", "dict", "registration", "run status"} <= set(gap), gap
    messages = [r.getMessage() for r in caplog.records if r.name == "eyas.track"]
    assert any("is unreachable" in m and "NOT logged" in m for m in messages), messages
    end = [m for m in messages if "ended with a gap" in m]
    assert end and "training.json" in end[-1] and "model e3-mlflow-down" in end[-1] and mlflow_server["url"] in end[-1]
    # the server's own store: the run is there with the losses from before the kill, never marked finished
    steps = logged_losses(mlflow_server["db"])
    client = MlflowClient(f"sqlite:///{mlflow_server['db']}")
    runs = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "RUNNING", runs
    assert steps and max(steps) < num_steps, steps  # every step ran; the later losses are the gap
    assert "metrics" in end[-1] and "run status" in end[-1]


# ---------------------------------------------------------------- a Regenerator actor killed mid-run


def regenerator_pids() -> list[int]:
    from ray._private import state

    return [a["Pid"] for a in state.actors().values()
            if a.get("ActorClassName") == "Regenerator" and a.get("State") == "ALIVE" and a.get("Pid")]


def test_a_killed_regenerator_actor_is_replaced_and_every_shard_is_there_once(home, local_ray):
    import pyarrow.parquet as pq

    from eyas.config import load_config
    from eyas.train.config import DataConfig, target_path
    from eyas.train.data import num_shards
    from jobs.data_actors import plan_prompts
    from jobs.generate_data import build

    cfg = load_config(DataConfig, REPO / "jobs" / "configs" / "data-micro.yaml", [
        "name=data-killed", "target=target-rand", "num_prompts=48", "num_heldout_prompts=8", "shard_size=4",
        "max_new_tokens=64", "batch_size=4", "num_workers=2",  # long enough to kill an actor mid-run
        "keep_taps=[1, 2]"])
    out = home / "data" / "data-killed"
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["out"] = build(cfg)
        except BaseException as err:  # handed to the test thread below
            outcome["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    # once the first shard is written, both actors are up and working: kill one's process (SIGKILL)
    wait_until(lambda: list(out.glob("*/shard-*.parquet")) or not thread.is_alive(), 180, every_s=0.25,
               what="the first shard")
    pids = regenerator_pids()
    assert thread.is_alive() and pids, "the job ended before an actor could be killed; make it longer"
    done_before = len(list(out.glob("*/shard-*.parquet")))
    os.kill(pids[0], signal.SIGKILL)
    thread.join(240)
    assert not thread.is_alive() and "error" not in outcome, repr(outcome.get("error"))
    planned = {"train": NUM_TRAIN, "heldout": 8}
    assert done_before < sum(num_shards(n, 4) for n in planned.values()), "the kill came after the last shard"

    prompts = plan_prompts(cfg, target_path(cfg.target))
    for split, count in planned.items():
        files = sorted((out / split).glob("shard-*.parquet"))
        assert [f.name for f in files] == [f"shard-{i:05d}.parquet" for i in range(num_shards(count, 4))]
        rows = [row for f in files for row in pq.read_table(f).to_pylist()]
        # every planned prompt once, in shard order: none missing, none twice
        assert [row["prompt_ids"] for row in rows] == prompts[split][:count]
        assert all(row["response_ids"] for row in rows)
    assert not list(out.glob("*/.shard-*")), "a temp file of the killed actor was left behind"

    from safetensors.torch import load_file

    from eyas.train.feature_cache import ARGMAX, row_file, sequence_key

    meta = json.loads((out / "data.json").read_text())
    cache = out / meta["kept_features"]["directory"]
    assert meta["kept_features"]["taps"] == [1, 2, 3] and meta["last_run"]["positions_per_s"] > 0
    assert not list(cache.glob(".*.tmp")), "a temp feature file of the killed actor was left behind"
    for split in planned:
        for row in (r for f in sorted((out / split).glob("shard-*.parquet")) for r in pq.read_table(f).to_pylist()):
            ids = row["prompt_ids"] + row["response_ids"]
            assert load_file(str(row_file(cache, sequence_key(torch.tensor(ids)))))[ARGMAX].shape == (len(ids),)
    files = {f: f.stat().st_mtime_ns for f in out.rglob("*") if f.is_file() and f.name != "data.json"}
    build(cfg)  # a rerun: every shard and its features are there
    assert {f: f.stat().st_mtime_ns for f in out.rglob("*") if f.is_file() and f.name != "data.json"} == files
