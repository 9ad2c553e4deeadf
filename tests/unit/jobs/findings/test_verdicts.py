"""Each finding's verdict rule on hand-written numbers: the same numbers always give the same outcome, and the
outcome follows the numbers (every check passes -> reproduced, some -> partly, none -> refuted)."""
from __future__ import annotations

import pytest

from jobs.findings import (calibration, data_scaling, dflash_eagle3, dspark_dflash, eagle31_eagle3, hardware_nstar,
                           position_context, tree_chain)
from jobs.findings.common import outcome_of


def test_the_one_rule():
    assert outcome_of([True, True]) == "reproduced"
    assert outcome_of([True, False]) == "partly"
    assert outcome_of([False, False]) == "refuted"
    with pytest.raises(ValueError):
        outcome_of([])


def nstar_rows(speedup, predicted, budgets=(1, 8, 32, 48)):
    return [{"N": n, "speedup": s, "predicted_speedup": p} for n, s, p in zip(budgets, speedup, predicted)]


def test_hardware_n_star():
    settings = hardware_nstar.Settings()
    gpu_like = hardware_nstar.judge(nstar_rows([1.5, 2.0, 2.6, 2.4], [1.5, 2.1, 2.7, 2.3]), settings)
    assert gpu_like.outcome == "reproduced"
    cpu_like = hardware_nstar.judge(nstar_rows([1.1, 1.3, 0.9, 0.7], [1.15, 1.35, 0.95, 0.7]), settings)
    assert cpu_like.outcome == "partly" and [c.passed for c in cpu_like.checks] == [True, True, False]
    assert cpu_like.checks[2].numbers["n_star_measured"] == 8
    wrong = hardware_nstar.judge(nstar_rows([1.1, 1.3, 0.9, 0.7], [0.5, 0.6, 2.0, 3.0]), settings)
    assert wrong.outcome == "refuted"


def chain_rows(chain, static, dynamic, budgets=(4, 8, 16, 32)):
    return [{"shape": shape, "N": n, "tau": tau} for shape, taus in
            (("chain", chain), ("static", static), ("dynamic", dynamic), ("best-first", dynamic))
            for n, tau in zip(budgets, taus)]


def test_tree_vs_chain():
    paper_like = tree_chain.judge(chain_rows([2.0, 2.3, 2.4, 2.4], [2.2, 2.6, 2.9, 3.0], [2.4, 2.9, 3.3, 3.5]))
    assert paper_like.outcome == "reproduced"
    ties = tree_chain.judge(chain_rows([1.0] * 4, [1.0] * 4, [1.0] * 4))  # an untrained drafter: all equal
    assert [c.passed for c in ties.checks] == [False, True, False] and ties.outcome == "partly"
    inverted = tree_chain.judge(chain_rows([3.0, 3.5, 4.0, 4.5], [2.5] * 4, [2.0] * 4))
    assert inverted.outcome == "refuted"


def position_table(per_query, min_judged=1):
    return position_context.position_rows(per_query, min_judged)


def test_position_vs_context():
    settings = position_context.Settings(depth=3, min_judged=1, min_position_judged=4)
    # query 0 accepts P1 and P2 and is rejected at P3; query 1 is rejected at P2: means 1, 0.5, 0; span 1 at P2
    rows = position_table([[(4, 4), (4, 4), (0, 4)], [(4, 4), (0, 4), (0, 0)]])
    assert [r["mean"] for r in rows] == [1.0, 0.5, 0.0] and rows[1]["span"] == 1.0
    assert position_context.judge(rows, settings).outcome == "reproduced"
    flat = position_table([[(2, 4), (2, 4), (2, 4)], [(2, 4), (2, 4), (2, 4)]])  # same everywhere, no spread
    assert position_context.judge(flat, settings).outcome == "refuted"
    rising = position_table([[(1, 4), (4, 4), (4, 4)], [(4, 4), (1, 1), (1, 1)]])
    assert [c.passed for c in position_context.judge(rising, settings).checks] == [False, True]
    # an untrained drafter: P3 is never judged and P2 too rarely, so a fall over two positions is no evidence
    shallow = position_table([[(2, 40), (0, 3), (0, 0)], [(8, 40), (0, 1), (0, 0)]])
    assert [c.passed for c in position_context.judge(shallow, settings).checks] == [False, False]


def bins(pairs, count=50):
    return [{"bin_low": i / 10, "mean_confidence": c, "acceptance": a, "count": count} for i, (c, a) in
            enumerate(pairs)]


def summary_of(pairs, count=50):
    table = bins(pairs, count)
    return {"ece": calibration.ece(table), "slope": calibration.weighted_slope(table, 10), "judged": count * len(pairs)}


