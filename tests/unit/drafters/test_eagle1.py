"""EAGLE-1: the loss falls on regenerated data, and greedy speculative output equals plain greedy output for every
tree mode (chain, static, dynamic, best-first), with the target's whole head or a reduced draft vocabulary read
through it; a checkpoint without a draft vocabulary warm-starts one; a sampled run completes."""
import pytest
import torch
from drafter_testing import (TARGET_CONFIG, assert_greedy_identity, random_prompts, regenerated_batch, tiny_target,
                             train)

from eyas.drafters.eagle_drafter import EagleDrafter
from eyas.drafters import registry
from eyas.drafters.eagle1 import Eagle1Config, Eagle1Model
from eyas.drafters.vocab import build_draft_vocab
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


def counts_of(batch):
    return torch.bincount(batch.input_ids_BT.flatten(), minlength=TARGET_CONFIG.vocab_size)


@pytest.fixture(scope="module")
def vocab_setup(setup):
    """EAGLE-1 over a 40-token draft vocabulary (of the target's 64), trained on the same data."""
    target, batch = setup["target"], regenerated_batch(setup["target"])
    torch.manual_seed(2)
    model = Eagle1Model(Eagle1Config(metric_steps=2, draft_vocab_size=40), target,
                        build_draft_vocab(counts_of(batch), 40).tolist())
    return {"model": model, "history": train(model, batch, target)}


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


def test_a_draft_vocabulary_trains_and_reads_those_rows(setup, vocab_setup):
    model, history = vocab_setup["model"], vocab_setup["history"]
    assert history[-1]["loss"] < 0.8 * history[0]["loss"] and history[-1]["acc_1"] > history[0]["acc_1"] + 0.2
    feature_E = torch.randn(32)
    torch.testing.assert_close(model.readout(feature_E), setup["target"].lm_head(feature_E)[model.draft_vocab])
    assert not model.vocab_head.weight.requires_grad


@pytest.mark.parametrize("mode", ["chain", "dynamic"])
def test_greedy_identity_with_a_draft_vocabulary(setup, vocab_setup, mode):
    drafter = EagleDrafter(vocab_setup["model"], TREES[mode])
    accepted = assert_greedy_identity(setup["target"], drafter, setup["prompts"], setup["vanilla"])
    assert accepted > 0


def test_a_checkpoint_without_a_draft_vocabulary_warm_starts_one(setup, tmp_path):
    target, batch = setup["target"], regenerated_batch(setup["target"])
    registry.save_drafter(setup["model"], tmp_path / "eagle1", "tiny")
    with pytest.raises(registry.CheckpointError, match="needs a draft vocabulary"):
        registry.load_model(tmp_path / "eagle1", target, config_overrides={"draft_vocab_size": 40})
    warm = registry.load_model(tmp_path / "eagle1", target, config_overrides={"draft_vocab_size": 40},
                               token_counts_V=counts_of(batch))
    assert warm.draft_vocab == build_draft_vocab(counts_of(batch), 40).tolist()
    trained = setup["model"].state_dict()
    assert all(torch.equal(tensor, trained[name]) for name, tensor in warm.state_dict().items()
               if not name.startswith("vocab_head"))
    registry.save_drafter(warm, tmp_path / "warm", "tiny")  # and it saves and loads as any drafter with one
    again = registry.load_model(tmp_path / "warm", target)
    assert again.draft_vocab == warm.draft_vocab and torch.equal(again.vocab_head.weight, warm.vocab_head.weight)
