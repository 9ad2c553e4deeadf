"""LocalRayHead's one-machine Ray Train settings: the names Ray Train reads, and the caller's environment first."""
from __future__ import annotations

from ray.train.v2._internal import constants

from eyas_ray.cluster import LOCAL_TRAIN_ENV
from eyas_ray.local_head import LocalRayHead


def test_the_settings_are_ones_ray_train_reads():
    # a renamed variable in a later Ray would silently do nothing: these are the installed Ray's own names
    assert set(LOCAL_TRAIN_ENV) == {constants.ENABLE_PREEMPTION_WATCHER_ENV_VAR,
                                    constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR}


def test_a_head_passes_them_on_and_the_caller_overrides(monkeypatch):
    monkeypatch.delenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", raising=False)
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "3")
    head = LocalRayHead(num_cpus=1, env={"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "1"})  # not started
    assert head.env["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "1"
    assert head.env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "3"
    assert LocalRayHead(num_cpus=1).env["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