def test_calibration():
    settings = calibration.Settings()
    calibrated = summary_of([(0.15, 0.14), (0.45, 0.47), (0.75, 0.73), (0.95, 0.93)])
    assert calibrated["ece"] == pytest.approx(0.0175) and calibrated["slope"] == pytest.approx(0.975, abs=0.01)
    assert calibration.judge(calibrated, settings).outcome == "reproduced"
    shifted = summary_of([(0.55, 0.1), (0.75, 0.3), (0.95, 0.5)])  # the right slope, 0.45 too confident
    assert [c.passed for c in calibration.judge(shifted, settings).checks] == [False, True]
    # most nodes at low confidence and right there, overconfident above: a small ECE, a flat slope
    low_mass = bins([(0.04, 0.02)], 850) + bins([(0.35, 0.05), (0.55, 0.06), (0.75, 0.3)], 20)
    summary = {"ece": calibration.ece(low_mass), "slope": calibration.weighted_slope(low_mass, 10), "judged": 910}
    assert summary["ece"] < 0.1 and summary["slope"] < 0.5
    assert [c.passed for c in calibration.judge(summary, settings).checks] == [True, False]
    assert calibration.weighted_slope(bins([(0.5, 0.5), (0.9, 0.9)]), 10) is None  # under 3 bins: no line
    anti = summary_of([(0.15, 0.9), (0.55, 0.5), (0.95, 0.1)])
    assert calibration.judge(anti, settings).outcome == "refuted"


def scaling_rows(e3, e1, sizes=(16, 32, 64, 128)):
    return [{"family": f, "sequences": s, "tau": t} for f, taus in (("eagle3", e3), ("eagle1", e1))
            for s, t in zip(sizes, taus)]


def test_data_scaling():
    settings = data_scaling.Settings()
    paper_like = data_scaling.judge(scaling_rows([4.5, 5.0, 5.5, 6.0], [3.0, 3.4, 3.5, 3.5]), settings)
    assert paper_like.outcome == "reproduced"
    both_rise = data_scaling.judge(scaling_rows([4.5, 5.0, 5.5, 6.0], [3.0, 3.5, 4.0, 4.5]), settings)
    assert [c.passed for c in both_rise.checks] == [True, False, False]
    e3_flat = data_scaling.judge(scaling_rows([1.1, 1.05, 1.1, 1.08], [1.0, 1.2, 1.4, 1.6]), settings)
    assert e3_flat.outcome == "refuted"


def dflash_rows(tau, speedup, auc):
    labels = ("eagle3", "dflash", "dflash-gamma-off", "dflash-3taps")
    return [{"variant": v, "tau": t, "speedup": s, "curve_mean_sim_tau": a}
            for v, t, s, a in zip(labels, tau, speedup, auc)]


def test_dflash_vs_eagle3():
    settings = dflash_eagle3.Settings()
    paper_like = dflash_eagle3.judge(dflash_rows([3.7, 6.5, 6.0, 6.1], [2.1, 5.6, 5.1, 5.3], [3, 5, 4, 4.5]),
                                     settings)
    assert paper_like.outcome == "reproduced"
    mixed = dflash_eagle3.judge(dflash_rows([1.15, 1.09, 1.1, 1.12], [0.9, 0.95, 0.9, 0.9], [1.1, 1.09, 1.1, 1.1]),
                                settings)
    assert [c.passed for c in mixed.checks] == [False, True, False, False] and mixed.outcome == "partly"
    no_curve = dflash_eagle3.judge(dflash_rows([2, 1, 1, 1], [2, 1, 1, 1], [None, None, None, None]), settings)
    assert no_curve.outcome == "refuted"


def family_rows(values, key="tau", identical=1.0, suites=("humaneval", "chat")):
    """values: variant -> one number per suite (``key``); the other of tau / speedup is 1."""
    other = "speedup" if key == "tau" else "tau"
    return [{"variant": v, "suite": s, key: x, other: 1.0, "greedy_identical": identical}
            for v, xs in values.items() for s, x in zip(suites, xs)]


def test_dspark_vs_dflash():
    settings = dspark_dflash.Settings()
    goal = dspark_dflash.judge(family_rows({"dflash": [1.5, 1.3], "dspark": [1.6, 1.3], "dflash2": [1.5, 1.4]}),
                               settings)
    assert goal.outcome == "reproduced" and goal.checks[0].numbers == {
        "dspark_humaneval": 1.6, "dflash_humaneval": 1.5, "dspark_chat": 1.3, "dflash_chat": 1.3}
    one_suite = dspark_dflash.judge(family_rows({"dflash": [1.5, 1.3], "dspark": [1.6, 1.2],
                                                 "dflash2": [1.4, 1.4]}), settings)
    assert [c.passed for c in one_suite.checks] == [False, False, True]  # each misses on one suite
    lossy = dspark_dflash.judge(family_rows({"dflash": [2, 2], "dspark": [1, 1], "dflash2": [1, 1]}, identical=0.5),
                                settings)
    assert lossy.outcome == "refuted"


def test_eagle31_vs_eagle3():
    settings = eagle31_eagle3.Settings()
    rows = family_rows({"eagle3": [1.4, 1.2], "eagle3.1": [1.5, 1.2], "peagle": [1.3, 1.3]})
    for row, speedup in zip(rows, [1.1, 0.9, 1.0, 1.0, 1.2, 0.95]):
        row["speedup"] = speedup
    verdict = eagle31_eagle3.judge(rows, settings)
    assert [c.passed for c in verdict.checks] == [True, True, True] and verdict.outcome == "reproduced"
    rows[4]["speedup"] = 1.0  # P-EAGLE slower than EAGLE-3 on humaneval
    assert [c.passed for c in eagle31_eagle3.judge(rows, settings).checks] == [True, False, True]
