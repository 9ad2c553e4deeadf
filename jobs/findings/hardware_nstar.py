"""hardware-n-star (seed section D.3): the speedup against the node budget N, and the best budget N*, measured on
this machine, next to the papers' GPU N* of 24-60.

The seed's decomposition: speedup(N) ~ tau(N) * t(1) / (t(N) + t_draft(N)), where t(n) is one target forward over n
new tokens (the cost curve, eyas.decoding.costs as jobs.bench measures it: a tree of N drafted nodes is a forward
over N + 1 tokens) and t_draft(N) the drafting time per cycle (measured in the same runs). On a GPU decode is
memory-bound and t(N) stays near t(1) up to N ~ 60, so N* is large; where t(N) grows sooner, N* is smaller: N* is a
property of the hardware. Busy-machine warnings (sample spread, load average) go with the cost curve.

Checks: (1) the decomposition predicts the measured speedup (mean relative error <= max_rel_error); (2) it
predicts where the best budget is (predicted N* within one budget step of the measured N*); (3) the measured N*
lies in the papers' GPU range. On a CPU (3) is expected to fail: the cost curve shows why.

    python -m jobs.findings --finding hardware-n-star [--scale micro|default|large] [key=value ...]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from eyas.config import require
from eyas.decoding import costs
from jobs.findings.common import Check, Common, Finding, Outcome, Verdict, figure
from jobs.findings.measure import budget_tree, method_factory, open_workbench, run_methods, speed_row

CLAIM = ("N* is a property of the hardware: speedup ~ tau(N) t(1) / (t(N) + t_draft) peaks at the best node budget "
         "N*, 24-60 on the papers' GPUs")


@dataclass(frozen=True)
class Settings(Common):
    method: str = "eagle2"            # a method with a node budget (dynamic / best-first / ddtree tree)
    budgets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 60)   # drafted nodes N per tree
    depth: int = 6
    top_k: int = 4
    cost_sizes: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64)  # tokens per timed forward
    cost_repeats: int = 5
    gpu_range: tuple[int, int] = (24, 60)   # the papers' N* on GPUs
    max_rel_error: float = 0.15

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.budgets) >= 2 and all(1 <= n <= 63 for n in self.budgets), "budgets", self.budgets,
                "needs >= 2 budgets in [1, 63] (a tree holds at most 64 nodes, root included)")
        require(all(1 <= n <= 64 for n in self.cost_sizes), "cost_sizes", self.cost_sizes, "must lie in [1, 64]")
        require(self.cost_repeats >= 1, "cost_repeats", self.cost_repeats, "must be >= 1")


SCALES = {
    "micro": {"target": "micro", "suite": "code", "num_prompts": 2, "max_new_tokens": 12, "max_prompt_tokens": 24,
              "budgets": [1, 4, 16], "cost_sizes": [1, 5, 17], "cost_repeats": 2},
    "default": {"num_prompts": 4, "max_new_tokens": 48},
    "large": {"num_prompts": 16, "max_new_tokens": 128, "repeats": 2,
              "budgets": [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 60], "cost_repeats": 20},
}


def run(settings: Settings) -> Outcome:
    bench = open_workbench(settings)
    budgets = sorted(set(settings.budgets))
    factories = {f"N={n}": method_factory(bench, settings.method,
                                          **budget_tree(settings.method, n, settings.depth, settings.top_k))
                 for n in budgets}
    cpu_start = costs.cpu_reading()
    runs = run_methods(bench, factories)
    prefix = sum(map(len, bench.prompts)) // len(bench.prompts) + settings.max_new_tokens // 2
    sizes = sorted(set(settings.cost_sizes) | {1} | {n + 1 for n in budgets})
    timings = costs.forward_costs(bench.target, prefix, sizes, settings.cost_repeats)
    cost = {n: t.median for n, t in timings.items()}
    busy = costs.busy_reasons({f"t({n})": t for n, t in timings.items()},
                              costs.CpuWindow(cpu_start, costs.cpu_reading()), torch.get_num_threads())
    rows = []
    for n in budgets:
        run_n = runs[f"N={n}"]
        row = {"N": n, **speed_row(runs, f"N={n}")}
        cycles = max(run_n.stats.cycles, 1)
        row.update({"t_verify_ms": 1e3 * cost[n + 1], "t_verify_in_run_ms": 1e3 * run_n.stats.verify_s / cycles,
                    "t_draft_ms": 1e3 * run_n.draft_s_per_cycle, "cost_ratio": cost[n + 1] / cost[1]})
        row["predicted_speedup"] = costs.predicted_speedup(run_n.tau, cost[1], cost[n + 1], run_n.draft_s_per_cycle)
        rows.append(row)
    verdict = judge(rows, settings)
    metrics = {"n_star_measured": float(best(rows, "speedup")), "n_star_predicted": float(best(rows,
               "predicted_speedup")), "best_speedup": max(r["speedup"] for r in rows), "t1_ms": 1e3 * cost[1],
               "mean_rel_error": verdict.checks[0].numbers["mean_rel_error"]}
    cost_rows = [{"n_tokens": n, "t_ms": timings[n].to_dict(1e3), "t_over_t1": cost[n] / cost[1]} for n in sizes]
    figures = {"cost_curve.png": cost_figure(cost, prefix, settings),
               "speedup_vs_n.png": speedup_figure(rows, settings)}
    for reason in busy:
        print(f"[findings] warning: {reason}", flush=True)
    return Outcome(rows, figures, metrics, verdict, {"cost_curve.json": {"curve": cost_rows, "busy": busy}})


def best(rows: list[dict[str, Any]], key: str) -> int:
    return max(rows, key=lambda r: r[key])["N"]


def judge(rows: list[dict[str, Any]], settings: Settings) -> Verdict:
    """The checks of the module docstring, computed from the table rows (N, speedup, predicted_speedup)."""
    errors = [abs(r["predicted_speedup"] - r["speedup"]) / r["speedup"] for r in rows if r["speedup"] > 0]
    mean_error = sum(errors) / len(errors) if errors else float("inf")
    budgets = [r["N"] for r in rows]
    measured, predicted = best(rows, "speedup"), best(rows, "predicted_speedup")
    low, high = settings.gpu_range
    return Verdict(CLAIM, (
        Check("decomposition predicts the speedup", f"mean |predicted - measured| / measured <= "
              f"{settings.max_rel_error}", mean_error <= settings.max_rel_error,
              {"mean_rel_error": mean_error}),
        Check("decomposition predicts N*", "predicted N* within one budget step of the measured N*",
              abs(budgets.index(predicted) - budgets.index(measured)) <= 1,
              {"n_star_measured": measured, "n_star_predicted": predicted}),
        Check("N* in the papers' GPU range", f"{low} <= measured N* <= {high}", low <= measured <= high,
              {"n_star_measured": measured, "best_speedup": max(r["speedup"] for r in rows)}),
    ))


def cost_figure(cost: dict[int, float], prefix: int, settings: Settings):
    fig, ax = figure(5.5, 3.8)
    sizes = sorted(cost)
    ax.plot(sizes, [cost[n] / cost[1] for n in sizes], marker="o", label=f"this machine (t(1) = "
            f"{1e3 * cost[1]:.1f} ms)")
    ax.axhline(1.0, color="grey", ls="--", lw=0.8, label="free verification (memory-bound GPU, N <~ 60)")
    ax.set_xlabel("new tokens in one target forward (N drafted + root)")
    ax.set_ylabel("t(N) / t(1)")
    ax.set_title(f"target cost curve, prefix {prefix} tokens")
    ax.legend(fontsize=8)
    return fig


def speedup_figure(rows: list[dict[str, Any]], settings: Settings):
    fig, ax = figure(5.8, 3.8)
    budgets = [r["N"] for r in rows]
    ax.plot(budgets, [r["speedup"] for r in rows], marker="o", label="measured")
    ax.plot(budgets, [r["predicted_speedup"] for r in rows], marker="x", ls="--",
            label="tau(N) t(1) / (t(N) + t_draft)")
    n_star = best(rows, "speedup")
    ax.axvline(n_star, color="C0", lw=0.8, ls=":", label=f"N* here = {n_star}")
    ax.axvspan(*settings.gpu_range, color="C2", alpha=0.12, label="papers' GPU N* (24-60)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("node budget N (drafted nodes)")
    ax.set_ylabel("speedup over vanilla")
    ax.set_title(f"{settings.method}: speedup against N")
    ax.legend(fontsize=8)
    return fig


FINDING = Finding("hardware-n-star", "seed D.3; EAGLE-2 (N 24-32 for 7-8B, 60+ for 70B)", CLAIM, Settings, SCALES,
                  run)
