"""The golden decoding test: today's code reproduces the recorded token ids, tau and per-depth acceptance of every
method and tree shape, single-sequence and batched, greedy and seeded sampling (golden_cases.py says how the
cases are built and how to regenerate the fixture after a deliberate behaviour change)."""
from __future__ import annotations

import json

import pytest
from golden_cases import FIXTURE, Setup, record_all


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    return record_all(Setup(tmp_path_factory.mktemp("golden-drafters")))


@pytest.fixture(scope="module")
def expected():
    return json.loads(FIXTURE.read_text())


def test_cases_cover_every_method(expected):
    methods = {case.split("/")[0] for case in expected["single"]}
    assert methods == {"vanilla", "ngram", "draft-lm", "eagle1", "eagle2", "eagle3", "medusa", "dflash",
                       "dflash-ddtree", "hybrid", "dspark", "dflash2",
                       "eagle3.1", "peagle", "suffix"}


@pytest.mark.parametrize("section", ["single", "sampled", "batch", "batch_adaptive", "batch_sampled"])
def test_reproduces_fixture(recorded, expected, section):
    assert sorted(recorded[section]) == sorted(expected[section])
    for case, want in expected[section].items():
        assert recorded[section][case] == want, f"{section}/{case} differs from tests/golden/decoding.json"


def test_greedy_is_lossless(expected):
    """Every greedy case emits vanilla's tokens (the fixture itself is consistent with the product's promise)."""
    vanilla = [r["token_ids"] for r in expected["single"]["vanilla"]]
    for case, records in expected["single"].items():
        assert [r["token_ids"] for r in records] == vanilla, case
    for case, records in expected["batch"].items():
        for record, full in zip(records, vanilla):
            assert full[:len(record["token_ids"])] == record["token_ids"], case
