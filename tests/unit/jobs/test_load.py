"""jobs.load's pieces that need no server: the two applications it deploys, percentiles and ratios."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from eyas.config import ConfigError
from jobs.load import add_ratios, app_configs, configured_schedule, main, percentile

REPO = Path(__file__).resolve().parents[3]


def test_spec_and_vanilla_twins_run_on_one_replica_each():
    config = yaml.safe_load((REPO / "serving" / "configs" / "tiny.yaml").read_text())
    configs = app_configs(config, "/t", 8123, ["max_batch_size=4", "spec.num_draft=3"])
    spec, vanilla = (configs[m]["applications"][0] for m in ("spec", "vanilla"))
    assert (spec["route_prefix"], vanilla["route_prefix"]) == ("/spec", "/vanilla")
    assert spec["args"]["target"] == vanilla["args"]["target"] == "/t"
    assert spec["args"]["spec"]["num_draft"] == 3 and vanilla["args"]["spec"] == {"method": "vanilla"}
    assert spec["args"]["max_batch_size"] == vanilla["args"]["max_batch_size"] == 4
    for app in (spec, vanilla):
        assert app["deployments"][0]["num_replicas"] == 1 and "autoscaling_config" not in app["deployments"][0]
    assert configs["spec"]["http_options"] == {"host": "127.0.0.1", "port": 8123}
    assert config["applications"][0]["deployments"][0]["autoscaling_config"]  # the input is left as it was


def test_percentiles_and_ratios():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    results = [{"mode": m, "concurrency": c, "tokens_per_s": t}
               for m, c, t in (("spec", 1, 30.0), ("vanilla", 1, 10.0), ("spec", 4, 90.0), ("vanilla", 4, 45.0))]
    add_ratios(results)
    assert [(r["speedup"], r["scaling"]) for r in results] == [(3.0, 1.0), (1.0, 1.0), (2.0, 3.0), (1.0, 4.5)]


def test_greedy_identity_compares_each_request_with_vanilla_at_the_same_concurrency():
    def row(mode, c, texts):
        return {"mode": mode, "concurrency": c, "tokens_per_s": 10.0, "texts": texts}

    results = [row("spec", 1, {0: "a", 1: "b"}), row("vanilla", 1, {0: "a", 1: "b"}),
               row("spec", 2, {0: "a", 1: "x", 2: "c", 3: "d"}), row("vanilla", 2, {0: "a", 1: "b", 2: "c", 3: "d"})]
    add_ratios(results, greedy=True)
    assert [r["greedy_identical"] for r in results] == [1.0, None, 0.75, None]
    assert not any("texts" in r for r in results)  # the report keeps no texts
    sampled = [row("spec", 1, {0: "a"}), row("vanilla", 1, {0: "b"})]
    add_ratios(sampled)  # sampled runs: texts may differ, nothing is judged
    assert [r["greedy_identical"] for r in sampled] == [None, None]


def test_the_schedule_measured_is_the_user_configs_else_the_args():
    app = {"args": {"target": "/t", "speculation_by_batch": {1: 3, 4: 0}},
           "deployments": [{"name": "EyasServer"}]}
    assert configured_schedule(app) == {1: 3, 4: 0}
    app["deployments"][0]["user_config"] = {"speculation_by_batch": {"1": None, "2": 2}}
    assert configured_schedule(app) == {1: None, 2: 2}  # what the replica serves with: reconfigure wins
    app["deployments"][0]["user_config"] = {"speculation_by_batch": {2: 2}}
    with pytest.raises(ConfigError, match="user_config.speculation_by_batch .* batch size 1"):
        configured_schedule(app)


def test_a_bad_user_config_or_baseline_stops_before_ray_starts(tmp_path, capsys):
    config = yaml.safe_load((REPO / "serving" / "configs" / "micro.yaml").read_text())
    config["applications"][0]["deployments"][0]["user_config"] = {"speculation_by_batch": {1: -2}}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["--config", str(path), "--target", "/t", "--out", str(tmp_path / "load.json")]) == 2
    assert "user_config.speculation_by_batch[1]=-2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", str(path), "--baseline", "neighbour"])
    assert not (tmp_path / "load.json").exists()


def test_passes_run_outermost_and_spec_meets_the_traffic_first():
    from jobs.traffic import rounds

    assert rounds([1], 2) == [(1, 1, "spec"), (1, 1, "vanilla"), (2, 1, "vanilla"), (2, 1, "spec")]
    # one pass: spec and vanilla alternate level by level, as before passes existed
    assert rounds([1, 4, 8], 1) == [(1, 1, "spec"), (1, 1, "vanilla"), (1, 4, "vanilla"), (1, 4, "spec"),
                                    (1, 8, "spec"), (1, 8, "vanilla")]
    assert [(p, c) for p, c, _ in rounds([1, 2], 2)][::2] == [(1, 1), (1, 2), (2, 1), (2, 2)]


def test_each_pass_is_compared_with_vanillas_of_the_same_pass():
    def row(mode, n, tokens_per_s, texts):
        return {"mode": mode, "concurrency": 1, "pass": n, "tokens_per_s": tokens_per_s, "texts": texts}

    results = [row("spec", 1, 20.0, {0: "a", 1: "b"}), row("vanilla", 1, 10.0, {0: "a", 1: "b"}),
               row("spec", 2, 60.0, {0: "a", 1: "x"}), row("vanilla", 2, 12.0, {0: "a", 1: "b"})]
    add_ratios(results, greedy=True)
    assert [r["speedup"] for r in results] == [2.0, 1.0, 5.0, 1.0]
    assert [r["scaling"] for r in results] == [1.0] * 4  # over the same mode and pass at the lowest concurrency
    assert [r["greedy_identical"] for r in results] == [1.0, None, 0.5, None]


def test_traffic_from_a_file_a_suite_or_chat_token_ids(tmp_path, monkeypatch, chat_tokenizer):
    from argparse import Namespace

    from eyas import datasets
    from jobs import traffic

    def args(**given):
        return Namespace(**{"prompts_file": None, "suite": "code", "num_prompts": 2, "max_prompt_chars": 5,
                            "max_prompt_tokens": 64, **given})

    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt": "one two three"}\n\n{"prompt": "four"}\n{"prompt": "five"}\n')
    assert traffic.traffic_prompts(args(prompts_file=str(file)), None) == ["three", "four"]  # cut to their end
    file.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ConfigError, match=r"p.jsonl:1: expected one JSON object"):
        traffic.traffic_prompts(args(prompts_file=str(file)), None)
    assert all(len(p) <= 5 for p in traffic.traffic_prompts(args(), None))
    # chat: ShareGPT first turns in the target's chat template, sent as token ids (the over-long one skipped)
    monkeypatch.setattr(datasets, "first_user_turns", lambda split, downloader=None: ["a b " * 40, "hello there"])
    monkeypatch.setattr(traffic, "load_tokenizer", lambda path: chat_tokenizer)
    [ids] = traffic.traffic_prompts(args(suite="chat"), str(tmp_path))
    assert chat_tokenizer.decode(ids) == "<|im_start|> user hello there <|im_end|> <|im_start|> assistant"
    with pytest.raises(ConfigError, match="--suite chat .* give --target"):
        traffic.traffic_prompts(args(suite="chat"), None)


def test_bad_passes_or_a_soak_on_token_ids_stop_before_ray_starts(tmp_path, monkeypatch, capsys):
    from jobs import load

    out = str(tmp_path / "load.json")
    micro = str(REPO / "serving" / "configs" / "micro.yaml")
    assert main(["--config", micro, "--target", "/t", "--passes", "0", "--out", out]) == 2
    assert "--passes 0: give at least 1" in capsys.readouterr().err
    monkeypatch.setattr(load, "traffic_prompts", lambda args, target: [[1, 2, 3]])
    assert main(["--config", micro, "--target", "/t", "--soak", "1", "--suite", "chat", "--out", out]) == 2
    assert "--soak writes chat and completion requests around prompt texts" in capsys.readouterr().err
