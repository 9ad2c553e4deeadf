"""The replica's shared suffix index of finished answers: answers go in when their request finishes (not when it
leaves or fails); the same request sent twice drafts more the second time with sharing on, the same with it off;
the answers are vanilla's either way."""
from __future__ import annotations

import httpx
import pytest

from eyas.decoding.requests import SequenceRequest, StepOutput
from eyas.drafters.suffix import SuffixIndex
from eyas.methods import SpecConfig, history_index
from serving.worker import SharedAnswers
from serving_loopback import MODEL, serve_locally


def test_only_finished_answers_are_indexed():
    shared = SharedAnswers(SuffixIndex((2,)))
    joins = [SequenceRequest(name, [1, 2], 8) for name in ("done", "left", "failed", "running")]
    shared.record(joins, [], [StepOutput(name, [5, 6]) for name in ("done", "left", "failed", "running")])
    shared.record([], ["left"], [StepOutput("done", [7], finished=True, finish_reason="length"),
                                 StepOutput("failed", [], finished=True, finish_reason="error")])
    assert shared.index.tokens_T.tolist() == [5, 6, 7, -1]  # the answer alone, not the prompt
    assert set(shared.answers) == {"running"}


def test_history_index_only_for_a_suffix_proposer():
    assert history_index(SpecConfig(method="ngram"), 100) is None
    assert history_index(SpecConfig(method="suffix", min_match=3), 100).anchors == (6, 3)
    assert history_index(SpecConfig(method="hybrid", proposers=("suffix", "draft-lm")), 100).max_tokens == 100


def completion(server, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("share", [True, False])
def test_the_same_request_twice_drafts_more_only_when_answers_are_shared(random_checkpoint, share):
    prompt = "The quick brown fox"
    with serve_locally(random_checkpoint, spec=SpecConfig(method="suffix"), share_answers=share) as server:
        first, second = completion(server, prompt), completion(server, prompt)
    with serve_locally(random_checkpoint, spec=SpecConfig(method="vanilla")) as server:
        vanilla = completion(server, prompt)
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == vanilla["choices"][0]["text"]
    if share:
        assert second["spec"]["tau"] > first["spec"]["tau"] + 1, (first["spec"], second["spec"])
    else:
        assert second["spec"]["tau"] == first["spec"]["tau"]
