"""Suffix drafting (SuffixDecoding, arXiv 2411.04975; papers.md section 5): find the longest suffix of the context
that occurred before, in the request's own prompt and output, the data sets of ``spec.datastore`` and (serving)
the finished answers of earlier requests, and propose a TREE of the continuations that followed it most often.

The index (``SuffixIndex``) holds token sequences in one array, separated by SEPARATOR. Instead of a suffix tree (a
Python object per node, D nodes per token) every position is chained to the previous occurrence of the same
``k``-gram for a few anchor lengths k (a hash -> latest position dict and one ``prev`` array per k). A lookup walks
the chain of the context's last k tokens, latest first, and measures how far back each occurrence matches the
context (up to ``max_match``): the occurrences with the longest match are the suffix-tree node of the longest
matching suffix. Hash collisions never draft: the match is measured on the tokens. The long anchor finds an old
long match that the short anchor's latest occurrences would miss.

The tree: the continuations (up to ``depth`` tokens, cut at a sequence's end) of those occurrences, shared prefixes
merged; a node's probability is the fraction of the occurrences that pass through it (SuffixDecoding's product of
child / parent counts). Nodes under ``min_prob`` are dropped and the ``num_nodes`` most probable kept; as the
probability never grows along a path they form a tree (``tree.from_paths``), whose ``scores_N`` are these
probabilities (root 1), the value the hybrid ranks retrieval nodes by. Candidates are deterministic (sampled=False):
verification is exact in greedy and sampling alike.

A shared index (``max_tokens``) evicts whole sequences, oldest first (FIFO), once it holds more tokens than that.

Shape legend (docs/SHAPES.md): T indexed tokens; this file adds M (occurrences of the matched suffix).
"""
from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from eyas.decoding.tree import DraftTree, from_paths

SEPARATOR = -1   # between sequences: no match and no continuation crosses it
NO_POSITION = -1
LONG_ANCHOR = 6  # the second anchor length (with min_match): a long match is found however old it is


@dataclass(frozen=True)
class SuffixConfig:
    depth: int = 8             # the deepest drafted token (tree depth cap)
    num_nodes: int = 16        # node budget (drafted nodes, root excluded)
    min_match: int = 1         # the shortest context suffix that may draft (2 drafted less on held-out code)
    max_match: int = 16        # matches are measured up to this many tokens (longer ones tie)
    min_prob: float = 0.1      # a node drafts only if at least this fraction of the occurrences pass through it
    max_occurrences: int = 64  # latest occurrences of an anchor read per source per lookup

    def __post_init__(self) -> None:
        for name in ("depth", "num_nodes", "min_match", "max_occurrences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.max_match < self.min_match:
            raise ValueError(f"max_match={self.max_match}: must be >= min_match={self.min_match}")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"min_prob={self.min_prob}: must be in [0, 1]")

    @property
    def anchors(self) -> tuple[int, ...]:
        """The anchor lengths indexed, longest first."""
        return tuple(sorted({self.min_match, max(self.min_match, min(LONG_ANCHOR, self.max_match))}, reverse=True))


