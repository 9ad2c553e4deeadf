"""jobs.load_peers end to end, through real HTTP: eyas's own cells (vanilla, ngram, EAGLE-3 on its Ray Serve
application, a local Ray) on the random target in every run, and the peers' cells where their tools are built.

The peers need a target they can read: llama.cpp's converter knows only the tokenizers it has hashes for, and
vLLM's engine here takes a 2048-token context. ``EYAS_PEER_TARGET`` names one (e.g. $EYAS_HOME/targets/smollm2-135m)
and the tools come from ``make tools-llamacpp`` / ``make tools-vllm`` (or EYAS_LLAMACPP_DIR / EYAS_VLLM_PYTHON).
CI builds neither, so there those tests skip and say what they need; on a developer's machine the llama.cpp cells
take about a minute, vLLM's one cell 2-3 minutes (its engine compiles at start-up)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eyas.drafters import registry
from eyas.models import load_target
from jobs import load_peers
from jobs.peers import llamacpp, vllm
from peers_testing import PEER_TARGET, tool_missing, write_prompts

pytestmark = pytest.mark.slow


def random_eagle3(target_dir: Path, out: Path) -> Path:
    torch.manual_seed(0)
    model = registry.build_model("eagle3", {"ttt_steps": 2}, load_target(target_dir))
    return registry.save_drafter(model, out, target_dir)


def run_harness(tmp_path: Path, target: Path, engines: str, methods: str, concurrency: str) -> dict:
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    out, page = tmp_path / "load_peers.json", tmp_path / "load_peers.md"
    drafter = random_eagle3(target, tmp_path / "eagle3")
    code = load_peers.main(["--engines", engines, "--methods", methods, "--concurrency", concurrency,
                            "--target", str(target), "--drafter", str(drafter), "--prompts-file", str(prompts),
                            "--requests-per-level", "2", "--max-tokens", "8", "--workdir", str(tmp_path / "work"),
                            "--out", str(out), "--report", str(page)])
    assert code == 0
    report = json.loads(out.read_text())
    assert page.read_text() == load_peers.markdown(report)  # the page is the JSON rendered
    return report


def check_cells(report: dict, engine: str, methods: list[str], levels: list[int]) -> dict:
    cells = {(r["method"], r["concurrency"]): r for r in report["results"]}
    assert sorted(cells) == sorted((m, c) for m in methods for c in levels)
    assert all(r["engine"] == engine and r["new_tokens"] > 0 and r["tokens_per_s"] > 0 for r in cells.values())
    assert all(r["num_requests"] == max(2, r["concurrency"]) for r in cells.values())
    return cells


def test_eyas_cells_through_its_served_application(random_checkpoint, tmp_path):
    report = run_harness(tmp_path, random_checkpoint, "eyas", "vanilla,ngram,eagle3", "1,2")
    cells = check_cells(report, "eyas", ["vanilla", "ngram", "eagle3"], [1, 2])
    for c in (1, 2):
        assert cells[("vanilla", c)]["same_as_vanilla"] is None and cells[("vanilla", c)]["acceptance"] is None
        for method in ("ngram", "eagle3"):
            assert cells[(method, c)]["same_as_vanilla"] == 1.0  # float32 greedy: lossless over HTTP too
        eagle3 = cells[("eagle3", c)]["drafts"]
        assert eagle3["num_drafts"] > 0 and eagle3["num_draft_tokens"] == 3 * eagle3["num_drafts"]  # chain of 3
    assert "| eyas | EAGLE-3 |" in load_peers.markdown(report)


@pytest.mark.skipif(tool_missing(llamacpp.llama_server_bin) is not None,
                    reason=f"llama.cpp cells: {tool_missing(llamacpp.llama_server_bin)}")
def test_llamacpp_cells_through_llama_server(tmp_path):
    report = run_harness(tmp_path, Path(PEER_TARGET), "llamacpp", "vanilla,ngram,eagle3", "1,2")
    cells = check_cells(report, "llamacpp", ["vanilla", "ngram", "eagle3"], [1, 2])
    for c in (1, 2):
        assert cells[("eagle3", c)]["drafts"]["num_draft_tokens"] > 0  # its timings' draft_n: the GGUF drafted
        assert cells[("eagle3", c)]["same_as_vanilla"] == 1.0


@pytest.mark.skipif(tool_missing(vllm.vllm_python) is not None, reason=f"vLLM cell: {tool_missing(vllm.vllm_python)}")
def test_vllm_cell_through_its_openai_server(tmp_path):
    report = run_harness(tmp_path, Path(PEER_TARGET), "vllm", "eagle3", "1")
    cell = check_cells(report, "vllm", ["eagle3"], [1])[("eagle3", 1)]
    assert cell["drafts"]["num_drafts"] > 0 and cell["drafts"]["num_draft_tokens"] == 3 * cell["drafts"]["num_drafts"]
