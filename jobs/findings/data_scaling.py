"""data-scaling (EAGLE-3): EAGLE-3 and EAGLE-1 tau as the training data grows (1x, 2x, 4x, 8x regenerated data) at a
fixed step budget per sample (``epochs`` passes over each data set, the same batch size: 8x data, 8x the steps).

EAGLE-3's argument: EAGLE-1's feature regression (l_reg) pins the drafter to the top-layer feature, so more data
stops helping; without it (and with training-time test and fused taps) tau keeps rising: 4.5 -> 6.0 from 1x to 8x
in the paper, the first monotone data-scaling curve for a drafter.

Data: the first ``sizes[i]`` training sequences of the base data set (``data``; regenerated with ``data_config``
by jobs.generate_data when it holds too few), each subset written once under ``$EYAS_HOME/data/<data>-first<size>``
with the base's held-out split. Drafters: ``train_config`` (``{family}`` is filled in) with ``train_overrides``,
one variant per family and size (jobs/findings/training.py: trained here or on Ray Train, reused when present).
tau: greedy, each family's own tree (eagle3: eagle3; eagle1: eagle2's dynamic tree), on the finding's prompts.

Checks (measured tau, tolerance ``tol``): (1) EAGLE-3 rises monotonically: no doubling loses more than tol and the
largest set beats the smallest by more than tol; (2) EAGLE-1 saturates: its last doubling gains at most
``saturation`` of its whole gain (or tol); (3) EAGLE-3 gains more from the data than EAGLE-1.

    python -m jobs.findings --finding data-scaling [--scale micro|default|large] [key=value ...]
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.config import ConfigError, load_config, require
from eyas.train.config import DataConfig, data_path, target_path
from eyas.train.data import read_rows, shard_path, write_shard
from jobs import generate_data
from jobs.findings.common import Check, Common, Finding, Outcome, Verdict, figure
from jobs.findings.measure import method_factory, open_workbench, run_methods
from jobs.findings.training import RUNNERS, Variant, train_variants, variant_config

CLAIM = "EAGLE-3's tau rises monotonically with training data while EAGLE-1's saturates"
FAMILIES = ("eagle3", "eagle1")
METHOD = {"eagle3": "eagle3", "eagle1": "eagle2"}  # the tree each family's tau is measured with
SUBSET_FILE = "subset.json"


@dataclass(frozen=True)
class Settings(Common):
    sizes: tuple[int, ...] = (16, 32, 64, 128)   # training sequences: 1x, 2x, 4x, 8x
    epochs: int = 1                              # passes over each data set: the step budget per sample
    data: str = "data-smollm2"
    data_config: str = "jobs/configs/data-smollm2.yaml"
    train_config: str = "jobs/configs/{family}-smollm2-135m.yaml"
    train_overrides: tuple[str, ...] = ("train.feature_cache=none", "train.eval_every=1000")
    runner: str = "local"
    tol: float = 0.02
    saturation: float = 0.25

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.sizes) >= 3 and list(self.sizes) == sorted(set(self.sizes)) and self.sizes[0] >= 1,
                "sizes", self.sizes, "needs >= 3 increasing data sizes")
        require(self.epochs >= 1, "epochs", self.epochs, "must be >= 1")
        require(self.runner in RUNNERS, "runner", self.runner, f"must be one of {list(RUNNERS)}")
        require("{family}" in self.train_config, "train_config", self.train_config, "must contain {family}")


SCALES = {
    "micro": {"target": "micro", "suite": "code", "num_prompts": 2, "max_new_tokens": 12, "max_prompt_tokens": 24,
              "sizes": [4, 8, 16], "data": "data-micro", "data_config": "jobs/configs/data-micro.yaml",
              "train_config": "jobs/configs/{family}-micro.yaml",
              "train_overrides": ["train.batch_size=4", "train.max_len=48", "train.eval_sequences=4",
                                  "train.eval_every=1000"]},
    "default": {"num_prompts": 8, "max_new_tokens": 48},
    "large": {"num_prompts": 32, "max_new_tokens": 128, "sizes": [512, 1024, 2048, 4096], "epochs": 2,
              "runner": "ray-train", "train_overrides": ["train.eval_every=1000"]},
}


def base_data(settings: Settings) -> Path:
    """The base data set, regenerated (jobs.generate_data, Ray actors) when it holds fewer than max(sizes)."""
    directory = data_path(settings.data)
    have = len(read_rows(directory, "train")) if any((directory / "train").glob("shard-*.parquet")) else 0
    if have < settings.sizes[-1]:
        cfg = load_config(DataConfig, settings.data_config, [f"name={settings.data}",
                                                             f"num_prompts={settings.sizes[-1]}"])
        print(f"[findings] {directory}: {have} train sequences, {settings.sizes[-1]} needed: generating", flush=True)
        generate_data.build(cfg)
        have = len(read_rows(directory, "train"))
        if have < settings.sizes[-1]:
            raise ConfigError(f"sizes={list(settings.sizes)}: {directory} has only {have} train sequences "
                              "(the source ran out of prompts); choose smaller sizes")
    return directory


def subset(base: Path, size: int) -> str:
    """``<base>-first<size>``: the first ``size`` train sequences of ``base`` and its held-out split (written once,
    shard by shard, each atomically; a stamp names the base and size)."""
    name = f"{base.name}-first{size}"
    out = data_path(name)
    stamp = {"base": str(base.resolve()), "size": size}
    if (out / SUBSET_FILE).is_file() and json.loads((out / SUBSET_FILE).read_text()) == stamp:
        return name
    rows = read_rows(base, "train")[:size]
    for index in range(0, len(rows), 64):
        write_shard(shard_path(out, "train", index // 64), rows[index:index + 64])
    write_shard(shard_path(out, "heldout", 0), read_rows(base, "heldout"))
    (out / SUBSET_FILE).write_text(json.dumps(stamp) + "\n")
    return name


def variants(settings: Settings) -> list[Variant]:
    """One variant per family and size, each on its data subset (written here when missing)."""
    base, target_dir = base_data(settings), target_path(settings.target).resolve()
    out = []
    for size in settings.sizes:
        data = str(data_path(subset(base, size)))
        for family in FAMILIES:
            overrides = [f"train.num_epochs={settings.epochs}", "train.max_steps=null", *settings.train_overrides]
            name = f"findings-data-scaling-{family}-{size}-{target_dir.name}"
            out.append(Variant(f"{family}-{size}", variant_config(settings.train_config.format(family=family), name,
                                                                  str(target_dir), data, overrides)))
    return out


def run(settings: Settings) -> Outcome:
    trained = train_variants(variants(settings), settings.runner)  # first: training loads a target of its own
    bench = open_workbench(settings)
    factories = {label: method_factory(bench, METHOD[label.split("-")[0]], drafter=t.path)
                 for label, t in trained.items()}
    runs = run_methods(bench, factories, timed=False)
    rows = [{"family": label.split("-")[0], "sequences": int(label.split("-")[1]), "tau": runs[label].tau,
             "heldout_sim_tau": trained[label].final.get("heldout_sim_tau"), "steps": trained[label].steps,
             "train_seconds": round(trained[label].seconds, 1), "reused": trained[label].reused}
            for label in trained]
    verdict = judge(rows, settings)
    metrics = {f"tau_{r['family']}_{r['sequences']}": r["tau"] for r in rows}
    return Outcome(rows, {"tau_vs_data.png": plot(rows, settings)}, metrics, verdict)


def judge(rows: list[dict[str, Any]], settings: Settings) -> Verdict:
    """The checks of the module docstring, from the rows (family, sequences, tau)."""
    tau = {f: [r["tau"] for r in sorted(rows, key=lambda r: r["sequences"]) if r["family"] == f] for f in FAMILIES}
    e3, e1 = tau["eagle3"], tau["eagle1"]
    tol = settings.tol
    rises = all(b >= a - tol for a, b in zip(e3, e3[1:])) and e3[-1] > e3[0] + tol
    e1_total, e1_last = e1[-1] - e1[0], e1[-1] - e1[-2]
    return Verdict(CLAIM, (
        Check("EAGLE-3 rises monotonically", f"every doubling >= -{tol} and last - first > {tol}", rises,
              {"eagle3_tau": e3}),
        Check("EAGLE-1 saturates", f"last doubling gain <= max({tol}, {settings.saturation} x total gain)",
              e1_last <= max(tol, settings.saturation * e1_total),
              {"eagle1_tau": e1, "last_gain": e1_last, "total_gain": e1_total}),
        Check("EAGLE-3 gains more from data", "tau gain first -> last size: eagle3 > eagle1",
              e3[-1] - e3[0] > e1_total, {"eagle3_gain": e3[-1] - e3[0], "eagle1_gain": e1_total}),
    ))


def plot(rows: list[dict[str, Any]], settings: Settings):
    fig, ax = figure(6, 4)
    for i, family in enumerate(FAMILIES):
        mine = sorted((r for r in rows if r["family"] == family), key=lambda r: r["sequences"])
        sizes = [r["sequences"] for r in mine]
        ax.plot(sizes, [r["tau"] for r in mine], marker="o", color=f"C{i}", label=f"{family}: measured tau")
        sim = [(s, r["heldout_sim_tau"]) for s, r in zip(sizes, mine) if r["heldout_sim_tau"] is not None]
        if sim:
            ax.plot(*zip(*sim), ls="--", color=f"C{i}", alpha=0.6, label=f"{family}: held-out sim tau")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"training sequences ({settings.epochs} epoch(s) each: steps grow with the data)")
    ax.set_ylabel("tau")
    ax.set_title(f"data scaling on {settings.target}")
    ax.legend(fontsize=8)
    return fig


FINDING = Finding("data-scaling", "EAGLE-3 (arXiv 2503.01840), Figure 1 / section 'scaling'", CLAIM, Settings,
                  SCALES, run, variants)
