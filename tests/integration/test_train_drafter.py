"""jobs.train_drafter end to end on a local Ray: DDP and DeepSpeed ZeRO-2 over 2 gloo workers, a worker killed
mid-training and resumed, the MLflow run read back. The same job through ``ray job submit`` on a token-auth cluster
of our own (its driver killed and the job resubmitted) is tests/integration/test_cluster_faults.py.

The target is the shared random checkpoint (tests/conftest.py); the data set is regenerated here without Ray
(``eyas.train.data.regenerate``), so the Ray time goes to the trainer runs alone.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from integration_testing import random_target_workspace

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "jobs" / "configs" / "eagle3-micro.yaml"
NUM_TRAIN, NUM_HELDOUT = 48, 8
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, random_checkpoint):
    """EYAS_HOME with the random target and a regenerated data set; MLflow in a tmp sqlite store."""
    with random_target_workspace(tmp_path_factory.mktemp("train-drafter"), random_checkpoint, NUM_TRAIN,
                                 NUM_HELDOUT) as workspace:
        yield workspace


@pytest.fixture(scope="module")
def local_ray(workspace):
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=True)  # never another session's cluster
    yield
    ray.shutdown()


def overrides(workspace, name: str, *extra: str) -> list[str]:
    return [f"name={name}", f"target={workspace['target_dir']}", f"data={workspace['data_dir']}",
            "scaling.num_to_keep=1", *extra]


def assert_greedy_identical(workspace, drafter_dir: Path) -> float:
    """The engine loads the checkpoint, and speculative greedy output equals plain greedy output."""
    from eyas import corpus
    from eyas.drafters import registry
    from eyas.methods import load_drafter
    from eyas.decoding.generate import generate

    target, tokenizer = workspace["target"], workspace["tokenizer"]
    drafter = load_drafter(drafter_dir, target)
    taus = []
    for text in corpus.heldout_prompts("all", 3):
        prompt = tokenizer(text).input_ids[:20]
        spec = generate(target, prompt, 24, drafter=drafter)
        assert spec.token_ids == generate(target, prompt, 24).token_ids
        taus.append(spec.stats.tau)
    return sum(taus) / len(taus)


def read_back(name: str, alias: str = "champion") -> tuple:
    from mlflow import MlflowClient

    from eyas import track

    client = MlflowClient(track.tracking_uri())
    version = client.get_model_version_by_alias(name, alias)
    run = client.get_run(version.run_id)
    artifacts = []
    stack = [None]
    while stack:
        for item in client.list_artifacts(run.info.run_id, stack.pop()):
            (stack.append(item.path) if item.is_dir else artifacts.append(item.path))
    return client, version, run, sorted(artifacts)


@pytest.fixture(scope="module")
def ddp_run(workspace, local_ray):
    from eyas.config import load_config
    from eyas.train.config import TrainConfig
    from jobs.train_drafter import train

    start = time.monotonic()
    out = train(load_config(TrainConfig, CONFIG, overrides(workspace, "e3-ddp", "scaling.strategy=ddp")))
    print(f"DDP run: {time.monotonic() - start:.0f}s")
    return out


def test_ddp_checkpoint_loads_generates_greedy_identical_and_is_tracked(workspace, ddp_run):
    assert (ddp_run / "config.json").is_file() and (ddp_run / "model.safetensors").is_file()
    training = json.loads((ddp_run / "training.json").read_text())
    assert training["step"] == 2 * (NUM_TRAIN // 2 // 4)  # 2 epochs x 6 steps per rank
    assert assert_greedy_identical(workspace, ddp_run) >= 1.0

    from eyas import track
    from eyas.drafters import registry
    from eyas.methods import load_drafter

    client, version, run, artifacts = read_back("e3-ddp")
    assert run.info.status == "FINISHED"
    assert run.data.params["drafter.type"] == "eagle3" and run.data.params["scaling.strategy"] == "ddp"
    for key in ("loss", "acc_1", "heldout_loss", "heldout_acc_1", "heldout_sim_accept_len", "tau",
                "accept_depth_1", "greedy_identical"):
        assert key in run.data.metrics, key
    assert run.data.metrics["greedy_identical"] == 1.0
    assert [m.step for m in client.get_metric_history(run.info.run_id, "tau")] == [6, 12]
    assert len(client.get_metric_history(run.info.run_id, "loss")) >= 6
    for name in ("acceptance/epoch_1.png", "acceptance/epoch_2.png", "calibration/epoch_2.png",
                 "drafter/config.json", "drafter/model.safetensors"):
        assert name in artifacts, (name, artifacts)
    downloaded = track.download_model(track.model_uri("e3-ddp", "champion"), workspace["root"] / "dl")
    assert registry.load_model(downloaded, workspace["target"]).drafter_type == "eagle3"


def test_zero2_with_a_killed_worker_resumes_and_matches_ddp(workspace, ddp_run, local_ray):
    from safetensors.torch import load_file

    from eyas.config import load_config
    from eyas.train.config import TrainConfig
    from jobs.train_drafter import train

    # rank 1 dies (os._exit) before step 9; the last checkpoint is the end of epoch 1 (step 6)
    cfg = load_config(TrainConfig, CONFIG, overrides(workspace, "e3-zero2", "scaling.strategy=zero2",
                                                     "train.fail_at_step=8", "train.fail_rank=1",
                                                     "scaling.max_failures=1"))
    out = train(cfg)
    training = json.loads((out / "training.json").read_text())
    assert training["step"] == 12 and training["position"] == {"epoch": 2, "batch": 0}
    assert Path(training["ray_run_dir"], "fail_at_step.done").is_file()  # the failure did happen
    client, _, run, _ = read_back("e3-zero2")
    resumed = client.get_metric_history(run.info.run_id, "resumed_from_step")
    assert [(m.step, m.value) for m in resumed] == [(6, 6.0)]
    assert max(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == 12  # continued, not restarted
    assert assert_greedy_identical(workspace, out) >= 1.0
    # same data order, same seeds, deterministic per-step randomness: ZeRO-2 + resume == uninterrupted DDP
    zero, ddp = load_file(str(out / "model.safetensors")), load_file(str(ddp_run / "model.safetensors"))
    assert zero.keys() == ddp.keys()
    for key in zero:
        torch.testing.assert_close(zero[key], ddp[key], atol=1e-4, rtol=1e-3, msg=key)


@pytest.mark.parametrize("config, strategy", [("peagle-micro.yaml", "zero2"), ("eagle3.1-micro.yaml", "ddp"),
                                              ("peagle-micro.yaml", "ddp")])
def test_new_families_train_on_ray_and_track_their_curves(workspace, local_ray, config, strategy):
    """P-EAGLE and EAGLE-3.1 through jobs.train_drafter on Ray Train (DDP, and P-EAGLE on DeepSpeed ZeRO-2): the
    checkpoint drafts greedy-identically and MLflow holds the per-position acceptance curve of every trained depth."""
    from eyas.config import load_config
    from eyas.train.config import TrainConfig
    from jobs.train_drafter import train

    cfg = load_config(TrainConfig, REPO / "jobs" / "configs" / config)
    name = f"{cfg.drafter.type}-{strategy}"
    out = train(load_config(TrainConfig, REPO / "jobs" / "configs" / config,
                            overrides(workspace, name, f"scaling.strategy={strategy}")))
    assert assert_greedy_identical(workspace, out) >= 1.0
    _, _, run, artifacts = read_back(name)
    assert run.data.params["drafter.type"] == cfg.drafter.type and run.data.params["scaling.strategy"] == strategy
    depths = cfg.drafter.config.get("num_depths") or cfg.drafter.config.get("ttt_steps")
    for key in [f"heldout_acc_{d}" for d in range(1, depths + 1)] + ["tau", "greedy_identical"]:
        assert key in run.data.metrics, key
    assert run.data.metrics["greedy_identical"] == 1.0
    assert "acceptance/epoch_2.png" in artifacts
