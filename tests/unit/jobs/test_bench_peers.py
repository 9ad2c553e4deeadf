"""jobs.bench_peers and its report: best thread count per engine and dtype, eyas over each peer, eyas's best lossless
method over the best peer row (the 1.3x goal), refused methods, the tables, the peers' speculative settings, and the
runners against fakes (a /v1/completions server, a server that will not start); the lock and main's plumbing:
test_peers_cli.py. The real engines: tests/integration/test_bench_peers_engines.py."""
from __future__ import annotations

import contextlib
import http.server
import json
import os
import threading
import types

import pytest

from eyas.config import ConfigError
from jobs import bench_peers, bench_peers_measure as measure, bench_peers_methods, bench_peers_report


def row(engine: str, dtype: str, threads: int | str, tps: float, same: float | None = None, method: str | None = None,
        same_as_vanilla: float | None = None, suites: tuple[float, float] | None = None, refused: str | None = None
        ) -> dict:
    """A bench_peers.json row; ``method`` None: a row from before methods (no "method" key at all)."""
    humaneval, chat = suites or (tps, tps)
    out = {"engine": engine, "dtype": dtype, "threads": threads, "timing": "t", "new_tokens": 100,
           "seconds": 100 / tps if tps else 0.0, "tokens_per_s": tps, "wall_tokens_per_s": tps * 0.9,
           "suites": {"humaneval": humaneval, "chat": chat}, "same_as_eyas": same, "load_before": [1.5, 1.0, 1.0],
           "load_after": [1.6, 1.0, 1.0]}
    if method is not None:
        out.update({"method": method, "same_as_vanilla": same_as_vanilla, "refused": refused, "acceptance": None,
                    "tau": None})
    return out


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


def test_measurement_row_counts_prompts_equal_to_eyas_and_to_its_own_vanilla():
    m = measure.Measurement("llamacpp", "float32", 1, "server timings", method="ngram-simple")
    m.add("chat", [1, 2, 3], 0.5, 0.6)
    m.add("humaneval", [4, 5], 0.5, 0.6)
    out = m.row(eyas_vanilla=[[1, 2, 3], [4, 6]], own_vanilla=[[1, 2, 3], [4, 5]])
    assert out["same_as_eyas"] == 0.5 and out["same_as_vanilla"] == 1.0
    assert out["method"] == "ngram-simple" and out["refused"] is None
    assert out["tokens_per_s"] == 5.0 and out["wall_tokens_per_s"] == round(5 / 1.2, 2)
    assert out["suites"] == {"chat": 6.0, "humaneval": 4.0}
    reference = measure.Measurement("eyas", "float32", 1, "wall").row([[1]], [[1]])
    assert reference["same_as_eyas"] is None and reference["same_as_vanilla"] is None  # eyas vanilla is the reference


def test_rows_set_each_method_against_its_own_engines_vanilla_and_eyas_vanilla_at_the_same_threads():
    def measured(engine, method, threads, outputs):
        m = measure.Measurement(engine, "bfloat16", threads, "t", method=method)
        for tokens in outputs:
            m.add("chat", tokens, 1.0, 1.0)
        return m

    rows = bench_peers.rows_of([
        measured("eyas", "vanilla", 2, [[1], [2]]), measured("eyas", "ngram", 2, [[1], [2]]),
        measured("eyas", "vanilla", "auto", [[1], [3]]), measured("eyas", "ngram", "auto", [[1], [2]]),
        measured("llamacpp", "vanilla", 2, [[1], [9]]), measured("llamacpp", "ngram-mod", 2, [[1], [8]])])
    by = {(r["engine"], r["method"], r["threads"]): r for r in rows}
    assert by[("eyas", "ngram", 2)]["same_as_vanilla"] == 1.0
    assert by[("eyas", "ngram", "auto")]["same_as_vanilla"] == 0.5  # against vanilla at auto, not at 2
    assert by[("llamacpp", "vanilla", 2)]["same_as_eyas"] == 0.5
    assert by[("llamacpp", "vanilla", 2)]["same_as_vanilla"] is None
    assert by[("llamacpp", "ngram-mod", 2)]["same_as_vanilla"] == 0.5


