"""What the block-drafter tests (DFlash, DSpark, DFlash2) share: a tiny target with a reserved <|mask|> id, its
regenerated data, a short training run, and the module-scoped fixtures built on them.

A test module imports the fixtures by name (``from block_testing import target, trained, vanilla_runs``) and sets
``MODEL`` (the model class) and ``TINY`` (its config); ``trained`` builds and trains ``MODEL(TINY, target)``, once
per module."""
from __future__ import annotations

import random

import pytest
import torch

from eyas.decoding.generate import generate
from eyas.models.config import ModelConfig
from eyas.models.decoder import Decoder
from eyas.models.features import TrainBatch, target_features

VOCAB, MASK_ID = 64, 63  # the last id is reserved as <|mask|>: the target never sees it in prompts


def tiny_target(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    config = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=6,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
    target = Decoder(config).eval().requires_grad_(False)
    with torch.no_grad():  # a sharper random model: greedy continuations repeat, so a drafter can learn them
        target.lm_head.weight.mul_(8.0)
    return target


def random_prompt(rng: random.Random, length: int | None = None) -> list[int]:
    return [rng.randrange(MASK_ID) for _ in range(length or rng.randrange(3, 12))]


def regenerated_batch(target: Decoder, num_rows: int = 6, prompt_len: int = 6, response_len: int = 26,
                      seed: int = 0) -> TrainBatch:
    """Prompts + the target's own greedy responses (what jobs.generate_data produces), right-padded."""
    rng = random.Random(seed)
    rows, masks = [], []
    for i in range(num_rows):
        prompt = random_prompt(rng, prompt_len - (i % 3))
        response = generate(target, prompt, response_len - i).token_ids
        rows.append(prompt + response)
        masks.append([0] * len(prompt) + [1] * len(response))
    T = max(map(len, rows))
    pad = lambda xs: xs + [0] * (T - len(xs))  # noqa: E731
    return TrainBatch(input_ids_BT=torch.tensor([pad(r) for r in rows]),
                      loss_mask_BT=torch.tensor([pad(m) for m in masks]),
                      valid_BT=torch.tensor([pad([1] * len(r)) for r in rows]))


def train(model, target: Decoder, batch: TrainBatch, steps: int, seed: int = 0) -> list[float]:
    """A plain AdamW loop over one batch; returns the loss of every step and leaves the model in eval mode."""
    features = target_features(target, batch.input_ids_BT, model.target_taps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in range(steps):
        loss, metrics = model.training_loss(batch, features, generator)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(metrics["loss"])
    model.eval()
    return losses


@pytest.fixture(scope="module")
def target() -> Decoder:
    return tiny_target()


@pytest.fixture(scope="module")
def trained(request, target) -> tuple:
    """(the module's ``MODEL(TINY, target)`` after 30 training steps, frozen; its loss per step)."""
    torch.manual_seed(1)
    model = request.module.MODEL(request.module.TINY, target)
    losses = train(model, target, regenerated_batch(target), steps=30)
    return model.requires_grad_(False), losses


@pytest.fixture(scope="module")
def vanilla_runs(target) -> list[tuple[list[int], list[int]]]:
    """20 random prompts, each with the target's plain greedy continuation of 40 tokens."""
    rng = random.Random(7)
    prompts = [random_prompt(rng) for _ in range(20)]
    return [(prompt, generate(target, prompt, 40).token_ids) for prompt in prompts]
