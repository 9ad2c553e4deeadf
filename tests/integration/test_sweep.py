"""tune.sweep end to end on a local Ray: an inference sweep (EAGLE-3 node budget x top-k) and a training sweep (DFlash
block size x loss decay, ASHA), each under two minutes on the micro target; MLflow parent and child runs read back;
the best-config YAML loaded by jobs.generate (greedy output identical to vanilla), jobs.bench and serving.

The target is the shared random checkpoint (tests/conftest.py) installed as ``micro``; the data set is
regenerated without Ray and the drafters are trained with the sweep's own Ray-free loop (tune.measure.TrialTrainer),
so the Ray time goes to the sweeps alone.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import yaml

from integration_testing import random_target_workspace

REPO = Path(__file__).resolve().parents[2]
INFERENCE = REPO / "tune" / "configs" / "eagle3-tree-micro.yaml"
TRAINING = REPO / "tune" / "configs" / "dflash-train-micro.yaml"
EAGLE3_TRAINING = REPO / "tune" / "configs" / "eagle3-train-micro.yaml"
SCHEDULE = REPO / "tune" / "configs" / "schedule-micro.yaml"
NUM_TRAIN, NUM_HELDOUT = 32, 8
pytestmark = pytest.mark.slow


def train_micro_drafter(home: Path, config: Path, epochs: int) -> Path:
    from eyas.config import load_config
    from eyas.train.config import TrainConfig
    from tune.measure import TrialTrainer

    cfg = load_config(TrainConfig, config, [f"train.num_epochs={epochs}"])
    trainer = TrialTrainer(cfg, home / "targets" / "micro", home / "data" / "data-micro")
    for epoch in range(epochs):
        trainer.run_epoch(epoch)
    return trainer.save(home / "drafters" / cfg.name)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, random_checkpoint):
    """EYAS_HOME with micro, data-micro and the eagle3-micro drafter; MLflow in a tmp sqlite store."""
    with random_target_workspace(tmp_path_factory.mktemp("sweep"), random_checkpoint, NUM_TRAIN, NUM_HELDOUT,
                                 target_name="micro", data_name="data-micro") as workspace:
        train_micro_drafter(workspace["home"], REPO / "jobs" / "configs" / "eagle3-micro.yaml", epochs=3)
        yield workspace


@pytest.fixture(scope="module")
def local_ray(workspace):
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never a running cluster
    yield
    ray.shutdown()


def mlflow_runs(sweep_name: str):
    """(parent run, child runs) of the latest sweep called ``sweep_name``."""
    from mlflow import MlflowClient

    from eyas import track

    client = MlflowClient(track.tracking_uri())
    experiment = client.get_experiment_by_name("eyas-sweeps")
    parents = client.search_runs([experiment.experiment_id],
                                 f"tags.`eyas.kind` = 'sweep' and attributes.run_name = '{sweep_name}'",
                                 order_by=["attributes.start_time DESC"])
    assert parents, f"no parent run for {sweep_name}"
    parent = parents[0]
    children = client.search_runs([experiment.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    return client, parent, children, artifacts


@pytest.fixture(scope="module")
def inference_sweep(workspace, local_ray):
    from tune.sweep import main

    out = workspace["root"] / "inference-out"
    start = time.monotonic()
    assert main(["--config", str(INFERENCE), f"output.dir={out}"]) == 0
    return out, time.monotonic() - start


def test_inference_sweep_finishes_tracks_and_writes_the_best_config(inference_sweep):
    out, _ = inference_sweep
    results = json.loads((out / "results.json").read_text())
    points = sorted((t["point"]["num_nodes"], t["point"]["top_k"]) for t in results["trials"])
    assert points == [(2, 2), (4, 2), (4, 4), (8, 2), (8, 4)]  # (2, 4) is impossible and skipped
    for trial in results["trials"]:
        assert trial["error"] is None
        assert trial["metrics"]["greedy_identical"] == 1.0
        # greedy output is vanilla's in every trial, so every trial emits the same tokens; each one after a
        # sequence's first comes from a cycle (accepted + 1 each, tau on average): 2 prompts x 1 timed pass
        metrics = trial["metrics"]
        assert metrics["new_tokens"] == results["trials"][0]["metrics"]["new_tokens"]
        assert metrics["tau"] * metrics["cycles"] >= metrics["new_tokens"] - 2
    assert set(results["curve"]) == {"top_k=2", "top_k=4"}  # one line per top-k, x = num_nodes
    assert (out / "curve.png").stat().st_size > 0

    client, parent, children, artifacts = mlflow_runs("eagle3-tree-micro")
    assert parent.info.status == "FINISHED"
    assert {"best.yaml", "curve.png", "results.json"} <= artifacts
    assert "best_speedup" in parent.data.metrics and parent.data.metrics["num_trials"] == 5
    assert parent.data.params["best.num_nodes"] in {"2", "4", "8"}
    assert len(children) == 5
    for child in children:
        assert child.info.status == "FINISHED"
        for key in ("speedup", "tau", "tokens_per_s", "vanilla_tokens_per_s", "greedy_identical"):
            assert key in child.data.metrics, (key, child.data.metrics)
        assert child.data.params["spec.method"] == "eagle3" and "point.num_nodes" in child.data.params

    best = yaml.safe_load((out / "best.yaml").read_text())
    assert best["spec"]["method"] == "eagle3" and Path(best["spec"]["drafter"]).is_dir()
    assert best["spec"]["num_nodes"] == int(parent.data.params["best.num_nodes"])


def test_best_config_is_accepted_by_generate_bench_and_serving(workspace, inference_sweep, capsys, tmp_path):
    from jobs import bench, generate
    from eyas_ray.serve_config import ServeArgs

    best = inference_sweep[0] / "best.yaml"
    prompt = ",".join(map(str, workspace["tokenizer"]("def parse(text):").input_ids))
    outputs = {}
    for name, args in (("spec", ["--config", str(best)]), ("vanilla", ["--method", "vanilla"])):
        capsys.readouterr()
        assert generate.main([*args, "--target", str(workspace["target_dir"]), "--prompt-ids", prompt,
                              "--max-new-tokens", "24", "--json"]) == 0
        outputs[name] = json.loads(capsys.readouterr().out)
    assert outputs["spec"]["spec"]["method"] == "eagle3" and outputs["spec"]["stats"]["cycles"] > 0
    assert outputs["spec"]["token_ids"] == outputs["vanilla"]["token_ids"]
    # jobs.generate also takes the target from the YAML itself
    assert generate.main(["--config", str(best), "--prompt-ids", prompt, "--max-new-tokens", "8"]) == 0

    report = tmp_path / "bench.json"
    assert bench.main(["--methods", "eagle3", "--spec", str(best), "--target", str(workspace["target_dir"]),
                       "--suite", "code", "--num-prompts", "1", "--max-new-tokens", "8", "--strict",
                       "--out", str(report)]) == 0
    spec = yaml.safe_load(best.read_text())["spec"]
    used = json.loads(report.read_text())["config"]["specs"]["eagle3"]
    assert (used["num_nodes"], used["top_k"], used["depth"]) == (spec["num_nodes"], spec["top_k"], spec["depth"])

    args = ServeArgs.from_args({"target": str(workspace["target_dir"]), "spec_file": str(best)})
    assert args.spec.num_nodes == spec["num_nodes"] and args.spec.drafter == spec["drafter"]


def test_schedule_sweep_chooses_speculation_by_batch_that_serving_reads(workspace, local_ray, capsys):
    """A schedule sweep: B concurrent greedy requests through the batched engine at each draft-node budget against
    vanilla at the same B; schedule.yaml is the per-B best budget, read as is by the serving config's args."""
    from eyas_ray.serve_config import ServeArgs
    from tune.sweep import main

    out = workspace["root"] / "schedule-out"
    assert main(["--config", str(SCHEDULE), f"output.dir={out}"]) == 0
    printed = capsys.readouterr().out
    assert "speculation_by_batch" in printed and "python -m jobs.load" in printed

    results = json.loads((out / "results.json").read_text())
    trials = {(t["point"]["batch_size"], t["point"]["max_draft_nodes"]): t["metrics"] for t in results["trials"]}
    assert sorted(trials) == [(1, 0), (1, 4), (2, 0), (2, 4)]
    assert all(t["error"] is None for t in results["trials"])
    for (size, budget), metrics in trials.items():
        assert metrics["greedy_identical"] == 1.0  # every request's speculative output is vanilla's
        assert metrics["new_tokens"] == trials[(1, 0)]["new_tokens"]  # the same 2 requests, whatever B
        assert (metrics["draft_nodes_per_cycle"] == 0) == (budget == 0)
    fragment = yaml.safe_load((out / "schedule.yaml").read_text())
    chosen = {size: max((0, 4), key=lambda n: trials[(size, n)]["speedup"]) for size in (1, 2)}
    assert fragment == {"dtype": "float32", "speculation_by_batch": chosen}

    args = ServeArgs.from_args({"target": str(workspace["target_dir"]), "spec_file": str(out / "best.yaml"),
                                **fragment})
    assert args.spec.method == "eagle3" and args.speculation_by_batch == chosen
    _, parent, children, artifacts = mlflow_runs("schedule-micro")
    assert {"best.yaml", "schedule.yaml", "curve.png", "results.json"} <= artifacts
    assert {k: v for k, v in parent.data.params.items() if k.startswith("speculation_by_batch.")} == {
        f"speculation_by_batch.{size}": str(budget) for size, budget in chosen.items()}
    assert sorted(c.data.params["point.batch_size"] for c in children) == ["1", "1", "2", "2"]


