"""The hybrid method in the engine: greedy output equals plain greedy output for every retrieval (ngram, suffix) +
learned proposer pair and tree shape, alone and batched under load-adaptive pruning; seeded sampling is the same alone and batched;
SpecStats reports acceptance per proposer and depth."""
from __future__ import annotations

import dataclasses

import pytest

from decoding_testing import NUM_NEW, assert_seeded_sampling_alone_equals_batched
from eyas.decoding.engine import SpecEngine
from eyas.decoding.generate import generate
from eyas.decoding.requests import SequenceRequest, SpeculationSchedule
from eyas.methods import LEARNED_PROPOSERS, METHODS, RETRIEVAL_PROPOSERS, SpecConfig, build_drafter

FAMILY_OF = {"eagle1": "eagle1", "eagle2": "eagle1", "eagle3": "eagle3", "medusa": "medusa", "dflash": "dflash",
             "dflash-ddtree": "dflash", "eagle3.1": "eagle3.1", "peagle": "peagle"}
# (retrieval proposer, learned proposer, tree settings): every pair, and every tree shape of one learned proposer
CASES = [(retrieval, name, {}) for retrieval in RETRIEVAL_PROPOSERS for name in LEARNED_PROPOSERS] + [
    ("ngram", "eagle3", {"tree": "chain", "depth": 3}), ("ngram", "eagle3", {"tree": "static"}),
    ("ngram", "eagle3", {"tree": "best-first", "depth": 4, "top_k": 3}),
    ("ngram", "medusa", {"tree": "dynamic", "depth": 3}), ("ngram", "dflash-ddtree", {"top_k": 2}),
    ("suffix", "eagle3", {"tree": "chain", "depth": 3, "min_prob": 0.0}),
    ("ngram", "peagle", {"tree": "ddtree", "top_k": 2}),
    ("suffix", "eagle3", {"tree": "best-first", "depth": 4, "top_k": 3, "min_match": 1, "retrieval_prior": 0.3}),
    ("suffix", "eagle3", {"tree": "chain", "depth": 1, "cost_cut": True, "learned_below": 0.5}),
    ("ngram", "dflash", {"cost_cut": True})]


def hybrid_spec(learned: str, tree: dict, drafters, draft_dir, datastore_dir, num_nodes: int = 10,
                retrieval: str = "ngram") -> SpecConfig:
    location = ({"drafter": str(drafters[FAMILY_OF[learned]])} if METHODS[learned].trained
                else {"draft_model": str(draft_dir)})
    return SpecConfig(method="hybrid", proposers=(retrieval, learned), num_nodes=num_nodes, num_draft=6,
                      datastore=(str(datastore_dir),), **location, **tree)


def test_every_proposer_pair_is_covered():
    assert {(retrieval, learned) for retrieval, learned, _ in CASES} == \
        {(r, n) for r in RETRIEVAL_PROPOSERS for n in LEARNED_PROPOSERS}


@pytest.mark.parametrize("retrieval, learned, tree", CASES,
                         ids=[f"{r}-{n}-{'-'.join(map(str, t.values()))}" for r, n, t in CASES])
def test_greedy_hybrid_equals_vanilla(setup, random_drafters, random_draft_checkpoint, datastore_dir, retrieval,
                                      learned, tree):
    target, prompts, eos = setup
    spec = hybrid_spec(learned, tree, random_drafters, random_draft_checkpoint, datastore_dir, retrieval=retrieval)
    vanilla = [generate(target, ids, NUM_NEW, eos_token_ids=eos).token_ids for ids in prompts[:3]]
    singles = [generate(target, ids, NUM_NEW, drafter=build_drafter(target, spec), eos_token_ids=eos)
               for ids in prompts[:3]]
    assert [single.token_ids for single in singles] == vanilla
    assert max(single.stats.tau for single in singles) >= 2  # the datastore holds two answers: long drafts pass
    engine = SpecEngine(target, capacity=2, max_len=256, drafter_factory=lambda: build_drafter(target, spec),
                        schedule=SpeculationSchedule({1: None, 2: 3}), eos_token_ids=eos)
    done = engine.run([SequenceRequest(str(i), ids, NUM_NEW) for i, ids in enumerate(prompts[:3])])
    assert [done[str(i)][0] for i in range(3)] == vanilla


def test_stats_report_acceptance_per_proposer_and_depth(setup, random_drafters, random_draft_checkpoint,
                                                        datastore_dir):
    target, prompts, eos = setup
    spec = hybrid_spec("eagle3", {}, random_drafters, random_draft_checkpoint, datastore_dir)
    stats = generate(target, prompts[0], NUM_NEW, drafter=build_drafter(target, spec), eos_token_ids=eos).stats
    per_proposer = stats.to_dict()["per_proposer_accept"]
    assert set(per_proposer) <= {"ngram", "eagle3"} and "ngram" in per_proposer
    assert per_proposer["ngram"][0] > 0.5  # the store's answer: retrieval drafts are accepted
    # every accepted depth-d token was drafted by one of them, so their accepted cycles cover the overall ones
    for d, accepted in enumerate(stats.depth_accepted):
        assert max(stats.proposer_accepted[name][d] if d < len(stats.proposer_accepted[name]) else 0
                   for name in per_proposer) <= accepted
        assert sum(stats.proposer_accepted[name][d] if d < len(stats.proposer_accepted[name]) else 0
                   for name in per_proposer) >= accepted
    merged = stats.merge(stats)
    assert merged.proposer_offered["ngram"] == [2 * n for n in stats.proposer_offered["ngram"]]
    assert merged.per_proposer_accept == stats.per_proposer_accept
    vanilla_like = generate(target, prompts[0], 4, drafter=build_drafter(target, SpecConfig(method="ngram")),
                            eos_token_ids=eos).stats
    assert vanilla_like.to_dict()["per_proposer_accept"] == {}  # other methods: empty


@pytest.mark.parametrize("retrieval, learned", [("ngram", "eagle3"), ("ngram", "draft-lm"), ("ngram", "dflash"),
                                                ("suffix", "eagle3")])
def test_seeded_sampling_is_the_same_alone_and_batched(setup, random_drafters, random_draft_checkpoint, datastore_dir,
                                                       retrieval, learned):
    target, prompts, eos = setup
    spec = hybrid_spec(learned, {}, random_drafters, random_draft_checkpoint, datastore_dir, retrieval=retrieval)
    assert_seeded_sampling_alone_equals_batched(target, prompts, eos, spec)


@pytest.mark.parametrize("learned", LEARNED_PROPOSERS)
def test_learned_below_skips_the_learned_drafter_where_retrieval_is_sure_and_stays_exact(
        setup, random_drafters, random_draft_checkpoint, datastore_dir, learned):
    """Every learned family copes with commits that no propose of its own separates (the cycles it sits out)."""
    target, prompts, eos = setup
    spec = dataclasses.replace(hybrid_spec(learned, {}, random_drafters, random_draft_checkpoint, datastore_dir),
                               learned_below=0.5)
    drafters = [build_drafter(target, spec) for _ in prompts[:3]]
    outputs = [generate(target, ids, NUM_NEW, drafter=drafter, eos_token_ids=eos).token_ids
               for ids, drafter in zip(prompts[:3], drafters)]
    assert outputs == [generate(target, ids, NUM_NEW, eos_token_ids=eos).token_ids for ids in prompts[:3]]
    cycles = sum(d.cycles for d in drafters)
    assert 0 < sum(d.learned_cycles for d in drafters) < cycles  # both kinds of cycle happened
