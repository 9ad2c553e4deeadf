"""calibration (EAGLE-2): draft confidence against measured acceptance, binned (the reliability diagram, y = x), and
the expected calibration error, for EAGLE-1/EAGLE-2 as the paper trains them and for EAGLE-3 and DFlash.

EAGLE-2 rests its dynamic tree on this: the EAGLE drafter's confidence in a token is close to the rate at which the
target accepts it, so confidence can stand in for acceptance. A drafter trained on soft targets (the target's
distribution: EAGLE-1's l_cls, EAGLE-3's default ``loss_target: soft``) is expected to be calibrated; one trained
on the argmax (``loss_target: argmax``) or on the data's tokens (DFlash) need not be. The table says which
objective each drafter was trained with.

Measured greedy: a drafted node is judged when its parent was accepted; its confidence is its draft probability
(V over its parent's V) and it is accepted when it equals the target's argmax. Bins of width 0.1 (SpecStats);
ECE = sum over bins of count * |acceptance - mean confidence| / total.

Checks on ``claim_method`` (default eagle2: the EAGLE-1 drafter with EAGLE-2's tree): (1) ECE <= ``max_ece``;
(2) y = x over the range, not only where most nodes sit: the count-weighted least-squares line of bin acceptance
on bin confidence, over the bins with >= ``min_bin_count`` nodes (at least 3 of them, else the check fails), has a
slope within ``slope_range`` (1 is y = x). A drafter that puts most nodes at low confidence has a small ECE even when
it is overconfident everywhere else; the slope sees that.

    python -m jobs.findings --finding calibration [--scale micro|default|large] [key=value ...]
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from eyas.config import ConfigError, require
from eyas.methods import METHODS
from jobs.findings.common import Check, Common, Finding, Outcome, Verdict, figure
from jobs.findings.measure import drafter_dir, has_drafter, method_factory, open_workbench, run_methods

CLAIM = "the EAGLE drafter is well calibrated: draft confidence ~ acceptance rate (y = x)"


@dataclass(frozen=True)
class Settings(Common):
    methods: tuple[str, ...] = ("eagle2", "eagle1", "eagle3", "dflash")  # those without a drafter are skipped
    claim_method: str = "eagle2"
    max_ece: float = 0.10
    slope_range: tuple[float, float] = (0.7, 1.3)
    min_bin_count: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        for method in self.methods:
            require(method in METHODS and METHODS[method].trained, "methods", self.methods,
                    "each must be a method with a trained drafter (eagle1, eagle2, eagle3, medusa, dflash, ...)")
        require(self.claim_method in self.methods, "claim_method", self.claim_method, "must be one of methods")


SCALES = {
    "micro": {"target": "micro", "suite": "code", "num_prompts": 2, "max_new_tokens": 12, "max_prompt_tokens": 24,
              "min_bin_count": 2},
    "default": {"num_prompts": 8, "max_new_tokens": 64},
    "large": {"num_prompts": 80, "max_new_tokens": 256},
}


def run(settings: Settings) -> Outcome:
    bench = open_workbench(settings)
    if not has_drafter(bench, settings.claim_method):
        family = METHODS[settings.claim_method].family
        raise ConfigError(f"claim_method={settings.claim_method}: no {family} drafter at "
                          f"{drafter_dir(settings, family, bench.target_dir)}")
    methods = [m for m in settings.methods if has_drafter(bench, m)]
    skipped = [m for m in settings.methods if m not in methods]
    runs = run_methods(bench, {m: method_factory(bench, m) for m in methods}, timed=False)
    rows, summary = [], {}
    for method in methods:
        bins = runs[method].stats.calibration()
        rows += [{"method": method, **b} for b in bins]
        summary[method] = {"ece": ece(bins), "slope": weighted_slope(bins, settings.min_bin_count),
                           "judged": sum(b["count"] for b in bins), "tau": runs[method].tau,
                           "objective": objective(drafter_dir(settings, METHODS[method].family, bench.target_dir))}
    verdict = judge(summary[settings.claim_method], settings)
    metrics = {f"{k}_{m}": v for m, s in summary.items() for k, v in s.items() if isinstance(v, (int, float))
               and v is not None}
    table = [{"method": m, **s} for m, s in summary.items()] + rows
    return Outcome(table, {"reliability.png": plot(rows, summary, settings)}, metrics, verdict,
                   {"calibration.json": {"summary": summary, "bins": rows, "skipped": skipped}})


def ece(bins: list[dict[str, float]]) -> float:
    total = sum(b["count"] for b in bins)
    return sum(b["count"] * abs(b["acceptance"] - b["mean_confidence"]) for b in bins) / total if total else 1.0


def weighted_slope(bins: list[dict[str, float]], min_count: int) -> float | None:
    """Slope of the count-weighted least-squares line acceptance ~ confidence over bins with >= min_count nodes;
    None with fewer than 3 such bins (or no spread in confidence)."""
    kept = [b for b in bins if b["count"] >= min_count]
    if len(kept) < 3:
        return None
    w = [b["count"] for b in kept]
    x, y = [b["mean_confidence"] for b in kept], [b["acceptance"] for b in kept]
    total = sum(w)
    mx, my = sum(wi * xi for wi, xi in zip(w, x)) / total, sum(wi * yi for wi, yi in zip(w, y)) / total
    vx = sum(wi * (xi - mx) ** 2 for wi, xi in zip(w, x))
    return sum(wi * (xi - mx) * (yi - my) for wi, xi, yi in zip(w, x, y)) / vx if vx > 0 else None


def objective(path) -> str:
    """What the drafter's token loss was trained against, from its checkpoint config."""
    meta = json.loads((path / "config.json").read_text())
    config, kind = meta.get("config", {}), meta.get("drafter_type")
    if kind == "eagle1":
        return "soft (l_cls on the target's distribution) + l_reg"
    if kind == "eagle3":
        return config.get("loss_target", "soft")
    if kind == "dflash":
        return "data tokens (CE on the regenerated answer)"
    return "see its config"