def test_training_sweep_asha_mlflow_and_best_drafter(workspace, local_ray):
    from eyas.drafters import registry
    from eyas.methods import load_drafter
    from eyas.decoding.generate import generate
    from tune.sweep import main

    out = workspace["root"] / "training-out"
    start = time.monotonic()
    assert main(["--config", str(TRAINING), f"output.dir={out}"]) == 0

    results = json.loads((out / "results.json").read_text())
    trials = results["trials"]
    assert len(trials) == 4 and all(t["error"] is None for t in trials)
    for trial in trials:  # one report per epoch, each with the simulated acceptance length
        assert 1 <= trial["epochs"] <= 2 and len(trial["history"]) == trial["epochs"]
        assert all("sim_accept_len" in h and "sim_tau" in h for h in trial["history"])
        assert trial["early_stopped"] == (trial["epochs"] < 2)
    assert any(t["epochs"] == 2 for t in trials)
    # a block-2 trial (one drafted position) trails the block-6 ones at epoch 1: ASHA stops it there
    assert 2 in {t["point"]["drafter.config.block_size"] for t in trials if t["early_stopped"]}

    client, parent, children, artifacts = mlflow_runs("dflash-train-micro")
    assert {"best.yaml", "best-train.yaml", "curve.png", "epochs.png", "results.json"} <= artifacts
    assert "best_sim_tau" in parent.data.metrics
    assert len(children) == 4
    for child in children:
        history = client.get_metric_history(child.info.run_id, "sim_accept_len")
        assert [m.step for m in history] == list(range(1, len(history) + 1))
        assert child.data.params["training.drafter.type"] == "dflash"
        assert child.data.tags["eyas.early_stopped"] in ("true", "false")

    best_train = yaml.safe_load((out / "best-train.yaml").read_text())
    best = yaml.safe_load((out / "best.yaml").read_text())
    assert best_train["drafter"]["config"]["block_size"] == best["sweep"]["point"]["drafter.config.block_size"]
    assert best["spec"]["method"] == "dflash"
    target = workspace["target"]
    drafter = load_drafter(best["spec"]["drafter"], target, method="dflash")
    assert drafter.model.config.block_size == best["sweep"]["point"]["drafter.config.block_size"]
    prompt = workspace["tokenizer"]("class Parser:").input_ids
    assert generate(target, prompt, 16, drafter=drafter).token_ids == generate(target, prompt, 16).token_ids


