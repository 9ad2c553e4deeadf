"""tune/measure.py and tune/report.py without Ray: the interleaved speed measurement on a tiny random target, the
curve table, the choice of the best trial and the best-config YAML that jobs.generate reads."""
from __future__ import annotations

import argparse

import torch
import yaml

from eyas.decoding.generate import generate
from eyas.decoding.stats import SpecStats
from eyas.drafters.draft_lm import DraftLMConfig, DraftLMDrafter
from eyas.drafters.hybrid import HybridDrafter
from eyas.methods import SpecConfig, build_drafter, drafter_factory
from eyas.models import Decoder, ModelConfig
from tune.config import SweepConfig, load_sweep
from tune.measure import measure_speed, prompt_batches
from tune.report import best_documents, best_row, choose_schedule, curve_table, write_outputs, x_key


def tiny_target() -> Decoder:
    torch.manual_seed(0)
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
    target = Decoder(config).eval().requires_grad_(False)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # sharp: greedy continuations repeat, so n-grams get accepted
    return target


def test_measure_speed_interleaves_and_matches_vanilla():
    target = tiny_target()
    drafter = build_drafter(target, SpecConfig(method="ngram", num_draft=3))
    prompts = [[1, 2, 3, 4, 1, 2], [5, 6, 7], [9, 9, 9, 9]]
    metrics = measure_speed(target, lambda: drafter, prompts, 16, eos_token_ids=(), warmup_prompts=1, repeats=2)
    assert metrics["greedy_identical"] == 1.0
    # tau over both timed passes is what generate() gives on the prompts, twice
    alone = SpecStats()
    for prompt in prompts:
        alone = alone.merge(generate(target, prompt, 16, drafter=drafter).stats)
    assert metrics["tau"] == alone.tau and metrics["cycles"] == 2 * alone.cycles
    assert [metrics[f"accept_depth_{d + 1}"] for d in range(len(alone.per_depth_accept))] == alone.per_depth_accept
    assert metrics["speedup"] == metrics["tokens_per_s"] / metrics["vanilla_tokens_per_s"]
    assert metrics["new_tokens"] == 2 * 3 * 16  # two timed passes over three prompts


def test_measure_speed_reports_a_hybrids_acceptance_per_proposer():
    target = tiny_target()
    spec = SpecConfig(method="hybrid", proposers=("suffix", "draft-lm"), num_nodes=8)
    make = lambda: HybridDrafter(build_drafter(target, SpecConfig(method="suffix", min_match=1)),  # noqa: E731
                                 DraftLMDrafter(target, DraftLMConfig(num_draft=3), max_len=256), spec.num_nodes)
    metrics = measure_speed(target, make, [[1, 2, 3, 4, 1, 2], [5, 6, 7]], 32, eos_token_ids=(), warmup_prompts=0,
                            repeats=1)  # the sharp target's greedy text loops: its suffixes repeat
    assert metrics["greedy_identical"] == 1.0
    assert metrics["accept_draft-lm_depth_1"] == 1.0  # the target drafting for itself
    assert "accept_suffix_depth_1" in metrics


def test_measure_speed_batches_concurrent_requests_under_a_node_cap():
    """batch_size B: ceil(P / B) batches of B requests through the batched engine (the prompts cycle to fill the
    last one); the cap limits every tree, 0 decodes plainly; greedy output is vanilla's per request."""
    target = tiny_target()
    spec = SpecConfig(method="ngram", num_draft=3)
    prompts = [[1, 2, 3, 4, 1, 2], [5, 6, 7], [9, 9, 9, 9]]
    assert prompt_batches(prompts, 2) == [prompts[:2], [prompts[2], prompts[0]]]
    full = measure_speed(target, drafter_factory(target, spec), prompts, 16, (), warmup_prompts=1, batch_size=2)
    assert full["greedy_identical"] == 1.0 and full["new_tokens"] == 4 * 16
    assert 0 < full["draft_nodes_per_cycle"] <= 3 and full["tau"] > 1.0
    capped = measure_speed(target, drafter_factory(target, spec), prompts, 16, (), batch_size=2, max_draft_nodes=1)
    assert capped["greedy_identical"] == 1.0 and 0 < capped["draft_nodes_per_cycle"] <= 1
    off = measure_speed(target, drafter_factory(target, spec), prompts, 16, (), batch_size=3, max_draft_nodes=0)
    assert off["greedy_identical"] == 1.0 and off["draft_nodes_per_cycle"] == 0 and off["tau"] == 1.0


def sweep(tmp_path) -> SweepConfig:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "name": "s", "target": str(tmp_path / "target"),
        "spec": {"method": "eagle3", "drafter": str(tmp_path / "drafter")},
        "search": {"space": {"num_nodes": [4, 8], "top_k": [2, 4], "depth": [3]}}}))
    return load_sweep(path)


def row(point, speedup, tau, error=None):
    return {"trial_id": str(point), "point": point, "metrics": {"speedup": speedup, "tau": tau}, "epochs": 1,
            "history": [], "early_stopped": False, "error": error, "checkpoint": None}