def judge(summary: dict[str, Any], settings: Settings) -> Verdict:
    """The checks of the module docstring, from the claim method's ECE and bin slope."""
    slope, (low, high) = summary["slope"], settings.slope_range
    return Verdict(CLAIM, (
        Check("small calibration error", f"ECE <= {settings.max_ece}", summary["ece"] <= settings.max_ece,
              {"method": settings.claim_method, "ece": summary["ece"], "judged": summary["judged"]}),
        Check("y = x over the range", f"{low} <= slope of acceptance on confidence <= {high} (count-weighted, >= 3 "
              f"bins of >= {settings.min_bin_count} nodes)", slope is not None and low <= slope <= high,
              {"slope": slope if slope is not None else "n/a (under 3 bins)"}),
    ))


def plot(rows: list[dict[str, Any]], summary: dict[str, Any], settings: Settings):
    fig, (ax, ax_count) = figure(10, 4.4, ncols=2)
    ax.plot([0, 1], [0, 1], ls="--", color="grey", label="y = x (calibrated)")
    for i, (method, s) in enumerate(summary.items()):
        mine = [r for r in rows if r["method"] == method]
        sizes = [12 + 60 * r["count"] / max(max(m["count"] for m in mine), 1) for r in mine]
        ax.plot([r["mean_confidence"] for r in mine], [r["acceptance"] for r in mine], color=f"C{i}", lw=1)
        ax.scatter([r["mean_confidence"] for r in mine], [r["acceptance"] for r in mine], s=sizes, color=f"C{i}",
                   label=f"{method} (ECE {s['ece']:.3f})")
        ax_count.bar([r["bin_low"] + 0.1 * (i + 0.5) / (len(summary) + 0.5) for r in mine],
                     [r["count"] for r in mine], width=0.1 / (len(summary) + 1), color=f"C{i}", label=method)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft confidence (bin mean)")
    ax.set_ylabel("measured acceptance rate")
    ax.set_title(f"reliability diagram, {settings.target} ({settings.suite})")
    ax.legend(fontsize=8, loc="upper left")
    ax_count.set_xlim(0, 1)
    ax_count.set_yscale("log")
    ax_count.set_xlabel("draft confidence bin")
    ax_count.set_ylabel("judged nodes")
    ax_count.set_title("nodes per bin")
    ax_count.legend(fontsize=8)
    return fig


FINDING = Finding("calibration", "EAGLE-2 (arXiv 2406.16858), Figure 'confidence vs acceptance'", CLAIM, Settings,
                  SCALES, run)
