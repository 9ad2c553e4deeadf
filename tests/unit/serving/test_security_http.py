"""Security through the real app on loopback (issue 16, section 6): the API key is compared in constant time and never
logged or echoed; a request cannot make the server load a model or reach a path (``models:/``, ``runs:/``, file
paths); bodies past the size limit get 413 before they are read, prompts past the context 400."""
from __future__ import annotations

import hmac
import logging
import socket

import httpx
import pytest

from eyas import methods, track
from eyas.drafters import registry
from eyas.models import loading
from serving import api
from serving.protocol import MAX_BODY_BYTES, MAX_STOP_STRINGS
from serving_loopback import MODEL, serve_locally

KEY = "sk-eyas-test-7f3a9c1e5b"


def test_the_api_key_is_compared_in_constant_time_and_never_logged(random_checkpoint, monkeypatch, caplog,
                                                                  capfd):
    compared, real_compare = [], hmac.compare_digest  # api.hmac is the hmac module: keep the real function

    def compare_digest(a, b):
        compared.append((a, b))
        return real_compare(a, b)

    monkeypatch.setattr(api.hmac, "compare_digest", compare_digest)
    caplog.set_level(logging.DEBUG)
    body = {"model": MODEL, "prompt": "def f", "max_tokens": 2, "temperature": 0}
    with serve_locally(random_checkpoint, api_key=KEY) as server, httpx.Client(base_url=server.url) as http:
        answers = [http.post("/v1/completions", json=body),
                   http.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-eyas-wrong"}),
                   http.post("/v1/completions", json=body, headers={"Authorization": f"Basic {KEY}"}),
                   http.get("/v1/models", headers={"Authorization": "Bearer nope"})]
        assert [a.status_code for a in answers] == [401, 401, 401, 401]
        assert all(a.json()["error"]["code"] == "invalid_api_key" for a in answers)
        good = {"Authorization": f"Bearer {KEY}"}
        answers += [http.post("/v1/completions", json=body, headers=good), http.get("/v1/models", headers=good),
                    http.get("/health"), http.get("/openapi.json")]
        assert [a.status_code for a in answers[4:]] == [200, 200, 200, 200]
    assert (b"sk-eyas-wrong", KEY.encode()) in compared and (KEY.encode(), KEY.encode()) in compared
    printed = capfd.readouterr()
    seen = [a.text for a in answers] + [r.getMessage() for r in caplog.records] + [printed.out, printed.err]
    assert not [text for text in seen if KEY in text]


BODIES_NAMING_MODELS = [  # a request names a model, never a location: anything but the served name is a 404
    "models:/eagle3-smollm2@prod", "runs:/0123456789abcdef/drafter", "/etc/passwd", "../targets/smollm2-135m",
    f"{MODEL}/../../drafters/x", "file:///etc/passwd", "~/.cache/eyas/targets/tiny", "",
]


@pytest.mark.parametrize("name", BODIES_NAMING_MODELS)
def test_a_request_cannot_name_a_model_or_a_path_to_load(local_server, monkeypatch, name):
    def never(*args, **kwargs):
        raise AssertionError(f"a request made the server load {args}")

    for module, function in ((methods, "resolve_checkpoint"), (track, "download_model"), (loading, "load_target"),
                             (registry, "load_model")):
        monkeypatch.setattr(module, function, never)
    for path, body in (("/v1/completions", {"model": name, "prompt": "x", "max_tokens": 1}),
                       ("/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "x"}]})):
        answer = httpx.post(f"{local_server.url}{path}", json=body, timeout=30)
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found", answer.text
    # fields that name locations are not part of a request: refused as unknown fields (400), never resolved
    for field, value in (("drafter", "models:/evil@prod"), ("target", "/etc"), ("spec_file", "/etc/passwd"),
                         ("spec", {"method": "eagle3", "drafter": "/tmp/evil"})):
        answer = httpx.post(f"{local_server.url}/v1/completions", timeout=30,
                            json={"model": MODEL, "prompt": "x", "max_tokens": 1, field: value})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text


def test_bodies_and_prompts_have_size_limits(local_server):
    # a declared body past the limit is refused before one byte of it is read (the server does not wait for it)
    with socket.create_connection(("127.0.0.1", local_server.port), timeout=10) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000000000000\r\n\r\n")
        head = raw.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]

    def chunked(total: int):  # no Content-Length: the limit applies while the body streams in
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(total // 65536):
            yield b"a" * 65536
        yield b'"}'

    with httpx.Client(base_url=local_server.url, timeout=60) as http:
        over = http.post("/v1/completions", content=chunked(MAX_BODY_BYTES + 65536))
        assert over.status_code == 413 and "limit" in over.json()["error"]["message"]
        too_long = http.post("/v1/completions", json={"model": MODEL, "prompt": list(range(5)) * 200})
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        budget = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 10**6})
        assert budget.status_code == 400 and budget.json()["error"]["param"] == "max_tokens"
        stops = http.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                   "stop": ["a"] * (MAX_STOP_STRINGS + 1)})
        assert stops.status_code == 400 and stops.json()["error"]["param"] == "stop"
