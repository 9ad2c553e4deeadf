"""schemathesis over the HTTP layer's own OpenAPI schema, on loopback without Ray (conftest.local_server): every
generated request, valid or not, gets a 2xx or a 4xx in OpenAI's error shape, never a 5xx, and afterwards the
server still gives the same greedy text. The Serve app gets the same run in tests/integration/test_fuzz_api.py."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from serving_loopback import MODEL

GREEDY = {"model": MODEL, "prompt": "def add(a, b):\n    return", "max_tokens": 12, "temperature": 0}
EXAMPLES_PER_MODE = 30  # per operation and mode (positive, negative); the Serve app gets 40
seen: dict[str, int] = {}  # responses by status code
first_failure: list[tuple[str, str]] = []


@pytest.fixture(scope="module")
def greedy_before(local_server) -> dict:
    return httpx.post(f"{local_server.url}/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]


def check_response(case, response) -> None:
    """2xx, or a 4xx whose body is OpenAI's error shape."""
    sent = f"{case.method} {case.path} {case.body!r:.600}"
    if response.status_code >= 500 and not first_failure:  # Hypothesis shrinks to whatever fails next; keep this
        first_failure.append((sent, response.text[:500]))
    assert response.status_code < 500, (first_failure[0], sent, response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (sent, response.text[:500])
    seen[str(response.status_code)] = seen.get(str(response.status_code), 0) + 1


def fuzz(schema_url: str, examples_per_mode: int, headers: dict[str, str] | None = None) -> None:
    """Every operation, with schema-valid (positive) and schema-breaking (negative) cases: Hypothesis over
    schemathesis's strategies (its pytest loader, from_fixture, does not run under pytest 9)."""
    schema = schemathesis.openapi.from_url(schema_url)
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in GenerationMode:
            if mode is GenerationMode.NEGATIVE and not len(operation.body):  # nothing to break in a bare GET
                continue
            @settings(max_examples=examples_per_mode, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(mode))
            def run(case) -> None:
                check_response(case, case.call(headers=headers, timeout=60))

            run()


def test_fuzzed_requests_get_2xx_or_openai_4xx_and_greedy_text_is_unchanged(local_server, greedy_before):
    fuzz(f"{local_server.url}/openapi.json", examples_per_mode=EXAMPLES_PER_MODE)
    print("responses by status:", seen)
    assert sum(seen.values()) >= 4 * EXAMPLES_PER_MODE, seen
    assert seen.get("200", 0) >= EXAMPLES_PER_MODE, seen  # it reached the engine, not only the validation
    after = httpx.post(f"{local_server.url}/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]
    assert after["text"] == greedy_before["text"] and after["finish_reason"] == greedy_before["finish_reason"]
