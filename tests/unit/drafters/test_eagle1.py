"""EAGLE-1: the loss falls on regenerated data, and greedy speculative output equals plain greedy output for every
tree mode (chain, static, dynamic, best-first); a sampled run completes."""
import pytest
import torch
from drafter_testing import assert_greedy_identity, random_prompts, regenerated_batch, tiny_target, train

from eyas.drafters.eagle_drafter import EagleDrafter
from eyas.drafters.eagle1 import Eagle1Config, Eagle1Model
from eyas.drafters.trees import TreeSpec
from eyas.decoding.generate import SamplingParams, generate

TREES = {
    "chain": TreeSpec(mode="chain", depth=4),
    "static": TreeSpec(mode="static"),  # EAGLE-1's 26-node default
    "dynamic": TreeSpec(mode="dynamic", depth=4, top_k=3, num_nodes=12),
    "best-first": TreeSpec(mode="best-first", depth=5, top_k=3, num_nodes=12),
}


@pytest.fixture(scope="module")
def setup():
    target = tiny_target()
    batch = regenerated_batch(target)
    torch.manual_seed(2)
    model = Eagle1Model(Eagle1Config(metric_steps=2), target)
    history = train(model, batch, target)
    prompts = random_prompts()
    vanilla = [generate(target, prompt, 40).token_ids for prompt in prompts]
    return {"target": target, "model": model, "history": history, "prompts": prompts, "vanilla": vanilla}


def test_loss_falls(setup):
    first, last = setup["history"][0], setup["history"][-1]
    assert last["loss"] < 0.8 * first["loss"], (first, last)
    assert last["acc_1"] > first["acc_1"] + 0.2, (first, last)


@pytest.mark.parametrize("mode", list(TREES))
def test_greedy_identity(setup, mode):
    drafter = EagleDrafter(setup["model"], TREES[mode])
    accepted = assert_greedy_identity(setup["target"], drafter, setup["prompts"], setup["vanilla"])
    assert accepted > 0  # the trained drafter is right sometimes: multi-token commits are exercised


def test_sampled_run_completes(setup):
    drafter = EagleDrafter(setup["model"], TREES["dynamic"])
    result = generate(setup["target"], setup["prompts"][0], 40, drafter=drafter,
                      sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=0))
    assert len(result.token_ids) == 40 and all(0 <= t < 64 for t in result.token_ids)
