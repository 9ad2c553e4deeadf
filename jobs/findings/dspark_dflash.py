"""dspark-vs-dflash (issue 51; DSpark arXiv 2607.05147, DFlash2 the z-lab release): tau and speedup of DSpark and
DFlash2 drafters against a DFlash drafter trained alike, at equal block size.

DSpark and DFlash2 are DFlash backbones with more heads: DSpark a Markov head (a rank-r bigram correction from the
previous token) and a confidence head, DFlash2 dynamic convolutions and a candidate selector. The three train
from their configs (``dflash_config``, ``dspark_config``, ``dflash2_config``) with the same data, steps, batch,
seed, layers, taps and block size (``block_size``, ``loss_decay`` and ``family_overrides`` go to all three), as
jobs/findings/families.py does, and run with their block on each suite (``suites``, ``num_prompts`` each).

Issue 51's goal: DSpark's and DFlash2's tau at least DFlash's at equal block size and training.

Checks: (1) tau(dspark) >= tau(dflash) on every suite; (2) tau(dflash2) >= tau(dflash) on every suite; (3) all
three lossless (greedy output equals vanilla on every prompt).

    python -m jobs.findings --finding dspark-vs-dflash [--scale micro|default|large] [key=value ...]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eyas.config import require
from jobs.findings.common import Finding, Outcome, Verdict
from jobs.findings.families import (FamilySettings, at_least_on_every_suite, family_outcome, family_variants,
                                    lossless, measure_families)
from jobs.findings.measure import method_factory
from jobs.findings.training import Variant

NAME = "dspark-vs-dflash"
CLAIM = "at equal block size and training, DSpark and DFlash2 accept at least as many tokens per cycle as DFlash"
FAMILIES = ("dflash", "dspark", "dflash2")


@dataclass(frozen=True)
class Settings(FamilySettings):
    dflash_config: str = "jobs/configs/dflash-smollm2-135m.yaml"
    dspark_config: str = "jobs/configs/dspark-smollm2-135m.yaml"
    dflash2_config: str = "jobs/configs/dflash2-smollm2-135m.yaml"
    block_size: int = 4          # G, all three (issue 49: blocks of at most 8 on this CPU)
    loss_decay: float = 4.0      # gamma of the decayed block loss, all three

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.block_size >= 2, "block_size", self.block_size, "must be >= 2 (the root and a drafted token)")
        require(self.loss_decay > 0, "loss_decay", self.loss_decay, "must be > 0")


SCALES = {
    "micro": {"target": "micro", "suites": ["code", "prose"], "num_prompts": 2, "max_new_tokens": 12, "max_prompt_tokens": 24,
              "data": "data-micro", "dflash_config": "jobs/configs/dflash-micro.yaml",
              "dspark_config": "jobs/configs/dspark-micro.yaml", "dflash2_config": "jobs/configs/dflash2-micro.yaml",
              "num_steps": 3, "eval_every": 3, "dtype": "float32",
              "train_overrides": ["train.max_len=48", "train.eval_sequences=4", "train.feature_cache=none"]},
    # 2 cores, ~25 min with the bench: 1 drafter layer (copied from the target's last), 3 taps, 32 anchors a
    # sequence and an 8192-token draft vocabulary, DSpark ~7 min of training, DFlash and DFlash2 ~4
    "default": {"num_prompts": 8, "max_new_tokens": 48, "num_steps": 160, "eval_every": 40,
                "family_overrides": ["drafter.config.num_layers=1", "drafter.config.num_taps=3",
                                     "drafter.config.num_anchors=32", "drafter.config.draft_vocab_size=8192"],
                "train_overrides": ["train.feature_cache=memory", "train.eval_sequences=16"]},
    "large": {"num_prompts": 32, "max_new_tokens": 128, "block_size": 8, "num_steps": 2000, "eval_every": 100,
              "runner": "ray-train"},
}


def variants(settings: Settings) -> list[Variant]:
    configs = {"dflash": settings.dflash_config, "dspark": settings.dspark_config,
               "dflash2": settings.dflash2_config}
    return family_variants(settings, NAME, configs, (f"drafter.config.block_size={settings.block_size}",
                                                     f"drafter.config.loss_decay={settings.loss_decay}"))


def run(settings: Settings) -> Outcome:
    rows, trained = measure_families(settings, variants(settings),
                                     lambda bench, label, t: method_factory(bench, label, drafter=t.path))
    verdict = judge(rows, settings)
    return family_outcome(rows, settings, f"DSpark and DFlash2 against DFlash, block {settings.block_size}", verdict,
                          trained, {"block_size": settings.block_size, "loss_decay": settings.loss_decay},
                          "the same data, steps, batch, seed, block size and overrides for every family")


def judge(rows: list[dict[str, Any]], settings: Settings) -> Verdict:
    """The checks of the module docstring, from the rows (variant, suite, tau, greedy_identical)."""
    return Verdict(CLAIM, (
        at_least_on_every_suite(rows, "tau", "dspark", "dflash", "DSpark accepts at least as much as DFlash"),
        at_least_on_every_suite(rows, "tau", "dflash2", "dflash", "DFlash2 accepts at least as much as DFlash"),
        lossless(rows),
    ))


FINDING = Finding(NAME, "DSpark (arXiv 2607.05147), DFlash2 (z-lab); issue 51's goal", CLAIM, Settings, SCALES, run,
                  variants)
