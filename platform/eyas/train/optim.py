"""The optimizer and its schedule for drafter training: AdamW over the drafter's trainable parameters (its own LM head
at ``optim.head_lr_multiplier`` times the lr, or frozen), linear warm-up, then cosine / linear / constant."""
from __future__ import annotations

import math

import torch
from torch import nn

from eyas.config import ConfigError
from eyas.train.config import OptimConfig


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


HEAD_PREFIX = "lm_head."  # a drafter's own LM head (optim.head_lr_multiplier)


def is_head(name: str) -> bool:
    return name.startswith(HEAD_PREFIX) or f".{HEAD_PREFIX}" in name


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; matrices decay, norms and biases (1-D) do not. The drafter's own LM
    head (``lm_head.*``) runs at ``lr * optim.head_lr_multiplier``; a multiplier of 0 freezes it (requires_grad
    off, so no optimizer state and no gradient are kept for it)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if optim.head_lr_multiplier != 1.0 and not any(is_head(n) for n, _ in named):
        raise ConfigError(f"optim.head_lr_multiplier={optim.head_lr_multiplier}: {type(model).__name__} has no "
                          f"trainable LM head of its own (parameters named {HEAD_PREFIX}*); leave it at 1.0")
    if optim.head_lr_multiplier == 0:
        for name, param in named:
            if is_head(name):
                param.requires_grad_(False)
        named = [(n, p) for n, p in named if not is_head(n)]
    if not named:
        raise ValueError(f"{type(model).__name__} has no trainable parameters")
    groups = []
    for head in (False, True):
        lr = optim.lr * (optim.head_lr_multiplier if head else 1.0)
        for decays in (True, False):
            params = [p for n, p in named if is_head(n) == head and (p.ndim >= 2) == decays]
            if params:
                groups.append({"params": params, "lr": lr, "weight_decay": optim.weight_decay if decays else 0.0})
    return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas))


def lr_factor(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Multiplier of ``optim.lr`` before update ``step`` (from 0): linear warmup, then the decay schedule."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1.0 - progress
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, optim, total_steps))
