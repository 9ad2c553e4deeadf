"""Prometheus and the HTTP ``spec`` field: a hybrid's acceptance per proposer and depth, and the prompt tokens the prefix
cache supplied."""
from __future__ import annotations

import httpx

from eyas.methods import SpecConfig
from serving.metrics import ServingMetrics
from serving_loopback import MODEL, serve_locally


def test_the_spec_field_carries_acceptance_per_proposer(random_checkpoint):
    spec = SpecConfig(method="hybrid", proposers=("suffix", "draft-lm"), draft_model=str(random_checkpoint),
                      num_nodes=6)
    body = {"model": MODEL, "prompt": "import os\nimport os\n", "max_tokens": 16, "temperature": 0}
    with serve_locally(random_checkpoint, spec=spec) as server:
        hybrid = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["spec"]
    with serve_locally(random_checkpoint) as server:  # n-gram alone: no proposers
        alone = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["spec"]
    assert hybrid["acceptance_per_proposer"]["draft-lm"][0] == 1.0  # the target drafting for itself
    assert set(hybrid["accepted_per_proposer"]) == set(hybrid["acceptance_per_proposer"]) <= {"suffix", "draft-lm"}
    assert sum(hybrid["accepted_per_proposer"]["draft-lm"]) >= 1
    assert alone["acceptance_per_proposer"] == {} and alone["accepted_per_proposer"] == {}


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, dict]] = []

    def inc(self, value, tags) -> None:
        self.calls.append((value, tags))


def test_prometheus_counts_offered_and_accepted_per_proposer_and_depth():
    metrics = ServingMetrics("m")
    metrics.proposer_offered, metrics.proposer_accepted = Recorder(), Recorder()
    metrics.finished(8, [2, 1], 2.5, 0.1, {"suffix": [3, 2], "eagle3": [1]}, {"suffix": [2, 0], "eagle3": [1]})
    assert metrics.proposer_offered.calls == [
        (3, {"model": "m", "proposer": "suffix", "position": "1"}),
        (2, {"model": "m", "proposer": "suffix", "position": "2"}),
        (1, {"model": "m", "proposer": "eagle3", "position": "1"})]
    assert metrics.proposer_accepted.calls == [  # zero counts are not sent
        (2, {"model": "m", "proposer": "suffix", "position": "1"}),
        (1, {"model": "m", "proposer": "eagle3", "position": "1"})]
    metrics.finished(4, [], None, 0.1)  # other methods: nothing
    assert len(metrics.proposer_offered.calls) == 3


def test_prometheus_counts_prompt_tokens_and_the_cached_ones():
    metrics = ServingMetrics("m")
    metrics.prompt_tokens, metrics.cached_prompt_tokens = Recorder(), Recorder()
    metrics.prompt(20, 0)
    metrics.prompt(20, 19)
    assert metrics.prompt_tokens.calls == [(20, {"model": "m"}), (20, {"model": "m"})]
    assert metrics.cached_prompt_tokens.calls == [(19, {"model": "m"})]  # zero counts are not sent
