"""One live sequence's state in the speculative engine (eyas.decoding.engine): its cache length, what it emitted and
has not yet reported, its drafter and the committed tokens the drafter has not seen, its stats and how it ended."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from eyas.decoding.logits import TokenLogprob
from eyas.decoding.requests import SequenceRequest
from eyas.decoding.stats import SpecStats


@dataclass
class Row:
    request: SequenceRequest
    length: int = 0  # cache slots of this row holding committed tokens
    out: list[int] = field(default_factory=list)  # emitted tokens
    new: list[int] = field(default_factory=list)  # emitted this step, not yet reported
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, when the request asked (leader only)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # not yet reported (leader only)
    drafter: Any = None
    begun: bool = False  # the drafter's begin ran; until then the prompt waits in ``behind`` like any commit
    # committed tokens the drafter has not seen, per cycle: (tokens, taps {layer: hidden_BTE}, row b, node indices)
    behind: list[tuple[list[int], dict[int, torch.Tensor], int, list[int]]] = field(default_factory=list)
    generator: torch.Generator | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    cycles: list[tuple[int, int, int]] = field(default_factory=list)  # not yet reported
    finish_reason: str | None = None
    error: str | None = None  # why the leader failed this request (finish_reason "error")
    cached_tokens: int | None = None  # prompt tokens the prefix cache supplied; reported once, in the first output
    decode_bits: bool = False  # every forward so far gave its tokens a decode step's bits (its K/V may be kept)
