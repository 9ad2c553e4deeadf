"""Ray Serve end to end on loopback: serving/configs/micro.yaml deployed with a random-weight target.

One local Ray and one Serve instance for the module; applications are deployed one after another and deleted when
done, so the shared CPUs hold at most one or two replicas. Checked: tp=1 and tp=2 greedy output equals the library's
vanilla greedy output; streaming and the official `openai` client; concurrent requests share a batch and each
equals its own single-request output; every bad input gets its 4xx in OpenAI's error shape and the replica keeps
serving (also for fields hypothesis fills with arbitrary JSON); a client that disconnects mid-stream frees its batch
row at once (on one row, the next request is admitted); requests past the rows and the waiting places get 429 with
Retry-After; loopback load scales 1 -> 2 replicas and back; killing a TP worker actor gets the replica replaced and
later requests succeed. The fuzzed API (schemathesis) is test_fuzz_api.py.
"""
from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ray import serve

from api_checks import drop_a_stream_then_ask
from integration_testing import wait_until
from serve_testing import (API_KEY, API_KEY_ENV, MODEL, NUM_NEW, PROMPTS, REPO_ROOT, client, complete, deploy,
                           micro_config, ray_session, reference, running_replicas, serve_port,  # noqa: F401
                           worker_names)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


# ---------------------------------------------------------------- tp=1: correctness, HTTP, bad input


@pytest.fixture(scope="module")
def tp1(serve_port, random_checkpoint):
    deploy(micro_config(random_checkpoint, "tp1", "/tp1", api_key_env=API_KEY_ENV))
    yield "/tp1"


def test_tp1_greedy_equals_vanilla_streaming_and_openai_client(serve_port, tp1, reference):
    import openai

    http = client(serve_port, tp1)
    for prompt in PROMPTS:
        result = complete(http, prompt)
        choice = result["choices"][0]
        assert choice["token_ids"] == reference[prompt]
        assert result["usage"]["completion_tokens"] == len(reference[prompt])
        spec = result["spec"]
        assert spec["method"] == "ngram" and spec["cycles"] >= 1 and spec["tau"] is not None
        assert len(spec["accepted_per_position"]) == len(spec["acceptance_per_position"])

    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port}{tp1}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in sdk.models.list().data] == [MODEL]
    whole = sdk.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=NUM_NEW, temperature=0)
    assert whole.choices[0].text == complete(http, PROMPTS[0])["choices"][0]["text"]
    chunks = list(sdk.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=NUM_NEW, temperature=0,
                                         stream=True))
    assert "".join([c.choices[0].text for c in chunks]) == whole.choices[0].text  # every chunk has a choice
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].model_extra["spec"]["cycles"] >= 1 and all(c.usage is None for c in chunks)
    counted = list(sdk.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=NUM_NEW, temperature=0,
                                          stream=True, stream_options={"include_usage": True}))
    assert counted[-1].choices == [] and counted[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert counted[-1].model_extra["spec"]["cycles"] >= 1
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                                       temperature=0.7, top_p=0.9, seed=3)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 8
    streamed = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                                           temperature=0.7, top_p=0.9, seed=3, stream=True)
    text = "".join([c.choices[0].delta.content or "" for c in streamed])
    assert text == chat.choices[0].message.content  # same seed, same tokens


def test_stop_strings_cut_the_text(serve_port, tp1, reference):
    http = client(serve_port, tp1)
    full = complete(http, PROMPTS[1])["choices"][0]["text"]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip("the random model's continuation has no usable stop string")
    cut = complete(http, PROMPTS[1], stop=[stop])
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == full[:full.index(stop)]


def test_concurrent_requests_share_a_batch(serve_port, tp1, reference):
    results: dict[str, dict] = {}

    def one(prompt: str) -> None:
        with client(serve_port, tp1) as http:
            results[prompt] = complete(http, prompt, max_tokens=NUM_NEW)

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert set(results) == set(PROMPTS)
    for prompt in PROMPTS:
        assert results[prompt]["choices"][0]["token_ids"] == reference[prompt]
    assert max(r["spec"]["batch_size_max"] for r in results.values()) >= 2


