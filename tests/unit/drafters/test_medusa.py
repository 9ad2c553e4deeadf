"""Medusa: heads start as the target's readout, the loss (read at the learned positions only) equals the loss over the
whole batch, the loss falls, greedy speculative output equals plain greedy output (static tree from the heads' top-k
products, and a chain), a sampled run completes."""
import pytest
import torch
from drafter_testing import (TARGET_CONFIG, assert_greedy_identity, random_prompts, regenerated_batch, tiny_target,
                             train)

from eyas.config import ConfigError
from eyas.drafters.eagle import hard_cross_entropy, shift_left, soft_cross_entropy, step_mask
from eyas.drafters import registry
from eyas.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaModel
from eyas.drafters.vocab import build_draft_vocab
from eyas.models.features import TargetFeatures, target_features
from eyas.drafters.trees import TreeSpec
from eyas.decoding.generate import SamplingParams, generate
from eyas.decoding.builders import EAGLE_DEFAULT


@pytest.fixture(scope="module")
def setup():
    target = tiny_target()
    torch.manual_seed(2)
    model = MedusaModel(MedusaConfig(num_heads=3), target)
    history = train(model, regenerated_batch(target), target)
    prompts = random_prompts()
    vanilla = [generate(target, prompt, 40).token_ids for prompt in prompts]
    return {"target": target, "model": model, "history": history, "prompts": prompts, "vanilla": vanilla}


def test_untrained_heads_read_like_the_target():
    target = tiny_target()
    model = MedusaModel(MedusaConfig(num_heads=2), target)
    hidden_E = torch.randn(32)
    expected_V = target.lm_head(hidden_E)
    torch.testing.assert_close(model.head_logits(hidden_E), torch.stack([expected_V, expected_V]))
    assert not any(name.startswith("lm_head") for name in model.state_dict())  # shared, frozen, not saved


def whole_batch_loss(model, batch, features):
    """The loss as the paper writes it: every head at every position of the padded batch, masked afterwards."""
    logits_BTKX = model.head_logits(features.taps[model.target_config.num_layers])
    probs_BTX = features.logits_BTV[..., model.d2t].float().softmax(-1)
    draft_BT = model.t2d[features.argmax_BT]
    loss = 0.0
    for k in range(model.config.num_heads):
        mask_BT = step_mask(batch, 2 + k) * (shift_left(draft_BT, 1 + k) >= 0)
        if model.config.loss_target == "soft":
            ce = soft_cross_entropy(logits_BTKX[:, :, k], probs_BTX, mask_BT, ahead=1 + k)
        else:
            ce = hard_cross_entropy(logits_BTKX[:, :, k], shift_left(draft_BT, 1 + k), mask_BT)
        loss = loss + model.config.step_decay ** k * ce
    return loss


def vocab_of(target, size):
    counts_V = torch.bincount(regenerated_batch(target).input_ids_BT.flatten(), minlength=TARGET_CONFIG.vocab_size)
    return build_draft_vocab(counts_V, size).tolist()


@pytest.mark.parametrize("loss_target", ["soft", "argmax"])
@pytest.mark.parametrize("lazy", [False, True], ids=["logits", "lazy"])
@pytest.mark.parametrize("vocab_size", [None, 40], ids=["full-vocab", "draft-vocab"])
def test_loss_on_learned_positions_equals_the_whole_batch_loss(loss_target, lazy, vocab_size):
    target = tiny_target()
    torch.manual_seed(3)
    model = MedusaModel(MedusaConfig(num_heads=3, loss_target=loss_target, draft_vocab_size=vocab_size), target,
                        vocab_of(target, vocab_size) if vocab_size else None)
    for head in model.heads:  # away from the identity start, so the heads differ
        torch.nn.init.normal_(head[0].linear.weight, std=0.3)
    batch = regenerated_batch(target, num_rows=4)
    batch.loss_mask_BT[1, -3:] = 0  # ragged: responses of different lengths
    batch.valid_BT[2, -2:] = 0
    features = target_features(target, batch.input_ids_BT, model.target_taps)
    asked = []
    if lazy:  # as a feature cache builds them: the LM head on the final state, at the positions asked for
        final_BTE = features.taps[model.target_config.num_layers]

        def logits_from(index):
            asked.append(index)
            return target.lm_head(final_BTE if index is None else final_BTE[index])

        features = TargetFeatures(features.taps, argmax_BT=features.argmax_BT, logits_from=logits_from)
    loss, metrics = model.training_loss(batch, features)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    if lazy and loss_target == "soft":
        assert len(asked) == 1 and len(asked[0][0]) == int(step_mask(batch, 1).sum())  # the response rows only
    assert asked == [] or loss_target == "soft"
    expected = whole_batch_loss(model, batch, features)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for grad, expected_grad in zip(grads, torch.autograd.grad(expected, params)):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)
    assert 0 <= metrics["acc_1"] <= 1


@pytest.fixture(scope="module")
def vocab_setup(setup):
    """A Medusa over a 40-token draft vocabulary, trained on the argmax of the same data."""
    target = setup["target"]
    torch.manual_seed(2)
    model = MedusaModel(MedusaConfig(num_heads=3, loss_target="argmax", draft_vocab_size=40), target,
                        vocab_of(target, 40))
    train(model, regenerated_batch(target), target)
    return model


