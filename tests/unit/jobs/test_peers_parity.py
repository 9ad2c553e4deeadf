"""jobs.peers.parity: the checks on hand-built results, and the eyas reference run end to end on a random target
with a random EAGLE-3 (lossless, per-position counts). The vLLM run is `make peer-check`'s."""
from __future__ import annotations

import json

import pytest
import torch

from eyas.drafters import registry
from eyas.models import load_target
from jobs.peers import parity
from jobs.peers.acceptance import Acceptance


def result(per_position: list[int], rounds: int | None = 10, same: bool = True) -> parity.EngineResult:
    spec = ["a", "b"] if same else ["a", "x"]
    return parity.EngineResult(["a", "b"], spec, Acceptance(rounds, 30, sum(per_position), per_position))


def test_checks_lossless_and_parity_within_tolerance():
    found = parity.checks({"eyas": result([5, 2, 1]), "vllm": result([5, 2, 0]), "other": result([9, 2, 1])}, 0.15)
    by = {(c["check"], c["engine"]): c for c in found}
    assert all(by[("lossless", e)]["ok"] for e in ("eyas", "vllm", "other"))
    assert by[("acceptance parity", "vllm")]["ok"] and by[("acceptance parity", "vllm")]["max_gap"] == pytest.approx(0.1)
    assert not by[("acceptance parity", "other")]["ok"]  # 0.9 against 0.5 at position 0
    assert ("acceptance parity", "eyas") not in by
    lossy = parity.checks({"eyas": result([5]), "vllm": result([5], same=False)}, 0.05)
    assert [c["ok"] for c in lossy] == [True, False, True]
    # an engine without per-position rounds (llama-server) is compared on its overall rate: 8/30 against 9/30
    overall = parity.checks({"eyas": result([5, 3, 1]), "llamacpp": result([8], rounds=None)}, 0.05)
    assert overall[-1]["ok"] and overall[-1]["gaps"] == [pytest.approx(1 / 30)]


@pytest.fixture()
def drafter_dir(random_checkpoint, tmp_path):
    torch.manual_seed(0)
    model = registry.build_model("eagle3", {"ttt_steps": 2}, load_target(random_checkpoint))
    return registry.save_drafter(model, tmp_path / "eagle3", random_checkpoint)


def test_eyas_reference_run(random_checkpoint, drafter_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n{"prompt": "class A:"}\n')
    out = tmp_path / "parity.json"
    code = parity.main(["--target", str(random_checkpoint), "--drafter", str(drafter_dir), "--engines", "eyas",
                        "--prompts-file", str(prompts), "--max-new-tokens", "12", "--num-draft", "3",
                        "--workdir", str(tmp_path / "work"), "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, report["checks"]
    eyas = report["engines"]["eyas"]
    assert eyas["texts"]["spec"] == eyas["texts"]["vanilla"] and len(eyas["texts"]["spec"]) == 2
    assert eyas["num_drafts"] > 0 and eyas["num_draft_tokens"] == 3 * eyas["num_drafts"]  # a chain of 3
    assert len(eyas["per_position"]) <= 3
    assert parity.main(["--target", str(random_checkpoint), "--drafter", str(drafter_dir), "--engines", "vllm",
                        "--out", str(out)]) == 2  # eyas must come first: it is the reference
