"""Every trainable registry family learns through the shared Ray-free step: the loss falls on a fixed batch of the
target's own continuations, and held-out evaluation reports acc_1..acc_K and the simulated acceptance length."""
from __future__ import annotations

import random

import pytest
import torch

from eyas.drafters import registry
from eyas.models import Decoder, ModelConfig
from eyas.decoding.generate import generate
from eyas.train.config import OptimConfig
from eyas.train.data import collate, response_row, token_counts
from eyas.models.features import target_features
from eyas.train.optim import build_optimizer, build_scheduler
from eyas.train.step import LossModule, evaluate, train_step

SMALL = {  # fields over each family's defaults, sized for a 6-layer hidden-32 target
    "eagle1": {"metric_steps": 3},
    "eagle3": {"ttt_steps": 3, "draft_vocab_size": 48},
    "medusa": {"num_heads": 3},
    "dflash": {"num_layers": 1, "block_size": 4, "num_taps": 2, "num_anchors": 8},
    "dspark": {"num_layers": 1, "block_size": 4, "num_taps": 2, "num_anchors": 8, "markov_rank": 16},
    "dflash2": {"num_layers": 1, "block_size": 4, "num_taps": 2, "num_anchors": 8, "selector_rank": 16,
                "selector_top_k": 8},
    "eagle3.1": {"ttt_steps": 3, "draft_vocab_size": 48},
    "peagle": {"num_depths": 3, "draft_vocab_size": 48},
}
TRAINABLE = sorted(name for name, family in registry.FAMILIES.items() if family.build_model is not None)


@pytest.fixture(scope="module")
def target() -> Decoder:
    torch.manual_seed(0)
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=6,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
    target = Decoder(config).eval().requires_grad_(False)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # sharper: greedy continuations repeat, so they can be learned
    return target


@pytest.fixture(scope="module")
def rows(target):
    rng = random.Random(0)
    out = []
    for _ in range(6):
        prompt = [rng.randrange(64) for _ in range(rng.randrange(3, 8))]
        out.append(response_row(prompt, generate(target, prompt, 20).token_ids))
    return out


def test_families_are_covered():
    assert {"eagle1", "eagle3", "medusa"} <= set(TRAINABLE)
    assert set(TRAINABLE) <= set(SMALL), f"add a small config for {set(TRAINABLE) - set(SMALL)}"


@pytest.mark.parametrize("family", TRAINABLE)
def test_loss_falls(family, target, rows):
    torch.manual_seed(0)
    counts_V = token_counts(rows, target.config.vocab_size)
    drafter = registry.build_model(family, SMALL[family], target, token_counts_V=counts_V)
    batch = collate(rows, max_len=64)
    features = target_features(target, batch.input_ids_BT, drafter.target_taps)
    model = LossModule(drafter)
    optim = OptimConfig(lr=1e-2, warmup_steps=2)
    optimizer = build_optimizer(model, optim)
    scheduler = build_scheduler(optimizer, optim, total_steps=30)
    losses = []
    for step in range(30):
        torch.manual_seed(step)  # as jobs.train_drafter seeds each step (random anchors, feature noise)
        losses.append(train_step(model, batch, features, optimizer, scheduler, grad_clip=1.0)["loss"])
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    metrics = evaluate(drafter, [(batch, features)])
    acc = [metrics[f"acc_{j}"] for j in range(1, 4) if f"acc_{j}" in metrics]
    assert acc and all(0.0 <= a <= 1.0 for a in acc)
    assert 0.0 <= metrics["sim_accept_len"] <= len([k for k in metrics if k.startswith("acc_")])
