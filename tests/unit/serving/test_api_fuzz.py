"""schemathesis over the HTTP layer's own OpenAPI schema, on loopback without Ray (conftest.local_server): every
generated request, valid or not, gets a 2xx or a 4xx in OpenAI's error shape, never a 5xx, and afterwards the
server still gives the same greedy text. The Serve app gets the same run (tests/api_checks.fuzz) in
tests/integration/test_fuzz_api.py."""
from __future__ import annotations

import httpx
import pytest

from api_checks import by_status, fuzz
from serving_loopback import MODEL

GREEDY = {"model": MODEL, "prompt": "def add(a, b):\n    return", "max_tokens": 12, "temperature": 0}
EXAMPLES_PER_MODE = 30  # per operation and mode (positive, negative); the Serve app gets 40


@pytest.fixture(scope="module")
def greedy_before(local_server) -> dict:
    return httpx.post(f"{local_server.url}/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]


def test_fuzzed_requests_get_2xx_or_openai_4xx_and_greedy_text_is_unchanged(local_server, greedy_before):
    seen = fuzz(f"{local_server.url}/openapi.json", EXAMPLES_PER_MODE)
    print("responses by operation and status:", dict(seen))
    statuses = by_status(seen)
    assert sum(statuses.values()) >= 4 * EXAMPLES_PER_MODE, statuses
    # it reached the engine on both generating routes, not only the validation (how many schema-valid cases are a
    # 200 varies between processes: schemathesis's generation is not hash-seed stable)
    assert all(seen[(f"POST {route}", 200)] >= 5 for route in ("/v1/completions", "/v1/chat/completions")), seen
    after = httpx.post(f"{local_server.url}/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]
    assert after["text"] == greedy_before["text"] and after["finish_reason"] == greedy_before["finish_reason"]
