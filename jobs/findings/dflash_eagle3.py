"""dflash-vs-eagle3 (DFlash): tau and speedup of a DFlash drafter against an EAGLE-3 drafter trained at a matched
budget, plus the paper's two ablations that fit here: loss decay gamma on against off (convergence speed), and 3
against 5 target taps.

The budget is matched by steps: every variant trains ``num_steps`` steps of ``batch_size`` sequences on the same
data set (``data``), from its family config (``eagle3_config``, ``dflash_config``) with ``train_overrides``. The
variants: eagle3; dflash (``taps[0]`` taps, the config's gamma); dflash-gamma-off (gamma = ``gamma_off``: uniform
block weights, the decay off); dflash-<taps[1]>taps. They train through jobs/findings/training.py (here, or on Ray
Train at larger scales; reused when present), and are measured greedy on the same prompts, interleaved with vanilla:
eagle3 with its dynamic tree, DFlash with its block.

Paper (Qwen3-8B, T=0): DFlash tau ~6.5 and 5-6x against EAGLE-3 (tree 60) tau ~3.7 and ~2.1x; the decay speeds up
convergence; 5 tapped layers beat 3.

Checks: (1) tau(dflash) > tau(eagle3); (2) speedup(dflash) > speedup(eagle3); (3) gamma on converges faster: its
held-out sim_tau averaged over the training curve's evaluation points exceeds gamma off's; (4) tau(dflash, taps[0])
> tau(dflash, taps[1]).

    python -m jobs.findings --finding dflash-vs-eagle3 [--scale micro|default|large] [key=value ...]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eyas.config import require
from eyas.train.config import data_path, target_path
from jobs.findings.common import Check, Common, Finding, Outcome, Verdict, figure
from jobs.findings.measure import method_factory, open_workbench, run_methods, speed_row
from jobs.findings.training import RUNNERS, Trained, Variant, train_variants, variant_config

CLAIM = ("at a matched training budget DFlash accepts more and runs faster than EAGLE-3; its loss decay speeds "
         "convergence and 5 target taps beat 3")
PAPER = {"eagle3": {"tau": 3.7, "speedup": 2.1}, "dflash": {"tau": 6.5, "speedup": 5.6}}


@dataclass(frozen=True)
class Settings(Common):
    data: str = "data-smollm2"
    eagle3_config: str = "jobs/configs/eagle3-smollm2-135m.yaml"
    dflash_config: str = "jobs/configs/dflash-smollm2-135m.yaml"
    num_steps: int = 16
    batch_size: int = 4
    eval_every: int = 4          # held-out evaluation points of the convergence curve
    gamma_off: float = 1.0e6     # exp(-(k-1)/gamma) ~ 1 for every block position: the decay off
    taps: tuple[int, int] = (5, 3)
    train_overrides: tuple[str, ...] = ("train.feature_cache=none",)
    runner: str = "local"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_steps", "batch_size", "eval_every"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        require(self.taps[0] != self.taps[1], "taps", self.taps, "must be two different tap counts")
        require(self.runner in RUNNERS, "runner", self.runner, f"must be one of {list(RUNNERS)}")


SCALES = {
    "micro": {"target": "micro", "suite": "code", "num_prompts": 2, "max_new_tokens": 12, "max_prompt_tokens": 24,
              "data": "data-micro", "eagle3_config": "jobs/configs/eagle3-micro.yaml",
              "dflash_config": "jobs/configs/dflash-micro.yaml", "num_steps": 4, "eval_every": 2,
              "train_overrides": ["train.max_len=48", "train.eval_sequences=4"]},
    "default": {"num_prompts": 4, "max_new_tokens": 48},
    "large": {"num_prompts": 32, "max_new_tokens": 128, "num_steps": 2000, "eval_every": 100, "runner": "ray-train",
              "train_overrides": []},
}


def variants(settings: Settings) -> list[Variant]:
    target_dir = target_path(settings.target).resolve()
    common = [f"train.max_steps={settings.num_steps}", "train.num_epochs=1000",  # the step budget decides
              f"train.batch_size={settings.batch_size}", f"train.eval_every={settings.eval_every}",
              *settings.train_overrides]
    many, few = settings.taps
    plan = {"eagle3": (settings.eagle3_config, []),
            "dflash": (settings.dflash_config, [f"drafter.config.num_taps={many}"]),
            "dflash-gamma-off": (settings.dflash_config, [f"drafter.config.num_taps={many}",
                                                          f"drafter.config.loss_decay={settings.gamma_off}"]),
            f"dflash-{few}taps": (settings.dflash_config, [f"drafter.config.num_taps={few}"])}
    data = str(data_path(settings.data))
    return [Variant(label, variant_config(config, f"findings-dflash-vs-eagle3-{label}-{target_dir.name}",
                                          str(target_dir), data, common + extra))
            for label, (config, extra) in plan.items()]


def run(settings: Settings) -> Outcome:
    trained = train_variants(variants(settings), settings.runner)  # first: training loads a target of its own
    bench = open_workbench(settings)
    factories = {label: method_factory(bench, "eagle3" if label == "eagle3" else "dflash", drafter=t.path)
                 for label, t in trained.items()}
    runs = run_methods(bench, factories)
    rows = [{"variant": label, **speed_row(runs, label), "steps": t.steps, "train_seconds": round(t.seconds, 1),
             "heldout_sim_tau": t.final.get("heldout_sim_tau"), "curve_mean_sim_tau": curve_mean(t),
             "reused": t.reused, "paper_tau": PAPER.get(label, {}).get("tau")} for label, t in trained.items()]
    verdict = judge(rows, settings)
    metrics = {f"{k}_{r['variant']}": r[k] for r in rows for k in ("tau", "speedup", "curve_mean_sim_tau")
               if isinstance(r.get(k), float)}
    budget = {"data": settings.data, "steps": settings.num_steps, "batch_size": settings.batch_size,
              "matched_by": "steps (same data, same steps, same batch size)"}
    curves = {label: t.curve for label, t in trained.items()}
    return Outcome(rows, {"dflash_vs_eagle3.png": bars(rows, settings), "convergence.png": curves_figure(trained)},
                   metrics, verdict, {"budget.json": budget, "curves.json": curves})


def curve_mean(trained: Trained) -> float | None:
    """Held-out sim_tau averaged over the curve's evaluation points (area under the curve per point)."""
    points = [p["heldout_sim_tau"] for p in trained.curve if "heldout_sim_tau" in p]
    return sum(points) / len(points) if points else None