def test_eagle3_recipe_sweep_reports_acceptance_per_suite(workspace, local_ray):
    """The EAGLE-3 recipe keys (head lr multiplier x prompt loss) swept with ASHA: each trial reports the held-out
    acceptance of every suite (heldout_<label>_sim_tau) and their mean sim_tau each epoch, side by side in MLflow."""
    from tune.sweep import main

    out = workspace["root"] / "eagle3-training-out"
    assert main(["--config", str(EAGLE3_TRAINING), f"output.dir={out}"]) == 0
    trials = json.loads((out / "results.json").read_text())["trials"]
    assert len(trials) == 4 and all(t["error"] is None for t in trials)
    for trial in trials:
        for report in trial["history"]:
            assert {"sim_tau", "heldout_code_sim_tau", "heldout_chat_sim_tau"} <= set(report)
            assert report["sim_tau"] == pytest.approx((report["heldout_code_sim_tau"]
                                                       + report["heldout_chat_sim_tau"]) / 2)
    assert any(t["epochs"] == 2 for t in trials)
    client, parent, children, _ = mlflow_runs("eagle3-train-micro")
    assert len(children) == 4
    assert {child.data.params["point.optim.head_lr_multiplier"] for child in children} == {"1.0", "0.0"}
    for child in children:
        assert client.get_metric_history(child.info.run_id, "heldout_code_sim_tau")


