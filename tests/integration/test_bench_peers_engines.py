"""jobs.bench_peers end to end with its speculative methods: eyas's on the random target in every run (lossless in
float32, a method without its drafter a refused row with the reason), and llama.cpp's and vLLM's own speculation
beside eyas where their tools are built.

The peers need a target they read (llama.cpp's converter knows only the tokenizers it has hashes for):
``EYAS_PEER_TARGET`` names one (e.g. $EYAS_HOME/targets/smollm2-135m), and the tools come from ``make
tools-llamacpp`` / ``make tools-vllm`` (or EYAS_LLAMACPP_DIR / EYAS_VLLM_PYTHON). CI builds neither, so there those
tests skip and say what they need; here the llama.cpp test takes about half a minute, vLLM's 5 minutes (two engine
starts, each compiling)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs import bench_peers
from jobs.bench_peers_report import markdown
from jobs.peers import llamacpp, vllm
from peers_testing import PEER_TARGET, tool_missing, write_prompts

pytestmark = pytest.mark.slow


def bench(tmp_path: Path, target: Path, engines: str, *extra: str) -> dict:
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    ngram = tmp_path / "ngram.yaml"  # prompt lookup without a datastore: the random target has none
    ngram.write_text("spec:\n  method: ngram\n  num_draft: 4\n  max_matches: 1\n")
    out, page = tmp_path / "bench_peers.json", tmp_path / "bench_peers.md"
    code = bench_peers.main(["--engines", engines, "--dtypes", "float32", "--threads", "1", "--prompts-file",
                             str(prompts), "--max-new-tokens", "12", "--target", str(target), "--spec", str(ngram),
                             "--gguf-dir", str(tmp_path / "gguf"), "--workdir", str(tmp_path / "work"),
                             "--out", str(out), "--report", str(page), *extra])
    assert code == 0
    report = json.loads(out.read_text())
    assert page.read_text() == markdown(report)  # the page is the JSON rendered
    return report


def rows_by_method(report: dict, engine: str) -> dict[str, dict]:
    return {r["method"]: r for r in report["results"] if r["engine"] == engine}


def test_eyas_methods_are_lossless_and_a_missing_drafter_is_a_refused_row(random_checkpoint, eyas_home, tmp_path):
    report = bench(tmp_path, random_checkpoint, "eyas", "--eyas-methods", "vanilla,ngram,medusa")
    rows = rows_by_method(report, "eyas")
    assert list(rows) == ["vanilla", "ngram", "medusa"]
    assert rows["vanilla"]["new_tokens"] > 0 and rows["vanilla"]["refused"] is None
    assert rows["ngram"]["same_as_vanilla"] == 1.0 and rows["ngram"]["num_draft_tokens"] > 0
    assert rows["medusa"]["refused"].startswith("no drafter at") and rows["medusa"]["tokens_per_s"] == 0.0
    assert report["config"]["settings"]["eyas"]["ngram"].startswith("num_draft 4")


@pytest.mark.skipif(tool_missing(llamacpp.llama_server_bin) is not None,
                    reason=f"llama.cpp rows: {tool_missing(llamacpp.llama_server_bin)}")
def test_llamacpp_speculates_beside_eyas_and_the_goal_is_reported(tmp_path):
    report = bench(tmp_path, Path(PEER_TARGET), "eyas,llamacpp", "--eyas-methods", "vanilla,ngram",
                   "--llamacpp-methods", "vanilla,ngram-simple,ngram-cache", "--ngram-match", "2")
    rows = rows_by_method(report, "llamacpp")
    assert list(rows) == ["vanilla", "ngram-simple", "ngram-cache"]
    assert all(r["refused"] is None and r["new_tokens"] > 0 for r in rows.values())
    assert rows["ngram-simple"]["num_draft_tokens"] > 0  # its timings' draft_n: the repeated prompt was drafted
    assert rows["ngram-simple"]["same_as_vanilla"] is not None and rows["vanilla"]["same_as_eyas"] is not None
    assert "| float32 | overall |" in markdown(report)  # eyas's best lossless over the best peer row
    assert [g["scope"] for g in report["goal"]] == ["custom", "overall"] and report["goal"][-1]["ratio"] > 0


@pytest.mark.skipif(tool_missing(vllm.vllm_python) is not None, reason=f"vLLM rows: {tool_missing(vllm.vllm_python)}")
def test_vllm_ngram_speculates_and_reports_its_acceptance(tmp_path):
    report = bench(tmp_path, Path(PEER_TARGET), "vllm", "--vllm-methods", "vanilla,ngram", "--ngram-match", "2")
    rows = rows_by_method(report, "vllm")
    assert rows["ngram"]["refused"] is None and rows["ngram"]["num_draft_tokens"] > 0  # from its /metrics
    assert rows["ngram"]["same_as_vanilla"] is not None
