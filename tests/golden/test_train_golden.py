"""The golden training test: the library trainer reproduces the per-step losses (and every other step metric) and the
held-out evaluation recorded before training moved out of jobs.train_drafter (train_cases.py says how)."""
from __future__ import annotations

import json

import pytest
from train_cases import CASES, FIXTURE, record, write_data
from golden_cases import VOCAB


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("golden-train") / "data", VOCAB)


@pytest.mark.parametrize("case", sorted(CASES))
def test_reproduces_recorded_losses(case, data_dir):
    expected = json.loads(FIXTURE.read_text())[case]
    got = record(data_dir, case)
    # exact: the same ops in the same order on the same seeds (a different CPU or torch build may need a rerecord)
    assert [step["loss"] for step in got["steps"]] == [step["loss"] for step in expected["steps"]]
    assert got == expected
