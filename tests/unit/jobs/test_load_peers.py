"""jobs.load_peers without servers: the greedy agreement per level, the engines' settings, the argument checks and
the rendered tables. The servers run in tests/integration/test_load_peers_engines.py."""
from __future__ import annotations

import json

import pytest

from eyas.config import ConfigError
from eyas.methods import SpecConfig
from jobs import load_peers, load_peers_report


def row(engine: str, method: str, c: int, tps: float, texts: dict | None = None, acceptance: float | None = None,
        tau: float | None = None) -> dict:
    return {"engine": engine, "method": method, "concurrency": c, "num_requests": 8, "new_tokens": 512,
            "seconds": 512 / tps, "tokens_per_s": tps, "latency_p50_s": 1.0, "latency_p99_s": 2.0, "ttft_p50_s": 0.05,
            "ttft_p99_s": 0.1, "tau": tau, "acceptance": acceptance,
            "acceptance_per_position": [0.2, 0.1] if acceptance else None, "drafts": {},
            "texts": texts or {0: "a", 1: "b"}, "load_before": [1.2, 1.0, 1.0]}


def report(rows: list[dict]) -> dict:
    return {"commit": "abc1234", "machine": {"cpu_features": {"model": "AMD EPYC", "flags": ["avx2"]}, "num_cpus": 2},
            "config": {"command": "python -m jobs.load_peers", "target": "/x/smollm2-135m",
                       "engines": ["eyas", "llamacpp"], "methods": ["vanilla", "eagle3"], "concurrency": [1, 4],
                       "dtype": "float32", "threads": 1, "requests_per_level": 8, "max_tokens": 64,
                       "prompts": "chat", "num_prompts": 8,
                       "settings": {"eyas": {"vanilla": "-", "eagle3": "chain 3"},
                                    "llamacpp": {"vanilla": "-", "eagle3": "n-max 3"}}},
            "results": rows}


def test_speculative_rows_are_compared_with_their_own_engines_vanilla():
    rows = [row("eyas", "vanilla", 1, 10.0), row("eyas", "eagle3", 1, 12.0),
            row("llamacpp", "vanilla", 1, 20.0, {0: "a", 1: "c"}), row("llamacpp", "eagle3", 1, 18.0)]
    load_peers.same_as_vanilla(rows)
    assert [r["same_as_vanilla"] for r in rows] == [None, 1.0, None, 0.5]
    assert all("texts" not in r for r in rows)


def test_summary_table_gives_tokens_speedup_acceptance_and_agreement():
    rows = [row("eyas", "vanilla", 1, 10.0), row("eyas", "vanilla", 4, 30.0),
            row("eyas", "eagle3", 1, 12.0, acceptance=0.15, tau=1.4), row("eyas", "eagle3", 4, 27.0, acceptance=0.1),
            row("llamacpp", "vanilla", 1, 20.0), row("llamacpp", "vanilla", 4, 50.0),
            row("llamacpp", "eagle3", 1, 18.0, acceptance=0.14), row("llamacpp", "eagle3", 4, 45.0)]
    load_peers.same_as_vanilla(rows)
    lines = load_peers_report.summary_table(report(rows)).splitlines()
    assert lines[0] == "| engine | method | c=1 tok/s | c=4 tok/s | accept (c=1) | tau (c=1) | same as vanilla |"
    assert lines[2] == "| eyas | vanilla | 10.0 | 30.0 | - | - | - |"
    assert lines[3] == "| eyas | EAGLE-3 | 12.0 (1.20x) | 27.0 (0.90x) | 0.150 | 1.40 | 1.00 |"
    assert lines[5] == "| llama.cpp | EAGLE-3 | 18.0 (0.90x) | 45.0 (0.90x) | 0.140 | - | 1.00 |"
    page = load_peers_report.markdown(report(rows))
    assert "commit abc1234" in page and "AMD EPYC (2 CPUs, ISA: avx2)" in page and "load before each" in page
    assert "| llama.cpp | EAGLE-3 | 4 | 45.0 | 1.00 | 2.00 | 0.050 | 0.100 | - | - | 1.00 |" in page
    assert "eyas EAGLE-3: chain 3; llama.cpp EAGLE-3: n-max 3" in page


def test_from_renders_a_report_without_measuring(tmp_path):
    rows = [row("eyas", "vanilla", 1, 10.0), row("eyas", "vanilla", 4, 30.0)]
    load_peers.same_as_vanilla(rows)
    source = tmp_path / "load_peers.json"
    source.write_text(json.dumps(report(rows)))
    assert load_peers.main(["--from", str(source), "--report", str(tmp_path / "page.md")]) == 0
    assert (tmp_path / "page.md").read_text() == load_peers_report.markdown(report(rows))


def test_every_eyas_method_is_a_valid_spec_drafting_the_peers_shapes(tmp_path):
    cell = load_peers.Cell(tmp_path, tmp_path, tmp_path, "float32", 1, 3, [1, 4], 8000)
    specs = {m: SpecConfig(**load_peers.eyas_spec(m, cell)) for m in load_peers_report.METHODS}
    assert specs["ngram"].num_draft == load_peers.NGRAM_DRAFT and specs["ngram"].max_matches == 1  # one chain
    assert specs["eagle3"].tree == "chain" and specs["eagle3"].depth == 3
    assert load_peers.vllm_config("vanilla", cell) is None
    assert load_peers.vllm_config("ngram", cell)["num_speculative_tokens"] == load_peers.NGRAM_DRAFT


def test_bad_engines_methods_and_levels_are_refused(tmp_path, monkeypatch, capsys):
    with pytest.raises(ConfigError, match="--engines"):
        load_peers.parse_list("eyas,sglang", load_peers_report.ENGINES, "--engines")
    out = str(tmp_path / "x.json")
    assert load_peers.main(["--engines", "eyas", "--methods", "medusa", "--out", out]) == 2
    assert "--methods" in capsys.readouterr().err
    assert load_peers.main(["--engines", "eyas", "--concurrency", "1,16", "--out", out]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert load_peers.main(["--engines", "eyas", "--threads", "0", "--out", out]) == 2
    assert "--threads 0" in capsys.readouterr().err
    monkeypatch.setenv("EYAS_LLAMACPP_DIR", str(tmp_path / "no-build"))
    assert load_peers.main(["--engines", "eyas,llamacpp", "--out", out]) == 2
    assert "make tools-llamacpp" in capsys.readouterr().err
