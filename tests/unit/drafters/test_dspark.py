"""DSpark: config, the sample-from-anchor targets, the Markov walk against the training path, the confidence label,
training, greedy identity, sampling that follows the target, adaptive verification length, checkpoints."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from block_testing import MASK_ID, regenerated_batch, target, train, trained, vanilla_runs  # noqa: F401 (fixtures)
from drafter_testing import assert_greedy_identity, sampled_two_token_pvalue
from eyas.config import ConfigError
from eyas.drafters.dflash_train import block_states
from eyas.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkModel, acceptance_label
from eyas.drafters.registry import build_model, load_model, save_drafter
from eyas.drafters.trees import TreeSpec
from eyas.decoding.generate import generate
from eyas.methods import load_drafter
from eyas.models.features import TrainBatch, target_features

TINY = DSparkConfig(num_layers=2, block_size=4, num_taps=3, num_anchors=16, mask_token_id=MASK_ID, markov_rank=16)
MODEL = DSparkModel  # what block_testing's `trained` fixture builds from TINY


# ---- configuration


def test_defaults_follow_the_paper():
    config = DSparkConfig()
    assert (config.block_size, config.loss_decay, config.markov_rank, config.markov_head_type,
            config.confidence_loss_alpha) == (8, 4.0, 256, "vanilla", 1.0)


@pytest.mark.parametrize("field, value", [("markov_rank", 0), ("markov_head_type", "gated"),
                                          ("confidence_loss_alpha", -1.0), ("verify_threshold", 1.0),
                                          ("block_size", 1), ("num_anchors", 0)])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        DSparkConfig(**{field: value})


def test_registry_config_errors_name_the_field(target):
    with pytest.raises(ConfigError, match="drafter.config.markov_rank"):
        build_model("dspark", {"markov_rank": "big"}, target)


def test_weights_carry_the_engines_names(target):
    names = set(DSparkModel(TINY, target).state_dict())
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias", "fc.weight", "layers.0.self_attn.q_proj.weight"} <= names
    model = DSparkModel(TINY, target)
    assert model.markov_head.markov_w1.weight.shape == (64, 16) and model.markov_head.markov_w2.bias is None
    assert model.confidence_head.proj.weight.shape == (1, 32 + 16)


# ---- training


def test_loss_falls(trained):
    _, losses = trained
    assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[:3]) / 3, losses


def test_every_slot_drafts_and_reports_its_depth(target, trained):
    """sample_from_anchor: a block of G slots yields acc_1..acc_G, slot 0 scored against the token after the anchor."""
    model, _ = trained
    batch = regenerated_batch(target, num_rows=2, seed=5)
    features = target_features(target, batch.input_ids_BT, model.target_taps)
    loss, metrics = model.training_loss(batch, features, torch.Generator().manual_seed(0))
    assert {f"acc_{k}" for k in range(1, TINY.block_size + 1)} <= set(metrics)
    assert metrics["conf_bce"] > 0 and 0 <= metrics["conf_error"] <= 1 and metrics["acc_1"] > 0.3
    empty = TrainBatch(batch.input_ids_BT, torch.zeros_like(batch.loss_mask_BT), batch.valid_BT)
    loss, metrics = model.training_loss(empty, features)
    assert float(loss) == 0.0 and metrics["num_blocks"] == 0


def test_acceptance_label_is_one_minus_total_variation(target):
    model = DSparkModel(TINY, target)
    g = torch.Generator().manual_seed(0)
    draft_RX, target_RV = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    q, p = draft_RX.softmax(-1), target_RV.softmax(-1)
    torch.testing.assert_close(acceptance_label(model, draft_RX, target_RV), 1 - 0.5 * (q - p).abs().sum(-1))


def test_the_confidence_head_learns_the_acceptance_label(target):
    """alpha > 0 trains the confidence head towards 1 - TV; with alpha = 0 it only decays (AdamW), and misses it."""
    batch = regenerated_batch(target)
    errors = {}
    for alpha in (0.0, 1.0):
        torch.manual_seed(1)
        model = DSparkModel(replace(TINY, confidence_loss_alpha=alpha), target)
        train(model, target, batch, steps=30)
        features = target_features(target, batch.input_ids_BT, model.target_taps)
        errors[alpha] = model.eval().training_loss(batch, features)[1]["conf_error"]
    assert errors[1.0] < errors[0.0]


def test_the_markov_walk_equals_the_training_path(target, trained):
    """The walk's q_k (inference, predecessors drafted) = softmax of the training logits when the sequence holds the
    drafted tokens after the anchor (teacher forcing on them): one computation, two paths."""
    model, _ = trained
    batch = regenerated_batch(target, num_rows=1, seed=3)
    for anchor in (4, 9, 15):
        ids = batch.input_ids_BT[0, :anchor + 1].tolist()
        taps = target_features(target, torch.tensor([ids]), model.target_taps).taps
        drafter = DSparkDrafter(model)
        drafter.begin([], {t: h[0, :anchor] for t, h in taps.items()})
        tokens, probs_KV, conf_K = drafter.walk(ids[-1], 0.0, None)
        full_1T = torch.tensor([ids + tokens])
        taps = target_features(target, full_1T, model.target_taps).taps
        anchors_BA = torch.tensor([[anchor]])
        with torch.no_grad():
            hidden_GE = block_states(model, full_1T, torch.ones_like(full_1T), taps, anchors_BA)[0, 0]
            embedded_Gr = model.markov_head.markov_w1(full_1T[0, anchor:anchor + TINY.block_size])
            logits_GX = model.logits(hidden_GE) + model.markov_head(embedded_Gr)
            conf_G = model.confidence_head(hidden_GE, embedded_Gr).sigmoid()
        torch.testing.assert_close(probs_KV, logits_GX.float().softmax(-1), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(conf_K, conf_G.float(), rtol=1e-4, atol=1e-5)
        assert tokens == logits_GX.argmax(-1).tolist()


# ---- the speculative loop


@pytest.mark.parametrize("depth, threshold", [(None, 0.0), (2, 0.0), (None, 0.5)])
def test_greedy_identity(target, trained, vanilla_runs, depth, threshold):
    model, _ = trained
    model = DSparkModel(replace(TINY, verify_threshold=threshold), target)
    model.load_state_dict(trained[0].state_dict())
    drafter = DSparkDrafter(model.eval(), TreeSpec(mode="block", depth=depth))
    assert drafter.max_draft_nodes == (depth or TINY.block_size)  # all G slots draft
    prompts, expected = zip(*vanilla_runs)
    assert assert_greedy_identity(target, drafter, prompts, expected) > 0


def test_the_confidence_product_sets_the_verification_length(target, trained):
    model = DSparkModel(replace(TINY, verify_threshold=0.4), target)
    drafter = DSparkDrafter(model)
    assert drafter.verify_length(torch.tensor([0.9, 0.5, 0.9, 0.9])) == 3  # products 0.9, 0.45, 0.405, 0.3645
    assert drafter.verify_length(torch.tensor([0.9, 0.3, 0.9, 0.9])) == 1  # 0.27 < 0.4 at the second
    assert drafter.verify_length(torch.tensor([0.1, 0.9, 0.9, 0.9])) == 1  # at least one token is verified
    model, _ = trained
    drafter = DSparkDrafter(model)
    drafter.begin([1, 2], {t: torch.zeros(2, 32) for t in model.target_taps})
    tree = drafter.propose(5, [1, 2, 5], 0.0, None)
    conf_K = drafter.walk(5, 0.0, None)[2]
    torch.testing.assert_close(tree.scores_N[1:], conf_K.cumprod(0))  # node values: confidence products


def test_tree_modes_other_than_block_are_refused(trained):
    model, _ = trained
    with pytest.raises(ConfigError, match="DSpark drafter drafts one of"):
        DSparkDrafter(model, TreeSpec(mode="ddtree"))
    with pytest.raises(ConfigError, match="tree.depth=5: a block of block_size=4 drafts at most 4 positions"):
        DSparkDrafter(model, TreeSpec(mode="block", depth=5))


def test_sampled_chain_keeps_the_rows_it_drew_from(trained):
    model, _ = trained
    drafter = DSparkDrafter(model)
    drafter.begin([1, 2], {t: torch.zeros(2, 32) for t in model.target_taps})
    tree = drafter.propose(5, [1, 2, 5], 0.8, torch.Generator().manual_seed(0))
    assert tree.sampled and tree.num_nodes == TINY.block_size + 1
    torch.testing.assert_close(tree.draft_probs_NV[1:].sum(-1), torch.ones(TINY.block_size))


def test_sampled_output_follows_the_target(target, trained):
    """Lossless at T > 0: the first two tokens of seeded speculative runs follow the target's exact distribution;
    a drafter that reports q rows other than those it drew from fails the same test (the test's power)."""
    model, _ = trained
    prompt = [3, 17, 40]
    assert sampled_two_token_pvalue(target, lambda: DSparkDrafter(model), prompt, 300) > 1e-3

    class WrongRows(DSparkDrafter):
        def walk(self, root_token, temperature, generator):
            tokens, probs_KV, conf_K = super().walk(root_token, temperature, generator)
            return tokens, (probs_KV + 0.5 * probs_KV.mean(0)).softmax(-1), conf_K  # not what it drew from

    assert sampled_two_token_pvalue(target, lambda: WrongRows(model), prompt, 300) < 1e-3


# ---- checkpoints


def test_save_load_roundtrip(tmp_path, target, trained):
    model, _ = trained
    directory = save_drafter(model, tmp_path / "ckpt", "tiny-target")
    loaded = load_model(directory, target)
    assert isinstance(loaded, DSparkModel) and loaded.config == model.config
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    drafter = load_drafter(directory, target)
    assert drafter.name == "dspark" and drafter.tree.mode == "block" and drafter.max_draft_nodes == TINY.block_size
    with pytest.raises(ConfigError, match="a DSpark drafter drafts one of"):
        load_drafter(directory, target, tree={"mode": "ddtree"})
