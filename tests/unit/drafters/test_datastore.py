"""The retrieval datastore: the latest continuations of the longest context suffix it holds, as a brute-force scan
finds them; the data set reader and its errors."""
from __future__ import annotations

import random

import pytest

from eyas.config import ConfigError
from eyas.drafters.datastore import Datastore, DatastoreConfig
from eyas.methods import load_datastore
from eyas.train.data import response_row, shard_path, write_shard


def brute_force(sequences, context, depth, config):
    """The latest occurrences of the longest matching suffix, scanned sequence by sequence; their distinct
    continuations by count, then by recency."""
    for n in range(min(config.max_ngram, len(context)), config.min_ngram - 1, -1):
        suffix = list(context[len(context) - n:])
        found = []
        for sequence in sequences:
            for start in range(len(sequence) - n + 1):
                if sequence[start:start + n] == suffix and sequence[start + n:start + n + depth]:
                    found.append(tuple(sequence[start + n:start + n + depth]))
        if found:
            latest = found[::-1][:config.max_matches]
            distinct = sorted(set(latest), key=lambda c: (-latest.count(c), latest.index(c)))
            return [list(c) for c in distinct], [latest.count(c) for c in distinct]
    return [], []


@pytest.mark.parametrize("seed", range(20))
def test_continuations_match_a_brute_force_scan(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 20])  # small vocabularies: many matches, ties and sequence ends
    sequences = [[rng.randrange(vocab) for _ in range(rng.randint(0, 30))] for _ in range(rng.randint(1, 6))]
    config = DatastoreConfig(max_ngram=rng.randint(2, 5), min_ngram=rng.randint(1, 2), max_matches=rng.randint(1, 8))
    store = Datastore(sequences, config)
    for _ in range(10):
        context = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
        depth = rng.randint(1, 6)
        assert store.continuations(context, depth) == brute_force(sequences, context, depth, config)


def test_no_continuation_crosses_a_sequence_end():
    store = Datastore([[1, 2, 3], [4, 5]], DatastoreConfig(min_ngram=1))
    assert store.continuations([9, 2, 3], 4) == ([], [])        # (2, 3) ends its sequence: nothing follows it
    assert store.continuations([9, 1, 2], 4) == ([[3]], [1])    # cut at the end, never [3, 4, 5]
    assert store.continuations([3, 4], 2) == ([[5]], [1])       # (3, 4) spans two sequences: only (4,) matches
    assert store.num_tokens == 5 and store.num_sequences == 2
    assert Datastore([]).continuations([1, 2], 3) == ([], [])
    repeated = Datastore([[1, 2, 7], [1, 2, 8], [1, 2, 7, 9]], DatastoreConfig(min_ngram=1))
    assert repeated.continuations([1, 2], 1) == ([[7], [8]], [2, 1])  # counted, the most frequent first


def test_config_errors():
    for bad in ({"min_ngram": 0}, {"min_ngram": 3, "max_ngram": 2}, {"max_matches": 0}):
        with pytest.raises(ValueError):
            DatastoreConfig(**bad)


def test_load_reads_a_generated_data_set_and_checks_its_tokens(tmp_path, eyas_home):
    rows = [response_row([1, 2, 3], [4, 5, 6]), response_row([7, 8], [9, 1, 2, 3, 10])]
    write_shard(shard_path(eyas_home / "data" / "answers", "train", 0), rows)
    write_shard(shard_path(tmp_path / "more", "train", 0), [response_row([2, 3], [6])])
    store = load_datastore(["answers"], vocab_size=11)  # a name under $EYAS_HOME/data, as spec.datastore gives it
    assert store.num_sequences == 2 and store.num_tokens == 13
    assert store.continuations([0, 2, 3], 3) == ([[10], [4, 5, 6]], [1, 1])  # ties: the latest occurrence first
    both = load_datastore(["answers", tmp_path / "more"], 11)  # or a path; several are one store, in order
    assert both.num_tokens == 16 and both.continuations([0, 2, 3], 3)[0] == [[6], [10], [4, 5, 6]]
    with pytest.raises(ConfigError, match=r"spec.datastore: answers: token id 10 is outside the target's vocab"):
        load_datastore(["answers"], vocab_size=8)
    with pytest.raises(ConfigError, match=r"spec.datastore: .*missing.*no parquet shards"):
        load_datastore(["answers", "missing"], vocab_size=11)
