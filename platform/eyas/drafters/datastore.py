"""A datastore for retrieval drafting (REST, He et al. 2024; SuffixDecoding, Oliaro et al. 2024): what followed the
current context's last n tokens in text the target wrote before.

Prompt lookup (``eyas.drafters.ngram``) copies from the request's own context; a datastore adds every earlier
continuation of that n-gram in a token corpus, best the target's own regenerated answers (a data set of
``jobs.generate_data``): the target repeats its own phrasing across requests (``def``, ``for i in range(len(``,
``Here is``), and greedy decoding accepts exactly what it would have written.

The index is one sorted array of n-gram hashes per n, so a lookup is a binary search (no suffix tree in Python):
``max_ngram`` down to ``min_ngram``, the longest suffix with any match wins, and its ``max_matches`` latest
occurrences give the continuations. Hash hits are checked against the tokens, so a collision never drafts.

Shape legend (docs/SHAPES.md): T corpus tokens, K a continuation's positions (a drafted chain's length); this file
adds M (occurrences of the suffix read) and U (distinct continuations among them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

SEPARATOR = -1        # between sequences: no n-gram and no continuation crosses it
_HASH_BASE = 1_000_003


@dataclass(frozen=True)
class DatastoreConfig:
    max_ngram: int = 8      # longest context suffix looked up
    min_ngram: int = 2      # shortest; 1-token suffixes match almost anywhere and draft noise
    max_matches: int = 256  # latest occurrences of the suffix read per lookup (their continuations are counted)

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"min_ngram={self.min_ngram}, max_ngram={self.max_ngram}: need 1 <= min <= max")
        if self.max_matches < 1:
            raise ValueError(f"max_matches={self.max_matches}: must be >= 1")


def _hashes(tokens_T: np.ndarray, n: int) -> np.ndarray:
    """The hash of the n-gram starting at each position (wrapping int64 arithmetic)."""
    num = max(len(tokens_T) - n + 1, 0)
    keys = np.zeros(num, dtype=np.int64)
    with np.errstate(over="ignore"):
        for j in range(n):
            keys = keys * _HASH_BASE + (tokens_T[j:j + num] + 2)
    return keys


def _index_keys(tokens_T: np.ndarray, n: int) -> np.ndarray:
    """``_hashes`` of the n-grams a lookup may find; -1 for the rest: those that cross a separator or that nothing
    follows (the separator is next)."""
    keys = _hashes(tokens_T[:-1], n)  # the corpus ends with a separator: no n-gram there has a continuation
    useless = np.zeros(len(keys), dtype=bool)
    for j in range(n + 1):
        useless |= tokens_T[j:j + len(keys)] == SEPARATOR
    keys[useless] = -1
    return keys


class Datastore:
    """Token sequences indexed by their n-grams; read-only once built, so drafters of every row share one."""

    def __init__(self, sequences: Sequence[Sequence[int]], config: DatastoreConfig = DatastoreConfig(),
                 source: str = "") -> None:
        self.config = config
        self.source = source
        parts = []
        for sequence in sequences:
            parts += [np.asarray(sequence, dtype=np.int64), np.array([SEPARATOR], dtype=np.int64)]
        self.tokens_T = np.concatenate(parts) if parts else np.array([SEPARATOR], dtype=np.int64)
        self.num_sequences = len(sequences)
        self._index: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for n in range(config.min_ngram, config.max_ngram + 1):
            keys = _index_keys(self.tokens_T, n)
            order = np.argsort(keys, kind="stable")  # equal keys stay in corpus order: the latest is last
            self._index[n] = (keys[order], order)

    @property
    def num_tokens(self) -> int:
        return int((self.tokens_T != SEPARATOR).sum())

    @property
    def max_token_id(self) -> int:
        return int(self.tokens_T.max())

    def continuations(self, context: Sequence[int], depth: int) -> tuple[list[list[int]], list[int]]:
        """The distinct continuations (up to ``depth`` tokens) after the latest ``max_matches`` occurrences of the
        longest matching context suffix, and how many occurrences each follows; most frequent first (ties: the
        latest first)."""
        for n, key in self._suffix_keys(context):
            keys, order = self._index[n]
            lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
            if hi == lo:
                continue
            starts = order[max(lo, hi - self.config.max_matches):hi][::-1]  # latest first
            gram = np.asarray(context[len(context) - n:], dtype=np.int64)
            starts = starts[(self.tokens_T[starts[:, None] + np.arange(n)] == gram).all(axis=1)]
            if not len(starts):
                continue  # only a hash collision: no drafts from it
            window_MK = self.tokens_T[np.minimum(starts[:, None] + n + np.arange(depth), len(self.tokens_T) - 1)]
            window_MK[np.cumsum(window_MK == SEPARATOR, axis=1) > 0] = SEPARATOR  # cut at the sequence's end
            distinct_UK, first_U, count_U = np.unique(window_MK, axis=0, return_index=True, return_counts=True)
            ranked = sorted(range(len(first_U)), key=lambda u: (-count_U[u], first_U[u]))
            paths = [[t for t in distinct_UK[u].tolist() if t != SEPARATOR] for u in ranked]
            return paths, [int(count_U[u]) for u in ranked]
        return [], []

    def _suffix_keys(self, context: Sequence[int]) -> list[tuple[int, int]]:
        """(n, hash of the context's last n tokens), longest first: the index's ``_hashes`` in Python integers
        (a lookup per drafted tree: numpy's per-call overhead on 8-token arrays cost ~1 ms a cycle)."""
        top = min(self.config.max_ngram, len(context))
        keys, key, power = [], 0, 1
        for n in range(1, top + 1):
            key = (key + (context[-n] + 2) * power) % 2**64
            power = power * _HASH_BASE % 2**64
            if n >= self.config.min_ngram:
                keys.append((n, key - 2**64 if key >= 2**63 else key))
        return keys[::-1]