def test_plan_runs_engines_side_by_side_and_q8_0_on_eyas_and_llamacpp_only():
    assert bench_peers.plan(["eyas", "llamacpp", "vllm"], ["bfloat16", "q8_0"], [1, "auto"]) == [
        ("eyas", "bfloat16", 1, "*"), ("llamacpp", "bfloat16", 1, "vanilla"), ("vllm", "bfloat16", 1, "vanilla"),
        ("eyas", "bfloat16", "auto", "*"), ("eyas", "q8_0", 1, "*"), ("llamacpp", "q8_0", 1, "vanilla"),
        ("eyas", "q8_0", "auto", "*")]


def test_plan_runs_each_peer_method_beside_eyas_whose_methods_share_one_load():
    methods = {"llamacpp": ["vanilla", "ngram-mod"], "vllm": ["ngram"]}
    assert bench_peers.plan(["eyas", "llamacpp", "vllm"], ["bfloat16"], [2, "auto"], methods) == [
        ("eyas", "bfloat16", 2, "*"), ("llamacpp", "bfloat16", 2, "vanilla"), ("llamacpp", "bfloat16", 2, "ngram-mod"),
        ("vllm", "bfloat16", 2, "ngram"), ("eyas", "bfloat16", "auto", "*")]


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
    def vllm_server(model_dir, dtype, threads, speculative_config=None, log_path=None):
        yield url

    yield types.SimpleNamespace(SERVED_NAME="target", vllm_server=vllm_server)
    server.shutdown()
    FakeCompletions.answer_token_ids = True


def setup(tmp_path, prompts) -> measure.RunSetup:
    return measure.RunSetup("/target", prompts, max_new_tokens=2, eos=[0], workdir=tmp_path)


def test_vllm_is_timed_by_http_wall_time_on_the_same_prompt_ids(fake_vllm, tmp_path):
    prompts = {"chat": [[1, 2, 3], [4, 5]], "humaneval": [[6, 7, 8, 9]]}
    m = measure.run_vllm(fake_vllm, "float32", 2, setup(tmp_path, prompts), "ngram", {"method": "ngram"})
    assert (m.engine, m.dtype, m.threads, m.timing, m.method) == ("vllm", "float32", 2, "HTTP wall time", "ngram")
    assert m.outputs == [[3, 2], [5, 4], [9, 8]] and m.new_tokens == 6
    assert m.seconds == m.wall_seconds > 0


def test_vllm_without_token_ids_is_an_error_not_a_guess(fake_vllm):
    FakeCompletions.answer_token_ids = False
    with fake_vllm.vllm_server("/t", "float32", 1) as url, pytest.raises(RuntimeError, match="return_token_ids"):
        measure.vllm_complete(url, "target", [1, 2], 2)