def test_curve_table_has_one_line_per_other_key_and_best_skips_failures(tmp_path):
    s = sweep(tmp_path)
    rows = [row({"num_nodes": 4, "top_k": 2, "depth": 3}, 1.1, 2.0),
            row({"num_nodes": 8, "top_k": 2, "depth": 3}, 1.3, 2.4),
            row({"num_nodes": 8, "top_k": 2, "depth": 3}, 1.5, 2.6),  # a second sample of the same point
            row({"num_nodes": 4, "top_k": 4, "depth": 3}, 0.9, 2.1),
            row({"num_nodes": 8, "top_k": 4, "depth": 3}, 9.9, 9.9, error="RuntimeError: boom")]
    assert x_key(s) == "num_nodes"
    table = curve_table(s, rows)
    assert list(table) == ["top_k=2, depth=3", "top_k=4, depth=3"]
    assert table["top_k=2, depth=3"][8] == {"speedup": 1.4, "tau": 2.5}
    assert 8 not in table["top_k=4, depth=3"]  # the failed trial is left out
    assert best_row(s, rows)["metrics"]["speedup"] == 1.5


def test_best_yaml_is_read_by_jobs_generate(tmp_path):
    from jobs.generate import spec_from_args

    s = sweep(tmp_path)
    best = row({"num_nodes": 8, "top_k": 4, "depth": 3}, 1.2, 2.2)
    document = best_documents(s, best, tmp_path)["best.yaml"]
    path = tmp_path / "best.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    args = argparse.Namespace(config=str(path), target=None, method=None, drafter=None, draft_model=None, tree=None,
                              tree_depth=None, tree_top_k=None, tree_nodes=None, num_draft=None)
    spec, target = spec_from_args(args)
    assert (spec.method, spec.num_nodes, spec.top_k, spec.depth) == ("eagle3", 8, 4, 3)
    assert target == str((tmp_path / "target").resolve())
    assert document["sweep"]["objective"] == "speedup" and document["sweep"]["value"] == 1.2


def schedule_row(batch_size, budget, speedup, error=None):
    point = {"batch_size": batch_size, "max_draft_nodes": budget}
    metrics = {"speedup": speedup, "tokens_per_s": 10.0 * speedup, "vanilla_tokens_per_s": 10.0, "tau": 1.5,
               "greedy_identical": 1.0}
    return {**row(point, speedup, 1.5, error), "metrics": metrics}


def test_schedule_is_the_best_budget_per_batch_size_and_serving_reads_it_as_is(tmp_path):
    from eyas_ray.serve_config import ServeArgs

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "name": "s", "target": str(tmp_path / "target"), "output": {"dir": str(tmp_path / "out")},
        "dtype": "bfloat16", "spec": {"method": "eagle3", "drafter": str(tmp_path / "drafter"), "num_nodes": 8},
        "search": {"space": {"batch_size": [1, 2, 4], "max_draft_nodes": [0, 4, 8]}}}))
    s = load_sweep(path)
    rows = [schedule_row(1, 0, 0.97), schedule_row(1, 4, 1.30), schedule_row(1, 8, 1.25),
            schedule_row(2, 0, 1.00), schedule_row(2, 4, 1.10), schedule_row(2, 4, 0.90),  # mean 1.0: a tie
            schedule_row(4, 0, 0.95), schedule_row(4, 8, 9.90, error="RuntimeError: boom")]
    choice = choose_schedule(rows)
    assert {size: cell["max_draft_nodes"] for size, cell in choice.items()} == {1: 4, 2: 0, 4: 0}
    assert choice[1]["speedup"] == 1.30 and choice[1]["tokens_per_s"] == 13.0
    files = write_outputs(s, rows, best_row(s, rows), "python -m tune.sweep --config s.yaml")
    fragment = yaml.safe_load(files["schedule.yaml"].read_text())
    # the dtype it was measured in travels with the schedule (serving's `dtype:`)
    assert fragment == {"dtype": "bfloat16", "speculation_by_batch": {1: 4, 2: 0, 4: 0}}
    assert "python -m jobs.load" in files["schedule.yaml"].read_text()
    assert "--arg dtype=bfloat16" in files["schedule.yaml"].read_text()
    best = yaml.safe_load(files["best.yaml"].read_text())
    assert best["spec"]["num_nodes"] == 8 and best["sweep"]["schedule"][1]["max_draft_nodes"] == 4
    # the fragment pasted as is under a Serve config's args, next to the spec it was measured with
    args = ServeArgs.from_args({"target": str(tmp_path / "target"), "spec_file": str(files["best.yaml"]),
                                **fragment})
    assert args.spec.method == "eagle3" and args.schedule.max_draft_nodes(3) == 0 and args.dtype == "bfloat16"
    assert args.schedule.max_draft_nodes(1) == 4 and args.schedule.max_draft_nodes(8) == 0


def test_optuna_domains_follow_the_ranges(tmp_path):
    from ray.tune.search.sample import Categorical, Float, Integer

    from tune.space import parse_param
    from tune.sweep import domain

    assert isinstance(domain(parse_param("num_nodes", [4, 8])), Categorical)
    depth = domain(parse_param("depth", {"low": 2, "high": 6}))
    assert isinstance(depth, Integer) and (depth.lower, depth.upper) == (2, 7)  # randint's upper is exclusive
    lr = domain(parse_param("optim.lr", {"low": 1e-4, "high": 1e-2, "log": True}))
    assert isinstance(lr, Float) and (lr.lower, lr.upper) == (1e-4, 1e-2)
