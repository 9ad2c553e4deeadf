"""The target's own choices outside verification: sampling settings, the first token after a prefill, stops.

Shape legend (docs/SHAPES.md): V vocab.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eyas.decoding.verify import argmax_rows, process_logits, sample


MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI's range)


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next token is chosen. The penalties and logit_bias change the logits themselves, before
    greedy's argmax or temperature / top-k / top-p (eyas.decoding.logits); logit_bias holds (token id, bias) pairs."""
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN passes a plain "< 0" check
            raise ValueError(f"temperature={self.temperature}: must be a finite number >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise ValueError(f"{name}={value}: must be in [-{MAX_PENALTY}, {MAX_PENALTY}]")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        tokens = [t for t, _ in self.logit_bias]
        if len(set(tokens)) != len(tokens) or any(t < 0 for t in tokens):
            raise ValueError(f"logit_bias={self.logit_bias}: token ids must be distinct and >= 0")
        if not all(math.isfinite(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias):
            raise ValueError(f"logit_bias={self.logit_bias}: biases must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit_bias: the logits are changed before any choice (eyas.decoding.logits)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


def make_generator(sampling: SamplingParams, device: torch.device) -> torch.Generator | None:
    if sampling.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(sampling.seed if sampling.seed is not None else int(torch.seed() % 2**63))
    return generator


def pick_token(logits_V: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    """The target's own choice: argmax, or a sample from its processed distribution."""
    if sampling.greedy:
        return int(argmax_rows(logits_V[None])[0])
    probs_1V = process_logits(logits_V[None].float(), sampling.temperature, sampling.top_p, sampling.top_k)
    return int(sample(probs_1V[0], generator))


def truncate_at_stop(tokens: list[int], eos_token_ids: set[int], budget: int) -> tuple[list[int], bool]:
    """Keep tokens up to and including the first stop token, and at most ``budget`` of them."""
    for i, token in enumerate(tokens[:budget]):
        if token in eos_token_ids:
            return tokens[: i + 1], True
    return tokens[:budget], False
