"""init_ray's local Ray: Ray Train's PlacementGroupCleaner polls the State API, which a Ray without a dashboard does
not have, so init_ray's workers start with its logger at ERROR (it warned once a second for a whole training)."""
from __future__ import annotations

import logging

import pytest

from eyas_ray.allocator import ALLOCATOR_VAR, allocator_library
from eyas_ray import auth
from eyas_ray.cluster import PG_CLEANER_LOGGER, init_ray, with_quiet_state_api


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """One init_ray per process: Ray reads its auth token once, so a second local Ray under another HOME fails."""
    import ray

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))
        for name in (auth.TOKEN, auth.TOKEN_PATH, "RAY_ADDRESS", "LD_PRELOAD", ALLOCATOR_VAR):
            monkeypatch.delenv(name, raising=False)
        init_ray(preload_allocator=True, num_cpus=1)
        yield ray
        ray.shutdown()


def test_workers_of_a_local_ray_without_dashboard_hear_only_errors_from_the_pg_cleaner(local_ray):
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


def test_training_workers_start_on_the_preloaded_allocator(local_ray):
    """init_ray(preload_allocator=True): every worker of the job runs with tcmalloc or jemalloc mapped (a training
    step's varied tensor sizes fragment glibc's heap: eyas_ray.allocator). Ray's own wheel ships jemalloc, so one is
    always there."""
    library = allocator_library("auto")
    assert library is not None

    @local_ray.remote(num_cpus=0)
    def mapped() -> tuple[str, str]:
        import os
        from pathlib import Path

        return os.environ.get("LD_PRELOAD", ""), Path("/proc/self/maps").read_text()

    preload, maps = local_ray.get(mapped.remote())
    assert preload == library
    name = library.rsplit("/", 1)[-1].split(".so")[0]  # libtcmalloc_minimal / libjemalloc
    assert name in maps
