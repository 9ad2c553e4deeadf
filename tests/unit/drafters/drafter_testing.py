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


@torch.no_grad()
def exact_two_token_probs(target: Decoder, prompt: list[int], temperature: float) -> dict[tuple[int, int], float]:
    """The target's exact probability of every first two sampled tokens (x1, x2) after ``prompt``."""
    def next_probs(ids: list[int]) -> torch.Tensor:
        cache = target.new_cache(1, len(ids))
        logits_1TV, _ = target(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
        return (logits_1TV[0, -1].double() / temperature).softmax(-1)
    first_V = next_probs(prompt)
    return {(x1, x2): float(first_V[x1] * p2) for x1 in range(len(first_V)) if first_V[x1] > 1e-6
            for x2, p2 in enumerate(next_probs(prompt + [x1]).tolist())}


def sampled_two_token_pvalue(target: Decoder, make_drafter, prompt: list[int], num_trials: int,
                             temperature: float = 1.0) -> float:
    """Chi-square p-value of the first two tokens of ``num_trials`` seeded speculative runs against the target's
    exact distribution (cells expecting < 5 merged): small when the drafter's q rows make verification lossy."""
    from scipy.stats import chisquare

    from eyas.decoding.generate import SamplingParams

    exact = exact_two_token_probs(target, prompt, temperature)
    counts: dict[tuple[int, int], int] = {}
    for seed in range(num_trials):
        ids = generate(target, prompt, 2, drafter=make_drafter(),
                       sampling=SamplingParams(temperature=temperature, seed=seed)).token_ids
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    cells = sorted(set(exact) | set(counts), key=lambda c: -exact.get(c, 0.0))
    big = [c for c in cells if exact.get(c, 0.0) * num_trials >= 5]
    small = [c for c in cells if c not in set(big)]
    merged = [small] if small else []
    f_exp = [exact[c] * num_trials for c in big] + [sum(exact.get(c, 0.0) for c in m) * num_trials for m in merged]
    f_obs = [counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in m) for m in merged]
    scale = sum(f_obs) / sum(f_exp)
    return float(chisquare(f_obs, [e * scale for e in f_exp]).pvalue)
