"""tree-vs-chain (seed section D, E; EAGLE-1, EAGLE-2, DDTree): at equal verify budgets N, a chain of N drafted
tokens, a static tree, EAGLE-2's dynamic tree and the best-first tree, all drafted by the same drafter.

A chain fully passes with probability a^N, so its accepted length saturates near a / (1 - a) however long it gets;
a tree spends the same N verified tokens on alternatives where the drafter is unsure. The static tree is fixed in
advance: the N most probable rank paths under a context-free prior (rank r accepted with probability
``static_prior[r]``, depth <= ``depth``), which is how a static tree is designed offline; the dynamic tree (EAGLE-2)
and the best-first tree (DDTree) are grown per context from the drafter's own confidences.

Checks (tau, greedy): (1) the dynamic tree beats the chain at every N; (2) the dynamic tree is at least as good as
the static tree at every N (EAGLE-2 over EAGLE-1); (3) the dynamic tree gains more from the smallest to the largest
N than the chain does (the chain saturates). Speedup is measured and plotted too; whether a larger N pays on this
machine is the hardware-n-star finding.

    python -m jobs.findings --finding tree-vs-chain [--scale micro|default|large] [key=value ...]
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

from eyas.config import require
from jobs.findings.common import Check, Common, Finding, Outcome, Verdict, figure
from jobs.findings.measure import method_factory, open_workbench, run_methods, speed_row

CLAIM = "at equal verify budgets N, trees accept more than chains, and EAGLE-2's dynamic tree more than a static tree"
SHAPES = ("chain", "static", "dynamic", "best-first")


@dataclass(frozen=True)
class Settings(Common):
    method: str = "eagle2"            # whose drafter drafts every shape (eagle2/eagle1: EAGLE-1's; eagle3; medusa)
    budgets: tuple[int, ...] = (4, 8, 16, 32)
    depth: int = 6                    # tree depth cap (static, dynamic, best-first); a chain's depth is N
    top_k: int = 4
    static_prior: tuple[float, ...] = (0.6, 0.15, 0.08, 0.04)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.budgets) >= 2 and all(1 <= n <= 63 for n in self.budgets), "budgets", self.budgets,
                "needs >= 2 budgets in [1, 63]")
        require(all(0 < p < 1 for p in self.static_prior), "static_prior", self.static_prior, "must lie in (0, 1)")


SCALES = {
    "micro": {"target": "micro", "suite": "code", "num_prompts": 2, "max_new_tokens": 12, "max_prompt_tokens": 24,
              "budgets": [2, 6]},
    "default": {"num_prompts": 4, "max_new_tokens": 48},
    "large": {"num_prompts": 16, "max_new_tokens": 128, "repeats": 2, "budgets": [4, 8, 16, 24, 32, 48, 60]},
}


def static_shape(num_nodes: int, prior: tuple[float, ...], max_depth: int) -> tuple[tuple[int, ...], ...]:
    """The ``num_nodes`` rank paths of highest prior probability (prod of prior[rank] along the path), parents
    first; V falls along a path, so the chosen set is a connected tree. E.g. prior (0.6, 0.2), 3 nodes:
    (0,) 0.6, (0, 0) 0.36, (1,) 0.2."""
    heap = [(-p, (r,)) for r, p in enumerate(prior)]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < num_nodes:
        value, ranks = heapq.heappop(heap)
        chosen.append(ranks)
        if len(ranks) < max_depth:
            for r, p in enumerate(prior):
                heapq.heappush(heap, (value * p, ranks + (r,)))
    return tuple(sorted(chosen, key=lambda ranks: (len(ranks), ranks)))


def tree_of(shape: str, n: int, settings: Settings) -> dict[str, Any]:
    if shape == "chain":
        return {"mode": "chain", "depth": n}
    if shape == "static":
        return {"mode": "static", "shape": static_shape(n, settings.static_prior, settings.depth)}
    return {"mode": shape, "num_nodes": n, "top_k": min(settings.top_k, n), "depth": min(settings.depth, n)}


def run(settings: Settings) -> Outcome:
    bench = open_workbench(settings)
    budgets = sorted(set(settings.budgets))
    factories = {f"{shape} N={n}": method_factory(bench, settings.method, **tree_of(shape, n, settings))
                 for n in budgets for shape in SHAPES}
    runs = run_methods(bench, factories)
    rows = []
    for n in budgets:
        for shape in SHAPES:
            label = f"{shape} N={n}"
            stats = runs[label].stats
            rows.append({"shape": shape, "N": n, **speed_row(runs, label),
                         "nodes_per_cycle": stats.num_draft_nodes / max(stats.cycles, 1)})
    verdict = judge(rows)
    metrics = {f"tau_{r['shape']}_N{r['N']}": r["tau"] for r in rows}
    metrics.update({f"speedup_{r['shape']}_N{r['N']}": r["speedup"] for r in rows})
    return Outcome(rows, {"tau_speedup_vs_n.png": plot(rows, settings)}, metrics, verdict)


def judge(rows: list[dict[str, Any]]) -> Verdict:
    """The checks of the module docstring, from the table rows (shape, N, tau)."""
    tau = {(r["shape"], r["N"]): r["tau"] for r in rows}
    budgets = sorted({r["N"] for r in rows})
    chain, static, dynamic = ([tau[(s, n)] for n in budgets] for s in ("chain", "static", "dynamic"))
    gain_dynamic, gain_chain = dynamic[-1] - dynamic[0], chain[-1] - chain[0]
    return Verdict(CLAIM, (
        Check("tree beats chain", "tau(dynamic, N) > tau(chain, N) at every N",
              all(d > c for d, c in zip(dynamic, chain)), {"N": budgets, "dynamic": dynamic, "chain": chain}),
        Check("dynamic >= static", "tau(dynamic, N) >= tau(static, N) at every N",
              all(d >= s for d, s in zip(dynamic, static)), {"N": budgets, "dynamic": dynamic, "static": static}),
        Check("chain saturates", f"tau gain N={budgets[0]}->{budgets[-1]}: dynamic > chain",
              gain_dynamic > gain_chain, {"dynamic_gain": gain_dynamic, "chain_gain": gain_chain}),
    ))


def plot(rows: list[dict[str, Any]], settings: Settings):
    fig, (ax_tau, ax_speed) = figure(11, 4, ncols=2)
    styles = {"chain": ("o", "-"), "static": ("s", "--"), "dynamic": ("^", "-"), "best-first": ("x", ":")}
    for shape in SHAPES:  # distinct markers and lines: equal values overlap
        mine = [r for r in rows if r["shape"] == shape]
        marker, line = styles[shape]
        for ax, key in ((ax_tau, "tau"), (ax_speed, "speedup")):
            ax.plot([r["N"] for r in mine], [r[key] for r in mine], marker=marker, ls=line, label=shape)
    for ax, title in ((ax_tau, "tau (accepted + 1 per cycle)"), (ax_speed, "speedup over vanilla")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("verify budget N (drafted tokens)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    ax_speed.axhline(1.0, color="grey", lw=0.8)
    fig.suptitle(f"tree vs chain, {settings.method} drafter on {settings.target} ({settings.suite})")
    return fig


FINDING = Finding("tree-vs-chain", "seed D/E; EAGLE-1 static tree, EAGLE-2 dynamic tree, DDTree best-first", CLAIM,
                  Settings, SCALES, run)
