"""EAGLE machinery shared by EAGLE-1 and EAGLE-3: the TTT mask against brute force, training unroll equals
inference drafting, EAGLE-3's taps and draft vocabulary, config validation. Training and greedy identity per family
live in test_eagle1.py / test_eagle3.py."""
import pytest
import torch
from drafter_testing import regenerated_batch, tiny_target

from eyas.config import ConfigError
from eyas.drafters.eagle import shift_left, ttt_attention_mask, unroll
from eyas.drafters.eagle_drafter import EagleDrafter
from eyas.drafters.eagle1 import Eagle1Config, Eagle1Model
from eyas.drafters.eagle3 import Eagle3Config, Eagle3Model, eagle3_taps
from eyas.drafters.vocab import build_draft_vocab
from eyas.drafters.trees import TreeSpec
from eyas.decoding.tree import PartialTree, dense_probs
from eyas.models.features import target_features


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def inference_view_mask(num_tokens: int, num_steps: int) -> torch.Tensor:
    """Brute force: replay what the drafter cache holds while drafting a chain anchored at each index i."""
    T = num_tokens
    mask = torch.zeros(num_steps * T, num_steps * T, dtype=torch.bool)
    for i in range(T):
        cache = [(0, k) for k in range(i + 1)]  # committed: index k's entry, built from real target states
        for j in range(num_steps):
            if j > 0:
                cache.append((j, i))  # the depth-(j+1) draft node enters the cache as it runs
            for m, k in cache:
                mask[j * T + i, m * T + k] = True
    return mask


@pytest.mark.parametrize("num_tokens,num_steps", [(1, 1), (5, 1), (6, 3), (7, 7)])
def test_ttt_mask_matches_inference_view(num_tokens, num_steps):
    assert torch.equal(ttt_attention_mask(num_tokens, num_steps), inference_view_mask(num_tokens, num_steps))


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_training_unroll_equals_inference_chain(target, family):
    """Step j at index i of the training unroll computes exactly the depth-(j+1) draft of a chain whose real
    prefix ends at index i, through begin / propose / commit / expand and the drafter's KV cache."""
    ids_1T = regenerated_batch(target, num_rows=1).input_ids_BT
    torch.manual_seed(3)
    model = (Eagle1Model(Eagle1Config(), target) if family == "eagle1" else
             Eagle3Model(Eagle3Config(draft_vocab_size=32), target, list(range(0, 64, 2)))).eval()
    features = target_features(target, ids_1T, model.target_taps)
    with torch.no_grad():
        steps = unroll(model, ids_1T, model.initial_hidden(features.taps), num_steps=3)
    taps = {layer: h[0] for layer, h in features.taps.items()}
    tokens = ids_1T[0].tolist()
    anchor = 9  # the real prefix ends at index 9: tokens t_0..t_10, root t_10
    drafter = EagleDrafter(model, TreeSpec(mode="dynamic", depth=2, top_k=2, num_nodes=3))
    drafter.begin(tokens[:4], {l: h[:4] for l, h in taps.items()})
    drafter.propose(tokens[4], tokens[:5])  # a tree and its rollback, then the real tokens committed
    drafter.commit(tokens[4:7], {l: h[4:7] for l, h in taps.items()})
    # a cycle without a draft (speculation switched off under load): commit follows commit
    drafter.commit(tokens[7:anchor + 1], {l: h[7:anchor + 1] for l, h in taps.items()})
    drafter.advance(tokens[anchor + 1])
    partial, node = PartialTree(tokens[anchor + 1]), 0
    for j, (_, logits_BTX) in enumerate(steps):
        probs_V = dense_probs(drafter.expand([node], partial))[0]
        torch.testing.assert_close(probs_V, model.draft_probs(logits_BTX[0, anchor]), atol=1e-5, rtol=1e-4)
        node = partial.add(node, tokens[anchor + 2 + j], 1.0, probs_V)


