"""Findings measured with hand-built drafters of known acceptance: the measurement, not just the rule, must find
what was built in. An oracle knows the target's greedy continuation of each prompt and drafts it right or wrong by
a fixed plan, with the confidence the plan says."""
from __future__ import annotations

import json

import pytest
import torch

from eyas.decoding.generate import generate
from eyas.decoding.tree import chain
from jobs.findings import calibration, position_context
from jobs.findings.cli import main


class Oracle:
    """Chains of ``depth`` tokens; ``plan(query, position, serial)`` -> (right?, confidence) for each drafted token,
    ``serial`` counting the drafts of that query so far."""
    name, target_taps = "oracle", ()

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], depth: int, plan) -> None:
        self.continuations, self.depth, self.plan = continuations, depth, plan
        self.max_draft_nodes = depth
        self.prompts = list(continuations)

    def begin(self, prompt_ids, taps) -> None:
        self.prompt = tuple(prompt_ids)
        self.query, self.serial = self.prompts.index(self.prompt), 0

    def propose(self, root_token, context_ids, temperature, generator):
        truth = self.continuations[self.prompt]
        done = len(context_ids) - len(self.prompt)  # tokens emitted so far, root included
        tokens, confidences = [], []
        for position in range(1, self.depth + 1):
            right, confidence = self.plan(self.query, position, self.serial)
            self.serial += 1
            true = truth[done + position - 1] if done + position - 1 < len(truth) else 0
            tokens.append(true if right else (true + 1) % 300)
            confidences.append(confidence)
        return chain(root_token, tokens, scores=torch.tensor(confidences).cumprod(0))

    def commit(self, tokens, taps) -> None:
        pass


def oracle_factory(depth: int, plan):
    def method_factory(bench, method, drafter=None, **tree):
        continuations = {tuple(p): generate(bench.target, p, bench.settings.max_new_tokens + 64,
                                            eos_token_ids=()).token_ids for p in bench.prompts}
        return lambda: Oracle(continuations, depth, plan)
    return method_factory


def test_position_vs_context_finds_the_built_in_acceptance(findings_home, tmp_path, monkeypatch):
    # even queries: P1, P2 right, P3 wrong; odd queries: P1 right, P2 wrong. Pooled means: P1 1, P3 0, P2 between
    # (the share of P2 judgments made by even queries); at P2 the queries span 0 to 1
    plan = lambda query, position, serial: (position == 1 or (query % 2 == 0 and position == 2), 0.5)
    monkeypatch.setattr(position_context, "method_factory", oracle_factory(3, plan))
    out = tmp_path / "out"
    assert main(["--finding", "position-vs-context", "--scale", "micro", "--out", str(out), "num_prompts=4"]) == 0
    rows = json.loads((out / "table.json").read_text())
    assert rows[0]["mean"] == 1.0 and 0 < rows[1]["mean"] < 1 and rows[2]["mean"] == 0.0
    assert (rows[1]["min"], rows[1]["max"], rows[1]["num_queries"]) == (0.0, 1.0, 4)
    queries = json.loads((out / "per_query.json").read_text())
    assert [q["P2"] for q in queries] == [1.0, 0.0, 1.0, 0.0] and all(q["P1"] == 1.0 for q in queries)
    assert json.loads((out / "report.json").read_text())["verdict"]["outcome"] == "reproduced"


LEVELS = (0.1, 0.3, 0.5, 0.7, 0.9)


class Calibrated:
    """Draft k of a query has confidence LEVELS[k % 5]; at each level, a draft is right exactly when that keeps the
    level's hit rate at or under its confidence (so after n drafts it is within 1/n of it)."""

    def __init__(self) -> None:
        self.drafts = {c: 0 for c in LEVELS}
        self.hits = {c: 0 for c in LEVELS}

    def __call__(self, query, position, serial):
        level = LEVELS[serial % len(LEVELS)]
        self.drafts[level] += 1
        right = self.hits[level] + 1 <= level * self.drafts[level]
        self.hits[level] += right
        return right, level


@pytest.mark.parametrize("plan, outcome", [(Calibrated(), "reproduced"),
                                           (lambda q, p, s: (False, 0.9), "refuted")])
def test_calibration_finds_a_calibrated_and_an_overconfident_drafter(findings_home, tmp_path, monkeypatch, plan,
                                                                     outcome):
    monkeypatch.setattr(calibration, "method_factory", oracle_factory(1, plan))
    out = tmp_path / "out"
    assert main(["--finding", "calibration", "--scale", "micro", "--out", str(out), "methods=[eagle2]",
                 "num_prompts=4", "max_new_tokens=60", "min_bin_count=5"]) == 0
    report = json.loads((out / "report.json").read_text())
    summary = json.loads((out / "calibration.json").read_text())["summary"]["eagle2"]
    assert summary["ece"] < 0.1 if outcome == "reproduced" else summary["ece"] > 0.8
    assert report["verdict"]["outcome"] == outcome
