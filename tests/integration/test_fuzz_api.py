"""The Serve app fuzzed from its own OpenAPI schema (schemathesis), on loopback: every generated request, valid by
the schema or breaking it, gets a 2xx or a 4xx in OpenAI's error shape, never a 5xx; afterwards the replica is the
same one and answers a greedy request with the same text as before. A bounded run: EXAMPLES_PER_MODE cases per
operation and mode (positive, negative), derandomized so CI replays the same cases."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from ray import serve
from schemathesis import GenerationMode

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


def fuzz(base_url: str, headers: dict[str, str]) -> dict[int, int]:
    """Hypothesis over schemathesis's case strategies, operation by operation; returns the count per status.
    (schemathesis's pytest loader, from_fixture, does not run under pytest 9.)"""
    seen: dict[int, int] = {}
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in GenerationMode:
            if mode is GenerationMode.NEGATIVE and not len(operation.body):  # nothing to break in a bare GET
                continue

            @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(mode))
            def run(case) -> None:
                response = case.call(base_url=base_url, headers=headers, timeout=60)
                sent = f"{case.method} {case.path} {case.body!r:.500}"
                assert response.status_code < 500, (sent, response.status_code, response.text[:500])
                if response.status_code >= 400:
                    error = response.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"}, (sent, response.text[:500])
                seen[response.status_code] = seen.get(response.status_code, 0) + 1

            run()
    return seen


def test_fuzzed_api_never_answers_5xx_and_serves_the_same_greedy_text(serve_port, fuzz_app, reference):
    http = client(serve_port, fuzz_app)
    before = complete(http, PROMPTS[0], max_tokens=16)["choices"][0]
    workers = worker_names("fuzz")
    seen = fuzz(f"http://127.0.0.1:{serve_port}{fuzz_app}", {"Authorization": f"Bearer {API_KEY}"})
    print("responses by status:", seen)
    assert sum(seen.values()) >= 4 * EXAMPLES_PER_MODE and seen.get(200, 0) >= EXAMPLES_PER_MODE, seen
    after = complete(http, PROMPTS[0], max_tokens=16)["choices"][0]
    assert after["token_ids"] == before["token_ids"] == reference[PROMPTS[0]][:16]
    assert after["text"] == before["text"] and worker_names("fuzz") == workers  # the same replica, still healthy
