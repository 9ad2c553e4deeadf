"""``generate``: one sequence through the speculative engine (a batch of one; ``vanilla`` when drafter is None).

Shape legend (docs/SHAPES.md): the engine's (decoding/engine.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eyas.decoding.engine import SpecEngine
from eyas.decoding.requests import SequenceRequest
from eyas.decoding.sampling import SamplingParams
from eyas.decoding.stats import SpecStats
from eyas.decoding.tree import MAX_TREE_NODES
from eyas.models.decoder import Decoder


@dataclass
class Generation:
    token_ids: list[int]  # the new tokens, stop token included when one was hit
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str = "length"  # "stop" (EOS) or "length" (max_new_tokens)


@torch.inference_mode()
def generate(target: Decoder, prompt_ids: list[int], max_new_tokens: int, drafter=None,
             sampling: SamplingParams = SamplingParams(), eos_token_ids: tuple[int, ...] | set[int] = (),
             max_len: int | None = None) -> Generation:
    """Generate up to ``max_new_tokens`` after ``prompt_ids``; stops exactly at EOS or the budget.
    ``drafter`` is one Drafter (it holds this sequence's state); None decodes plainly."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: give at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be > 0")
    if max_len is None:  # the cache this request needs, not the whole context: zeroing 8192 slots of a 30-layer
        # cache (377 MB on smollm2) took 200 ms a call, 1.6 ms of every token of a 128-token answer
        max_len = min(target.config.max_position_embeddings, len(prompt_ids) + max_new_tokens + MAX_TREE_NODES)
    engine = SpecEngine(target, capacity=1, max_len=max_len,
                        drafter_factory=(lambda: drafter) if drafter is not None else None,
                        eos_token_ids=eos_token_ids)
    request = SequenceRequest("generate", list(prompt_ids), max_new_tokens, sampling)
    engine.check_request(request)
    token_ids, final = engine.run([request])["generate"]
    return Generation(token_ids, final.stats, final.finish_reason)
