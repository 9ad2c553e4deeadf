"""position-vs-context (EAGLE-2): acceptance at draft positions P1..P6, its mean per position and its spread across
queries at the same position.

EAGLE-2's observation: acceptance depends on the context far more than on the position in the draft: the mean
falls with depth, yet at one position different queries span about 0.1 to 1.0. So a fixed tree, which allots
nodes by position, leaves acceptance on the table, and a tree shaped per context (by draft confidence) takes it.

Measured with a chain of ``depth`` tokens (greedy) so that position j is judged exactly when positions 1..j-1 were
accepted: per query (prompt), acceptance at P_j = accepted / judged drafts at depth j over its cycles; a query
counts at P_j when it had at least ``min_judged`` judgments there.

Checks: (1) the mean falls with depth: over the positions judged at least ``min_position_judged`` times (at least 3
of them), P_last < P_1 and at least ``min_falling`` of the steps P_j -> P_j+1 do not rise; (2) queries spread: at
some position the queries' acceptance spans at least ``min_span`` (max - min; the paper: ~0.9).

    python -m jobs.findings --finding position-vs-context [--scale micro|default|large] [key=value ...]
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from eyas.config import require
from jobs.findings.common import Check, Common, Finding, Outcome, Verdict, figure
from jobs.findings.measure import method_factory, open_workbench, run_methods

CLAIM = ("acceptance depends on context more than on position: the mean falls with depth while queries span "
         "~0.1-1.0 at one position")


@dataclass(frozen=True)
class Settings(Common):
    method: str = "eagle2"       # whose drafter drafts the chain (eagle2 / eagle1: EAGLE-1's drafter)
    depth: int = 6               # positions P1..P<depth>
    min_judged: int = 3          # judgments a query needs at a position to count there
    min_position_judged: int = 20  # judgments (all queries) a position needs to enter the mean-falls check
    min_span: float = 0.6
    min_falling: float = 0.8     # fraction of position steps that must not rise

    def __post_init__(self) -> None:
        super().__post_init__()
        require(2 <= self.depth <= 16, "depth", self.depth, "must be in [2, 16]")
        require(self.min_judged >= 1, "min_judged", self.min_judged, "must be >= 1")


SCALES = {
    "micro": {"target": "micro", "suite": "code", "num_prompts": 3, "max_new_tokens": 12, "max_prompt_tokens": 24,
              "depth": 3, "min_judged": 1, "min_position_judged": 1},
    "default": {"num_prompts": 16, "max_new_tokens": 64},
    "large": {"num_prompts": 80, "max_new_tokens": 256, "suite": "chat"},
}


def run(settings: Settings) -> Outcome:
    bench = open_workbench(settings)
    factory = method_factory(bench, settings.method, mode="chain", depth=settings.depth)
    generations = run_methods(bench, {"chain": factory}, timed=False)["chain"].generations
    per_query = []  # per prompt: [(accepted, judged) per depth]
    for generation in generations:
        stats = generation.stats
        per_query.append([(stats.depth_accepted[d] if d < len(stats.depth_accepted) else 0,
                           stats.depth_offered[d] if d < len(stats.depth_offered) else 0)
                          for d in range(settings.depth)])
    rows = position_rows(per_query, settings.min_judged)
    verdict = judge(rows, settings)
    metrics = {f"mean_P{r['position']}": r["mean"] for r in rows if r["mean"] is not None}
    metrics.update({f"span_P{r['position']}": r["span"] for r in rows if r["span"] is not None})
    queries = [{"prompt": i, **{f"P{d + 1}": (a / o if o else None) for d, (a, o) in enumerate(q)},
                **{f"judged_P{d + 1}": o for d, (_, o) in enumerate(q)}} for i, q in enumerate(per_query)]
    return Outcome(rows, {"acceptance_by_position.png": plot(rows, per_query, settings)}, metrics, verdict,
                   {"per_query.json": queries})


def position_rows(per_query: list[list[tuple[int, int]]], min_judged: int) -> list[dict[str, Any]]:
    """Per position: the pooled mean (all judgments), and over the queries with >= min_judged judgments there:
    their count, min, median, max and span."""
    rows = []
    for d in range(len(per_query[0]) if per_query else 0):
        accepted = sum(q[d][0] for q in per_query)
        judged = sum(q[d][1] for q in per_query)
        rates = sorted(q[d][0] / q[d][1] for q in per_query if q[d][1] >= min_judged)
        rows.append({"position": d + 1, "judged": judged, "mean": accepted / judged if judged else None,
                     "num_queries": len(rates), "min": rates[0] if rates else None,
                     "median": statistics.median(rates) if rates else None, "max": rates[-1] if rates else None,
                     "span": rates[-1] - rates[0] if rates else None})
    return rows


def judge(rows: list[dict[str, Any]], settings: Settings) -> Verdict:
    """The checks of the module docstring, from the position rows (mean, span)."""
    means = [r["mean"] for r in rows if r["judged"] >= settings.min_position_judged]
    steps = list(zip(means, means[1:]))
    falling = sum(b <= a for a, b in steps) / len(steps) if steps else 0.0
    spans = [r["span"] for r in rows if r["span"] is not None]
    widest = max(spans, default=0.0)
    at = next((r["position"] for r in rows if r["span"] == widest), None)
    return Verdict(CLAIM, (
        Check("mean falls with depth", f"over >= 3 positions judged >= {settings.min_position_judged} times: "
              f"P_last < P_1 and >= {settings.min_falling:.0%} of steps do not rise",
              len(means) >= 3 and means[-1] < means[0] and falling >= settings.min_falling,
              {"means": means, "non_rising_steps": falling}),
        Check("queries spread at one position", f"max over positions of (max - min across queries) >= "
              f"{settings.min_span}", widest >= settings.min_span, {"widest_span": widest, "at_position": at}),
    ))


def plot(rows: list[dict[str, Any]], per_query: list[list[tuple[int, int]]], settings: Settings):
    import random

    fig, ax = figure(6.5, 4.2)
    jitter = random.Random(0)
    groups = []
    for d in range(settings.depth):
        rates = [q[d][0] / q[d][1] for q in per_query if q[d][1] >= settings.min_judged]
        groups.append(rates)
        ax.scatter([d + 1 + jitter.uniform(-0.15, 0.15) for _ in rates], rates, s=12, alpha=0.6, color="C0",
                   label="one query" if d == 0 else None)
    filled = [(d + 1, g) for d, g in enumerate(groups) if len(g) >= 2]
    if filled:
        ax.violinplot([g for _, g in filled], positions=[p for p, _ in filled], showextrema=False)
    means = [(r["position"], r["mean"]) for r in rows if r["mean"] is not None]
    ax.plot([p for p, _ in means], [m for _, m in means], color="C3", marker="D", label="mean (all judgments)")
    ax.set_xticks(range(1, settings.depth + 1), [f"P{d}" for d in range(1, settings.depth + 1)])
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (given earlier positions accepted)")
    ax.set_title(f"{settings.method} chain on {settings.target}: {len(per_query)} queries ({settings.suite})")
    ax.legend(fontsize=8)
    return fig


FINDING = Finding("position-vs-context", "EAGLE-2 (arXiv 2406.16858), section 3", CLAIM, Settings, SCALES, run)
