"""jobs.bench_peers and its report: best thread count per engine and dtype, eyas over each peer, the tables, and
the vLLM runner against a fake /v1/completions (the lock and main's plumbing: test_peers_cli.py)."""
from __future__ import annotations

import contextlib
import http.server
import json
import os
import threading
import types

import pytest

from eyas.config import ConfigError
from jobs import bench_peers, bench_peers_report


def row(engine: str, dtype: str, threads: int, tps: float, same: float | None = None) -> dict:
    return {"engine": engine, "dtype": dtype, "threads": threads, "timing": "t", "new_tokens": 100,
            "seconds": 100 / tps, "tokens_per_s": tps, "wall_tokens_per_s": tps * 0.9,
            "suites": {"humaneval": tps, "chat": tps}, "same_as_eyas": same, "load_before": [1.5, 1.0, 1.0],
            "load_after": [1.6, 1.0, 1.0]}


ROWS = [row("eyas", "bfloat16", 1, 24.6), row("eyas", "bfloat16", 2, 19.6),
        row("llamacpp", "bfloat16", 1, 29.1, 1.0), row("llamacpp", "bfloat16", 2, 51.8, 1.0),
        row("vllm", "bfloat16", 1, 27.1), row("vllm", "bfloat16", 2, 35.7),
        row("eyas", "float32", 1, 12.6), row("eyas", "float32", 2, 17.7),
        row("llamacpp", "float32", 1, 19.6, 0.5), row("llamacpp", "float32", 2, 35.0, 0.5),
        row("llamacpp", "q8_0", 1, 44.8), row("llamacpp", "q8_0", 2, 77.9)]


def report(rows=ROWS) -> dict:
    features = {"model": "AMD EPYC", "kind": "avx512", "flags": ["avx2", "avx512f"], "amx_listed": False,
                "amx_usable": None}
    return {"commit": "abc1234", "machine": {"cpu_model": "AMD EPYC", "cpu_features": features, "num_cpus": 2,
                                             "load_start": [1.0, 1.0, 1.0]},
            "config": {"target": "/x/smollm2-135m", "engines": ["eyas", "llamacpp", "vllm"],
                       "suites": ["humaneval", "chat"], "num_prompts": 8,
                       "max_new_tokens": 128, "command": "python -m jobs.bench_peers"},
            "results": rows, "summary": bench_peers_report.summary(rows)}


def test_each_engine_is_taken_at_its_best_thread_count():
    best = bench_peers_report.best_rows(ROWS)
    assert best[("eyas", "bfloat16")]["threads"] == 1  # 2 threads were slower
    assert best[("llamacpp", "bfloat16")]["threads"] == 2


def test_eyas_over_each_peer_at_their_best():
    by_dtype = {entry["dtype"]: entry for entry in bench_peers_report.summary(ROWS)}
    assert list(by_dtype) == ["bfloat16", "float32", "q8_0"]
    assert by_dtype["bfloat16"]["eyas_over"] == {"llamacpp": round(24.6 / 51.8, 3), "vllm": round(24.6 / 35.7, 3)}
    assert by_dtype["float32"]["eyas_over"] == {"llamacpp": round(17.7 / 35.0, 3)}
    # no eyas int8 path: q8_0 has llama.cpp alone and no ratio
    assert by_dtype["q8_0"]["engines"] == {"llamacpp": {"tokens_per_s": 77.9, "threads": 2}}
    assert by_dtype["q8_0"]["eyas_over"] == {}


def test_summary_table_shows_best_tokens_threads_and_ratios():
    lines = bench_peers_report.summary_table(report()).splitlines()
    assert lines[0] == ("| dtype | eyas tok/s (threads) | llama.cpp tok/s (threads) | vLLM tok/s (threads) | "
                        "eyas / llama.cpp | eyas / vLLM |")
    assert lines[2] == "| bfloat16 | 24.6 (1t) | 51.8 (2t) | 35.7 (2t) | 0.47x | 0.69x |"
    assert lines[3] == "| float32 | 17.7 (2t) | 35.0 (2t) | - | 0.51x | - |"
    assert lines[4] == "| q8_0 | - | 77.9 (2t) | - | - | - |"


def test_an_engine_left_out_has_no_column():
    rows = [r for r in ROWS if r["engine"] != "vllm"]
    assert "vLLM" not in bench_peers_report.summary_table(report(rows))