class SuffixIndex:
    """Token sequences indexed by the k-grams that end at each position, for k in ``anchors``; the last sequence may
    stay open and grow (a request's context). ``max_tokens``: FIFO eviction of whole sequences past it."""

    def __init__(self, anchors: Sequence[int], max_tokens: int | None = None) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}: must be >= 1")
        self.anchors = tuple(sorted(set(anchors), reverse=True))
        self.max_tokens = max_tokens
        self.tokens_T = array("q")  # tokens_T[i] is global position base + i
        self.base = 0
        self.latest = {k: {} for k in self.anchors}  # k -> hash of a k-gram -> global position of its latest end
        self.prev = {k: array("q") for k in self.anchors}  # k -> per position: previous end of the same k-gram
        self.lengths: deque[int] = deque()  # closed sequences' lengths (separator included), oldest first
        self.open_length = 0  # tokens of the open sequence (0: none open)
        self.num_tokens = 0  # indexed tokens, separators excluded

    @property
    def end(self) -> int:
        return self.base + len(self.tokens_T)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the open sequence (opening one)."""
        for token in tokens:
            self._append(int(token))
            self.open_length += 1
            self.num_tokens += 1

    def add(self, sequence: Sequence[int]) -> None:
        """Index one whole sequence (closing the open one first), then evict the oldest past ``max_tokens``."""
        self.close()
        self.extend(sequence)
        self.close()
        while self.max_tokens is not None and self.num_tokens > self.max_tokens and self.lengths:
            self._evict_oldest()

    def close(self) -> None:
        if self.open_length:
            self._append(SEPARATOR)
            self.lengths.append(self.open_length + 1)
            self.open_length = 0

    def _append(self, token: int) -> None:
        if token < 0 and token != SEPARATOR:
            raise ValueError(f"token id {token}: token ids are >= 0")
        tokens, position = self.tokens_T, self.end
        tokens.append(token)
        for k in self.anchors:
            chain = self.prev[k]
            if token == SEPARATOR or self.open_length + 1 < k:
                chain.append(NO_POSITION)
                continue
            key = hash(tuple(tokens[len(tokens) - k:]))
            chain.append(self.latest[k].get(key, NO_POSITION))
            self.latest[k][key] = position

    def _evict_oldest(self) -> None:
        length = self.lengths.popleft()
        gone = self.tokens_T[:length]
        for k in self.anchors:
            latest = self.latest[k]
            for i in range(k - 1, length - 1):  # the k-grams ending in the evicted sequence
                key = hash(tuple(gone[i - k + 1:i + 1]))
                if latest.get(key, self.end) < self.base + length:
                    del latest[key]  # its every occurrence is gone
            del self.prev[k][:length]
        del self.tokens_T[:length]
        self.base += length
        self.num_tokens -= length - 1

    def matches(self, context: Sequence[int], config: SuffixConfig) -> tuple[int, list[int]]:
        """(m, ends): the longest match length m >= min_match (capped at max_match) of a context suffix, and the
        global positions where its occurrences end, latest first; (0, []) when none. Only occurrences that a
        token follows count (not the context's own end in an open sequence, nor a sequence's last token)."""
        for k in self.anchors:
            if len(context) < k:
                continue
            best, ends = 0, []
            position = self.latest[k].get(hash(tuple(context[len(context) - k:])), NO_POSITION)
            for _ in range(config.max_occurrences):
                if position < self.base:
                    break
                length = self._match_length(context, position, config.max_match)
                if length >= max(config.min_match, best, 1) and self._followed(position):
                    if length > best:
                        best, ends = length, []
                    ends.append(position)
                position = self.prev[k][position - self.base]
            if ends:
                return best, ends
        return 0, []

    def _followed(self, position: int) -> bool:
        """Whether a token of the same sequence follows global ``position``."""
        i = position + 1 - self.base
        return i < len(self.tokens_T) and self.tokens_T[i] != SEPARATOR

    def _match_length(self, context: Sequence[int], position: int, max_match: int) -> int:
        """How many tokens before and at global ``position`` equal the context's last ones (at most max_match)."""
        tokens, i = self.tokens_T, position - self.base
        length = 0
        while length < max_match and length < len(context) and i - length >= 0 \
                and tokens[i - length] == context[len(context) - 1 - length]:
            length += 1
        return length

    def continuation(self, end: int, depth: int) -> list[int]:
        """Up to ``depth`` tokens after global position ``end``, cut at the sequence's end."""
        start = end + 1 - self.base
        out = self.tokens_T[start:start + depth].tolist()
        return out[:out.index(SEPARATOR)] if SEPARATOR in out else out


def lookup(context: Sequence[int], sources: Sequence[SuffixIndex], config: SuffixConfig
           ) -> tuple[int, list[list[int]]]:
    """(the longest match length over all sources, the continuations of its occurrences in every source that has
    it): one suffix tree over the union of the sources' texts."""
    found = [(index, *index.matches(context, config)) for index in sources]
    best = max((length for _, length, _ in found), default=0)
    if best == 0:
        return 0, []
    return best, [index.continuation(end, config.depth) for index, length, ends in found if length == best
                  for end in ends]


def continuation_tree(root_token: int, continuations: list[list[int]], config: SuffixConfig) -> DraftTree:
    """The tree of the most frequent continuations: node probability = the share of the M continuations through
    it, those under min_prob cut, the num_nodes most probable kept."""
    if not any(continuations):
        return DraftTree(torch.tensor([root_token]), torch.tensor([-1]), torch.ones(1))
    count: dict[tuple[int, ...], int] = {}
    for path in continuations:
        for d in range(1, len(path) + 1):
            count[tuple(path[:d])] = count.get(tuple(path[:d]), 0) + 1
    floor = config.min_prob * len(continuations)
    kept = []
    for path in continuations:  # each cut before its first node under the floor (an empty one stays: its share)
        cut = next((d for d in range(1, len(path) + 1) if count[tuple(path[:d])] < floor), len(path) + 1)
        kept.append(path[:cut - 1])
    return from_paths(root_token, kept, [1.0 / len(kept)] * len(kept), max_drafted=config.num_nodes)


class SuffixDrafter:
    """Drafter protocol (base.py): a per-request index of the context, over the shared read-only ``datastore`` and
    the serving replica's ``history`` of finished answers (either may be None)."""

    name = "suffix"
    target_taps: tuple[int, ...] = ()

    def __init__(self, config: SuffixConfig = SuffixConfig(), datastore: SuffixIndex | None = None,
                 history: SuffixIndex | None = None) -> None:
        self.config = config
        self.datastore, self.history = datastore, history
        self.max_draft_nodes = config.num_nodes
        self.local = SuffixIndex(config.anchors)
        self.last_match = 0  # the match length of the last proposal (0: none), for tests and tools

    def begin(self, prompt_ids: list[int], taps: dict[int, torch.Tensor]) -> None:
        self.local = SuffixIndex(self.config.anchors)

    def propose(self, root_token: int, context_ids: list[int], temperature: float,
                generator: torch.Generator | None) -> DraftTree:
        assert len(context_ids) >= self.local.open_length, "the context only grows within a request"
        self.local.extend(context_ids[self.local.open_length:])
        sources = [index for index in (self.local, self.datastore, self.history) if index is not None]
        self.last_match, continuations = lookup(context_ids, sources, self.config)
        return continuation_tree(root_token, continuations, self.config)

    def commit(self, tokens: list[int], taps: dict[int, torch.Tensor]) -> None:
        pass