def test_a_trial_keeps_features_on_disk_not_in_memory(workspace):
    """``train.feature_cache: disk`` holds in a trial as in jobs.train_drafter: rows go to the data set's feature
    directory, none stays in the trial's memory (kept there, they grow with every sequence the trial sees)."""
    from eyas.config import load_config
    from eyas.train.config import TrainConfig
    from tune.measure import TrialTrainer

    home = workspace["home"]
    cfg = load_config(TrainConfig, REPO / "jobs" / "configs" / "eagle3-micro.yaml",
                      ["train.feature_cache=disk", "name=e3-disk-trial"])
    trainer = TrialTrainer(cfg, home / "targets" / "micro", home / "data" / "data-micro")
    trainer.run_epoch(0)
    assert trainer.features.mode == "disk" and trainer.features.memory == {}
    assert trainer.features.directory.parent == home / "data" / "data-micro" / "features"
    assert list(trainer.features.directory.glob("*.safetensors"))


def test_ray_train_runner_launches_a_torch_trainer_per_trial(workspace, local_ray):
    """runner: ray-train: each trial launches jobs.train_drafter's TorchTrainer (Ray Train V2 inside Tune); the
    workers' epoch reports reach Tune (renamed to sim_tau) and the best trial's checkpoint becomes best-drafter/."""
    from tune.sweep import main

    out = workspace["root"] / "ray-train-out"
    assert main(["--config", str(TRAINING), f"output.dir={out}", "runner=ray-train", "training.scaling.num_workers=1",
                 "search.space={drafter.config.block_size: [6, 2]}"]) == 0
    trials = json.loads((out / "results.json").read_text())["trials"]
    assert len(trials) == 2 and all(t["error"] is None for t in trials)
    assert all("sim_tau" in h for t in trials for h in t["history"])
    assert max(t["epochs"] for t in trials) == 2
    best = yaml.safe_load((out / "best.yaml").read_text())
    assert (Path(best["spec"]["drafter"]) / "model.safetensors").is_file()


def test_a_killed_trial_is_retried_from_its_checkpoint_and_the_sweep_finishes(workspace, local_ray):
    """resources.max_failures (default 1): the first trial to reach step 10 (inside its second epoch of 8 steps)
    is SIGKILLed (training.train.fail_at_step); Tune retries it from its epoch-1 checkpoint. Every trial is reported
    once per epoch, none failed, and the retried trial ends with the very weights an uninterrupted run has."""
    from safetensors.torch import load_file

    from tune.config import load_sweep
    from tune.measure import TrialTrainer
    from tune.sweep import main

    out, storage = workspace["root"] / "killed-trial-out", workspace["root"] / "killed-trial-storage"
    overrides = [f"output.dir={out}", f"output.storage_path={storage}", "scheduler.asha=false",
                 "search.space={drafter.config.block_size: [6, 4]}", "training.train.fail_at_step=10"]
    assert main(["--config", str(TRAINING), *overrides]) == 0
    killed_id = next(storage.glob("*/fail_at_step.done")).read_text().split()[0]  # the kill did happen

    trials = {t["trial_id"]: t for t in json.loads((out / "results.json").read_text())["trials"]}
    assert len(trials) == 2 and killed_id in trials
    for trial in trials.values():
        assert trial["error"] is None and trial["epochs"] == 2
        assert [h["step"] for h in trial["history"]] == [8.0, 16.0]  # no epoch reported twice, none lost
    # resumed at step 8 with weights, optimizer and schedule: the same weights as training without the kill
    killed = trials[killed_id]
    cfg = load_sweep(TRAINING, overrides).trial_section(killed["point"])
    reference = TrialTrainer(cfg, workspace["target_dir"], workspace["home"] / "data" / "data-micro")
    for epoch in range(2):
        reference.run_epoch(epoch)
    resumed = load_file(str(Path(killed["checkpoint"]) / "drafter" / "model.safetensors"))
    expected = {k: v for k, v in reference.drafter.state_dict().items() if k in resumed}
    assert expected.keys() == resumed.keys()
    for key, value in resumed.items():
        assert torch.equal(value, expected[key]), key