def test_detail_table_and_page_carry_every_row_and_the_run(tmp_path):
    page = bench_peers_report.markdown(report())
    assert "| llama.cpp | float32 | 2 | 35.0 | 35.0 | 35.0 | 31.5 | 0.50 | t |" in page
    assert "commit abc1234" in page and "AMD EPYC" in page and "load before each measurement 1.50-1.50" in page
    assert "ISA: avx2 avx512f)" in page  # machine.cpu_features, the report's one source for the CPU
    path = tmp_path / "bench_peers.json"
    path.write_text(json.dumps(report()))
    assert bench_peers.main(["--from", str(path), "--report", str(tmp_path / "p.md")]) == 0
    assert (tmp_path / "p.md").read_text() == page


def test_measurement_row_counts_prompts_equal_to_eyas():
    m = bench_peers.Measurement("llamacpp", "float32", 1, "server timings")
    m.add("chat", [1, 2, 3], 0.5, 0.6)
    m.add("humaneval", [4, 5], 0.5, 0.6)
    out = m.row(reference=[[1, 2, 3], [4, 6]])
    assert out["same_as_eyas"] == 0.5
    assert out["tokens_per_s"] == 5.0 and out["wall_tokens_per_s"] == round(5 / 1.2, 2)
    assert out["suites"] == {"chat": 6.0, "humaneval": 4.0}


def test_plan_runs_engines_side_by_side_and_q8_0_on_eyas_and_llamacpp_only():
    assert bench_peers.plan(["eyas", "llamacpp", "vllm"], ["bfloat16", "q8_0"], [1, "auto"]) == [
        ("eyas", "bfloat16", 1), ("llamacpp", "bfloat16", 1), ("vllm", "bfloat16", 1), ("eyas", "bfloat16", "auto"),
        ("eyas", "q8_0", 1), ("llamacpp", "q8_0", 1), ("eyas", "q8_0", "auto")]


def test_bad_lists_are_errors_naming_the_flag():
    with pytest.raises(ConfigError, match="--engines 'eyas,sglang': unknown"):
        bench_peers.parse_list("eyas,sglang", bench_peers.ENGINES, "--engines")
    with pytest.raises(ConfigError, match="--threads"):
        bench_peers.parse_threads("1,two")
    with pytest.raises(ConfigError, match=">= 1"):
        bench_peers.parse_threads("0")


class FakeCompletions(http.server.BaseHTTPRequestHandler):
    """/v1/completions as vLLM answers it with return_token_ids: the prompt's ids reversed, cut to max_tokens."""
    answer_token_ids = True

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/completions" and body["temperature"] == 0.0 and body["model"] == "target"
        choice = {"text": "x"}
        if self.answer_token_ids:
            choice["token_ids"] = body["prompt"][::-1][: body["max_tokens"]]
        data = json.dumps({"choices": [choice], "usage": {"completion_tokens": 2}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_vllm():
    server = http.server.HTTPServer(("127.0.0.1", 0), FakeCompletions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}"

    @contextlib.contextmanager
    def vllm_server(model_dir, dtype, threads):
        yield url

    yield types.SimpleNamespace(SERVED_NAME="target", vllm_server=vllm_server)
    server.shutdown()
    FakeCompletions.answer_token_ids = True


def test_vllm_is_timed_by_http_wall_time_on_the_same_prompt_ids(fake_vllm):
    prompts = {"chat": [[1, 2, 3], [4, 5]], "humaneval": [[6, 7, 8, 9]]}
    m = bench_peers.run_vllm(fake_vllm, "/target", "float32", 2, prompts, max_new_tokens=2)
    assert (m.engine, m.dtype, m.threads, m.timing) == ("vllm", "float32", 2, "HTTP wall time")
    assert m.outputs == [[3, 2], [5, 4], [9, 8]] and m.new_tokens == 6
    assert m.seconds == m.wall_seconds > 0


def test_vllm_without_token_ids_is_an_error_not_a_guess(fake_vllm):
    FakeCompletions.answer_token_ids = False
    with fake_vllm.vllm_server("/t", "float32", 1) as url, pytest.raises(RuntimeError, match="return_token_ids"):
        bench_peers.vllm_complete(url, "target", [1, 2], 2)


def test_a_peer_starts_without_eyas_openmp_policy(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with bench_peers.without_openmp_policy():
        assert "OMP_WAIT_POLICY" not in os.environ
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_auto_is_eyas_own_policy_and_runs_for_eyas_alone():
    assert bench_peers.parse_threads("1,auto") == [1, "auto"]
    assert bench_peers.plan(["eyas", "llamacpp"], ["bfloat16"], [2, "auto"]) == [
        ("eyas", "bfloat16", 2), ("llamacpp", "bfloat16", 2), ("eyas", "bfloat16", "auto")]
    entry = {"tokens_per_s": 90.0, "threads": "auto"}
    assert bench_peers_report._cell(entry) == "90.0 (auto)"