def test_a_draft_vocabulary_reads_those_rows_of_the_target_head(setup):
    target = setup["target"]
    vocab = vocab_of(target, 40)
    model = MedusaModel(MedusaConfig(num_heads=2, draft_vocab_size=40), target, vocab)
    hidden_E = torch.randn(32)
    expected_X = target.lm_head(hidden_E)[vocab]
    torch.testing.assert_close(model.head_logits(hidden_E), torch.stack([expected_X, expected_X]))
    assert not model.vocab_head.weight.requires_grad
    with torch.no_grad():
        probs_V = model.draft_probs(model.head_logits(hidden_E)[0])
    assert probs_V.shape == (TARGET_CONFIG.vocab_size,) and float(probs_V[vocab].sum()) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="needs a draft vocabulary"):
        MedusaModel(MedusaConfig(draft_vocab_size=40), target)


@pytest.mark.parametrize("tree", [TreeSpec(mode="static"), TreeSpec(mode="dynamic", depth=3, top_k=3, num_nodes=8)],
                         ids=["static", "dynamic"])
def test_greedy_identity_with_a_draft_vocabulary(setup, vocab_setup, tree):
    drafter = MedusaDrafter(vocab_setup, tree)
    accepted = assert_greedy_identity(setup["target"], drafter, setup["prompts"], setup["vanilla"])
    assert accepted > 0
    drafter.begin([1, 2, 3], {4: torch.randn(3, 32)})
    drafted = drafter.propose(5, [1, 2, 3, 5]).tokens_N.tolist()[1:]
    assert drafted and set(drafted) <= set(vocab_setup.draft_vocab)  # the heads propose draft tokens only


def test_a_draft_vocabulary_survives_a_checkpoint(setup, vocab_setup, tmp_path):
    registry.save_drafter(vocab_setup, tmp_path / "medusa", "tiny")
    loaded = registry.load_model(tmp_path / "medusa", setup["target"])
    assert loaded.draft_vocab == vocab_setup.draft_vocab and loaded.config.draft_vocab_size == 40
    hidden_E = torch.randn(32)
    torch.testing.assert_close(loaded.head_logits(hidden_E), vocab_setup.head_logits(hidden_E))


def test_loss_target_is_checked():
    with pytest.raises(ConfigError, match="loss_target"):
        MedusaConfig(loss_target="hard")


def test_loss_falls(setup):
    first, last = setup["history"][0], setup["history"][-1]
    assert last["loss"] < 0.8 * first["loss"], (first, last)


@pytest.mark.parametrize("tree", [TreeSpec(mode="static"), TreeSpec(mode="chain", depth=3)],
                         ids=["static", "chain"])
def test_greedy_identity(setup, tree):
    drafter = MedusaDrafter(setup["model"], tree)
    accepted = assert_greedy_identity(setup["target"], drafter, setup["prompts"], setup["vanilla"])
    assert accepted > 0


def test_static_tree_takes_depth_d_candidates_from_head_d(setup):
    drafter = MedusaDrafter(setup["model"], TreeSpec(mode="static"))
    assert drafter.tree.shape == tuple(r for r in EAGLE_DEFAULT if len(r) <= 3)
    drafter.begin([1, 2, 3], {4: torch.randn(3, 32)})
    tree = drafter.propose(5, [1, 2, 3, 5])
    probs_KV = setup["model"].head_logits(drafter._last_state_E).softmax(-1)
    tokens, depth = tree.tokens_N.tolist(), tree.depth_N.tolist()
    for node in range(1, tree.num_nodes):
        top_tokens = probs_KV[depth[node] - 1].topk(4).indices.tolist()
        assert tokens[node] in top_tokens  # whatever the parent, a depth-d node is one of head d's top-k


def test_a_shallow_tree_reads_only_the_heads_it_reaches(setup):
    """Each head is one pass of the target's LM head: a depth-1 chain over a 3-head model runs head 1 only."""
    model = setup["model"]
    calls = []
    hooks = [head.register_forward_hook(lambda *_, k=k: calls.append(k)) for k, head in enumerate(model.heads)]
    try:
        drafter = MedusaDrafter(model, TreeSpec(mode="chain", depth=1))
        drafter.begin([1, 2, 3], {4: torch.randn(3, 32)})
        assert drafter.propose(5, [1, 2, 3, 5]).num_nodes == 2
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == [0]


def test_sampled_run_completes(setup):
    drafter = MedusaDrafter(setup["model"], TreeSpec(mode="static"))
    result = generate(setup["target"], setup["prompts"][0], 40, drafter=drafter,
                      sampling=SamplingParams(temperature=0.8, seed=0))
    assert len(result.token_ids) == 40


def test_validation(setup):
    with pytest.raises(ConfigError, match="num_heads"):
        MedusaConfig(num_heads=0)
    with pytest.raises(ConfigError, match="tree.depth"):
        MedusaDrafter(setup["model"], TreeSpec(mode="dynamic", depth=5))
