"""The drafter recipe's options, each a config key: EAGLE-3's last-layer tap, step-0 loss on prompt positions,
selected-index unrolling (the TTT steps computed only where they are read), ttt_steps / step_decay; the head lr
multiplier (0 = frozen head); DFlash's block size, loss decay, anchors and layers."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eyas.config import ConfigError, from_dict
from eyas.drafters.dflash import DFlashConfig
from eyas.drafters.eagle import selected_indices, shift_left, step_mask, unroll, unroll_selected
from eyas.drafters.eagle3 import Eagle3Config, Eagle3Model
from eyas.models.features import target_features
from eyas.train.config import OptimConfig, TrainConfig
from eyas.train.data import SequenceDataset
from eyas.train.optim import build_optimizer
from eyas.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "drafters"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "golden"))
from drafter_testing import assert_greedy_identity, random_prompts, regenerated_batch, tiny_target  # noqa: E402
from golden_cases import VOCAB, build_target  # noqa: E402
from train_cases import config, write_data  # noqa: E402
from eyas.decoding.generate import generate  # noqa: E402
from eyas.drafters.eagle_drafter import EagleDrafter  # noqa: E402
from eyas.drafters.trees import TreeSpec  # noqa: E402


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("recipe") / "data", VOCAB)


def test_selected_unroll_equals_the_full_unroll_where_it_is_read(target):
    """unroll_selected computes, at the selected indices, exactly what unroll computes there."""
    batch = regenerated_batch(target, num_rows=3)
    batch.loss_mask_BT[0, :9] = 0  # rows with different prompt lengths: a ragged selection
    batch.loss_mask_BT[1, :4] = 0
    torch.manual_seed(0)
    model = Eagle3Model(Eagle3Config(ttt_steps=3), target).eval()
    features = target_features(target, batch.input_ids_BT, model.target_taps)
    hidden_BTE = model.initial_hidden(features.taps)
    keep_BT = torch.stack([step_mask(batch, 2 + j) for j in range(3)]).amax(0)
    index_BR, kept_BR = selected_indices(keep_BT)
    with torch.no_grad():
        full = unroll(model, batch.input_ids_BT, hidden_BTE, 3)
        first_BTE, selected = unroll_selected(model, batch.input_ids_BT, hidden_BTE, 3, index_BR)
    assert torch.allclose(first_BTE, full[0][0], atol=1e-6)
    for (hidden_BTE_j, logits_BTX), (hidden_BRE, logits_BRX) in zip(full, selected):
        for b in range(3):
            rows = index_BR[b][kept_BR[b]]
            assert torch.allclose(hidden_BRE[b][kept_BR[b]], hidden_BTE_j[b, rows], atol=1e-5)
            assert torch.allclose(logits_BRX[b][kept_BR[b]], logits_BTX[b, rows], atol=1e-4)
    assert index_BR.shape[1] < batch.input_ids_BT.shape[1]  # the prompt of row 0 is skipped


def test_selected_indices():
    index_BR, kept_BR = selected_indices(torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0]]))
    assert index_BR.tolist() == [[1, 2], [0, 1]] and kept_BR.tolist() == [[True, True], [True, False]]


def test_last_layer_tap_fuses_the_final_state_and_stays_lossless(target):
    model = Eagle3Model(Eagle3Config(taps=(1, 2), last_layer_tap=True, ttt_steps=2), target)
    L = target.config.num_layers
    assert model.target_taps == (1, 2, L) and model.fc.in_features == 3 * target.config.hidden_size
    assert Eagle3Model(Eagle3Config(taps=(1, L), last_layer_tap=True), target).target_taps == (1, L)
    batch = regenerated_batch(target, num_rows=4)
    loss, metrics = model.training_loss(batch, target_features(target, batch.input_ids_BT, model.target_taps))
    loss.backward()
    assert model.fc.weight.grad[:, 2 * target.config.hidden_size:].abs().sum() > 0  # the last tap is read
    prompts = random_prompts(4)
    vanilla = [generate(target, p, 40).token_ids for p in prompts]
    assert_greedy_identity(target, EagleDrafter(model.eval(), TreeSpec(mode="chain", depth=3)), prompts, vanilla)


def test_prompt_loss_adds_step_zero_ce_on_prompt_positions(target):
    batch = regenerated_batch(target, num_rows=4)
    batch.loss_mask_BT[:, :8] = 0  # an 8-token prompt
    torch.manual_seed(1)
    base = Eagle3Model(Eagle3Config(ttt_steps=2, loss_target="argmax"), target)
    weighted = Eagle3Model(Eagle3Config(ttt_steps=2, prompt_loss_weight=0.5, loss_target="argmax"), target)
    weighted.load_state_dict(base.state_dict())
    features = target_features(target, batch.input_ids_BT, base.target_taps)
    loss, metrics = base.training_loss(batch, features)
    loss_w, metrics_w = weighted.training_loss(batch, features)
    assert "prompt_ce" not in metrics and metrics_w["acc_1"] == metrics["acc_1"]  # acc stays on the response
    assert float(loss_w.detach()) == pytest.approx(float(loss.detach()) + 0.5 * metrics_w["prompt_ce"], rel=1e-5)
    # by hand: step 0 over every index, CE against the target argmax one ahead, at prompt positions 0..5
    with torch.no_grad():
        logits_BTX = unroll(weighted, batch.input_ids_BT, weighted.initial_hidden(features.taps), 1)[0][1]
    labels_BT = shift_left(features.argmax_BT, 1)
    ce = torch.nn.functional.cross_entropy(logits_BTX[:, :6].flatten(0, 1).float(), labels_BT[:, :6].flatten())
    assert metrics_w["prompt_ce"] == pytest.approx(float(ce), rel=1e-4)
    with pytest.raises(ConfigError, match="prompt_loss_weight"):
        Eagle3Config(prompt_loss_weight=-1.0)


@pytest.mark.parametrize("multiplier", [0.0, 0.25])
def test_head_lr_multiplier_scales_or_freezes_the_head(data_dir, multiplier):
    cfg = config("eagle3", Path("unused-target"), data_dir)
    cfg = replace(cfg, optim=replace(cfg.optim, head_lr_multiplier=multiplier))
    trainer = Trainer(cfg, build_target(), SequenceDataset(data_dir, "train", cfg.train.max_len))
    head_before = trainer.drafter.lm_head.weight.detach().clone()
    fc_before = trainer.drafter.fc.weight.detach().clone()
    for batch in trainer.batches(0):
        trainer.train_step(batch)
    assert not torch.equal(trainer.drafter.fc.weight, fc_before)
    assert torch.equal(trainer.drafter.lm_head.weight, head_before) == (multiplier == 0)
    groups = trainer.strategy.optimizer.param_groups
    head_lrs = {g["lr"] / groups[0]["lr"] for g in groups if any(p is trainer.drafter.lm_head.weight
                                                                 for p in g["params"])}
    assert head_lrs == (set() if multiplier == 0 else {multiplier})


def test_head_lr_multiplier_needs_a_head_of_its_own(target):
    from eyas.drafters.eagle1 import Eagle1Config, Eagle1Model

    model = Eagle1Model(Eagle1Config(), target)  # reads the target's frozen head
    with pytest.raises(ConfigError, match="has no trainable LM head"):
        build_optimizer(model, OptimConfig(head_lr_multiplier=0.5))
    with pytest.raises(ConfigError, match="optim.head_lr_multiplier"):
        OptimConfig(head_lr_multiplier=-0.1)


@pytest.mark.parametrize("option", [{"ttt_steps": 2, "step_decay": 0.5}, {"ttt_steps": 4, "step_decay": 1.0}])
def test_ttt_steps_and_step_decay_weight_the_unrolled_steps(target, option):
    batch = regenerated_batch(target, num_rows=4)
    torch.manual_seed(2)
    model = Eagle3Model(Eagle3Config(**option), target)
    loss, metrics = model.training_loss(batch, target_features(target, batch.input_ids_BT, model.target_taps))
    assert sorted(k for k in metrics if k.startswith("ce_")) == [f"ce_{j + 1}" for j in range(option["ttt_steps"])]
    expected = sum(option["step_decay"] ** j * metrics[f"ce_{j + 1}"] for j in range(option["ttt_steps"]))
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("block_size", [4, 6, 8])
def test_dflash_recipe_keys_train(data_dir, block_size):
    """block size 4-8, loss decay, anchors per sequence and layers are config keys a training run takes."""
    cfg = config("dflash", Path("unused-target"), data_dir)
    options = {**cfg.drafter.config, "block_size": block_size, "loss_decay": 3.0, "num_anchors": 5, "num_layers": 2}
    cfg = replace(cfg, drafter=replace(cfg.drafter, config=options))
    trainer = Trainer(cfg, build_target(), SequenceDataset(data_dir, "train", cfg.train.max_len))
    metrics = trainer.train_step(next(trainer.batches(0)))
    model = trainer.drafter
    assert model.block_size == block_size and len(model.layers) == 2 and model.config.loss_decay == 3.0
    assert f"acc_{block_size - 1}" in metrics and f"acc_{block_size}" not in metrics
    assert metrics["num_blocks"] <= 5 * cfg.train.batch_size
    with pytest.raises(ConfigError, match="dflash.block_size"):
        DFlashConfig(block_size=1)
    raw = {"name": "x", "drafter": {"type": "eagle3", "config": {"prompt_loss_weight": 0.3}},
           "optim": {"head_lr_multiplier": 0.0}}
    assert from_dict(TrainConfig, raw).optim.head_lr_multiplier == 0.0


def test_per_suite_evaluation_keys_validate():
    from eyas.train.config import LoopConfig, MeasureConfig

    assert LoopConfig(heldout_data={"code": "data-smollm2-code", "chat": "data-smollm2-draft"}).heldout_data
    with pytest.raises(ConfigError, match="train.heldout_data='code-x'"):
        LoopConfig(heldout_data={"code-x": "data"})
    assert MeasureConfig(suite="docstring, chat").suite == "docstring, chat"
    with pytest.raises(ConfigError, match="measure.suite='humaneval'"):  # the bench's suite: never tuned on
        MeasureConfig(suite="humaneval")
    with pytest.raises(ConfigError, match="train.epoch_steps"):
        LoopConfig(epoch_steps=0)
