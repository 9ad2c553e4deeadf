"""tune/config.py without Ray: the search space, every bad input the sweep must refuse before a trial starts, and
the CLI's exit status for each (no Ray is ever started)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from eyas.config import ConfigError
from eyas.drafters.suffix import SuffixConfig
from eyas.methods import hybrid_parts, retrieval_prior, suffix_config
from tune.config import load_sweep
from tune.space import parse_param
from tune.preflight import preflight

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "tune" / "configs"

INFERENCE = {
    "name": "t",
    "target": "target-x",
    "spec": {"method": "eagle3", "drafter": "$EYAS_HOME/drafters/eagle3-x"},
    "search": {"space": {"num_nodes": [4, 8], "top_k": [2, 4]}},
}
SCHEDULE = {
    "name": "sch",
    "target": "target-x",
    "spec": {"method": "eagle3", "drafter": "$EYAS_HOME/drafters/eagle3-x", "num_nodes": 8},
    "search": {"space": {"batch_size": [1, 2, 4], "max_draft_nodes": [0, 4, 8]}},
}
TRAINING = {
    "name": "tt",
    "training": {"target": "target-x", "data": "data-x",
                 "drafter": {"type": "dflash", "config": {"num_layers": 1, "block_size": 4, "num_taps": 1}}},
    "search": {"objective": "sim_tau", "space": {"drafter.config.block_size": [4, 8],
                                                 "drafter.config.loss_decay": [2.0, 7.0]}},
    "measure": {"num_prompts": 0},
}


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def load(tmp_path: Path, data: dict, *overrides: str):
    return load_sweep(write(tmp_path, data), list(overrides))


def test_every_shipped_config_parses():
    for path in sorted(CONFIGS.glob("*.yaml")):
        sweep = load_sweep(path)
        assert sweep.points()[0], path


def test_the_suffix_and_hybrid_knobs_reach_the_trial_spec():
    suffix = load_sweep(CONFIGS / "suffix-smollm2.yaml")
    spec = suffix.trial_section({"num_nodes": 8, "num_draft": 16, "min_match": 1, "min_prob": 0.3})
    assert suffix_config(spec) == SuffixConfig(depth=16, num_nodes=8, min_match=1, min_prob=0.3)
    hybrid = load_sweep(CONFIGS / "hybrid-smollm2.yaml")
    spec = hybrid.trial_section({"num_nodes": 4, "retrieval_prior": 0.9, "num_draft": 12, "min_match": 1,
                                 "learned_below": 0.4, "cost_cut": True})
    retrieval, learned = hybrid_parts(spec)
    assert (spec.num_nodes, retrieval_prior(spec.retrieval_prior)) == (4, pytest.approx((3.6, 0.4)))
    assert (spec.learned_below, spec.cost_cut) == (0.4, True)
    assert suffix_config(retrieval) == SuffixConfig(depth=12, min_match=1) and learned.method == "eagle3"


def test_inference_points_and_defaults(tmp_path):
    sweep = load(tmp_path, INFERENCE)
    assert sweep.kind == "inference" and sweep.metric == "speedup"
    points, invalid = sweep.points()
    assert points == [{"num_nodes": 4, "top_k": 2}, {"num_nodes": 4, "top_k": 4}, {"num_nodes": 8, "top_k": 2},
                      {"num_nodes": 8, "top_k": 4}] and not invalid
    spec = sweep.trial_section({"num_nodes": 8, "top_k": 4})
    assert (spec.method, spec.num_nodes, spec.top_k) == ("eagle3", 8, 4)
    assert sweep.output_dir.name == "t"


def test_training_points_build_train_configs(tmp_path):
    sweep = load(tmp_path, TRAINING, "search.space.optim.lr=[1.0e-3]")
    assert sweep.kind == "training" and sweep.training.name == "tt"  # training.name defaults to the sweep's
    cfg = sweep.trial_section({"drafter.config.block_size": 8, "drafter.config.loss_decay": 7.0})
    assert cfg.drafter.config["block_size"] == 8 and cfg.drafter.config["loss_decay"] == 7.0


def test_ranges_for_grid_and_optuna():
    assert parse_param("depth", {"low": 2, "high": 8, "step": 3}).grid_values() == [2, 5, 8]
    assert parse_param("num_nodes", {"low": 4, "high": 6}).grid_values() == [4, 5, 6]
    assert parse_param("x", {"low": 0.5, "high": 1.0, "step": 0.25}).grid_values() == [0.5, 0.75, 1.0]
    assert parse_param("lr", {"low": 1e-4, "high": 1e-2, "log": True}).check_values() == [1e-4, 1e-2]
    assert parse_param("lr", {"low": "1e-4", "high": "1e-2"}).low == 1e-4  # YAML 1.1 reads 1e-4 as a string
    assert parse_param("lr", ["5e-3", 1.0e-3]).values == (5e-3, 1e-3)
    with pytest.raises(ConfigError, match="cannot be gridded"):
        parse_param("lr", {"low": 1e-4, "high": 1e-2}).grid_values()


@pytest.mark.parametrize("change, message", [
    ({"bogus": 1}, r"unknown key\(s\) \['bogus'\]"),
    ({"search": {"space": {"nodes": [4]}}}, "unknown key for an inference sweep; searchable spec fields"),
    ({"search": {"space": {"num_nodes": []}}}, "empty list"),
    ({"search": {"space": {"num_nodes": {"low": 16, "high": 4}}}}, "empty range: low=16 is above high=4"),
    ({"search": {"space": {}}}, "search.space=.*is empty"),
    ({"search": {"space": {"num_nodes": [4, 8], "top_k": [8]}}},
     r"impossible combination.*spec.top_k=8: cannot exceed the node budget spec.num_nodes=4"),
    ({"search": {"space": {"num_nodes": [64]}}}, "at most 63"),
    ({"search": {"space": {"num_nodes": [4]}, "objective": "sim_tau"}}, "sim_tau is a training metric"),
    ({"search": {"space": {"num_nodes": [4]}, "objective": "accuracy"}}, "must be one of"),
    ({"search": {"algorithm": "optuna", "skip_invalid": True, "space": {"num_nodes": [4]}}},
     "only a grid can drop"),
    ({"search": {"space": {"num_nodes": {"low": 4.0, "high": 8.5}}}}, "cannot be gridded"),
    ({"spec": {"method": "vanilla"}}, "vanilla does not speculate"),
    ({"spec": {"method": "eagle3", "top_k": 16, "num_nodes": 8}}, "spec.top_k=16: cannot exceed"),
    ({"training": TRAINING["training"]}, "give exactly one of"),
    ({"resources": {"cpus_per_trial": 0}}, "a trial needs some CPU or GPU"),
])
def test_bad_inference_input_is_a_config_error(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, {**INFERENCE, **change})


@pytest.mark.parametrize("change, message", [
    ({"search": {"objective": "sim_tau", "space": {"drafter.config.blocksize": [4]}}},
     r"unknown key; drafter.config has \[.*'block_size'"),
    ({"search": {"objective": "sim_tau", "space": {"scaling.num_workers": [1, 2]}}},
     "unknown key for a training sweep"),
    ({"search": {"objective": "sim_tau", "space": {"drafter.config.block_size": [1, 4]}}},
     r"impossible combination.*training.drafter.config.block_size=1: must be >= 2"),
    ({"search": {"objective": "speedup", "space": {"optim.lr": [1e-3]}}}, "needs measure.num_prompts >= 1"),
    ({"target": "target-x"}, "reads its target from training.target"),
    ({"runner": "ray-train", "search": {"objective": "speedup", "space": {"optim.lr": [1e-3]}},
      "measure": {"num_prompts": 2}}, "runner ray-train reports sim_tau and tau"),
])
def test_bad_training_input_is_a_config_error(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, {**TRAINING, **change})


def test_schedule_points_keep_the_spec_fixed(tmp_path):
    sweep = load(tmp_path, SCHEDULE)
    assert sweep.kind == "schedule" and sweep.metric == "speedup"
    points, invalid = sweep.points()
    assert len(points) == 9 and not invalid and points[1] == {"batch_size": 1, "max_draft_nodes": 4}
    assert sweep.trial_section({"batch_size": 4, "max_draft_nodes": 0}) == sweep.spec  # the engine's keys, not spec's


@pytest.mark.parametrize("space, change, message", [
    ({"batch_size": [1, 2]}, {}, r"search.space=.*searches exactly \['batch_size', 'max_draft_nodes'\]"),
    ({"batch_size": [1], "max_draft_nodes": [0], "num_nodes": [4]}, {}, "searches exactly"),
    ({"max_draft_nodes": [0, 4]}, {}, "searches exactly"),
    ({"batch_size": [2, 4], "max_draft_nodes": [0]}, {}, r"search.space.batch_size=\[2, 4\]: needs 1"),
    ({"batch_size": [0, 1], "max_draft_nodes": [0]}, {}, "search.space.batch_size=.*whole numbers >= 1"),
    ({"batch_size": [1], "max_draft_nodes": [-1, 4]}, {}, "search.space.max_draft_nodes=.*whole numbers >= 0"),
    ({"batch_size": [1], "max_draft_nodes": [64]}, {}, "search.space.max_draft_nodes=.* and <= 63"),
    ({"batch_size": [1], "max_draft_nodes": {"low": 0, "high": 8}}, {}, "search.space.max_draft_nodes=.*a list"),
    ({"batch_size": [1.5, 1], "max_draft_nodes": [0]}, {}, "search.space.batch_size=.*whole numbers"),
    (None, {"objective": "tau"}, "search.objective='tau': a schedule sweep picks .* use speedup"),
    (None, {"algorithm": "optuna"}, "search.algorithm='optuna': .* use grid"),
])
def test_bad_schedule_input_names_the_yaml_key_and_file(tmp_path, space, change, message):
    search = {**SCHEDULE["search"], **change, **({"space": space} if space is not None else {})}
    with pytest.raises(ConfigError, match=message) as err:
        load(tmp_path, {**SCHEDULE, "search": search})
    assert str(err.value).endswith(f" in {tmp_path / 'sweep.yaml'}")


def test_an_inference_sweep_measures_the_target_in_its_dtype(tmp_path):
    assert load(tmp_path, SCHEDULE).dtype == "float32"
    assert load(tmp_path, {**SCHEDULE, "dtype": "bfloat16"}).dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"dtype='bf16': must be one of \['float32', 'bfloat16', 'float16'\]"):
        load(tmp_path, {**INFERENCE, "dtype": "bf16"})
    with pytest.raises(ConfigError, match="dtype='bfloat16': a training sweep trains in float32"):
        load(tmp_path, {**TRAINING, "dtype": "bfloat16"})


def test_a_schedule_sweep_needs_a_speculative_method(tmp_path):
    with pytest.raises(ConfigError, match="spec.method='vanilla': vanilla does not speculate"):
        load(tmp_path, {**SCHEDULE, "spec": {"method": "vanilla"}})
    with pytest.raises(ConfigError, match=r"unknown key for an inference sweep.*a schedule sweep: \['batch_size'"):
        load(tmp_path, {**INFERENCE, "search": {"space": {"batch": [1]}}})


def test_skip_invalid_drops_impossible_grid_points(tmp_path):
    sweep = load(tmp_path, {**INFERENCE, "search": {"space": {"num_nodes": [2, 8], "top_k": [2, 4]},
                                                    "skip_invalid": True}})
    points, invalid = sweep.points()
    assert {"num_nodes": 2, "top_k": 4} not in points and len(points) == 3
    assert invalid == [({"num_nodes": 2, "top_k": 4}, "spec.top_k=4: cannot exceed the node budget spec.num_nodes=2")]


def test_missing_files_fail_the_preflight(tmp_path, eyas_home):
    sweep = load(tmp_path, INFERENCE)
    with pytest.raises(ConfigError, match="target=.*target-x: no checkpoint there"):
        preflight(sweep)
    (eyas_home / "targets" / "target-x").mkdir(parents=True)
    (eyas_home / "targets" / "target-x" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"spec.drafter=.*eagle3-x: no checkpoint there \(a drafter is trained with"):
        preflight(sweep)
    training = load(tmp_path, TRAINING)
    with pytest.raises(ConfigError, match="training.data='data-x': .* holds no shards"):
        preflight(training)


@pytest.mark.parametrize("overrides, message", [
    (["search.space.num_nodes=[]"], "empty list"),
    (["search.space.top_k=[16]"], "impossible combination"),
    (["spec.method=eagle9"], "spec.method='eagle9': must be one of"),
    (["search.space.depht=[2]"], "unknown key for an inference sweep"),
    ([], "spec.drafter=.*no checkpoint there"),
])
def test_cli_refuses_bad_input_before_starting_ray(tmp_path, eyas_home, capsys, overrides, message):
    import ray

    from tune.sweep import main

    target = eyas_home / "targets" / "target-x"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({}))
    assert main(["--config", str(write(tmp_path, INFERENCE)), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and __import__("re").search(message, err), err
    assert not ray.is_initialized()


def test_a_bare_drafter_name_reaches_the_trials_as_its_directory(tmp_path, monkeypatch):
    """tune/configs name the shipped drafter by name; trials run elsewhere, so the context holds its directory."""
    from tune.preflight import absolute_spec
    from eyas.methods import SpecConfig

    shipped = tmp_path / "shipped"
    monkeypatch.setenv("EYAS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("eyas.train.config.SHIPPED_DRAFTERS", shipped)
    (shipped / "eagle3-t").mkdir(parents=True)
    (shipped / "eagle3-t" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    spec = SpecConfig(method="eagle3", drafter="eagle3-t")
    assert absolute_spec(spec)["drafter"] == str((shipped / "eagle3-t").resolve())


def test_a_trial_can_reserve_memory_and_a_cluster_too_small_is_named(tmp_path):
    """resources.memory_gb_per_trial goes into Tune's resources (Ray's "memory"), so no more trials start than a node's
    memory holds; a cluster with less than one trial's share is refused before any trial, in GB."""
    from tune.sweep import concurrency, trial_needs

    sweep = load(tmp_path, {**TRAINING, "resources": {"cpus_per_trial": 2, "memory_gb_per_trial": 12}})
    assert sweep.resources.tune_resources() == {"cpu": 2, "memory": 12e9}
    assert trial_needs(sweep) == {"CPU": 2, "memory": 12e9}
    assert concurrency(sweep, {"CPU": 2.0, "memory": 17.5e9}) is None  # Tune's accounting: one at a time here
    with pytest.raises(ConfigError, match="a trial needs 12 GB of memory but the Ray cluster has 8.0 GB"):
        concurrency(sweep, {"CPU": 2.0, "memory": 8e9})
    with pytest.raises(ConfigError, match="memory_gb_per_trial"):
        load(tmp_path, {**TRAINING, "resources": {"memory_gb_per_trial": 0}})
    assert load(tmp_path, TRAINING).resources.tune_resources() == {"cpu": 1.0}
