"""jobs.train_target end to end: the micro target through Ray Train (2 workers). The same job through `ray job submit`
on a token-auth cluster of our own is tests/integration/test_demo.py's first step (its checkpoint checked there too).

Everything lands in tmp dirs (EYAS_HOME, the MLflow sqlite store).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from integration_testing import assert_loadable_checkpoint

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
