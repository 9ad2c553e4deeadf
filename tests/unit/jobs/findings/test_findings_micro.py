"""Every finding at the micro size, as CI runs it: one MLflow run (FINISHED, tagged with the finding and its
verdict) holding the figures, the table and the verdict, and that verdict is the one the finding's rule computes
from the table the run logged. The training findings train their drafters here, in this process (runner local)."""
from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from eyas.config import from_dict
from jobs.findings import (calibration, data_scaling, dflash_eagle3, dspark_dflash, eagle31_eagle3, hardware_nstar,
                           peagle_cost, position_context, tree_chain)
from jobs.findings.cli import FINDINGS, main

FIGURES = {
    "calibration": {"reliability.png"},
    "position-vs-context": {"acceptance_by_position.png"},
    "data-scaling": {"tau_vs_data.png"},
    "tree-vs-chain": {"tau_speedup_vs_n.png"},
    "hardware-n-star": {"cost_curve.png", "speedup_vs_n.png"},
    "dflash-vs-eagle3": {"dflash_vs_eagle3.png", "convergence.png"},
    "peagle-vs-eagle3-cost": {"drafter_share.png"},
    "dspark-vs-dflash": {"tau_per_suite.png"},
    "eagle31-vs-eagle3": {"tau_per_suite.png"},
}
TRAINED = {"dspark-vs-dflash": ("dflash", "dspark", "dflash2"), "eagle31-vs-eagle3": ("eagle3", "eagle3.1", "peagle")}


def rejudge(name: str, table: list[dict], settings):
    """The finding's own rule applied to the table it logged."""
    if name == "calibration":
        return calibration.judge(next(r for r in table if r["method"] == settings.claim_method and "ece" in r),
                                 settings)
    if name == "position-vs-context":
        return position_context.judge(table, settings)
    if name == "data-scaling":
        return data_scaling.judge(table, settings)
    if name == "tree-vs-chain":
        return tree_chain.judge(table)
    if name == "hardware-n-star":
        return hardware_nstar.judge(table, settings)
    if name == "peagle-vs-eagle3-cost":
        return peagle_cost.judge(table, settings)
    if name == "dspark-vs-dflash":
        return dspark_dflash.judge(table, settings)
    if name == "eagle31-vs-eagle3":
        return eagle31_eagle3.judge(table, settings)
    return dflash_eagle3.judge(table, settings)


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_micro_finding(findings_home, name, tmp_path):
    out = tmp_path / "out"
    assert main(["--finding", name, "--scale", "micro", "--out", str(out)]) == 0
    client = MlflowClient()
    experiment = client.get_experiment_by_name("eyas-findings")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    run = client.search_runs([experiment.experiment_id], f"tags.`eyas.finding` = '{name}'",
                             order_by=["attributes.start_time DESC"], max_results=1)[0]
    assert run.info.status == "FINISHED" and run.data.tags["eyas.scale"] == "micro"
    logged = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert FIGURES[name] | {"report.json", "table.json", "table.md"} <= logged
    report = json.loads((out / "report.json").read_text())
    table = json.loads((out / "table.json").read_text())
    settings = from_dict(FINDINGS[name].settings, report["settings"])
    verdict = rejudge(name, table, settings)
    assert report["verdict"] == json.loads(json.dumps(verdict.to_dict()))
    assert run.data.tags["eyas.verdict"] == verdict.outcome in ("reproduced", "partly", "refuted")
    for png in FIGURES[name]:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if name in TRAINED:  # every family trained alike and measured on every suite, every check computed
        assert {(r["variant"], r["suite"]) for r in table} == {(f, s) for f in TRAINED[name] for s in settings.suites}
        assert {r["steps"] for r in table} == {settings.num_steps} and not any(r["reused"] for r in table)
        assert all(r["tau"] >= 1.0 and r["cycles"] > 0 and r["greedy_identical"] == 1.0 for r in table)
        assert [c["name"] for c in report["verdict"]["checks"]][-1] == "lossless"
        assert all(isinstance(c["passed"], bool) and c["numbers"] for c in report["verdict"]["checks"])
        budget = json.loads((out / "budget.json").read_text())
        assert budget["steps"] == settings.num_steps and budget["data"] == settings.data
