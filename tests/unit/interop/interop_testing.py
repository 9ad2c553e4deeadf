"""Tiny seeded targets and drafters for the interop tests (a Llama target for the EAGLE-3 family, a Qwen3 one with
q/k norms for the DFlash family: the engines' DFlash layers always normalise q and k)."""
from __future__ import annotations

from dataclasses import replace

import torch

from eyas.drafters import registry
from eyas.models import Decoder, ModelConfig

LLAMA = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=8,
                    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
QWEN3 = replace(LLAMA, model_type="qwen3", qk_norm=True)
EAGLE3 = {"draft_vocab_size": 40, "ttt_steps": 2}
DFLASH = {"num_layers": 2, "block_size": 4, "num_taps": 3, "mask_token_id": 5, "num_anchors": 8}
PEAGLE = {"draft_vocab_size": 40, "num_depths": 3, "num_layers": 2, "mask_token_id": 5}
DSPARK = {**DFLASH, "markov_rank": 8}
DFLASH2 = {**DFLASH, "selector_rank": 8, "selector_top_k": 6}
CONFIGS = {"eagle3": EAGLE3, "eagle3.1": EAGLE3, "peagle": PEAGLE, "dflash": DFLASH, "dspark": DSPARK,
           "dflash2": DFLASH2}
BLOCK_FAMILIES = ("dflash", "dspark", "dflash2")  # Qwen3 targets (the engines' DFlash layers normalise q and k)
PROMPTS = [[5, 9, 2], [1, 7, 3, 9, 4, 11], [60, 2, 33, 33, 8]]


def tiny(config: ModelConfig = LLAMA, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    target = Decoder(config).eval().requires_grad_(False)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # sharper: greedy continuations repeat, drafts get accepted
    return target


def drafter(drafter_type: str, target: Decoder, config: dict | None = None, seed: int = 5):
    """A fresh drafter with every weight moved off its initial value (so a round trip proves something)."""
    torch.manual_seed(seed)
    config = dict(config if config is not None else CONFIGS[drafter_type])
    vocab = [i for i in range(64) if i % 8 != 7][:config["draft_vocab_size"]] if "draft_vocab_size" in config else None
    model = registry.build_model(drafter_type, config, target, vocab)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model.eval()


class Recorder:
    """Wraps a drafter and keeps every tree it proposes."""

    def __init__(self, inner) -> None:
        self.inner, self.trees = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, *args, **kwargs):
        tree = self.inner.propose(*args, **kwargs)
        self.trees.append(tree)
        return tree
