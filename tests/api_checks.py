"""HTTP checks that the loopback run of the API (tests/unit/serving, no Ray) and the Serve run (tests/integration)
share: the schemathesis fuzz loop and a dropped stream's row. Importable from any test: tests/ is on sys.path
(its conftest.py is not in a package)."""
from __future__ import annotations

import time
from collections import Counter

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


def fuzz(schema_url: str, examples_per_mode: int, headers: dict[str, str] | None = None,
         base_url: str | None = None) -> Counter[tuple[str, int]]:
    """Every operation of the schema at ``schema_url``, with schema-valid (positive) and schema-breaking (negative)
    cases, derandomized: each answer is a 2xx, or a 4xx whose body is OpenAI's error shape, never a 5xx. Returns
    the count of answers per (operation, status), e.g. ``("POST /v1/completions", 200)``. Hypothesis over schemathesis's case strategies (its pytest loader,
    from_fixture, does not run under pytest 9); ``base_url`` when the app is mounted under a route prefix."""
    seen: Counter[tuple[str, int]] = Counter()
    first_failure: list[tuple[str, str]] = []  # Hypothesis shrinks to whatever fails next; keep the first
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
                response = case.call(base_url=base_url, headers=headers, timeout=60)
                sent = f"{case.method} {case.path} {case.body!r:.600}"
                if response.status_code >= 500 and not first_failure:
                    first_failure.append((sent, response.text[:500]))
                assert response.status_code < 500, (first_failure[0], sent, response.status_code, response.text[:500])
                if response.status_code >= 400:
                    error = response.json()["error"]
                    assert set(error) == OPENAI_ERROR_KEYS and error["message"], (sent, response.text[:500])
                seen[(f"{case.method} {case.path}", response.status_code)] += 1

            run()
    return seen


def drop_a_stream_then_ask(http: httpx.Client, model: str, long_prompt: str, short_prompt: str, retry_s: float,
                           every_s: float) -> tuple[httpx.Response, float]:
    """Open a 400-token stream, read two events and drop it, then post a 4-token request, retrying its 429s for up
    to ``retry_s`` while the disconnect is in flight. Returns that answer and the seconds since the drop. On a
    deployment with one row and no waiting place, a 200 means the dropped stream's row was freed."""
    body = {"model": model, "prompt": long_prompt, "max_tokens": 400, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data:")
            if events >= 2:
                break
    closed = time.monotonic()
    short = {"model": model, "prompt": short_prompt, "max_tokens": 4, "temperature": 0}
    response = http.post("/v1/completions", json=short)
    while response.status_code == 429 and time.monotonic() - closed < retry_s:
        time.sleep(every_s)
        response = http.post("/v1/completions", json=short)
    return response, time.monotonic() - closed


def by_status(seen: Counter[tuple[str, int]]) -> Counter[int]:
    """``fuzz``'s counts summed over the operations."""
    total: Counter[int] = Counter()
    for (_, status), count in seen.items():
        total[status] += count
    return total