BAD_REQUESTS = [
    # (what, body bytes or object, status, param)
    ("malformed JSON", b'{"model": "eyas-micro", "prompt": ', 400, None),
    ("not an object", [1, 2, 3], 400, None),
    ("missing prompt", {"model": MODEL}, 400, "prompt"),
    ("missing model", {"prompt": "x"}, 400, "model"),
    ("prompt wrong type", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("max_tokens wrong type", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("temperature wrong type", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("max_tokens zero", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", {"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("max_tokens over limit", {"model": MODEL, "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("prompt over context", {"model": MODEL, "prompt": "hello world " * 400}, 400, "prompt"),
    ("token id out of vocab", {"model": MODEL, "prompt": [1, 2, 10 ** 6]}, 400, "prompt"),
    ("empty prompt", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("temperature < 0", {"model": MODEL, "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("top_p out of range", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("n past the replica's rows", {"model": MODEL, "prompt": "x", "n": 1000}, 400, "n"),
    ("an unknown field", {"model": MODEL, "prompt": "x", "temprature": 0.5}, 400, "temprature"),
    ("suffix (not served)", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("NaN temperature", b'{"model": "eyas-micro", "prompt": "x", "temperature": NaN}', 400, None),
    ("seed out of range", {"model": MODEL, "prompt": "x", "seed": 2 ** 70}, 400, "seed"),
    ("untokenizable text", {"model": MODEL, "prompt": "\ud800"}, 400, "prompt"),
    ("unknown model", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
]


def test_bad_input_gets_4xx_and_the_replica_keeps_serving(serve_port, tp1, reference):
    http = client(serve_port, tp1)
    workers_before = worker_names("tp1")
    for what, body, status, param in BAD_REQUESTS:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == status, (what, response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error", what
        assert error["param"] == param, (what, error)
    bad_chat = [{"model": MODEL}, {"model": MODEL, "messages": []}, {"model": MODEL, "messages": [{"role": "x"}]},
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}]
    for body in bad_chat:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, (body, response.text)
    assert client(serve_port, tp1, key=None).post("/v1/completions", json={"model": MODEL, "prompt": "x"}
                                                  ).status_code == 401
    assert client(serve_port, tp1, key="wrong").get("/v1/models").status_code == 401
    assert http.get("/v1/nothing-here").status_code == 404
    assert complete(http, PROMPTS[0])["choices"][0]["token_ids"] == reference[PROMPTS[0]]
    assert worker_names("tp1") == workers_before and running_replicas("tp1") == 1


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 66, 2 ** 66) | st.floats(-1e6, 1e6)
                    | st.text(max_size=6), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "stream",
          "return_token_ids", "stream_options"]


def test_a_field_of_arbitrary_json_gets_200_or_a_400_naming_it(serve_port, tp1, reference):
    http = client(serve_port, tp1)
    seen = []

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(FIELDS), JSON)
    def one(field, value):
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, field: value}
        if field == "max_tokens" and isinstance(value, int) and not isinstance(value, bool):
            body["max_tokens"] = max(min(value, 8), -8)  # a valid budget stays short
        response = http.post("/v1/completions", json=body)
        seen.append(response.status_code)
        assert response.status_code in (200, 400, 404), (body, response.text)
        if response.status_code != 200:
            error = response.json()["error"]
            assert error["param"] == field and set(error) == {"message", "type", "param", "code"}, (body, error)

    one()
    assert 200 in seen and 400 in seen
    assert complete(http, PROMPTS[0])["choices"][0]["token_ids"] == reference[PROMPTS[0]]


def test_client_disconnect_mid_stream_frees_its_row(serve_port, tp1):
    http = client(serve_port, tp1)
    cancelled = http.get("/health").json()["cancelled"]
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 150, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = []
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(line)
            if len(events) >= 2:
                break
    # the stream closed after two events of a 150-token request: its row must be freed, not run to the end
    wait_until(lambda: http.get("/health").json()["running"] == 0, 30, what="the row to be freed")
    assert http.get("/health").json()["cancelled"] == cancelled + 1  # freed by the disconnect, not by finishing
    assert complete(http, PROMPTS[3])["choices"][0]["finish_reason"] in ("length", "stop")


def test_metrics_reach_prometheus(ray_session, tp1):
    url = f"http://127.0.0.1:{ray_session[1]}/metrics"
    wanted = ("ray_eyas_requests_total", "ray_eyas_generated_tokens_total", "ray_eyas_accepted_tokens_total",
              "ray_eyas_tau_bucket", "ray_eyas_ttft_seconds_bucket", "ray_eyas_latency_seconds_bucket",
              "ray_eyas_batch_size")

    labels = ('status="400"', 'status="200"', 'position="1"')

    def exported() -> str | None:  # series appear one export at a time: wait for names and labels alike
        text = httpx.get(url, timeout=10).text
        return text if all(name in text for name in wanted + labels) else None

    text = wait_until(exported, 180, every_s=1.0, what=f"{wanted} at {url}")  # Ray exports every ~10 s; slower under load
    assert all(label in text for label in labels)


def test_killing_a_worker_replaces_the_replica(serve_port, tp1, reference):
    http = client(serve_port, tp1)
    old = worker_names("tp1")
    assert len(old) == 1
    ray.kill(ray.get_actor(next(iter(old)), namespace="eyas-serving"))

    def served() -> bool:
        try:
            response = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4,
                                                          "temperature": 0}, timeout=30)
        except httpx.HTTPError:
            return False
        assert response.status_code in (200, 503), response.text  # 503 while the broken replica is replaced
        return response.status_code == 200 and bool(worker_names("tp1") - old)

    wait_until(served, 120, every_s=1.0, what="a replacement replica")
    assert complete(http, PROMPTS[0])["choices"][0]["token_ids"] == reference[PROMPTS[0]]
    serve.delete("tp1")


# ---------------------------------------------------------------- one row, no waiting place: admission


@pytest.fixture(scope="module")
def one_row(serve_port, random_checkpoint):
    deploy(micro_config(random_checkpoint, "one-row", "/one-row", max_batch_size=1, max_waiting_requests=0,
                        speculation_by_batch={1: None}))
    yield "/one-row"
    serve.delete("one-row")


def test_requests_past_the_row_get_429_with_retry_after(serve_port, one_row):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 300, "temperature": 0}

    def post(_: int) -> httpx.Response:
        with client(serve_port, one_row, key=None) as http:
            return http.post("/v1/completions", json=body)

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(post, range(6)))
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 429} and time.monotonic() - start < 120, statuses
    for response in responses:
        if response.status_code == 429:
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "server_busy"


def test_a_disconnected_stream_frees_its_only_row_at_once(serve_port, one_row):
    http = client(serve_port, one_row, key=None)
    cancelled = http.get("/health").json()["cancelled"]
    # retried for 10 s while the disconnect reaches the replica through Serve's proxy
    response, _ = drop_a_stream_then_ask(http, MODEL, PROMPTS[2], PROMPTS[3], retry_s=10, every_s=0.1)
    # admitted on the only row while the 400-token stream would still be running: its leave freed the row
    assert response.status_code == 200, response.text
    assert http.get("/health").json()["cancelled"] == cancelled + 1


# ---------------------------------------------------------------- tp=2


def test_tp2_greedy_equals_vanilla_and_a_dead_rank_replaces_the_replica(serve_port, random_checkpoint, reference):
    deploy(micro_config(random_checkpoint, "tp2", "/tp2", tensor_parallel_size=2))
    try:
        http = client(serve_port, "/tp2", key=None)
        assert len(worker_names("tp2")) == 2
        for prompt in PROMPTS[:2]:
            assert complete(http, prompt)["choices"][0]["token_ids"] == reference[prompt]
        ids = [complete(http, p, max_tokens=8)["choices"][0]["token_ids"] for p in PROMPTS]
        assert ids == [reference[p][:8] for p in PROMPTS]
        # a dead rank breaks the TP group: the whole replica is replaced, both ranks anew
        old = worker_names("tp2")
        ray.kill(ray.get_actor(sorted(old)[1], namespace="eyas-serving"))
        wait_until(lambda: len(worker_names("tp2") - old) == 2, 120, every_s=1.0, what="a replacement tp=2 replica")
        wait_until(lambda: http.get("/health").status_code == 200, 60, what="the new replica to serve")
        assert complete(http, PROMPTS[1])["choices"][0]["token_ids"] == reference[PROMPTS[1]]
    finally:
        serve.delete("tp2")


def test_user_config_swaps_the_schedule_in_place(serve_port, random_checkpoint, reference):
    """``user_config: {speculation_by_batch: ...}`` rules from the start (reconfigure), and ``set_speculation`` (what
    a user_config update and jobs.load call) swaps it on the running replica: same workers, output still vanilla's,
    /v1/models reports the live schedule; a bad schedule is refused and the old one stays."""
    config = micro_config(random_checkpoint, "live", "/live")
    config["applications"][0]["deployments"][0]["user_config"] = {"speculation_by_batch": {1: 0}}
    deploy(config)
    try:
        handle = serve.get_app_handle("live")
        with client(serve_port, "/live", key=None) as http:
            off = complete(http, PROMPTS[0])
            assert off["spec"]["mean_draft_nodes"] == 0 and off["spec"]["tau"] == 1.0
            assert http.get("/v1/models").json()["data"][0]["speculation_by_batch"] == {"1": 0}
            workers = worker_names("live")
            assert handle.set_speculation.remote({1: None, 4: 0}).result() == {1: None, 4: 0}
            on = complete(http, PROMPTS[0])
            assert on["spec"]["mean_draft_nodes"] > 0
            assert on["choices"][0]["token_ids"] == off["choices"][0]["token_ids"] == reference[PROMPTS[0]]
            with pytest.raises(Exception, match="needs an entry for batch size 1"):
                handle.set_speculation.remote({2: 1}).result()
            assert http.get("/v1/models").json()["data"][0]["speculation_by_batch"] == {"1": None, "4": 0}
            assert complete(http, PROMPTS[1])["spec"]["mean_draft_nodes"] > 0
            assert worker_names("live") == workers  # the same replica and workers throughout
    finally:
        serve.delete("live")


def test_jobs_load_measures_spec_and_vanilla(serve_port, random_checkpoint, tmp_path):
    from jobs import load

    common = ["--config", str(REPO_ROOT / "serving" / "configs" / "micro.yaml"), "--target", str(random_checkpoint),
              "--port", str(serve_port), "--max-tokens", "8", "--num-prompts", "2"]
    out = tmp_path / "load.json"
    assert load.main([*common, "--concurrency", "1,2", "--requests-per-level", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["baseline"] == "replica"
    assert report["config"]["schedules"] == {"spec": {"1": None, "3": 4, "4": 0}, "vanilla": {"1": 0}}
    rows = {(r["mode"], r["concurrency"]): r for r in report["results"]}
    assert set(rows) == {("spec", 1), ("vanilla", 1), ("spec", 2), ("vanilla", 2)}
    assert rows[("vanilla", 2)]["speedup"] == 1.0 and rows[("spec", 1)]["scaling"] == 1.0
    assert all(r["tokens_per_s"] > 0 and r["latency_p99_s"] >= r["latency_p50_s"] for r in rows.values())
    # the one replica drafts as configured for spec, never for vanilla (every cycle one decode step: tau 1)
    assert rows[("spec", 1)]["draft_nodes"] > 0 and rows[("spec", 2)]["draft_nodes"] > 0
    assert rows[("vanilla", 1)]["draft_nodes"] == rows[("vanilla", 2)]["draft_nodes"] == 0
    assert rows[("vanilla", 1)]["tau"] == 1.0
    # greedy (the default): every request's speculative text is vanilla's, alone and batched
    assert rows[("spec", 1)]["greedy_identical"] == rows[("spec", 2)]["greedy_identical"] == 1.0
    # the twin baseline: a vanilla-method application beside it (no drafter, so no tau)
    assert load.main([*common, "--baseline", "twin", "--concurrency", "1", "--requests-per-level", "1",
                      "--out", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["vanilla"]["tau"] is None and rows["spec"]["tau"] is not None
    assert rows["spec"]["greedy_identical"] == 1.0
    assert "load-vanilla" not in serve.status().applications  # both deleted after the run


def random_eagle3(target_dir: Path, directory: Path) -> Path:
    """An untrained EAGLE-3 checkpoint for the target at ``target_dir``."""
    import torch

    from eyas.drafters.registry import build_model, save_drafter
    from eyas.models import load_target

    target = load_target(target_dir)
    torch.manual_seed(0)
    model = build_model("eagle3", None, target, token_counts_V=torch.ones(target.config.vocab_size))
    return save_drafter(model, directory, target_dir)


@pytest.mark.parametrize("method", ["suffix", "hybrid"])
@pytest.mark.parametrize("share", [True, False])
def test_jobs_load_passes_draft_more_the_second_time_only_with_shared_answers(serve_port, random_checkpoint,
                                                                             tmp_path, share, method):
    """``--passes 2`` sends the same traffic twice to one replica of the suffix method, or of the hybrid of the
    suffix index and EAGLE-3: with its shared index of finished answers on, pass 2 drafts from pass 1's answers
    (tau rises); with it off both passes draft alike; every answer of every pass is vanilla's."""
    from jobs import load

    spec = "{method: suffix, num_nodes: 8}"
    if method == "hybrid":  # no cost_cut here: its trees follow timings, and the passes must draft alike
        drafter = random_eagle3(random_checkpoint, tmp_path / "eagle3")
        spec = (f"{{method: hybrid, proposers: [suffix, eagle3], drafter: {drafter}, tree: chain, depth: 1, "
                "num_nodes: 8, learned_below: 0.4}")
    out = tmp_path / "load.json"
    assert load.main(["--config", str(REPO_ROOT / "serving" / "configs" / "micro.yaml"), "--target",
                      str(random_checkpoint), "--port", str(serve_port), "--arg", f"spec={spec}",
                      "--arg", f"share_answers={str(share).lower()}", "--concurrency", "1", "--passes", "2",
                      "--suite", "code", "--num-prompts", "3", "--requests-per-level", "3", "--max-tokens", "24",
                      "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["passes"] == 2 and report["config"]["shares_answers"] is share
    rows = {(r["mode"], r["pass"]): r for r in report["results"]}
    assert set(rows) == {(mode, n) for mode in ("spec", "vanilla") for n in (1, 2)}
    assert rows[("spec", 1)]["greedy_identical"] == rows[("spec", 2)]["greedy_identical"] == 1.0
    assert rows[("vanilla", 1)]["tau"] == rows[("vanilla", 2)]["tau"] == 1.0
    first, second = rows[("spec", 1)]["tau"], rows[("spec", 2)]["tau"]
    if share:
        assert second > first + 0.5, (first, second)
    else:
        assert second == first


# ---------------------------------------------------------------- autoscaling


def test_loopback_load_scales_up_and_back_down(serve_port, random_checkpoint):
    deploy(micro_config(random_checkpoint, "auto", "/auto"), single_replica=False)
    try:
        assert running_replicas("auto") == 1
        stop = threading.Event()

        def load() -> None:  # one closed-loop client: a new streaming request as soon as the last one ends
            with client(serve_port, "/auto", key=None) as http:
                while not stop.is_set():
                    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 64, "temperature": 0.8}
                    http.post("/v1/completions", json=body)

        clients = [threading.Thread(target=load, daemon=True) for _ in range(6)]  # 6 ongoing > 2 per replica
        for thread in clients:
            thread.start()
        try:
            wait_until(lambda: running_replicas("auto") == 2, 90, every_s=1.0, what="a second replica")
        finally:
            stop.set()
            for thread in clients:
                thread.join(timeout=60)
        wait_until(lambda: running_replicas("auto") == 1, 90, every_s=1.0, what="scaling back to one replica")
    finally:
        serve.delete("auto")
