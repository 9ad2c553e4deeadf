"""`make demo`'s pipeline end to end on the micro configs: a real local Ray (token auth), `ray job submit` for every
build and training step, a Tune sweep, a Serve deployment answering over HTTP, the bench table, MLflow on sqlite.

The micro target the demo builds (jobs.train_target through Ray Train, 2 workers) is checked here as that job's
test: it loads in transformers, its meta.json and MLflow run, its reuse, greedy identity of every drafter family on
it, and a draft LM config reusing its tokenizer. (Building it a second time in a test of its own cost CI a minute.)"""
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
TARGET_MICRO = REPO_ROOT / "jobs" / "configs" / "target-micro.yaml"
DRAFT_MICRO = REPO_ROOT / "jobs" / "configs" / "draft-micro.yaml"

pytestmark = pytest.mark.slow


def test_demo_micro_profile_end_to_end(tmp_path, monkeypatch):
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
    (tmp_path / "demo.log").write_text(log)  # every step's time ("done in ...s"), kept with pytest's tmp dirs
    assert proc.returncode == 0, log[-6000:]
    for step in ("build or reuse the target", "train drafter eagle3-micro", "Tune sweep", "answer one request",
                 "bench every method"):
        assert step in log, f"step {step!r} missing from the demo output"
    assert "POST http://127.0.0.1" in log and "make mlflow-ui" in log
    report = json.loads((out / "bench.json").read_text())
    rows = {r["method"]: r for r in report["results"]}
    assert {"vanilla", "hf", "ngram", "eagle3", "dflash", "dflash-ddtree"} <= set(rows)
    assert not {"draft-lm", "hf-assisted"} & set(rows)  # micro has no draft LM: the bench does not ask for them
    # trained drafters speculate (a tau), vanilla does not (null); their tau values are measured, not asserted
    assert rows["eagle3"]["tau"] is not None and rows["dflash"]["tau"] is not None and rows["vanilla"]["tau"] is None
    assert (out / "sweep" / "best.yaml").is_file()
    assert (home / "drafters" / "eagle3-micro" / "config.json").is_file()
    # the printed table names every method the bench ran
    assert all(method in proc.stdout for method in rows)
    assert_micro_target(home, env["MLFLOW_TRACKING_URI"], monkeypatch)


def assert_micro_target(home: Path, uri: str, monkeypatch) -> None:
    """The demo's micro target (target-micro.yaml, built through `ray job submit` and Ray Train): it loads in
    transformers, meta.json and the MLflow run say what ran, a second build reuses it, it is lossless for every
    drafter family, and a draft LM reuses its tokenizer."""
    from mlflow import MlflowClient

    from eyas.config import load_config
    from jobs.train_target import TargetJobConfig, build, llama_config, prepare_tokenizer, tokenizer_vocab

    monkeypatch.setenv("EYAS_HOME", str(home))
    out = home / "targets" / "micro"
    target_cfg = load_config(TargetJobConfig, TARGET_MICRO)
    assert target_cfg.train.num_workers == 2
    meta = assert_loadable_checkpoint(out, vocab_size=512)
    assert meta["steps"] == target_cfg.train.num_steps and meta["kind"] == "target"
    assert len(meta["samples"]) == target_cfg.num_samples == 1

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(meta["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "micro"
    assert run.data.params["train.num_workers"] == "2" and run.data.params["model.num_layers"] == "2"
    assert abs(run.data.metrics["heldout_loss"] - meta["heldout_loss"]) < 1e-9
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in losses] == [10, 20, 30]  # log_every 10 of 30 steps

    assert build(target_cfg) == out  # reused: meta.json marks a complete build
    assert json.loads((out / "meta.json").read_text())["created"] == meta["created"]

    assert_lossless_on_trained_target(out, home)

    # a draft LM config reuses the built target's tokenizer (jobs/configs/draft-micro.yaml; the demo builds none)
    draft_cfg = load_config(TargetJobConfig, DRAFT_MICRO)
    assert prepare_tokenizer(draft_cfg) == out
    assert llama_config(draft_cfg, tokenizer_vocab(out)).num_hidden_layers == 1


def assert_lossless_on_trained_target(target_dir: Path, home: Path) -> None:
    """Greedy identity on the TRAINED micro target (its argmax is far from uniform, unlike a random model's):
    every drafter family crossed with its tree shapes equals vanilla token for token over 8 held-out prompts (20 took
    42 s of CI)."""
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
    prompts = [tokenizer.encode(p)[:32] for p in corpus.heldout_prompts("all", 8)]  # micro context: 128
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
