"""jobs.peers.parity: the checks on hand-built results, llama-server's trace steps as an Acceptance, the engine
choice, and the eyas reference run end to end on a random target with a random EAGLE-3 (lossless, per-position
counts). The peers' runs are `make peer-check`'s (vLLM and llama.cpp) and `make peer-check-llamacpp`'s."""
from __future__ import annotations

import json

import pytest
import torch

from eyas.config import ConfigError
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
    # a position one engine never drafted counts as 0 there
    shorter = parity.checks({"eyas": result([5, 1]), "llamacpp": result([5])}, 0.05)
    assert shorter[-1]["gaps"] == [0.0, pytest.approx(0.1)] and not shorter[-1]["ok"]


def test_llamacpp_trace_steps_are_draft_rounds():
    steps = [(2, 3), (0, 3), (3, 3), (1, 3)]  # (accepted, drafted) per verify step
    accepted = parity.steps_acceptance(steps)
    assert (accepted.num_drafts, accepted.num_draft_tokens, accepted.num_accepted) == (4, 12, 6)
    assert accepted.summary()["per_position"] == [0.75, 0.5, 0.25]


def test_the_engine_choice_puts_eyas_first_and_refuses_unknown_peers():
    assert parity.parse_engines("llamacpp") == ["eyas", "llamacpp"]
    assert parity.parse_engines("vllm, llamacpp,vllm") == ["eyas", "vllm", "llamacpp"]
    for bad in ("", "eyas", "sglang"):
        with pytest.raises(ConfigError, match="--engine"):
            parity.parse_engines(bad)


def test_a_missing_llamacpp_build_fails_before_eyas_runs(random_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EYAS_LLAMACPP_DIR", str(tmp_path / "no-build"))
    monkeypatch.setattr(parity, "run_eyas", lambda run: pytest.fail("eyas ran before the tool check"))
    code = parity.main(["--engine", "llamacpp", "--target", str(random_checkpoint), "--drafter", str(tmp_path),
                        "--out", str(tmp_path / "parity.json")])
    assert code == 2 and "make tools-llamacpp" in capsys.readouterr().err


@pytest.fixture()
def drafter_dir(random_checkpoint, tmp_path):
    torch.manual_seed(0)
    model = registry.build_model("eagle3", {"ttt_steps": 2}, load_target(random_checkpoint))
    return registry.save_drafter(model, tmp_path / "eagle3", random_checkpoint)


def test_eyas_reference_run(random_checkpoint, drafter_dir, tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n{"prompt": "class A:"}\n')
    out = tmp_path / "parity.json"
    # the peer's place taken by a second eyas run: the report and the checks as a real peer gets them
    monkeypatch.setitem(parity.ENGINES, "llamacpp", parity.run_eyas)
    monkeypatch.setitem(parity.TOOLS, "llamacpp", lambda: tmp_path)
    code = parity.main(["--engine", "llamacpp", "--target", str(random_checkpoint), "--drafter", str(drafter_dir),
                        "--prompts-file", str(prompts), "--max-new-tokens", "12", "--num-draft", "3",
                        "--workdir", str(tmp_path / "work"), "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, report["checks"]
    eyas = report["engines"]["eyas"]
    assert eyas["texts"]["spec"] == eyas["texts"]["vanilla"] and len(eyas["texts"]["spec"]) == 2
    assert eyas["num_drafts"] > 0 and eyas["num_draft_tokens"] == 3 * eyas["num_drafts"]  # a chain of 3
    assert len(eyas["per_position"]) <= 3
    assert report["engines"]["llamacpp"]["vanilla_equals_eyas"] == [True, True]
    assert [(c["check"], c["engine"], c["ok"]) for c in report["checks"]] == [
        ("lossless", "eyas", True), ("lossless", "llamacpp", True), ("acceptance parity", "llamacpp", True)]
    assert report["config"]["command"].startswith("python -m jobs.peers.parity")
