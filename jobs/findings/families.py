"""What the family-against-base findings share (dspark-vs-dflash, eagle31-vs-eagle3; issue 51): drafter families
trained alike and measured side by side on several bench suites.

Alike: every variant trains ``num_steps`` steps of ``batch_size`` sequences of the same data set (``data``), with
the same seed, from its family's config (jobs/configs/<family>-*.yaml) with the finding's overrides for all
(``family_overrides``: the sizes that must match, e.g. the block size) and ``train_overrides``. They train through
jobs/findings/training.py (reused when already trained from the same config), then the target loads once (in
``dtype``) and every variant runs greedy on the prompts of each suite in ``suites``, interleaved with vanilla
(measure.run_methods): a row per variant and suite with tau, tokens/s, speedup over vanilla and greedy identity.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from eyas.config import require
from eyas.models import dtypes
from eyas.train.config import data_path, target_path
from jobs.findings.common import Check, Common, Outcome, Verdict, figure
from jobs.findings.measure import DrafterFactory, Workbench, run_methods, speed_row, suite_workbenches
from jobs.findings.training import RUNNERS, Trained, Variant, train_variants, variant_config


@dataclass(frozen=True)
class FamilySettings(Common):
    """Common's settings plus the matched training and the suites (a finding adds its family configs)."""
    data: str = "data-smollm2-mix"
    suites: tuple[str, ...] = ("humaneval", "chat")
    num_steps: int = 60
    batch_size: int = 4
    eval_every: int = 20
    seed: int = 0
    dtype: str = "auto"          # the target's (and drafters') dtype when measuring: auto = bfloat16 where it builds
    family_overrides: tuple[str, ...] = ()   # dotted overrides every family's config gets (matched sizes)
    train_overrides: tuple[str, ...] = ()
    runner: str = "local"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_steps", "batch_size", "eval_every"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        require(len(self.suites) >= 1 and len(set(self.suites)) == len(self.suites), "suites", self.suites,
                "must name one or more different suites")
        require(self.dtype in ("auto", *dtypes.DTYPES), "dtype", self.dtype, f"must be auto or one of "
                f"{list(dtypes.DTYPES)}")
        require(self.runner in RUNNERS, "runner", self.runner, f"must be one of {list(RUNNERS)}")


def family_variants(settings: FamilySettings, finding: str, configs: Mapping[str, str],
                    matched: Sequence[str] = ()) -> list[Variant]:
    """One variant per label -> family config, trained alike (module docstring); ``matched``: the finding's own
    overrides for every family, before ``family_overrides``."""
    target_dir = target_path(settings.target).resolve()
    common = [f"train.max_steps={settings.num_steps}", "train.num_epochs=1000",  # the step budget decides
              f"train.batch_size={settings.batch_size}", f"train.eval_every={settings.eval_every}",
              f"train.seed={settings.seed}", *matched, *settings.family_overrides, *settings.train_overrides]
    data = str(data_path(settings.data))
    return [Variant(label, variant_config(config, f"findings-{finding}-{label}-{target_dir.name}", str(target_dir),
                                          data, common))
            for label, config in configs.items()]


def measure_families(settings: FamilySettings, variants: Sequence[Variant],
                     factory: Callable[[Workbench, str, Trained], DrafterFactory]
                     ) -> tuple[list[dict[str, Any]], dict[str, Trained]]:
    """Train (or reuse) ``variants``, then run each on every suite: (rows, trained by label). ``factory(bench,
    label, trained)`` makes a variant's drafters."""
    trained = train_variants(variants, settings.runner)  # first: training loads a target of its own
    rows = []
    for suite, bench in suite_workbenches(settings, settings.suites, settings.dtype).items():
        print(f"[findings] suite {suite}: {len(bench.prompts)} prompts", flush=True)
        runs = run_methods(bench, {label: factory(bench, label, t) for label, t in trained.items()})
        for label, t in trained.items():
            rows.append({"variant": label, "suite": suite, **speed_row(runs, label),
                         "cycles": runs[label].stats.cycles, "steps": t.steps,
                         "train_seconds": round(t.seconds, 1), "heldout_acc_1": t.final.get("heldout_acc_1"),
                         "heldout_sim_tau": t.final.get("heldout_sim_tau"), "reused": t.reused})
    return rows, trained


def by_variant_suite(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], Mapping[str, Any]]:
    return {(r["variant"], r["suite"]): r for r in rows}


def at_least_on_every_suite(rows: Sequence[Mapping[str, Any]], key: str, label: str, base: str, name: str) -> Check:
    """``key`` of ``label`` >= ``base``'s on every suite the rows hold."""
    by = by_variant_suite(rows)
    suites = list(dict.fromkeys(r["suite"] for r in rows))
    numbers = {f"{who}_{suite}": by[(who, suite)][key] for suite in suites for who in (label, base)}
    passed = all(by[(label, s)][key] >= by[(base, s)][key] for s in suites)
    return Check(name, f"{key}({label}) >= {key}({base}) on every suite ({', '.join(suites)})", passed, numbers)


def lossless(rows: Sequence[Mapping[str, Any]]) -> Check:
    worst = min(r["greedy_identical"] for r in rows)
    return Check("lossless", "greedy output equals vanilla on every prompt, every variant and suite", worst == 1.0,
                 {"greedy_identical": worst})


def suite_metrics(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    return {f"{key}_{r['variant']}_{r['suite']}": r[key] for r in rows for key in ("tau", "speedup")
            if isinstance(r.get(key), float)}


def bars(rows: Sequence[Mapping[str, Any]], settings: FamilySettings, title: str):
    """tau and speedup per family (bar colour) per suite (bar group)."""
    fig, axes = figure(11, 4, ncols=2)
    labels = list(dict.fromkeys(r["variant"] for r in rows))
    suites = list(dict.fromkeys(r["suite"] for r in rows))
    by = by_variant_suite(rows)
    width = 0.8 / len(labels)
    for ax, key, what in zip(axes, ("tau", "speedup"), ("tau (tokens per cycle)", "speedup over vanilla")):
        for i, label in enumerate(labels):
            xs = [s + (i - (len(labels) - 1) / 2) * width for s in range(len(suites))]
            values = [by[(label, suite)][key] for suite in suites]
            ax.bar(xs, values, width, color=f"C{i}", label=label)
            for x, v in zip(xs, values):
                ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(suites)), suites)
        ax.set_title(what)
        if key == "speedup":
            ax.axhline(1.0, color="grey", lw=0.8)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}: {settings.num_steps} steps x {settings.batch_size} sequences of {settings.data} each, "
                 f"seed {settings.seed}, {settings.num_prompts} prompts a suite", fontsize=9)
    return fig


def family_outcome(rows: list[dict[str, Any]], settings: FamilySettings, title: str, verdict: Verdict,
                   trained: Mapping[str, Trained], budget: Mapping[str, Any], matched_by: str) -> Outcome:
    """A family finding's outcome: its rows, the tau/speedup figure, per-suite metrics, the verdict, and the
    budget every family trained on (the common settings, then ``budget``) with each variant's curve."""
    common = {"data": settings.data, "steps": settings.num_steps, "batch_size": settings.batch_size,
              "seed": settings.seed, "family_overrides": list(settings.family_overrides)}
    return Outcome(rows, {"tau_per_suite.png": bars(rows, settings, title)}, suite_metrics(rows), verdict,
                   {"budget.json": {**common, **budget, "matched_by": matched_by},
                    "curves.json": {label: t.curve for label, t in trained.items()}})
