"""eyas.track against a tracking server that is not there (a closed loopback port, no mocks): logging calls drop
their values into the gap within seconds, warn once naming them, and a caller's own mistake still raises."""
from __future__ import annotations

import logging
import time

import pytest


@pytest.fixture()
def dead_server(monkeypatch):
    from eyas import track
    from eyas.decoding.tp import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    for key in track.HTTP_RETRY_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(track, "_GAP", track.Gap())
    return track


def test_a_dead_server_drops_calls_fast_warns_once_and_counts(dead_server, caplog):
    track = dead_server
    caplog.set_level(logging.WARNING, logger="eyas.track")
    start = time.monotonic()
    track.log_metrics({"loss": 1.0, "acc_1": 0.5}, step=3)
    track.log_metrics({"loss": 0.9}, step=4)
    track.log_dict({"a": 1}, "summary.json")
    assert time.monotonic() - start < 30  # MLflow's own defaults would retry for minutes
    assert track.gap() == {"metrics": 2, "dict": 1}
    warned = [r.getMessage() for r in caplog.records if r.name == "eyas.track"]
    assert len(warned) == 1 and "unreachable" in warned[0] and "loss, acc_1 at step 3 NOT logged" in warned[0]
    summary = track._GAP.summary()
    assert "metrics: 2 call(s), steps 3..4 (loss, acc_1)" in summary and "dict: 1 call(s) (summary.json)" in summary


def test_a_caller_mistake_is_not_swallowed(dead_server):
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    track = dead_server
    error = MlflowException("bad value", error_code=INVALID_PARAMETER_VALUE)

    def bad() -> None:
        raise error

    with pytest.raises(MlflowException):
        track._tolerant("params", ["x"], bad)
    assert track.gap() == {}