def judge(rows: list[dict[str, Any]], settings: Settings) -> Verdict:
    """The checks of the module docstring, from the rows (variant, tau, speedup, curve_mean_sim_tau)."""
    by = {r["variant"]: r for r in rows}
    e3, df, off, few = by["eagle3"], by["dflash"], by["dflash-gamma-off"], by[f"dflash-{settings.taps[1]}taps"]
    on_auc, off_auc = df["curve_mean_sim_tau"], off["curve_mean_sim_tau"]
    return Verdict(CLAIM, (
        Check("DFlash accepts more", "tau(dflash) > tau(eagle3)", df["tau"] > e3["tau"],
              {"dflash": df["tau"], "eagle3": e3["tau"]}),
        Check("DFlash runs faster", "speedup(dflash) > speedup(eagle3)", df["speedup"] > e3["speedup"],
              {"dflash": df["speedup"], "eagle3": e3["speedup"]}),
        Check("loss decay speeds convergence", "mean held-out sim_tau over the curve: gamma on > gamma off",
              on_auc is not None and off_auc is not None and on_auc > off_auc,
              {"gamma_on": on_auc, "gamma_off": off_auc}),
        Check(f"{settings.taps[0]} taps beat {settings.taps[1]}",
              f"tau(dflash, {settings.taps[0]} taps) > tau(dflash, {settings.taps[1]} taps)", df["tau"] > few["tau"],
              {f"taps_{settings.taps[0]}": df["tau"], f"taps_{settings.taps[1]}": few["tau"]}),
    ))


def bars(rows: list[dict[str, Any]], settings: Settings):
    fig, (ax_tau, ax_speed) = figure(11, 4, ncols=2)
    labels = [r["variant"] for r in rows]
    ax_tau.bar(labels, [r["tau"] for r in rows], color=[f"C{i}" for i in range(len(rows))])
    ax_speed.bar(labels, [r["speedup"] for r in rows], color=[f"C{i}" for i in range(len(rows))])
    ax_speed.axhline(1.0, color="grey", lw=0.8)
    for ax, title in ((ax_tau, "tau"), (ax_speed, "speedup over vanilla")):
        ax.set_title(f"{title} ({settings.num_steps} steps x {settings.batch_size} sequences each)")
        ax.tick_params(axis="x", rotation=20)
    return fig


def curves_figure(trained: dict[str, Trained]):
    fig, ax = figure(6, 4)
    for i, (label, t) in enumerate(trained.items()):
        points = [(p["step"], p["heldout_sim_tau"]) for p in t.curve if "heldout_sim_tau" in p]
        if points:
            ax.plot(*zip(*points), marker="o", color=f"C{i}", label=label,
                    ls="--" if label == "dflash-gamma-off" else "-")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out sim tau")
    ax.set_title("convergence: loss decay on (dflash) vs off, and taps")
    ax.legend(fontsize=8)
    return fig


FINDING = Finding("dflash-vs-eagle3", "DFlash (arXiv 2602.06036), main table and ablations", CLAIM, Settings, SCALES,
                  run, variants)