def test_a_peer_starts_without_eyas_openmp_policy(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with measure.without_openmp_policy():
        assert "OMP_WAIT_POLICY" not in os.environ
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_auto_is_eyas_own_policy_and_runs_for_eyas_alone():
    assert bench_peers.parse_threads("1,auto") == [1, "auto"]
    assert bench_peers.plan(["eyas", "llamacpp"], ["bfloat16"], [2, "auto"]) == [
        ("eyas", "bfloat16", 2, "*"), ("llamacpp", "bfloat16", 2, "vanilla"), ("eyas", "bfloat16", "auto", "*")]
    entry = {"tokens_per_s": 90.0, "threads": "auto"}
    assert bench_peers_report._cell(entry) == "90.0 (auto)"


# -- speculative methods: eyas's best lossless against the best peer row ---------------------------------------------

SPEC_ROWS = [
    row("eyas", "bfloat16", 2, 70.0, method="vanilla", suites=(65.0, 75.0)),
    row("eyas", "bfloat16", 2, 105.0, 1.0, method="ngram", same_as_vanilla=1.0, suites=(110.0, 100.0)),
    row("eyas", "bfloat16", 2, 100.0, 1.0, method="hybrid", same_as_vanilla=1.0, suites=(95.0, 104.0)),
    # faster, but it changed a prompt's tokens: not lossless, never eyas's best
    row("eyas", "bfloat16", "auto", 150.0, 0.9, method="suffix", same_as_vanilla=0.9, suites=(150.0, 150.0)),
    row("llamacpp", "bfloat16", 2, 76.0, 0.3, method="vanilla", suites=(74.0, 78.0)),
    # a peer's speculative row counts even where it changed its own tokens: the goal is its fastest
    row("llamacpp", "bfloat16", 2, 84.0, 0.3, method="ngram-mod", same_as_vanilla=0.75, suites=(90.0, 77.0)),
    row("vllm", "bfloat16", 2, 0.0, method="suffix", refused="ImportError: Arctic Inference is required"),
    row("vllm", "bfloat16", 2, 41.0, 0.4, method="vanilla", suites=(46.0, 37.0)),
    row("eyas", "float32", 2, 40.0, method="vanilla"),  # no peer at float32: no goal row
]


def spec_report(rows=SPEC_ROWS) -> dict:
    out = report(rows)
    out["config"]["settings"] = {"llamacpp": {"vanilla": "-", "ngram-mod": "--spec-type ngram-mod"}}
    return out


def test_best_vs_best_takes_eyas_lossless_rows_and_any_peer_row_per_suite_and_overall():
    goal = {(g["dtype"], g["scope"]): g for g in bench_peers_report.best_vs_best(SPEC_ROWS, ["humaneval", "chat"])}
    assert list(goal) == [("bfloat16", "humaneval"), ("bfloat16", "chat"), ("bfloat16", "overall")]
    humaneval, chat, overall = goal.values()
    assert (humaneval["eyas"]["method"], humaneval["peer"]["method"]) == ("ngram", "ngram-mod")
    assert humaneval["ratio"] == round(110 / 90, 3) and not humaneval["meets_goal"]
    # per suite, each side's own fastest row: hybrid on chat for eyas, llama.cpp vanilla for the peers
    assert (chat["eyas"]["method"], chat["peer"]["method"], chat["peer"]["engine"]) == ("hybrid", "vanilla", "llamacpp")
    assert chat["ratio"] == round(104 / 78, 3) and chat["meets_goal"]
    assert overall["eyas"] == {"engine": "eyas", "method": "ngram", "threads": 2, "tokens_per_s": 105.0,
                               "same_as_vanilla": 1.0}
    assert overall["peer"]["same_as_vanilla"] == 0.75 and overall["ratio"] == round(105 / 84, 3)
    # beside it, the fastest peer row that kept its own vanilla's tokens: here llama.cpp's vanilla
    assert overall["lossless_peer"]["method"] == "vanilla" and overall["lossless_ratio"] == round(105 / 76, 3)


def test_a_refused_row_is_never_the_best_and_the_vanilla_summary_ignores_methods():
    rows = [row("eyas", "bfloat16", 2, 50.0, method="vanilla"),
            row("llamacpp", "bfloat16", 2, 0.0, method="eagle3", refused="jobs.export: 4 taps"),
            row("llamacpp", "bfloat16", 2, 40.0, method="vanilla")]
    (overall,) = bench_peers_report.best_vs_best(rows, [])
    assert overall["peer"]["method"] == "vanilla" and overall["ratio"] == 1.25 and not overall["meets_goal"]
    (entry,) = bench_peers_report.summary(SPEC_ROWS[:-1])
    assert entry["engines"]["eyas"]["tokens_per_s"] == 70.0  # vanilla, not the speculative rows
    assert entry["eyas_over"] == {"llamacpp": round(70 / 76, 3), "vllm": round(70 / 41, 3)}


def test_the_page_with_methods_leads_with_the_goal_and_says_why_a_method_was_refused():
    page = bench_peers_report.markdown(spec_report())
    assert page.startswith("## eyas's speculative methods beside the peer engines' (smollm2-135m)")
    assert ("| bfloat16 | humaneval | 110.0 (eyas ngram, 2t) | 90.0 (llama.cpp ngram-mod, 2t) | 0.75 | 1.22x | no | "
            "74.0 (llama.cpp vanilla, 2t) | 1.49x |") in page
    assert ("| bfloat16 | chat | 104.0 (eyas hybrid, 2t) | 78.0 (llama.cpp vanilla, 2t) | - | 1.33x | yes | "
            "78.0 (llama.cpp vanilla, 2t) | 1.33x |") in page
    assert ("| vLLM | suffix | bfloat16 | 2 | refused | - | - | - | - | - | - | - | "
            "ImportError: Arctic Inference is required |") in page
    assert "| eyas | suffix | bfloat16 | auto | 150.0 | 150.0 | 150.0 | 135.0 | - | - | 0.90 | 0.90 | t |" in page
    assert "- llama.cpp: vanilla: -; ngram-mod: --spec-type ngram-mod" in page
    assert "eyas vanilla beside" not in page and "eyas vanilla beside" in bench_peers_report.markdown(report())


def test_a_report_from_before_methods_still_renders_as_it_did():
    page = bench_peers_report.markdown(report())
    assert "| engine | dtype | threads | tok/s |" in page and "method" not in page and ">= 1.3x" not in page


# -- the peers' speculative settings and refusals ---------------------------------------------------------------------

def test_peer_methods_build_each_engines_own_flags_and_config(tmp_path):
    sizes = bench_peers_methods.PeerSizes(ngram_match=3, ngram_draft=8, num_draft=2)
    assert bench_peers_methods.llamacpp_spec_args("vanilla", sizes) == ()
    assert bench_peers_methods.llamacpp_spec_args("ngram-map-k", sizes)[:2] == ("--spec-type", "ngram-map-k")
    assert bench_peers_methods.llamacpp_spec_args("eagle3", sizes)[-4:] == ("--spec-draft-n-max", "2",
                                                                            "--spec-draft-p-min", "0")
    exported = []
    export = lambda: exported.append(1) or tmp_path  # noqa: E731
    assert bench_peers_methods.vllm_speculative_config("vanilla", sizes, export) is None
    assert bench_peers_methods.vllm_speculative_config("ngram", sizes, export)["num_speculative_tokens"] == 8
    assert bench_peers_methods.vllm_speculative_config("suffix", sizes, export) == {"method": "suffix"}
    assert not exported  # only eagle3 exports the drafter
    assert bench_peers_methods.vllm_speculative_config("eagle3", sizes, export)["model"] == str(tmp_path)
    assert exported == [1]
    assert bench_peers_methods.peer_settings("llamacpp", "ngram-cache", sizes) == \
        "--spec-type ngram-cache --spec-draft-n-max 8"
    assert bench_peers_methods.peer_settings("vllm", "vanilla", sizes) == "-"
    with pytest.raises(ConfigError, match="known"):
        bench_peers_methods.llamacpp_spec_args("ngram", sizes)  # vLLM's name, not llama.cpp's
    with pytest.raises(ConfigError, match="known"):
        bench_peers_methods.vllm_speculative_config("ngram-mod", sizes, export)
    with pytest.raises(ConfigError, match="ngram_draft=0"):
        bench_peers_methods.PeerSizes(ngram_draft=0)


VLLM_REFUSAL_LOG = """\
INFO 12-07 14:50:01 [api_server.py:1000] vLLM API server version 0.32.0
(EngineCore pid=123) Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/vllm/config/speculative.py", line 1599, in _validate_suffix_decoding
pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig
  Value error, Arctic Inference is required for suffix decoding. Install via `pip install arctic-inference==0.1.1`.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_refusal_reason_is_the_line_that_says_why_not_the_last_error():
    assert bench_peers_methods.refusal_reason(VLLM_REFUSAL_LOG) == (
        "Value error, Arctic Inference is required for suffix decoding. Install via `pip install "
        "arctic-inference==0.1.1`.")
    llama_log = "build: 437 (8700851)\nerror: invalid argument: --spec-type ngram-foo\nusage: llama-server ...\n"
    assert bench_peers_methods.refusal_reason(llama_log) == "error: invalid argument: --spec-type ngram-foo"
    assert bench_peers_methods.refusal_reason("main: loading model\nSegmentation fault\n") == "Segmentation fault"
    assert bench_peers_methods.refusal_reason("") == "the server exited without a word"


def test_a_server_that_will_not_start_is_a_refused_row_and_a_later_failure_still_raises(tmp_path):
    log = tmp_path / "server.log"

    @contextlib.contextmanager
    def refusing(model_dir, dtype, threads, speculative_config=None, log_path=None):
        log_path.write_text(VLLM_REFUSAL_LOG)  # the engine's whole log: its reason may lie above the tail
        raise RuntimeError(f"vllm exited with code 1 before it was healthy; its log ({log_path}) ends: ...")
        yield  # pragma: no cover

    fake = types.SimpleNamespace(SERVED_NAME="target", vllm_server=refusing)
    m = measure.run_vllm(fake, "bfloat16", 2, setup(tmp_path, {"chat": [[1]]}), "suffix", {"method": "suffix"})
    assert m.refused.startswith("Value error, Arctic Inference is required") and m.new_tokens == 0
    assert m.row(None, None)["refused"] == m.refused and m.row(None, None)["tokens_per_s"] == 0.0

    @contextlib.contextmanager
    def healthy():
        yield "http://127.0.0.1:1"

    with contextlib.ExitStack() as stack, pytest.raises(ValueError):
        url, why = measure.start_or_refuse(stack, healthy(), log)
        assert (url, why) == ("http://127.0.0.1:1", None)
        raise ValueError("a failure while measuring is a bug, not a refusal")


def test_eyas_methods_are_jobs_bench_specs_and_a_missing_drafter_is_a_reason(tmp_path):
    spec_file = tmp_path / "ngram.yaml"
    spec_file.write_text("spec:\n  method: ngram\n  num_draft: 6\n  num_nodes: 4\n")
    args = types.SimpleNamespace(spec=[str(spec_file)], drafters_dir=str(tmp_path / "drafters"),
                                 draft_model=str(tmp_path / "draft-lm"))
    methods = bench_peers.eyas_methods(["ngram", "medusa", "vanilla"], args, str(tmp_path / "smollm2-135m"))
    assert [m[0] for m in methods] == ["vanilla", "ngram", "medusa"]  # vanilla first: every row's reference
    (_, ngram, ngram_why), (_, _, medusa_why) = methods[1], methods[2]
    assert ngram.method == "ngram" and ngram.num_draft == 6 and ngram_why is None
    assert bench_peers.spec_settings(ngram).startswith("num_nodes 4, num_draft 6")
    assert medusa_why.startswith("no drafter at") and "medusa-smollm2-135m" in medusa_why


def test_ratio_parts_split_the_goal_ratio_into_plain_speed_and_each_sides_speedup():
    rows = [dict(r) for r in SPEC_ROWS]
    rows[1]["num_accepted"] = 50   # eyas ngram: 100 tokens from 50 target forwards
    rows[5]["num_accepted"] = 20   # llama.cpp ngram-mod: 100 tokens from 80
    entries = bench_peers_report.best_vs_best(rows, ["humaneval", "chat"])
    overall = entries[-1]
    parts = bench_peers_report.ratio_parts(rows, overall)
    assert parts == {"plain": round(70 / 76, 3), "eyas_speedup": 1.5, "peer_speedup": round(84 / 76, 3),
                     "eyas_tokens_per_forward": 2.0, "peer_tokens_per_forward": 1.25}
    assert parts["plain"] * parts["eyas_speedup"] / parts["peer_speedup"] == pytest.approx(overall["ratio"], rel=2e-3)
    chat = bench_peers_report.ratio_parts(rows, entries[1])  # per suite: no acceptance counted, speeds per suite
    assert chat["eyas_speedup"] == round(104 / 75, 3) and chat["eyas_tokens_per_forward"] is None
    table = bench_peers_report.parts_table(spec_report(rows))
    assert "| bfloat16 | overall | 0.92x | 1.50x | 1.10x | 2.00 / 1.25 |" in table
    assert "| bfloat16 | chat | 0.96x | 1.39x | 1.00x | - |" in table
