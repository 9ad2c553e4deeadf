"""init_ray's local Ray: Ray Train's PlacementGroupCleaner polls the State API, which a Ray without a dashboard does
not have, so init_ray's workers start with its logger at ERROR (it warned once a second for a whole training)."""
from __future__ import annotations

import logging

import pytest

from eyas_ray import auth
from eyas_ray.cluster import PG_CLEANER_LOGGER, init_ray, with_quiet_state_api


@pytest.fixture()
def local_ray(tmp_path, monkeypatch):
    import ray

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in (auth.TOKEN, auth.TOKEN_PATH, "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    yield ray
    ray.shutdown()


def test_workers_of_a_local_ray_without_dashboard_hear_only_errors_from_the_pg_cleaner(local_ray):
    init_ray(num_cpus=1)

    @local_ray.remote(num_cpus=0)
    def levels() -> tuple[int, int]:
        return logging.getLogger(PG_CLEANER_LOGGER).getEffectiveLevel(), logging.getLogger("ray.train").level

    cleaner, train = local_ray.get(levels.remote())
    assert cleaner == logging.ERROR
    assert train != logging.ERROR  # Ray Train's other warnings still reach the user


def test_a_setup_hook_of_the_callers_own_is_kept():
    assert with_quiet_state_api({"worker_process_setup_hook": "mine.hook"})["worker_process_setup_hook"] == "mine.hook"
    env = with_quiet_state_api({"env_vars": {"A": "1"}})
    assert env == {"env_vars": {"A": "1"}, "worker_process_setup_hook": "eyas_ray.cluster.quiet_state_api_warnings"}
