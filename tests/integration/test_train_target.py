"""jobs.train_target end to end: the micro target through Ray Train (2 workers) and through `ray job submit`.

Everything lands in tmp dirs (EYAS_HOME, the MLflow sqlite store). The cluster test starts its own head node with
``ray start --head --block`` and ends it by signalling that process (never ``ray stop``, which would stop every Ray
instance on a shared machine).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eyas_ray import local_head as local_ray
from eyas_ray.local_head import LocalRayHead

REPO_ROOT = Path(__file__).resolve().parents[2]
MICRO = REPO_ROOT / "jobs" / "configs" / "target-micro.yaml"
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


def assert_loadable_checkpoint(out: Path, vocab_size: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "meta.json"):
        assert (out / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert len(tokenizer) == vocab_size and model.config.vocab_size == vocab_size
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    input_ids_BT = tokenizer("def f(x):\n    return x", return_tensors="pt").input_ids
    with torch.no_grad():
        logits_BTV = model(input_ids=input_ids_BT).logits
    assert logits_BTV.shape == (1, input_ids_BT.shape[1], vocab_size)
    meta = json.loads((out / "meta.json").read_text())
    assert math.isfinite(meta["heldout_loss"]) and meta["heldout_loss"] < math.log(vocab_size)  # beats uniform
    return meta


def test_micro_target_builds_through_ray_train(job_env):
    import ray
    from mlflow import MlflowClient

    from eyas.config import load_config
    from jobs.train_target import TargetJobConfig, build, llama_config, prepare_tokenizer, tokenizer_vocab

    home, uri = job_env
    try:
        target_cfg = load_config(TargetJobConfig, MICRO, ["train.num_steps=20", "num_samples=1"])
        assert target_cfg.train.num_workers == 2
        out = build(target_cfg)
        assert out == home / "targets" / "micro"
        meta = assert_loadable_checkpoint(out, vocab_size=512)
        assert meta["steps"] == 20 and meta["kind"] == "target" and len(meta["samples"]) == 1

        run = MlflowClient(tracking_uri=uri).get_run(meta["mlflow_run_id"])
        assert run.info.status == "FINISHED" and run.info.run_name == "micro"
        assert run.data.params["train.num_workers"] == "2" and run.data.params["model.num_layers"] == "2"
        assert abs(run.data.metrics["heldout_loss"] - meta["heldout_loss"]) < 1e-9
        losses = MlflowClient(tracking_uri=uri).get_metric_history(run.info.run_id, "loss")
        assert [m.step for m in losses] == [10, 20]

        assert build(target_cfg) == out  # reused: meta.json marks a complete build
        assert json.loads((out / "meta.json").read_text())["created"] == meta["created"]

        assert_lossless_on_trained_target(out, home)

        # a draft LM reuses the built target's tokenizer (its own fit is the same code path as above)
        draft_cfg = load_config(TargetJobConfig, DRAFT_MICRO)
        assert prepare_tokenizer(draft_cfg) == out
        assert llama_config(draft_cfg, tokenizer_vocab(out)).num_hidden_layers == 1
    finally:
        ray.shutdown()


def assert_lossless_on_trained_target(target_dir: Path, home: Path) -> None:
    """Greedy identity on the TRAINED micro target (its argmax is far from uniform, unlike a random model's):
    every drafter family crossed with its tree shapes equals vanilla token for token over 20 held-out prompts."""
    import torch

    from eyas import corpus
    from eyas.drafters import registry
    from eyas.drafters.trees import MODE_SETTINGS
    from eyas.methods import METHODS, SpecConfig, build_drafter
    from eyas.drafters.draft_lm import DraftLMDrafter
    from eyas.drafters.ngram import NgramConfig, NgramDrafter
    from eyas.models import load_target, load_tokenizer
    from eyas.decoding.generate import generate

    torch.manual_seed(0)
    target = load_target(target_dir)
    tokenizer = load_tokenizer(target_dir)
    prompts = [tokenizer.encode(p)[:32] for p in corpus.heldout_prompts("all", 20)]  # micro context: 128
    expected = [generate(target, p, 24).token_ids for p in prompts]
    checkpoints = {}
    for family, config in (("eagle1", {}), ("eagle3", {"ttt_steps": 2}), ("medusa", {"num_heads": 3}),
                           ("dflash", {"num_layers": 1, "block_size": 4, "num_taps": 1})):
        model = registry.build_model(family, config, target, token_counts_V=torch.ones(512))
        checkpoints[family] = registry.save_drafter(model, home / "drafters" / f"{family}-untrained", str(target_dir))
    drafters = [NgramDrafter(NgramConfig(max_matches=1)), NgramDrafter(NgramConfig(max_matches=4)),
                DraftLMDrafter(target)]  # the target as its own draft LM: long accepted chains
    for method, trees in (("eagle1", ("chain", "static", "dynamic", "best-first")), ("eagle2", ("dynamic",)),
                          ("eagle3", ("chain", "static", "dynamic", "best-first")), ("medusa", ("static",)),
                          ("dflash", ("block",)), ("dflash-ddtree", ("ddtree",))):
        for tree in trees:
            settings = {k: v for k, v in {"depth": 3, "top_k": 3, "num_nodes": 8}.items() if k in MODE_SETTINGS[tree]}
            spec = SpecConfig(method=method, drafter=str(checkpoints[METHODS[method].family]), tree=tree, **settings)
            drafters.append(build_drafter(target, spec))
    for drafter in drafters:
        got = [generate(target, p, 24, drafter=drafter).token_ids for p in prompts]
        assert got == expected, f"{drafter.name} changed the trained target's greedy output"


def test_draft_without_built_target_says_what_to_do(job_env):
    from eyas.config import load_config
    from jobs.train_target import TargetJobConfig, build

    with pytest.raises(FileNotFoundError, match="jobs/configs/target-micro.yaml"):
        build(load_config(TargetJobConfig, DRAFT_MICRO))


# ---------------------------------------------------------------- a real cluster + ray job submit


@pytest.fixture()
def ray_head():
    """A head node of our own (token auth on), yielding the dashboard address; torn down by its process group."""
    with LocalRayHead(num_cpus=2) as head:
        yield head


def test_ray_job_submit_builds_micro_target(ray_head, tmp_path):
    from mlflow import MlflowClient

    home, uri = tmp_path / "eyas-home", f"sqlite:///{tmp_path / 'mlruns.db'}"
    runtime_env = {
        # .gitignore is honoured too (.venv/, mlruns.db, mlartifacts/); be explicit for the big ones
        "excludes": [".git", ".venv", "mlartifacts", "mlruns.db", "out"],
        "env_vars": {"EYAS_HOME": str(home), "MLFLOW_TRACKING_URI": uri, "TOKENIZERS_PARALLELISM": "false"},
    }
    cmd = [local_ray.ray_cli(), "job", "submit", "--address", ray_head.address, "--working-dir", ".",
           "--runtime-env-json", json.dumps(runtime_env), "--",
           sys.executable, "-m", "jobs.train_target", "--config", "jobs/configs/target-micro.yaml",
           "train.num_steps=10", "num_samples=0"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=ray_head.env, capture_output=True, text=True, timeout=420)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "succeeded" in output, output[-4000:]
    meta = assert_loadable_checkpoint(home / "targets" / "micro", vocab_size=512)
    assert meta["steps"] == 10
    run = MlflowClient(tracking_uri=uri).get_run(meta["mlflow_run_id"])
    assert run.info.status == "FINISHED"
