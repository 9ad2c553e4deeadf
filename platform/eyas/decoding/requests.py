"""What goes into and comes out of the speculative engine: requests, per-step outputs, the load-adaptive
speculation schedule, and the channel that carries the leader's decisions to the other tensor-parallel ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from eyas.decoding.logits import TokenLogprob
from eyas.decoding.sampling import SamplingParams
from eyas.decoding.stats import SpecStats


@dataclass(frozen=True)
class SpeculationSchedule:
    """Load-adaptive speculation: the most drafted nodes (root excluded) one sequence's tree may have per cycle,
    as a function of the batch size.

    ``max_draft_nodes_by_batch`` maps a batch size to a limit; a batch of B uses the entry with the largest key
    <= B. A limit of None keeps the drafter's full tree, 0 turns speculation off (plain decoding). Example: {1: None,
    4: 8, 8: 0} drafts full trees alone, at most 8 nodes per sequence from 4 sequences, none from 8: at high load
    the target forward is compute-bound and every rejected node costs real throughput (EAGLE-3 falls below 1x).
    """

    max_draft_nodes_by_batch: dict[int, int | None] = field(default_factory=lambda: {1: None})

    def __post_init__(self) -> None:
        table: dict[int, int | None] = {}
        for key, value in dict(self.max_draft_nodes_by_batch).items():
            size = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"speculation_by_batch: key {key!r} must be a batch size >= 1")
            limit = None if value in (None, "full") else value
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
                raise ValueError(f"speculation_by_batch[{size}]={value!r}: must be null/'full' (the drafter's "
                                 f"whole tree), 0 (no speculation) or a positive number of drafted nodes")
            table[size] = limit
        if 1 not in table:
            raise ValueError(f"speculation_by_batch {dict(self.max_draft_nodes_by_batch)} needs an entry for "
                             f"batch size 1")
        object.__setattr__(self, "max_draft_nodes_by_batch", dict(sorted(table.items())))

    def max_draft_nodes(self, batch_size: int) -> int | None:
        limit = None
        for size, value in self.max_draft_nodes_by_batch.items():
            if size > batch_size:
                break
            limit = value
        return limit


@dataclass(frozen=True)
class SequenceRequest:
    """One sequence to generate. ``logprobs``: report each emitted token's logprob and this many top alternatives
    (None: no logprobs, nothing computed); ``prompt_logprobs``: the same for the prompt's tokens (its prefill then
    computes logits over the whole prompt). Both come from the adjusted logits (eyas.decoding.logits)."""
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def check(self, vocab_size: int, max_len: int, tree_room: int) -> None:
        """A ValueError naming what is wrong: an empty prompt, token ids outside the vocabulary, no new tokens, or a
        prompt and max_new_tokens past a context of ``max_len`` slots less the ``tree_room`` a draft tree reserves."""
        name = f"request {self.request_id}"
        if not self.prompt_ids:
            raise ValueError(f"{name}: the prompt is empty; give at least one token")
        if any(not 0 <= t < vocab_size for t in self.prompt_ids):
            raise ValueError(f"{name}: prompt token ids must lie in [0, {vocab_size})")
        if any(not 0 <= t < vocab_size for t, _ in self.sampling.logit_bias):
            raise ValueError(f"{name}: logit_bias token ids must lie in [0, {vocab_size})")
        if self.max_new_tokens <= 0:
            raise ValueError(f"{name}: max_new_tokens={self.max_new_tokens} must be > 0")
        if self.max_new_tokens > max_len - len(self.prompt_ids) - tree_room:
            raise ValueError(f"{name}: prompt ({len(self.prompt_ids)} tokens) + max_new_tokens ({self.max_new_tokens}) "
                             f"exceeds the context of {max_len} tokens ({tree_room} reserved for a draft tree)")


@dataclass
class StepOutput:
    """What one step did for one sequence: tokens emitted this step (stop token included when hit)."""
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS), "length" (max_new_tokens) or "error", when finished
    stats: SpecStats | None = None  # the whole request's, when finished (leader only)
    # this step's cycles as (accepted drafted tokens, deepest judged depth, drafted nodes), so a caller that stops
    # early (a stop string, a disconnect) still knows what the sequence's cycles did; leader only
    cycles: list[tuple[int, int, int]] = field(default_factory=list)
    error: str | None = None  # why this request failed (finish_reason "error"); the rest of the batch went on
    # one per new token, when the request asked for logprobs (leader only)
    logprobs: list[TokenLogprob] | None = None
    # one per prompt token (None for the first), in the request's first output, when it asked (leader only)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # in the request's first output: how many prompt tokens came from the prefix cache instead of the prefill
    cached_prompt_tokens: int | None = None


class Channel(Protocol):
    """How the leader's decisions reach every rank: ``share(value)`` returns the leader's value on every rank."""
    is_leader: bool

    def share(self, value: Any) -> Any: ...


class LocalChannel:
    """One rank: nothing to share."""
    is_leader = True


    def share(self, value: Any) -> Any:
        return value
