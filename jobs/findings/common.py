"""What every finding shares: its settings (a frozen dataclass per finding over ``Common``), named scales, the
verdict rule, and the one MLflow run with its figures, table and verdict (``run_finding``).

The verdict rule is the same for all six: a finding states its claim as checks, each a comparison of measured
numbers with a threshold written in the check; the verdict is ``reproduced`` when every check passes, ``refuted``
when none does, and ``partly`` otherwise. No verdict is written by hand.
"""
from __future__ import annotations

import json
import os
import platform as host
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from eyas import track
from eyas.config import ConfigError, apply_overrides, eyas_home, flatten, from_dict, require, to_dict
from eyas.threads import configure_threads
from jobs.common import git_commit

EXPERIMENT = "eyas-findings"
OUTCOMES = ("reproduced", "partly", "refuted")


@dataclass(frozen=True)
class Common:
    """Settings every finding reads (a finding's own settings add to these)."""
    target: str = "smollm2-135m"     # a name under $EYAS_HOME/targets, or a checkpoint path
    suite: str = "chat"              # eyas.datasets suite of the prompts: chat, humaneval, code, prose
    num_prompts: int = 8
    max_new_tokens: int = 64
    max_prompt_tokens: int = 256     # longer chat prompts are skipped, others cut
    drafters_dir: str = "$EYAS_HOME/drafters"  # trained drafters at <dir>/<family>-<target dir name> (jobs.bench)
    device: str = "auto"             # auto: cuda when there is one, else cpu
    threads: int | None = None       # torch threads (null: eyas.threads' policy)
    repeats: int = 1                 # timed passes over the prompts (speed findings)
    experiment: str = EXPERIMENT     # MLflow experiment

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_new_tokens", "max_prompt_tokens", "repeats"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        require(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device", self.device,
                "must be auto, cpu or cuda[:i]")
        require(self.threads is None or self.threads >= 1, "threads", self.threads, "must be >= 1 or null")


# ---------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class Check:
    """One part of a claim: ``passed`` is computed from ``numbers`` by the comparison that ``rule`` states."""
    name: str
    rule: str
    passed: bool
    numbers: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    claim: str
    checks: tuple[Check, ...]

    @property
    def outcome(self) -> str:
        return outcome_of([c.passed for c in self.checks])

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "claim": self.claim,
                "rule": "reproduced: every check passes; refuted: none passes; partly: otherwise",
                "checks": [{"name": c.name, "rule": c.rule, "passed": c.passed, "numbers": dict(c.numbers)}
                           for c in self.checks]}

    def text(self) -> str:
        lines = [f"verdict: {self.outcome.upper()} -- {self.claim}"]
        for c in self.checks:
            numbers = ", ".join(f"{k}={fmt(v)}" for k, v in c.numbers.items())
            lines.append(f"  [{'pass' if c.passed else 'FAIL'}] {c.name}: {c.rule} ({numbers})")
        return "\n".join(lines)


def outcome_of(passed: Sequence[bool]) -> str:
    """The one verdict rule: every check passes -> reproduced, none -> refuted, some -> partly."""
    if not passed:
        raise ValueError("a verdict needs at least one check")
    if all(passed):
        return "reproduced"
    return "refuted" if not any(passed) else "partly"


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return str(value)


# ---------------------------------------------------------------- findings and their runs


@dataclass
class Outcome:
    """What a finding measured: table rows, figures (name -> matplotlib Figure), headline metrics, the verdict and
    any further JSON artifacts (name -> data)."""
    table: list[dict[str, Any]]
    figures: dict[str, Any]
    metrics: dict[str, float]
    verdict: Verdict
    artifacts: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Finding:
    name: str
    paper: str                      # where the claim comes from
    claim: str
    settings: type                  # a frozen dataclass over Common
    scales: Mapping[str, Mapping[str, Any]]  # scale name -> settings over the dataclass defaults
    run: Callable[[Any], Outcome]   # settings -> Outcome
    variants: Callable[[Any], list] | None = None  # settings -> the drafter variants it trains (training.Variant)

    def make_settings(self, scale: str, overrides: Sequence[str] = ()) -> Any:
        if scale not in self.scales:
            raise ConfigError(f"--scale {scale!r}: {self.name} knows {sorted(self.scales)}")
        data = apply_overrides(dict(self.scales[scale]), list(overrides))
        return from_dict(self.settings, data)


def apply_threads(settings: Common) -> None:
    """``threads``: torch's intra-op threads for everything the finding runs in this process (training included);
    unset, eyas.threads' policy."""
    configure_threads(settings.threads)


def out_dir(finding: str, scale: str) -> Path:
    return eyas_home() / "findings" / f"{finding}-{scale}"


def run_finding(finding: Finding, settings: Any, scale: str, out: Path | None = None,
                command: str | None = None) -> tuple[str, Outcome]:
    """Measure ``finding`` in one MLflow run (params = the settings, tags = finding, scale, commit, verdict) and
    write its figures, table and verdict there and to ``out``; returns (run id, Outcome)."""
    out = out or out_dir(finding.name, scale)
    apply_threads(settings)
    tags = {"eyas.kind": "finding", "eyas.finding": finding.name, "eyas.scale": scale, "eyas.commit": git_commit()}
    with track.start_run(settings.experiment, run_name=f"{finding.name}-{scale}", params=flatten(settings),
                         tags=tags) as run:
        start = time.monotonic()
        outcome = finding.run(settings)
        seconds = time.monotonic() - start
        report = {"finding": finding.name, "paper": finding.paper, "scale": scale, "commit": tags["eyas.commit"],
                  "command": command or " ".join(sys.argv), "machine": {**machine(), **load_average()},
                  "seconds": round(seconds, 1), "settings": to_dict(settings),
                  "verdict": outcome.verdict.to_dict(), "metrics": outcome.metrics}
        track.log_metrics({**outcome.metrics, "finding_seconds": seconds})
        track.set_tags({"eyas.verdict": outcome.verdict.outcome})
        write_outputs(out, finding, outcome, report)
        track.log_artifacts(out)
    print(outcome.verdict.text(), flush=True)
    print(f"[findings] {finding.name}: run {run.info.run_id} in experiment {settings.experiment}; files in {out}",
          flush=True)
    return run.info.run_id, outcome


def machine() -> dict[str, Any]:
    return {"host": host.node(), "cpu": host.processor() or host.machine(), "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def load_average() -> dict[str, float]:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return {}
    return {"load_1m": round(one, 2), "load_5m": round(five, 2), "load_15m": round(fifteen, 2)}


def write_outputs(out: Path, finding: Finding, outcome: Outcome, report: dict[str, Any]) -> None:
    """report.json, table.json, table.md and the figures' PNGs, staged and swapped in (no half-written folder)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    (staging / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (staging / "table.json").write_text(json.dumps(outcome.table, indent=2, default=str) + "\n")
    (staging / "table.md").write_text(markdown_table(outcome.table) + "\n\n" + outcome.verdict.text() + "\n")
    for name, data in outcome.artifacts.items():
        (staging / name).write_text(json.dumps(data, indent=2, default=str) + "\n")
    for name, figure in outcome.figures.items():
        figure.savefig(staging / name, dpi=110)
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.replace(old)
    staging.replace(out)
    shutil.rmtree(old, ignore_errors=True)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)"
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def figure(width: float = 6.0, height: float = 4.0, ncols: int = 1):
    """A matplotlib Figure (no pyplot state: nothing leaks between findings) and its axes."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(1, ncols)
    return fig, axes
