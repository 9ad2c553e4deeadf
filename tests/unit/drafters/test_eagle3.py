"""EAGLE-3: the loss falls on regenerated data, and greedy speculative output equals plain greedy output for every
tree mode (chain, static, dynamic, best-first); a sampled run completes."""
import pytest
import torch
from drafter_testing import assert_greedy_identity, random_prompts, regenerated_batch, tiny_target, train

from eyas.drafters.eagle_drafter import EagleDrafter
from eyas.drafters.eagle3 import Eagle3Config, Eagle3Model
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


@pytest.mark.parametrize("loss_target", ["argmax", "soft"])
def test_loss_is_ce_against_the_shifted_target(setup, loss_target):
    """The loss, computed from targets derived once, equals step j's CE against the target's logits shifted 1 + j
    by hand: a one-hot on their argmax (masked outside the draft vocabulary) or their restricted softmax."""
    from eyas.drafters.eagle import shift_left, soft_cross_entropy, step_mask, unroll
    from eyas.models.features import target_features

    target, batch = setup["target"], regenerated_batch(setup["target"])
    counts_V = torch.bincount(batch.input_ids_BT.flatten(), minlength=64)
    torch.manual_seed(3)
    model = Eagle3Model(Eagle3Config(ttt_steps=3, draft_vocab_size=48, loss_target=loss_target, noise_scale=0.0),
                        target, build_draft_vocab(counts_V, 48))
    features = target_features(target, batch.input_ids_BT, tuple(model.target_taps))
    loss, metrics = model.training_loss(batch, features)
    hidden_BTE = model.initial_hidden({layer: features.taps[layer] for layer in model.target_taps})
    expected = 0.0
    for j, (_, logits_BTX) in enumerate(unroll(model, batch.input_ids_BT, hidden_BTE, 3)):
        shifted_BTV = shift_left(features.logits_BTV, 1 + j)
        draft_BT = model.t2d[shifted_BTV.argmax(-1)]
        probs_BTX = (torch.nn.functional.one_hot(draft_BT.clamp(min=0), 48).float() if loss_target == "argmax"
                     else shifted_BTV[..., model.d2t].softmax(-1))
        expected = expected + 0.8 ** j * soft_cross_entropy(logits_BTX, probs_BTX,
                                                            step_mask(batch, 2 + j) * (draft_BT >= 0))
    assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-6), (float(loss), float(expected))
    assert metrics["acc_1"] >= 0 and "ce_3" in metrics


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


def test_packed_linears_draft_what_the_plain_ones_do_and_leave_training_alone(setup):
    """pack_linears (a checkpoint's drafter, eyas.methods) lays the drafter's own linears out for inference: a step
    gives the plain step's outputs, drafting stays lossless, and with gradients on it still runs the parameters."""
    model = Eagle3Model(Eagle3Config(ttt_steps=3, draft_vocab_size=48), setup["target"],
                        setup["model"].d2t.tolist())
    model.load_state_dict(setup["model"].state_dict())
    model.eval()
    tokens_BT, hidden_BTE = torch.tensor([[3, 5, 7]]), torch.randn(1, 3, setup["target"].config.hidden_size)
    positions_BT = torch.arange(3)[None]
    with torch.no_grad():
        plain_BTE, plain_logits_BTX, _ = model.step(tokens_BT, hidden_BTE, positions_BT, None, None)
        model.pack_linears()
        assert model.fc.packed is not None and model.layer.mlp.fused_gate_up is not None
        packed_BTE, packed_logits_BTX, _ = model.step(tokens_BT, hidden_BTE, positions_BT, None, None)
    torch.testing.assert_close(packed_BTE, plain_BTE, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_logits_BTX, plain_logits_BTX, atol=1e-5, rtol=1e-5)
    drafter = EagleDrafter(model, TREES["dynamic"])
    assert assert_greedy_identity(setup["target"], drafter, setup["prompts"], setup["vanilla"]) > 0
    _, grad_logits_BTX, _ = model.step(tokens_BT, hidden_BTE, positions_BT, None, None)  # gradients on: parameters
    grad_logits_BTX.sum().backward()
    assert model.lm_head.weight.grad is not None and model.layer.self_attn.q_proj.weight.grad is not None


@pytest.mark.parametrize("mode", list(TREES))
def test_sparse_draft_probs_grow_the_trees_dense_ones_do(setup, mode, monkeypatch):
    """The drafter hands the builders its draft-vocabulary distributions (SparseProbs): every tree, its tokens,
    scores and draft rows, is bit for bit the one grown from the dense [V] distributions (vocab.to_target_probs)."""
    target, model, prompt = setup["target"], setup["model"], setup["prompts"][0]

    def trees() -> list:
        drafter = EagleDrafter(model, TREES[mode])
        out = []
        generate(target, prompt, 24, _Recorder(drafter, out))
        return out

    sparse = trees()
    from eyas.drafters import eagle_drafter
    dense_step = eagle_drafter.EagleDrafter._run

    def dense_run(self, *args, **kwargs):
        out_PE, probs = dense_step(self, *args, **kwargs)
        return out_PE, probs.dense()

    monkeypatch.setattr(eagle_drafter.EagleDrafter, "_run", dense_run)
    dense = trees()
    assert len(sparse) == len(dense) > 3
    for a, b in zip(sparse, dense):
        assert a.tokens_list == b.tokens_list and a.parents_list == b.parents_list
        assert torch.equal(a.scores_N, b.scores_N) and torch.equal(a.draft_probs_NV, b.draft_probs_NV)


class _Recorder:
    """A drafter that keeps every tree it proposes."""

    def __init__(self, drafter: EagleDrafter, trees: list) -> None:
        self.drafter, self.trees = drafter, trees

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, *args):
        tree = self.drafter.propose(*args)
        self.trees.append(tree)
        return tree
