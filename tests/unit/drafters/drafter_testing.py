"""Helpers for the EAGLE / Medusa / registry tests: a tiny random target, its regenerated data, a short training
run, and the greedy-identity check."""
from __future__ import annotations

import torch

from eyas.models import Decoder, ModelConfig
from eyas.decoding.generate import generate
from eyas.models.features import TrainBatch, target_features

TARGET_CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                            num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
PROMPT_LEN, RESPONSE_LEN = 6, 34


def tiny_target() -> Decoder:
    torch.manual_seed(0)
    target = Decoder(TARGET_CONFIG).eval().requires_grad_(False)
    with torch.no_grad():  # a sharper random model: greedy continuations repeat, so a drafter can learn them
        target.lm_head.weight.mul_(8.0)
    return target


@torch.no_grad()
def greedy_batch(target: Decoder, prompts_BT: torch.Tensor, steps: int) -> torch.Tensor:
    """Prompts followed by the target's greedy continuation."""
    B, P = prompts_BT.shape
    cache = target.new_cache(B, P + steps)
    logits_BTV, _ = target(prompts_BT, torch.arange(P).expand(B, P), cache)
    out, token_B1 = [prompts_BT], logits_BTV[:, -1].argmax(-1, keepdim=True)
    for s in range(steps):
        out.append(token_B1)
        logits_BTV, _ = target(token_B1, torch.full((B, 1), P + s), cache)
        token_B1 = logits_BTV[:, -1].argmax(-1, keepdim=True)
    return torch.cat(out, dim=1)


def regenerated_batch(target: Decoder, num_rows: int = 16, seed: int = 1) -> TrainBatch:
    """Random prompts + the target's own greedy responses (what jobs.generate_data produces); loss on responses."""
    generator = torch.Generator().manual_seed(seed)
    ids_BT = greedy_batch(target, torch.randint(0, 64, (num_rows, PROMPT_LEN), generator=generator), RESPONSE_LEN)
    loss_mask_BT = torch.zeros_like(ids_BT, dtype=torch.float32)
    loss_mask_BT[:, PROMPT_LEN:] = 1
    return TrainBatch(ids_BT, loss_mask_BT, torch.ones_like(loss_mask_BT))


def train(model, batch: TrainBatch, target: Decoder, num_steps: int = 30, lr: float = 3e-3) -> list[dict]:
    """A plain AdamW loop; returns the metrics of every step."""
    features = target_features(target, batch.input_ids_BT, model.target_taps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    history = []
    for _ in range(num_steps):
        loss, metrics = model.training_loss(batch, features)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append(metrics)
    return history


def random_prompts(num_prompts: int = 20, seed: int = 7) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 10, (num_prompts,), generator=generator).tolist()
    return [torch.randint(0, 64, (n,), generator=generator).tolist() for n in lengths]


def assert_greedy_identity(target: Decoder, drafter, prompts: list[list[int]], expected: list[list[int]],
                           max_new_tokens: int = 40) -> int:
    """generate(drafter) == vanilla, token for token, on every prompt; returns the drafted tokens accepted."""
    accepted = 0
    for prompt, want in zip(prompts, expected):
        result = generate(target, prompt, max_new_tokens, drafter=drafter)
        assert result.token_ids == want, f"prompt {prompt}: {result.token_ids} != vanilla {want}"
        accepted += sum(result.stats.accepted_per_cycle)
    return accepted
