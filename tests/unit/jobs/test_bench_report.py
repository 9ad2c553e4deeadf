"""jobs.bench_report: Markdown results from a real bench.json (docs/bench-smollm2-s5.json), without measuring."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eyas.config import ConfigError
from jobs import bench, bench_report

DOCS = Path(__file__).resolve().parents[3] / "docs"
RUN = DOCS / "bench-smollm2-s5.json"          # humaneval + chat, 12 methods, commit f3d80da
CHAT8 = DOCS / "bench-smollm2-s5-chat8.json"  # chat only, 8 methods


def row(text: str, method: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {method} |"))


def test_summary_is_method_by_suite_with_speedup_and_tau():
    text = bench_report.summary(bench_report.load_report(RUN), RUN, DOCS)
    assert text.splitlines()[0] == ("| method | settings | humaneval speedup | humaneval tau | chat speedup | "
                                    "chat tau |")
    assert row(text, "eagle3") == "| eagle3 | 4 nodes, depth 3, top-4 | 1.09x | 1.48 | 1.32x | 1.84 |"
    assert row(text, "vanilla") == "| vanilla |  | 1.00x | - | 1.00x | - |"
    assert row(text, "hf") == "| hf |  | 0.42x | - | 0.42x | - |"  # no tau: transformers does not speculate
    assert row(text, "draft-lm") == "| draft-lm | chain of 1 | 1.09x | 1.15 | 1.10x | 1.19 |"
    # the best speedup of a suite is bold: ngram with its budget and datastore
    assert row(text, "ngram").startswith("| ngram | 4 nodes, 8 tokens a match, 4 matches, datastore "
                                         "data-smollm2-draft + data-smollm2-code | **2.21x** | 2.58 | **1.84x** |")
    assert len([line for line in text.splitlines() if line.startswith("|")]) == 2 + 12  # header, rule, methods
    # what ran where: the command as a reader types it, the commit, the machine, the JSON it came from
    assert "- command: `python -m jobs.bench --methods vanilla,hf,hf-assisted," in text
    assert "--draft-model $EYAS_HOME/targets/draft-smollm2-mix" in text and "/root/.cache" not in text
    assert "- commit: `f3d80da`" in text
    assert "- machine: x86_64, 2 cores, 1 torch thread (eyas policy), no GPU, weights read at 24.5 GB/s" in text
    assert "- data: [bench-smollm2-s5.json](bench-smollm2-s5.json)" in text
    assert "bfloat16, greedy, 4 prompts a suite, 128 new tokens" in text
    assert "every speculative method decoded vanilla's very tokens on every prompt" in text


def test_the_table_follows_the_json(tmp_path):
    """Edit the JSON and the table changes with it: the rendering reads the numbers, it does not keep them."""
    report = json.loads(RUN.read_text())
    for r in report["results"]:
        if (r["method"], r["suite"]) == ("eagle3", "chat"):
            r.update(speedup=2.5, tau=3.0, same_as_vanilla=0.5)
    report["machine"]["cpu_model"] = "Some CPU 9000"
    edited = tmp_path / "bench.json"
    edited.write_text(json.dumps(report))
    text = bench_report.summary(bench_report.load_report(edited), edited, tmp_path)
    assert row(text, "eagle3") == "| eagle3 | 4 nodes, depth 3, top-4 | 1.09x | 1.48 | **2.50x** | 3.00 |"
    assert row(text, "ngram").endswith("| **2.21x** | 2.58 | 1.84x | 2.10 |")  # no longer chat's best
    assert "eagle3 decoded another text than vanilla on some prompts: not a lossless speedup" in text
    assert "- machine: Some CPU 9000, 2 cores" in text


def test_page_groups_runs_by_target_with_details_and_figures(tmp_path, monkeypatch):
    monkeypatch.chdir(DOCS.parent)
    text = bench_report.page(["docs/bench-smollm2-s5.json", "docs/bench-smollm2-s5-chat8.json"], "docs/results.md")
    assert text.startswith("# Results\n")
    assert ("python -m jobs.bench --from docs/bench-smollm2-s5.json,docs/bench-smollm2-s5-chat8.json "
            "--report docs/results.md") in text
    assert text.count("\n## smollm2-135m\n") == 1  # one target, two runs under it
    assert "### humaneval, chat: 4 prompts a suite (bench-smollm2-s5.json)" in text
    assert "### chat: 8 prompts a suite (bench-smollm2-s5-chat8.json)" in text
    assert "| eagle3 | 4 nodes, depth 3, top-4 | **1.11x** | 1.57 |" in text  # the chat-only run's own table
    # the details: per suite tok/s, per-depth acceptance, same, time split, of limit
    assert ("| eagle3 | `eagle3-smollm2-135m-mix3` | 54.7 | 1.32x | 1.84 | 0.57 0.54 0.69 | 1.00 | 22% / 76% / 2% "
            "| 0.91 |") in text
    assert "Vanilla on humaneval: 45% of the memory-bandwidth limit (90.9 tok/s), 2.38x transformers" in text
    assert "![speedup and tau per method, bench-smollm2-s5](bench-smollm2-s5.png)" in text
    # without its figure the page leaves the image out
    shutil.copy(CHAT8, tmp_path / "alone.json")
    alone = bench_report.page([str(tmp_path / "alone.json")], str(tmp_path / "r.md"))
    assert "![" not in alone and "| dflash-ddtree |" in alone


def test_update_tables_rewrites_only_the_marked_blocks(tmp_path):
    shutil.copy(RUN, tmp_path / "run.json")
    text = "intro\n<!-- bench-table run.json -->\nstale\n<!-- bench-table:end -->\noutro\n"
    new = bench_report.update_tables(text, tmp_path)
    assert new.startswith("intro\n<!-- bench-table run.json -->\n| method | settings |")
    assert new.endswith("- data: [run.json](run.json)\n<!-- bench-table:end -->\noutro\n")
    assert "stale" not in new and bench_report.update_tables(new, tmp_path) == new
    with pytest.raises(ConfigError, match="no such bench.json"):
        bench_report.update_tables("<!-- bench-table gone.json -->\n<!-- bench-table:end -->", tmp_path)


def test_cli_renders_without_measuring(tmp_path, capsys):
    shutil.copy(RUN, tmp_path / "run.json")
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- bench-table run.json -->\n<!-- bench-table:end -->\n")
    page = tmp_path / "out" / "results.md"
    assert bench.main(["--from", str(tmp_path / "run.json"), "--report", str(page),
                       "--update-tables", str(readme)]) == 0
    assert "| eagle3 | 4 nodes, depth 3, top-4 | 1.09x | 1.48 | 1.32x | 1.84 |" in page.read_text()
    assert "](../run.json)" in page.read_text()  # links relative to the page
    assert "| eagle3 | 4 nodes, depth 3, top-4 | 1.09x | 1.48 | 1.32x | 1.84 |" in readme.read_text()
    assert bench.main(["--from", str(tmp_path / "run.json")]) == 2
    assert "--report" in capsys.readouterr().err
    assert bench.main(["--from", str(tmp_path / "nope.json"), "--report", str(page)]) == 2
    assert "no such bench.json" in capsys.readouterr().err
    (tmp_path / "plain.md").write_text("no blocks\n")
    assert bench.main(["--from", str(tmp_path / "run.json"), "--update-tables", str(tmp_path / "plain.md")]) == 2


def test_a_fresh_run_writes_its_report(random_checkpoint, tmp_path, eyas_home):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("import os\n", "x = [1, 2,")))
    spec = eyas_home / "sweeps" / "ngram" / "best.yaml"  # named as a config names it: '$EYAS_HOME/...'
    spec.parent.mkdir(parents=True)
    spec.write_text("spec: {method: ngram, num_draft: 3}\n")
    out, page = tmp_path / "bench.json", tmp_path / "results.md"
    assert bench.main(["--target", str(random_checkpoint), "--methods", "vanilla,ngram", "--prompts-file",
                       str(prompts), "--max-new-tokens", "8", "--cost-repeats", "0", "--out", str(out),
                       "--spec", "$EYAS_HOME/sweeps/ngram/best.yaml", "--report", str(page)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["dtype"] == "float32" and "cpu_model" in report["machine"]
    text = page.read_text()
    assert f"--from {out} --report {page}" in text and f"## {random_checkpoint.name}" in text
    assert "| method | settings | custom speedup | custom tau |" in text
    assert row(text, "ngram").startswith("| ngram | 3 tokens a match | ")
    assert "![speedup and tau per method, bench](bench.png)" in text


def test_a_hybrid_row_names_its_proposers_and_its_cost_settings():
    spec = {"method": "hybrid", "proposers": ["suffix", "eagle3"], "tree": "chain", "depth": 1, "num_nodes": 8,
            "learned_below": 0.4, "cost_cut": True}
    assert bench_report.settings(spec) == "suffix + eagle3, chain, 8 nodes, depth 1, learned below 0.4, cost cut"
    assert bench_report.settings({"method": "ngram", "num_draft": 8}) == "8 tokens a match"
