"""eagle31-vs-eagle3 (issue 51; EAGLE-3.1, P-EAGLE arXiv 2602.01469): tau of an EAGLE-3.1 drafter and speedup of a
P-EAGLE drafter against an EAGLE-3 drafter trained alike.

EAGLE-3.1 is EAGLE-3 with an RMSNorm per tap before the fusing fc and the normed state fed to the next draft step;
P-EAGLE drafts a whole chain in one drafter pass. The three train from their configs (``eagle3_config``,
``eagle31_config``, ``peagle_config``: the same taps and draft vocabulary) with the same data, steps, batch and
seed (jobs/findings/families.py), and run on each suite (``suites``, ``num_prompts`` each): EAGLE-3 and 3.1 with
the same dynamic tree (``tree_depth``, ``tree_top_k``, ``tree_nodes``), P-EAGLE with its chain of
``peagle_depth`` (one pass; its drafter share is peagle-vs-eagle3-cost's subject).

Issue 51's goals: EAGLE-3.1's tau at least EAGLE-3's; P-EAGLE's speedup at least EAGLE-3's.

Checks: (1) tau(eagle3.1) >= tau(eagle3) on every suite; (2) speedup(peagle) >= speedup(eagle3) on every suite;
(3) all three lossless (greedy output equals vanilla on every prompt).

    python -m jobs.findings --finding eagle31-vs-eagle3 [--scale micro|default|large] [key=value ...]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eyas.config import require
from jobs.findings.common import Finding, Outcome, Verdict
from jobs.findings.families import (FamilySettings, at_least_on_every_suite, family_outcome, family_variants,
                                    lossless, measure_families)
from jobs.findings.measure import Workbench, method_factory
from jobs.findings.training import Trained, Variant

NAME = "eagle31-vs-eagle3"
CLAIM = ("trained alike, EAGLE-3.1 accepts at least as many tokens per cycle as EAGLE-3, and P-EAGLE runs at least "
         "as fast")


@dataclass(frozen=True)
class Settings(FamilySettings):
    eagle3_config: str = "jobs/configs/eagle3-smollm2-135m.yaml"
    eagle31_config: str = "jobs/configs/eagle3.1-smollm2-135m.yaml"
    peagle_config: str = "jobs/configs/peagle-smollm2-135m.yaml"
    tree_depth: int = 5          # EAGLE-3 and 3.1: the same dynamic tree
    tree_top_k: int = 4
    tree_nodes: int = 16
    peagle_depth: int = 4        # P-EAGLE's chain (at most the config's num_depths)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("tree_depth", "tree_top_k", "tree_nodes", "peagle_depth"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")


SCALES = {
    "micro": {"target": "micro", "suites": ["code", "prose"], "num_prompts": 2, "max_new_tokens": 12, "max_prompt_tokens": 24,
              "data": "data-micro", "eagle3_config": "jobs/configs/eagle3-micro.yaml",
              "eagle31_config": "jobs/configs/eagle3.1-micro.yaml", "peagle_config": "jobs/configs/peagle-micro.yaml",
              "num_steps": 3, "eval_every": 3, "dtype": "float32", "tree_depth": 3, "tree_nodes": 6,
              "peagle_depth": 2,
              "train_overrides": ["train.max_len=48", "train.eval_sequences=4", "train.feature_cache=none"]},
    # 2 cores, ~25 min with the bench: the three read data-smollm2-mix's feature cache (taps 2, 15, 27 in
    # bfloat16, jobs.generate_data's), so a step is the drafter's alone
    "default": {"num_prompts": 8, "max_new_tokens": 48, "num_steps": 160, "eval_every": 40,
                "train_overrides": ["train.feature_cache=disk", "train.eval_sequences=16"]},
    "large": {"num_prompts": 32, "max_new_tokens": 128, "num_steps": 2000, "eval_every": 100, "runner": "ray-train"},
}


def variants(settings: Settings) -> list[Variant]:
    configs = {"eagle3": settings.eagle3_config, "eagle3.1": settings.eagle31_config,
               "peagle": settings.peagle_config}
    return family_variants(settings, NAME, configs)


def drafters(settings: Settings):
    tree = {"mode": "dynamic", "depth": settings.tree_depth, "top_k": settings.tree_top_k,
            "num_nodes": settings.tree_nodes}

    def factory(bench: Workbench, label: str, trained: Trained):
        if label == "peagle":
            return method_factory(bench, "peagle", drafter=trained.path, mode="block", depth=settings.peagle_depth)
        return method_factory(bench, label, drafter=trained.path, **tree)
    return factory


def run(settings: Settings) -> Outcome:
    rows, trained = measure_families(settings, variants(settings), drafters(settings))
    verdict = judge(rows, settings)
    return family_outcome(rows, settings, "EAGLE-3.1 and P-EAGLE against EAGLE-3", verdict, trained,
                          {"tree": {"depth": settings.tree_depth, "top_k": settings.tree_top_k,
                                    "num_nodes": settings.tree_nodes}, "peagle_depth": settings.peagle_depth},
                          "the same data, steps, batch, seed and overrides for every family")


def judge(rows: list[dict[str, Any]], settings: Settings) -> Verdict:
    """The checks of the module docstring, from the rows (variant, suite, tau, speedup, greedy_identical)."""
    return Verdict(CLAIM, (
        at_least_on_every_suite(rows, "tau", "eagle3.1", "eagle3", "EAGLE-3.1 accepts at least as much as EAGLE-3"),
        at_least_on_every_suite(rows, "speedup", "peagle", "eagle3", "P-EAGLE runs at least as fast as EAGLE-3"),
        lossless(rows),
    ))


FINDING = Finding(NAME, "EAGLE-3.1 (SpecForge), P-EAGLE (arXiv 2602.01469); issue 51's goals", CLAIM, Settings,
                  SCALES, run, variants)
