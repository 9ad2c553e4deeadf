"""Faults of jobs on a cluster, simulated on this machine: a LocalRayHead plus a worker node joined with
``ray start --address`` (eyas_ray.local_head), each with its own resources, the jobs submitted with ``ray job submit``.

- The driver of a drafter-training job killed (SIGKILL) after its first checkpoint: the same command submitted again
  says it resumes from that checkpoint (step 4, mid-epoch, not 0), continues the same MLflow run, and ends with the
  weights of an uninterrupted run, bit for bit.
- The worker node killed (SIGKILL to every process of the node) while a 2-worker training job spreads over both
  nodes and a Serve app has a replica on each: training resumes from its last checkpoint on the surviving head,
  Serve keeps answering from the head's replica and replaces the lost one on a node that joins in its place.

The kills land at a known step: ``train.hold_at_step`` makes one rank wait there, once, after its last checkpoint is
committed (eyas_ray.train_worker.maybe_fail). The target is the shared random checkpoint (tests/conftest.py); the
data set is regenerated here without Ray.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from eyas_ray.local_head import LocalRayHead
from eyas_ray.resume import ResumableRun
from integration_testing import random_target_workspace, wait_until

REPO = Path(__file__).resolve().parents[2]
CONFIG = "jobs/configs/eagle3-micro.yaml"
NUM_TRAIN, NUM_HELDOUT = 48, 8
SLOT = "eyas_serve_slot"  # a custom resource each node has one of: one Serve replica per node
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, random_checkpoint):
    """EYAS_HOME with the random target and a regenerated data set; MLflow in a tmp sqlite store."""
    with random_target_workspace(tmp_path_factory.mktemp("cluster-faults"), random_checkpoint, NUM_TRAIN,
                                 NUM_HELDOUT) as workspace:
        yield workspace


@pytest.fixture(scope="module")
def cluster(workspace):
    """The head (4 CPUs) and one worker node (2 CPUs), each with one Serve slot. A lost node is declared dead
    after 3 missed health checks 1 s apart (Ray's default: 5 x 3 s)."""
    env = {**workspace["env"], "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
           "RAY_health_check_failure_threshold": "3"}
    with LocalRayHead(num_cpus=4, resources={SLOT: 1}, env=env) as head:
        head.add_worker(num_cpus=2, resources={SLOT: 1})
        yield head


def overrides(workspace, name: str, *extra: str) -> list[str]:
    return [f"name={name}", f"target={workspace['target_dir']}", f"data={workspace['data_dir']}",
            "scaling.num_to_keep=1", "measure.num_prompts=0", *extra]


def train_command(workspace, head: LocalRayHead, args: list[str], submission_id: str) -> list[str]:
    # RAY_DEDUP_LOGS=0: Ray's log deduplication drops every word holding a digit, so "rank 0 of 2 on node <id>" and
    # "rank 1 of 2 on node <id>" from two workers read as one line; the second is held back and may never be
    # printed before the job ends (ray-project/ray#45262). The checks below count those lines.
    return head.submit_command([sys.executable, "-m", "jobs.train_drafter", "--config", CONFIG, *args],
                               env_vars={**workspace["env"], "RAY_DEDUP_LOGS": "0"}, submission_id=submission_id)


def resumable_run(args: list[str]) -> ResumableRun:
    """The Ray Train run the job will use for these overrides (the same config, the same name)."""
    from eyas.config import load_config, resolve_path, to_dict
    from eyas.train.config import TrainConfig

    cfg = load_config(TrainConfig, REPO / CONFIG, args)
    return ResumableRun.for_config("train_drafter", cfg.name, to_dict(cfg), resolve_path(cfg.scaling.storage_path))


def held(run: ResumableRun) -> bool:
    """A rank waits at train.hold_at_step, its checkpoint before committed."""
    return (run.dir / "hold_at_step.done").is_file() and run.last_checkpoint() is not None


# ---------------------------------------------------------------- a killed driver, resubmitted


def test_a_killed_driver_resubmitted_resumes_from_its_checkpoint_bit_for_bit(workspace, cluster, tmp_path):
    from mlflow import MlflowClient
    from safetensors.torch import load_file

    from eyas import track
    from eyas.config import load_config
    from eyas.train.config import TrainConfig
    from eyas.train.trainer import Trainer, load_inputs

    # one worker, 12 steps an epoch, 2 epochs, a checkpoint every 4 steps; the rank waits at step 6 in the first run
    args = overrides(workspace, "e3-driver-killed", "scaling.num_workers=1", "train.checkpoint_every=4",
                     "train.hold_at_step=6", "train.fail_rank=0")
    run = resumable_run(args)
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(train_command(workspace, cluster, args, "driver-killed-1"), env=cluster.env,
                                 cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: held(run) or first.poll() is not None, 300, what="the first checkpoint")
    assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    assert run.last_checkpoint().step == 4
    job = cluster.list_state("jobs", "submission_id=driver-killed-1")[0]
    os.kill(int(job["driver_info"]["pid"]), signal.SIGKILL)  # the driver dies; its Train run with it
    assert first.wait(120) != 0

    again = subprocess.run(train_command(workspace, cluster, args, "driver-killed-2"), env=cluster.env, cwd=REPO,
                           capture_output=True, text=True, timeout=400)
    log = again.stdout + again.stderr
    (tmp_path / "second.log").write_text(log)
    assert again.returncode == 0, log[-4000:]
    assert f"resuming from checkpoint {run.dir / 'checkpoint-step0000004'} at step 4" in log, log[-4000:]
    assert "resumed at step 4, epoch 0, batch 4" in log  # the data position too: mid-epoch
    out = workspace["home"] / "drafters" / "e3-driver-killed"
    training = json.loads((out / "training.json").read_text())
    assert training["step"] == 24 and training["position"] == {"epoch": 2, "batch": 0}
    assert not run.dir.exists() and Path(training["ray_run_dir"], "hold_at_step.done").is_file()  # moved aside

    # one MLflow run across both drivers: resumed at step 4, finished, registered
    client = MlflowClient(track.tracking_uri())
    experiment = client.get_experiment_by_name("eyas-drafters")
    runs = client.search_runs([experiment.experiment_id], "attributes.run_name = 'e3-driver-killed'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", runs
    history = client.get_metric_history(runs[0].info.run_id, "resumed_from_step")
    assert [(m.step, m.value) for m in history] == [(4, 4.0)]
    assert client.get_model_version_by_alias("e3-driver-killed", "champion").run_id == runs[0].info.run_id

    # the same steps without Ray and without a kill: weights, optimizer, schedule and data order all resumed
    cfg = load_config(TrainConfig, REPO / CONFIG, args)
    inputs = load_inputs(cfg, workspace["target_dir"], workspace["data_dir"], torch.device("cpu"), prompts=False)
    reference = Trainer(cfg, inputs.target, inputs.data, target_dir=workspace["target_dir"])
    for epoch in range(cfg.train.num_epochs):
        for batch in reference.batches(epoch):
            reference.train_step(batch)
    resumed = load_file(str(out / "model.safetensors"))
    expected = reference.drafter.state_dict()
    assert resumed and set(resumed) <= set(expected)
    for key, value in resumed.items():
        assert torch.equal(value, expected[key]), key


# ---------------------------------------------------------------- the worker node lost mid-run


def serve_config(workspace, port: int) -> dict:
    """serving/configs/micro.yaml on the random target, 2 replicas, each holding a node's one Serve slot."""
    config = yaml.safe_load((REPO / "serving" / "configs" / "micro.yaml").read_text())
    config["http_options"]["port"] = port
    app = config["applications"][0]
    app["args"]["target"] = str(workspace["target_dir"])
    deployment = app["deployments"][0]
    deployment.pop("autoscaling_config")
    deployment["num_replicas"] = 2
    # the builder's placement group (the replica, one TP worker), the replica's bundle also taking the node's slot
    args = app["args"]
    deployment["placement_group_bundles"] = [{"CPU": args["replica_cpus"], SLOT: 1}, {"CPU": args["worker_cpus"]}]
    return config


def serve_cli(head: LocalRayHead, *args: str) -> str:
    done = subprocess.run([str(Path(sys.executable).with_name("serve")), *args, "--address", head.address],
                          env=head.env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def replica_nodes(head: LocalRayHead, app: str) -> list[str]:
    """The node of every RUNNING replica of ``app`` (none while any replica is still starting)."""
    status = yaml.safe_load(serve_cli(head, "status"))
    states = {}
    for entry in status.get("applications", {}).get(app, {}).get("deployments", {}).values():
        states.update(entry.get("replica_states") or {})
    if set(states) != {"RUNNING"}:
        return []
    actors = head.list_state("actors", "state=ALIVE")
    return sorted(a["node_id"] for a in actors if a["class_name"] == f"ServeReplica:{app}:EyasServer")


def greedy_text(port: int, prompt: str) -> str:
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                          json={"model": "eyas-micro", "prompt": prompt, "max_tokens": 16, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_a_lost_worker_node_training_resumes_on_the_head_and_serve_replaces_its_replica(workspace, cluster,
                                                                                        tmp_path):
    from eyas.decoding.tp import free_port

    head_id = cluster.head_node_id()
    lost = cluster.workers[0]
    port = free_port()
    config_file = tmp_path / "serve.yaml"
    config_file.write_text(yaml.safe_dump(serve_config(workspace, port)))
    serve_cli(cluster, "deploy", str(config_file))
    wait_until(lambda: len(replica_nodes(cluster, "eyas-micro")) == 2, 300, every_s=2, what="two Serve replicas")
    assert replica_nodes(cluster, "eyas-micro") == sorted([head_id, lost.node_id])  # one on each node
    prompt = "def add(a, b):\n    return"
    text = greedy_text(port, prompt)

    # 2 workers, SPREAD: one per node; 6 steps an epoch, a checkpoint every 2, a rank waits at step 3
    args = overrides(workspace, "e3-node-lost", "scaling.placement_strategy=SPREAD", "train.checkpoint_every=2",
                     "train.hold_at_step=3", "tracking.enabled=false")
    run = resumable_run(args)
    with open(tmp_path / "train.log", "w") as log:
        job = subprocess.Popen(train_command(workspace, cluster, args, "node-lost"), env=cluster.env, cwd=REPO,
                               stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: held(run) or job.poll() is not None, 300, what="the first checkpoint")
        assert job.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
        workers = [a["node_id"] for a in cluster.list_state("actors", "state=ALIVE")
                   if a["class_name"] == "RayTrainWorker"]
        assert sorted(workers) == sorted([head_id, lost.node_id])  # one on each node

        lost.kill()  # SIGKILL to the node's raylet, object store, its train worker and its Serve replica
        assert job.wait(400) == 0, (tmp_path / "train.log").read_text()[-4000:]
    log = (tmp_path / "train.log").read_text()
    assert log.count("resumed at step 2, epoch 0, batch 2") == 2, log[-4000:]  # both ranks, from the checkpoint
    # placed: one rank on each node, then both on the surviving head
    assert log.count(f"of 2 on node {head_id}") == 3 and log.count(f"of 2 on node {lost.node_id}") == 1, log[-4000:]
    training = json.loads((workspace["home"] / "drafters" / "e3-node-lost" / "training.json").read_text())
    assert training["step"] == 12

    # Serve: the head's replica answers all along; a node joins in the lost one's place and gets a new replica
    assert greedy_text(port, prompt) == text
    replacement = cluster.add_worker(num_cpus=2, resources={SLOT: 1})
    wait_until(lambda: replica_nodes(cluster, "eyas-micro") == sorted([head_id, replacement.node_id]), 300,
               every_s=2, what="the replacement replica on the new node")
    assert {greedy_text(port, prompt) for _ in range(4)} == {text}
    serve_cli(cluster, "shutdown", "-y")
