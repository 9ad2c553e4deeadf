"""EAGLE-3: the loss falls on regenerated data, and greedy speculative output equals plain greedy output for every
tree mode (chain, static, dynamic, best-first); a sampled run completes."""
import pytest
import torch
from drafter_testing import assert_greedy_identity, random_prompts, regenerated_batch, tiny_target, train

from eyas.drafters.eagle_drafter import EagleDrafter
from eyas.drafters.eagle3 import Eagle3Config, Eagle3Model, build_draft_vocab
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
    counts_V = torch.bincount(batch.input_ids_BT.flatten(), minlength=64)  # a reduced vocabulary: 48 of 64
    model = Eagle3Model(Eagle3Config(ttt_steps=3, draft_vocab_size=48), target, build_draft_vocab(counts_V, 48))
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


def test_argmax_loss_target_is_one_hot_on_target_argmax(setup):
    target, batch = setup["target"], regenerated_batch(setup["target"])
    counts_V = torch.bincount(batch.input_ids_BT.flatten(), minlength=64)
    model = Eagle3Model(Eagle3Config(ttt_steps=2, draft_vocab_size=48, loss_target="argmax"), target,
                        build_draft_vocab(counts_V, 48))
    logits_BTV = torch.randn(2, 5, 64)
    target_draft_BT = model.t2d[logits_BTV.argmax(-1)]
    probs_BTX = model.loss_target_probs(logits_BTV, target_draft_BT)
    inside_BT = target_draft_BT >= 0
    assert torch.equal(probs_BTX.sum(-1), torch.ones(2, 5))
    assert torch.equal(model.d2t[probs_BTX.argmax(-1)][inside_BT], logits_BTV.argmax(-1)[inside_BT])
    soft = Eagle3Model(Eagle3Config(ttt_steps=2, draft_vocab_size=48), target, build_draft_vocab(counts_V, 48))
    assert torch.allclose(soft.loss_target_probs(logits_BTV, target_draft_BT),
                          logits_BTV[..., soft.d2t].softmax(-1))


def test_argmax_loss_target_trains_and_stays_lossless(setup):
    target = setup["target"]
    batch = regenerated_batch(target)
    counts_V = torch.bincount(batch.input_ids_BT.flatten(), minlength=64)
    torch.manual_seed(2)
    model = Eagle3Model(Eagle3Config(ttt_steps=3, draft_vocab_size=48, loss_target="argmax"), target,
                        build_draft_vocab(counts_V, 48))
    history = train(model, batch, target)
    assert history[-1]["loss"] < 0.8 * history[0]["loss"] and history[-1]["acc_1"] > history[0]["acc_1"] + 0.2
    drafter = EagleDrafter(model, TREES["dynamic"])
    assert assert_greedy_identity(target, drafter, setup["prompts"], setup["vanilla"]) > 0


def test_unknown_loss_target_is_rejected():
    with pytest.raises(Exception, match="loss_target"):
        Eagle3Config(loss_target="hard")
