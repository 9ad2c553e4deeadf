"""peagle-vs-eagle3-cost (issue 51; P-EAGLE, arXiv 2602.01469): the drafter's share of a speculative cycle, P-EAGLE
against EAGLE-3, drafting chains of the same depth.

EAGLE-3 drafts a chain of d tokens with d drafter passes (each pass feeds the previous one's state forward); P-EAGLE
drafts all d in ONE pass over the root and d-1 mask entries. Both drafters here are built with the same widths
(one EAGLE-3 decoder layer, the same draft vocabulary) and untrained, random weights: the claim is about cost, and
a chain of d costs the same verify forward (d + 1 tokens) whatever is accepted. Each cycle's time is split into
draft / verify / other by the engine (SpecStats); the drafter share is draft / (draft + verify + other).

Checks: (1) at every depth, P-EAGLE's drafter share is at most ``max_share_ratio`` (the issue's one half) of
EAGLE-3's; (2) P-EAGLE's drafting time per cycle grows with depth more slowly than EAGLE-3's (the slope of ms per
added depth, deepest against shallowest, is below half of EAGLE-3's); (3) both stay lossless (greedy output equals
vanilla on every prompt).

    python -m jobs.findings --finding peagle-vs-eagle3-cost [--scale micro|default|large] [key=value ...]
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.config import require
from eyas.drafters import registry
from jobs.findings.common import Check, Common, Finding, Outcome, Verdict, figure
from jobs.findings.measure import method_factory, open_workbench, run_methods, speed_row

CLAIM = ("P-EAGLE drafts a chain in one drafter pass, so its drafter share of a cycle is at most half of EAGLE-3's at "
         "the same depth (EAGLE-3: one pass per drafted token)")


@dataclass(frozen=True)
class Settings(Common):
    depths: tuple[int, ...] = (2, 4, 6)    # chain lengths compared (tokens drafted per cycle)
    draft_vocab_size: int = 8192          # both drafters' output vocabulary (capped at the target's)
    max_share_ratio: float = 0.5          # check (1): P-EAGLE share / EAGLE-3 share at most this
    seed: int = 0                         # the random drafter weights

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.depths) >= 2 and all(d >= 2 for d in self.depths), "depths", self.depths,
                "needs >= 2 depths, each >= 2 (at depth 1 both draft with one pass)")
        require(self.draft_vocab_size >= 1, "draft_vocab_size", self.draft_vocab_size, "must be >= 1")
        require(0 < self.max_share_ratio <= 1, "max_share_ratio", self.max_share_ratio, "must be in (0, 1]")


SCALES = {
    "micro": {"target": "micro", "suite": "code", "num_prompts": 2, "max_new_tokens": 12, "max_prompt_tokens": 24,
              "depths": [2, 4], "draft_vocab_size": 128},
    "default": {"num_prompts": 4, "max_new_tokens": 48},
    "large": {"num_prompts": 16, "max_new_tokens": 128, "repeats": 2, "depths": [2, 3, 4, 5, 6, 7, 8]},
}


def random_drafters(bench, settings: Settings, directory: Path) -> dict[str, Path]:
    """Untrained EAGLE-3 and P-EAGLE checkpoints of the same widths for the workbench's target."""
    vocab = list(range(min(settings.draft_vocab_size, bench.target.config.vocab_size)))
    configs = {"eagle3": {"draft_vocab_size": len(vocab)},
               "peagle": {"draft_vocab_size": len(vocab), "num_depths": max(settings.depths)}}
    paths = {}
    for family, config in configs.items():
        torch.manual_seed(settings.seed)
        model = registry.build_model(family, config, bench.target, draft_vocab=vocab)
        paths[family] = registry.save_drafter(model, directory / family, str(bench.target_dir))
    return paths


def share(run) -> float:
    stats = run.stats
    total = stats.draft_s + stats.verify_s + stats.other_s
    return stats.draft_s / total if total else 0.0


