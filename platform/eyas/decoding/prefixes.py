"""The prefix cache: prompts' K/V (and their drafter taps) kept after prefill, so that a later prompt starting with
the same tokens copies them into its cache row instead of recomputing them.

Shape legend (docs/SHAPES.md): L layers, H kv heads, P prompt tokens, D head dim, E hidden size.

Chat traffic shares a lot: every prompt opens with the template's system turn, a conversation's next turn repeats
the whole earlier one, and clients resend the same prompt. ``SpecEngine`` asks ``longest`` for the stored prompt
sharing the most leading tokens with a joining one, copies those slots (``restore``), prefills only the rest, and
``store``s the new prompt, and, when a request finishes, its prompt and answer (``SpecEngine._keep_answer``: a
conversation's next turn starts with both). At least the prompt's last token is always prefilled, since its logits
give the first token. Entries are whole token sequences, evicted least recently used first once their tokens pass
``max_tokens``.

Exactness: a prefix's K/V are the very values its own prefill wrote, and a token's K/V depend only on the tokens
before it. The engine reuses and stores only where ``Decoder.prefill_is_exact`` holds (eyas's fused kernels, whose
prefill gives every token a decode step's bits), so a prefill split at the reuse point gives the bits of the whole
one and every output is the one without the cache (tests/unit/decoding/test_prefixes.py). torch's prefill (a fixed
thread count with prompts over ``panels.MAX_ROWS`` tokens, or a GPU) blocks its products by the prompt's length,
and a reused prefix would change the last bits of what follows: those prompts prefill in full.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from eyas.models.cache import KVCache

MIN_REUSE = 8  # shorter common prefixes are prefilled again: copying costs about what it saves


@dataclass
class Prefix:
    k_LHPD: torch.Tensor
    v_LHPD: torch.Tensor
    taps: dict[int, torch.Tensor]  # {layer: hidden_1PE}, the drafter's taps over the prompt (empty: no drafter)


def common_length(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"prefix cache of {max_tokens} tokens: give at least 1 (or no cache at all)")
        self.max_tokens = max_tokens
        self.entries: OrderedDict[tuple[int, ...], Prefix] = OrderedDict()  # least recently used first
        self.num_tokens = 0
        self.hits = 0

    def longest(self, prompt: list[int], taps: tuple[int, ...]) -> tuple[int, tuple[int, ...] | None]:
        """(tokens to reuse, the entry's key) for ``prompt``: at most len(prompt) - 1, 0 and None below MIN_REUSE.
        An entry stored without the taps asked for is no use to a drafter."""
        best, best_key = 0, None
        for key, entry in self.entries.items():
            if key[0] != prompt[0] or not set(taps) <= entry.taps.keys():
                continue
            n = min(common_length(key, prompt), len(prompt) - 1)
            if n > best:
                best, best_key = n, key
        return (best, best_key) if best >= MIN_REUSE else (0, None)

    def restore(self, key: tuple[int, ...], length: int, cache: KVCache, row: int) -> dict[int, torch.Tensor]:
        """Copy the entry's first ``length`` slots into cache row ``row`` (which then holds ``length`` slots) and
        return its taps over them."""
        entry = self.entries[key]
        self.entries.move_to_end(key)
        cache.fill_row(row, entry.k_LHPD[:, :, :length], entry.v_LHPD[:, :, :length])
        self.hits += 1
        return {layer: hidden_1PE[:, :length] for layer, hidden_1PE in entry.taps.items()}

    def store(self, prompt: list[int], cache: KVCache, row: int, taps: dict[int, torch.Tensor]) -> None:
        """Keep the prompt's slots of cache row ``row`` (right after its prefill) and its taps, evicting the least
        recently used prompts past ``max_tokens``. A prompt longer than the whole cache is not kept."""
        key = tuple(prompt)
        if len(key) > self.max_tokens:
            return
        if key in self.entries:
            self.num_tokens -= len(key)
            del self.entries[key]
        k_LHPD, v_LHPD = cache.row_slots(row, len(key))
        self.entries[key] = Prefix(k_LHPD, v_LHPD, {layer: h.clone() for layer, h in taps.items()})
        self.num_tokens += len(key)
        while self.num_tokens > self.max_tokens:
            old, _ = self.entries.popitem(last=False)
            self.num_tokens -= len(old)