def test_propose_leaves_only_the_committed_prefix(target):
    model = Eagle1Model(Eagle1Config(), target)
    drafter = EagleDrafter(model, TreeSpec(mode="best-first", depth=4, top_k=3, num_nodes=10))
    taps = {target.config.num_layers: torch.randn(5, 32)}
    drafter.begin([1, 2, 3, 4, 5], taps)
    for root in range(6, 40):  # the cache starts small and grows
        tree = drafter.propose(root, list(range(1, root + 1)))
        assert tree.num_nodes == 11 and not tree.sampled
        assert drafter.cache.lengths[0] == drafter.num_committed == root - 1  # the tree's slots are gone
        drafter.commit([root], {l: torch.randn(1, 32) for l in taps})


def test_shift_left():
    assert shift_left(torch.tensor([[1, 2, 3, 4]]), 2).tolist() == [[3, 4, 0, 0]]


def test_eagle3_taps():
    assert eagle3_taps(32) == (2, 16, 29)  # the reference's (2, N/2, N-3)
    assert eagle3_taps(4) == (1, 2, 3)
    assert all(0 < t < n for n in range(2, 40) for t in eagle3_taps(n))


def test_build_draft_vocab_takes_most_frequent_lower_id_on_ties():
    counts = torch.tensor([5, 0, 7, 5, 1, 5])
    assert build_draft_vocab(counts, 3).tolist() == [0, 2, 3]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(counts, 7)


def test_eagle3_masks_targets_outside_the_draft_vocab(target):
    batch = regenerated_batch(target, num_rows=4)
    features = target_features(target, batch.input_ids_BT, eagle3_taps(4))
    target_argmax = set(features.logits_BTV.argmax(-1).flatten().tolist())
    outside = [t for t in range(64) if t not in target_argmax]
    model = Eagle3Model(Eagle3Config(ttt_steps=2, draft_vocab_size=len(outside)), target, outside)
    loss, metrics = model.training_loss(batch, features)
    assert float(loss.detach()) == 0.0 and metrics["acc_1"] == 0.0  # every position masked, every target missed


def test_configs_validate(target):
    with pytest.raises(ConfigError, match="ttt_steps"):
        Eagle3Config(ttt_steps=0)
    with pytest.raises(ConfigError, match="step_decay"):
        Eagle1Config(step_decay=1.5)
    with pytest.raises(ConfigError, match="tree.mode"):
        TreeSpec(mode="wide")
    with pytest.raises(ConfigError, match="tree.shape"):
        TreeSpec(mode="static", shape=((0,), (1, 0)))
    with pytest.raises(ValueError, match="draft vocabulary"):
        Eagle3Model(Eagle3Config(draft_vocab_size=10), target)
    with pytest.raises(ConfigError, match="taps"):
        Eagle3Model(Eagle3Config(taps=(1, 9)), target)


def test_cross_entropy_ahead_equals_shifting_the_targets():
    from eyas.drafters.eagle import hard_cross_entropy, soft_cross_entropy

    torch.manual_seed(0)
    logits_BTX, probs_BTX = torch.randn(2, 7, 11), torch.randn(2, 7, 11).softmax(-1)
    mask_BT = (torch.rand(2, 7) > 0.3).float()
    for ahead in (0, 1, 3, 7):
        shifted_mask_BT = mask_BT * (torch.arange(7) < 7 - ahead)
        assert torch.allclose(soft_cross_entropy(logits_BTX, probs_BTX, shifted_mask_BT, ahead=ahead),
                              soft_cross_entropy(logits_BTX, shift_left(probs_BTX, ahead), shifted_mask_BT))
    labels_BT = torch.randint(-1, 11, (2, 7))
    inside_BT = mask_BT * (labels_BT >= 0)
    one_hot_BTX = torch.nn.functional.one_hot(labels_BT.clamp(min=0), 11).float()
    assert torch.allclose(hard_cross_entropy(logits_BTX, labels_BT, inside_BT),
                          soft_cross_entropy(logits_BTX, one_hot_BTX, inside_BT))
