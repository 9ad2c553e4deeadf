"""The Serve app fuzzed from its own OpenAPI schema (schemathesis), on loopback: every generated request, valid by
the schema or breaking it, gets a 2xx or a 4xx in OpenAI's error shape, never a 5xx; afterwards the replica is the
same one and answers a greedy request with the same text as before. A bounded run: EXAMPLES_PER_MODE cases per
operation and mode (positive, negative), derandomized so CI replays the same cases (tests/api_checks.fuzz, shared
with the loopback run in tests/unit/serving/test_api_fuzz.py)."""
from __future__ import annotations

import pytest
from ray import serve

from api_checks import by_status, fuzz
from serve_testing import (API_KEY, API_KEY_ENV, PROMPTS, client, complete, deploy, micro_config,  # noqa: F401
                           ray_session, reference, serve_port, worker_names)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

EXAMPLES_PER_MODE = 40


@pytest.fixture(scope="module")
def fuzz_app(serve_port, random_checkpoint):
    # max_tokens_limit keeps a schema-valid budget short; the API key makes the fuzzer send it (and nothing else)
    deploy(micro_config(random_checkpoint, "fuzz", "/fuzz", api_key_env=API_KEY_ENV, max_tokens_limit=16))
    yield "/fuzz"
    serve.delete("fuzz")


def test_fuzzed_api_never_answers_5xx_and_serves_the_same_greedy_text(serve_port, fuzz_app, reference):
    http = client(serve_port, fuzz_app)
    before = complete(http, PROMPTS[0], max_tokens=16)["choices"][0]
    workers = worker_names("fuzz")
    base_url = f"http://127.0.0.1:{serve_port}{fuzz_app}"
    seen = fuzz(f"{base_url}/openapi.json", EXAMPLES_PER_MODE, {"Authorization": f"Bearer {API_KEY}"}, base_url)
    print("responses by operation and status:", dict(seen))
    statuses = by_status(seen)
    assert sum(statuses.values()) >= 4 * EXAMPLES_PER_MODE, statuses
    # the schema-valid cases reach the engine on both generating routes (how many of them is a 200 varies between
    # processes: schemathesis's generation is not hash-seed stable; 12 and 23 of 80 in one CI run)
    assert all(seen[(f"POST {route}", 200)] >= 5 for route in ("/v1/completions", "/v1/chat/completions")), seen
    after = complete(http, PROMPTS[0], max_tokens=16)["choices"][0]
    assert after["token_ids"] == before["token_ids"] == reference[PROMPTS[0]][:16]
    assert after["text"] == before["text"] and worker_names("fuzz") == workers  # the same replica, still healthy
