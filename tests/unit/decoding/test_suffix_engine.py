"""The suffix method in the engine: greedy output equals plain greedy output for every tree shape and budget, alone
and batched under load-adaptive pruning, from the context, a datastore and a shared index of earlier answers;
seeded sampling is the same alone and batched."""
from __future__ import annotations

import pytest

from decoding_testing import NUM_NEW, assert_seeded_sampling_alone_equals_batched
from eyas.decoding.engine import SpecEngine
from eyas.decoding.generate import generate
from eyas.decoding.requests import SequenceRequest, SpeculationSchedule
from eyas.drafters.suffix import SuffixIndex
from eyas.methods import SpecConfig, build_drafter, drafter_factory, suffix_config

# tree shapes and budgets: a chain (one node a depth), narrow and wide trees, deep and shallow
SHAPES = [{"num_nodes": 1}, {"num_draft": 1, "num_nodes": 4}, {"num_draft": 3, "min_prob": 0.0, "num_nodes": 24},
          {"num_draft": 12, "num_nodes": 12, "min_prob": 0.5}, {"min_match": 2, "num_nodes": 8},
          {"min_match": 4, "num_draft": 6}, {}]


@pytest.mark.parametrize("shape", SHAPES, ids=[",".join(f"{k}={v}" for k, v in s.items()) or "default"
                                               for s in SHAPES])
def test_greedy_suffix_equals_vanilla(setup, datastore_dir, shape):
    target, prompts, eos = setup
    spec = SpecConfig(method="suffix", datastore=(str(datastore_dir),), **shape)
    vanilla = [generate(target, ids, NUM_NEW, eos_token_ids=eos).token_ids for ids in prompts]
    singles = [generate(target, ids, NUM_NEW, drafter=build_drafter(target, spec), eos_token_ids=eos)
               for ids in prompts]
    assert [single.token_ids for single in singles] == vanilla
    assert max(single.stats.tau for single in singles) > 1.5  # the datastore holds two answers: drafts pass
    budget = suffix_config(spec).num_nodes
    assert all(single.stats.num_draft_nodes <= budget * single.stats.cycles for single in singles)
    engine = SpecEngine(target, capacity=3, max_len=256, drafter_factory=lambda: build_drafter(target, spec),
                        schedule=SpeculationSchedule({1: None, 2: 2}), eos_token_ids=eos)
    done = engine.run([SequenceRequest(str(i), ids, NUM_NEW) for i, ids in enumerate(prompts)])
    assert [done[str(i)][0] for i in range(len(prompts))] == vanilla


def test_a_shared_index_of_earlier_answers_drafts_them_again(setup):
    target, prompts, eos = setup
    spec = SpecConfig(method="suffix")
    history = SuffixIndex(suffix_config(spec).anchors, max_tokens=10_000)
    make = drafter_factory(target, spec, history)
    first = [generate(target, ids, NUM_NEW, drafter=make(), eos_token_ids=eos) for ids in prompts]
    for ids, result in zip(prompts, first):
        history.add(result.token_ids)
    again = [generate(target, ids, NUM_NEW, drafter=make(), eos_token_ids=eos) for ids in prompts]
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    tau_first = sum(r.stats.tau for r in first) / len(first)
    tau_again = sum(r.stats.tau for r in again) / len(again)
    assert tau_again > tau_first + 1, (tau_first, tau_again)


def test_seeded_sampling_is_the_same_alone_and_batched(setup, datastore_dir):
    target, prompts, eos = setup
    assert_seeded_sampling_alone_equals_batched(target, prompts, eos,
                                                SpecConfig(method="suffix", datastore=(str(datastore_dir),)))
