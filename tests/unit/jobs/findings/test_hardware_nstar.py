"""hardware-n-star at the micro size: the run, its figures and table, and the verdict computed from the numbers."""
from __future__ import annotations

import json

from jobs.findings import hardware_nstar
from jobs.findings.cli import main


def test_micro_run(findings_home):
    out = findings_home["root"] / "out-nstar"
    assert main(["--finding", "hardware-n-star", "--scale", "micro", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert {"cost_curve.png", "speedup_vs_n.png", "table.md"} <= {p.name for p in out.iterdir()}
    print(report["verdict"])