def run(settings: Settings) -> Outcome:
    bench = open_workbench(settings)
    depths = sorted(set(settings.depths))
    with tempfile.TemporaryDirectory(prefix="peagle-cost-") as tmp:
        paths = random_drafters(bench, settings, Path(tmp))
        factories = {}
        for d in depths:
            factories[f"eagle3 d={d}"] = method_factory(bench, "eagle3", drafter=paths["eagle3"], mode="chain",
                                                        depth=d)
            factories[f"peagle d={d}"] = method_factory(bench, "peagle", drafter=paths["peagle"], mode="block",
                                                        depth=d)
        runs = run_methods(bench, factories)
    rows = []
    for d in depths:
        e3, pe = runs[f"eagle3 d={d}"], runs[f"peagle d={d}"]
        e3_share, pe_share = share(e3), share(pe)
        rows.append({"depth": d, "eagle3_share": round(e3_share, 4), "peagle_share": round(pe_share, 4),
                     "share_ratio": round(pe_share / e3_share, 4) if e3_share else float("inf"),
                     "eagle3_draft_ms": round(1e3 * e3.draft_s_per_cycle, 3),
                     "peagle_draft_ms": round(1e3 * pe.draft_s_per_cycle, 3),
                     "eagle3_speedup": speed_row(runs, f"eagle3 d={d}").get("speedup"),
                     "peagle_speedup": speed_row(runs, f"peagle d={d}").get("speedup"),
                     "greedy_identical": min(speed_row(runs, f"eagle3 d={d}")["greedy_identical"],
                                             speed_row(runs, f"peagle d={d}")["greedy_identical"])})
    verdict = judge(rows, settings)
    metrics = {"max_share_ratio": max(r["share_ratio"] for r in rows),
               "eagle3_share_deepest": rows[-1]["eagle3_share"], "peagle_share_deepest": rows[-1]["peagle_share"]}
    return Outcome(rows, {"drafter_share.png": share_figure(rows, settings)}, metrics, verdict)


def slope(rows: list[dict[str, Any]], key: str) -> float:
    first, last = rows[0], rows[-1]
    return (last[key] - first[key]) / (last["depth"] - first["depth"])


def judge(rows: list[dict[str, Any]], settings: Settings) -> Verdict:
    """The checks of the module docstring, from the table rows."""
    worst = max(r["share_ratio"] for r in rows)
    e3_slope, pe_slope = slope(rows, "eagle3_draft_ms"), slope(rows, "peagle_draft_ms")
    return Verdict(CLAIM, (
        Check("drafter share at most half of EAGLE-3's", f"peagle_share / eagle3_share <= {settings.max_share_ratio} "
              "at every depth", worst <= settings.max_share_ratio,
              {"worst_share_ratio": worst, "depths": [r["depth"] for r in rows]}),
        Check("drafting time grows slower with depth", "ms per added depth: P-EAGLE < 0.5 x EAGLE-3's",
              pe_slope < 0.5 * e3_slope, {"eagle3_ms_per_depth": e3_slope, "peagle_ms_per_depth": pe_slope}),
        Check("lossless", "greedy output equals vanilla on every prompt, both methods, every depth",
              all(r["greedy_identical"] == 1.0 for r in rows),
              {"greedy_identical": min(r["greedy_identical"] for r in rows)}),
    ))


def share_figure(rows: list[dict[str, Any]], settings: Settings):
    fig, (left, right) = figure(10.0, 3.8, ncols=2)
    depths = [r["depth"] for r in rows]
    left.plot(depths, [r["eagle3_share"] for r in rows], marker="o", label="EAGLE-3 (one pass per token)")
    left.plot(depths, [r["peagle_share"] for r in rows], marker="s", label="P-EAGLE (one pass)")
    left.plot(depths, [settings.max_share_ratio * r["eagle3_share"] for r in rows], ls=":", color="grey",
              label=f"{settings.max_share_ratio} x EAGLE-3 (the goal)")
    left.set_xlabel("chain depth (tokens drafted per cycle)")
    left.set_ylabel("drafter share of a cycle")
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    right.plot(depths, [r["eagle3_draft_ms"] for r in rows], marker="o", label="EAGLE-3")
    right.plot(depths, [r["peagle_draft_ms"] for r in rows], marker="s", label="P-EAGLE")
    right.set_xlabel("chain depth")
    right.set_ylabel("drafting ms per cycle")
    right.set_ylim(bottom=0)
    right.legend(fontsize=8)
    fig.suptitle(f"drafter cost, {settings.target} (untrained drafters, same widths)")
    return fig


FINDING = Finding("peagle-vs-eagle3-cost", "P-EAGLE (arXiv 2602.01469); issue 51's goal", CLAIM, Settings, SCALES,
                  run)
