"""The golden training test: the library trainer reproduces the per-step losses (and every other step metric) and the
held-out evaluation recorded before training moved out of jobs.train_drafter (train_cases.py says how)."""
from __future__ import annotations

import json

import pytest
from train_cases import CASES, FIXTURE, record, write_data
from golden_cases import VOCAB

RELATIVE = 1e-5  # 50x the largest difference seen between two CPUs
ABSOLUTE = 1e-7  # metrics recorded as 0.0 (accuracies, a warm-up lr)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("golden-train") / "data", VOCAB)


@pytest.mark.parametrize("case", sorted(CASES))
def test_reproduces_recorded_losses(case, data_dir):
    expected = json.loads(FIXTURE.read_text())[case]
    got = record(data_dir, case)
    # the same ops in the same order on the same seeds: equal to float32 rounding. Not bit-exact, because the CPU's
    # kernels differ (recorded on an AVX-512 EPYC; an AVX2 one differs by up to 2.1e-7 relative over these steps),
    # while any change to the math moves the losses by orders of magnitude more than RELATIVE.
    assert [step["loss"] for step in got["steps"]] == pytest.approx([step["loss"] for step in expected["steps"]],
                                                                    rel=RELATIVE, abs=ABSOLUTE)
    assert got.keys() == expected.keys() and len(got["steps"]) == len(expected["steps"])
    for got_step, expected_step in zip(got["steps"], expected["steps"]):
        assert got_step == pytest.approx(expected_step, rel=RELATIVE, abs=ABSOLUTE)
    assert got["heldout"] == pytest.approx(expected["heldout"], rel=RELATIVE, abs=ABSOLUTE)
