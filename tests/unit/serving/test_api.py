"""The HTTP layer (serving.api) on loopback without Ray, over a real engine in-process (conftest.serve_locally):
streams as the official `openai` client expects them, back-pressure with 429 + Retry-After, a disconnected stream
freeing its row at once, the OpenAPI schema describing the request bodies, and errors in OpenAI's shape."""
from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from api_checks import drop_a_stream_then_ask
from serving_loopback import MODEL, serve_locally

PROMPT = "def add(a, b):\n    return"


def sdk(server, **options):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, **options)


def test_streams_follow_openai_contract(local_server):
    client = sdk(local_server)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    # the common client loop: every chunk has a choice unless the client asked for the usage chunk
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    assert "".join([c.choices[0].text for c in chunks]) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].model_extra["spec"]["cycles"] == whole.model_extra["spec"]["cycles"] >= 1
    assert all(c.usage is None for c in chunks)

    with_usage = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert with_usage[-1].model_extra["spec"]["cycles"] >= 1
    assert all(c.usage is None and len(c.choices) == 1 for c in with_usage[:-1])

    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                   stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_openapi_schema_describes_the_request_bodies(local_server):
    schema = httpx.get(f"{local_server.url}/openapi.json").json()
    for path, model in (("/v1/completions", "CompletionBody"), ("/v1/chat/completions", "ChatBody")):
        operation = schema["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert {"400", "429", "503"} <= set(operation["responses"])
    completion = schema["components"]["schemas"]["CompletionBody"]
    assert set(completion["required"]) == {"model", "prompt"}
    assert completion["properties"]["model"]["enum"] == [MODEL]
    assert completion["properties"]["top_p"]["exclusiveMinimum"] == 0
    assert "ChatMessage" in schema["components"]["schemas"] and "ErrorResponse" in schema["components"]["schemas"]


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/v1/completions", b'{"model": "eyas-unit", "prompt": ', 400),
    ("POST", "/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', 404),  # a lone surrogate, quoted back
    ("POST", "/v1/completions", b'{"model": "eyas-unit", "prompt": "x", "top_k": 1e999}', 400),
    ("POST", "/v1/completions", b"[" * 50_000 + b"]" * 50_000, 400),
    ("POST", "/v1/chat/completions", b'{"model": "eyas-unit", "messages": [{"role": "user"}]}', 400),
    ("GET", "/v1/completions", b"", 405),
    ("GET", "/v1/nothing-here", b"", 404),
])
def test_errors_have_openai_shape(local_server, method, path, body, status):
    response = httpx.request(method, f"{local_server.url}{path}", content=body, timeout=30)
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_requests_beyond_capacity_get_429_with_retry_after(random_checkpoint):
    # one row and one waiting place; rounds of 60 ms make each 40-token request take about 2.5 s, so all six arrive
    # while the first two hold the row and the waiting place even on a loaded 2-core machine (20 ms rounds let a
    # late sixth request find the first one done there once)
    with serve_locally(random_checkpoint, capacity=1, max_waiting=1, pause_s=0.06) as server:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}

        def post(_: int) -> httpx.Response:
            return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)

        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(post, range(6)))
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200, 200, 429, 429, 429, 429], [r.text for r in responses]
        for response in responses:
            if response.status_code == 429:
                assert response.headers["retry-after"] == "1"
                error = response.json()["error"]
                assert error["code"] == "server_busy" and "max_waiting_requests=1" in error["message"]
        assert time.monotonic() - start < 30
        import openai

        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the row and the waiting place taken: the SDK's
            held = [pool.submit(post, i) for i in range(2)]       # RateLimitError (it must not retry here)
            while server.frontend.scheduler.num_admitted < 2 and time.monotonic() - start < 30:
                time.sleep(0.01)
            with pytest.raises(openai.RateLimitError):
                sdk(server).completions.create(**body)
            assert [h.result().status_code for h in held] == [200, 200]
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200


def test_a_disconnected_stream_frees_its_row_at_once(random_checkpoint):
    # one row, no waiting place: the next request is admitted only once the disconnected stream's row is free
    with serve_locally(random_checkpoint, capacity=1, max_waiting=0, pause_s=0.02) as server:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            # retried for 2 s while the disconnect is in flight
            response, seconds = drop_a_stream_then_ask(http, MODEL, PROMPT, PROMPT, retry_s=2, every_s=0.05)
            # 400 tokens at 20 ms a round would hold the row for seconds: it was freed at the disconnect
            assert response.status_code == 200, response.text
            assert seconds < 3
            assert http.get("/health").json()["cancelled"] == 1
        assert server.worker.engine.rows == [] and server.frontend.scheduler.num_admitted == 0


POISON = [7, 7, 7, 7, 7]  # a prompt (token ids) whose drafter raises on its 4th proposal


class DrafterBugOnPoison:
    """The n-gram drafter, except that it raises mid-run for the POISON prompt: a bug that hits one request."""

    def __init__(self, target) -> None:
        from eyas.methods import SpecConfig, build_drafter

        self.inner = build_drafter(target, SpecConfig(method="ngram"))
        self.name, self.max_draft_nodes, self.target_taps = "poisoned", self.inner.max_draft_nodes, ()

    def begin(self, prompt_ids, taps) -> None:
        self.poisoned, self.calls = list(prompt_ids) == POISON, 0
        self.inner.begin(prompt_ids, taps)

    def propose(self, root, context_ids, temperature, generator):
        self.calls += 1
        if self.poisoned and self.calls == 4:
            raise RuntimeError("drafter bug")
        return self.inner.propose(root, context_ids, temperature, generator)

    def commit(self, tokens, taps) -> None:
        self.inner.commit(tokens, taps)


def test_a_request_the_engine_fails_gets_a_500_and_the_others_are_served(random_checkpoint):
    """One request whose drafter raises: that request alone answers 500 in OpenAI's shape (mid-stream: an error
    event), the request batched beside it gets exactly its text from alone, and the replica stays healthy."""
    good = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    bad = {"model": MODEL, "prompt": POISON, "max_tokens": 64, "temperature": 0}
    with serve_locally(random_checkpoint, capacity=2, max_waiting=2, pause_s=0.02,
                       make_drafter=DrafterBugOnPoison) as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            alone = http.post("/v1/completions", json=good).json()["choices"][0]["text"]
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                failing = pool.submit(http.post, "/v1/completions", json=bad)
                beside = pool.submit(http.post, "/v1/completions", json=good)
                failed, served = failing.result(), beside.result()
            assert failed.status_code == 500 and failed.json()["error"]["code"] == "request_failed"
            assert "drafting failed (RuntimeError: drafter bug)" in failed.json()["error"]["message"]
            assert served.status_code == 200 and served.json()["choices"][0]["text"] == alone
            assert served.json()["spec"]["batch_size_max"] == 2  # it shared rounds with the failing request
            with http.stream("POST", "/v1/completions", json={**bad, "stream": True}) as stream:
                assert stream.status_code == 200  # the first tokens went out before the failure
                events = [line for line in stream.iter_lines() if line.startswith("data: ")]
            assert '"code": "request_failed"' in events[-1] and "data: [DONE]" not in events
            health = http.get("/health")
            assert health.status_code == 200 and server.frontend.scheduler.broken is None
            assert http.post("/v1/completions", json=good).json()["choices"][0]["text"] == alone
        assert server.worker.engine.rows == [] and server.frontend.scheduler.num_admitted == 0
