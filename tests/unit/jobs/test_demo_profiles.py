"""The demo's profiles name configs that exist and overrides that the jobs accept (no Ray, no training)."""
from __future__ import annotations

from pathlib import Path

import pytest

from eyas.config import load_config
from eyas.train.config import TrainConfig
from jobs.demo import DEMO_EPOCHS, PROFILES

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_configs_exist_and_overrides_parse(name):
    profile = PROFILES[name]
    for path in (profile.target, profile.draft, profile.data, *profile.drafters, profile.sweep, profile.serve):
        assert (REPO_ROOT / path).is_file(), path
    assert set(profile.overrides) <= set(profile.drafters), "overrides must name one of the profile's drafters"
    for path in profile.drafters:
        cfg = load_config(TrainConfig, REPO_ROOT / path, list(profile.overrides.get(path, ())))
        assert cfg.train.num_epochs >= 1


def test_tiny_demo_trains_the_table_drafters_for_demo_epochs():
    profile = PROFILES["tiny"]
    families = {load_config(TrainConfig, REPO_ROOT / p).drafter.type for p in profile.drafters}
    assert families == {"eagle1", "eagle3", "dflash"}  # eagle1 also serves the eagle2 row
    for path in profile.drafters:
        cfg = load_config(TrainConfig, REPO_ROOT / path, list(profile.overrides[path]))
        assert cfg.train.num_epochs == DEMO_EPOCHS
