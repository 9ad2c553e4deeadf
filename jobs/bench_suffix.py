"""The suffix index's cost (eyas.drafters.suffix): memory per indexed token and time per lookup, on real text.

    python -m jobs.bench_suffix [--target PATH] [--tokens N] [--lookups N] [--max-tokens N] [--out FILE.json]

Tokenizes the embedded stdlib/pydoc corpus (eyas.corpus, train split) with the target's tokenizer, in sequences of
ANSWER_TOKENS (an answer's length), and indexes the first ``--tokens`` tokens into a shared index (``--max-tokens``: its FIFO budget, the
serving index's ``shared_answer_tokens``; default: no eviction). Memory is what the index allocated (tracemalloc)
over the tokens it holds. A lookup is one drafter cycle's work: index the context's new token, find the longest
matching suffix and build the tree (``SuffixDrafter.propose``), timed over ``--lookups`` cycles of held-out
documents read token by token (their context growing as a request's would); compare the time with a target
forward (jobs.bench's t(1), or its ``draft`` share of a cycle for the suffix method).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc

from eyas import corpus
from eyas.config import eyas_home, resolve_path
from eyas.drafters.suffix import SuffixConfig, SuffixDrafter, SuffixIndex
from eyas.files import writable_path, write_text_atomic
from eyas.models import load_tokenizer

ANSWER_TOKENS = 512


def build_index(sequences: list[list[int]], num_tokens: int, config: SuffixConfig, max_tokens: int | None
                ) -> tuple[SuffixIndex, int, float]:
    """(the index of the sequences' first ``num_tokens`` tokens, the bytes it allocated, seconds to build it)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    index, added = SuffixIndex(config.anchors, max_tokens), 0
    for sequence in sequences:
        if added >= num_tokens:
            break
        index.add(sequence[:num_tokens - added])
        added += min(len(sequence), num_tokens - added)
    seconds = time.perf_counter() - start
    allocated = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return index, allocated, seconds


def time_lookups(index: SuffixIndex, contexts: list[list[int]], num_lookups: int, config: SuffixConfig
                 ) -> tuple[list[float], int]:
    """Seconds of each drafter cycle (``propose``) over the contexts read token by token, and the drafted nodes."""
    times, drafted = [], 0
    for context in contexts:
        drafter = SuffixDrafter(config, history=index)
        drafter.begin(context[:1], {})
        for end in range(1, len(context)):
            start = time.perf_counter()
            tree = drafter.propose(context[end - 1], context[:end], 0.0, None)
            times.append(time.perf_counter() - start)
            drafted += tree.num_nodes - 1
            if len(times) == num_lookups:
                return times, drafted
    return times, drafted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(eyas_home() / "targets" / "smollm2-135m"))
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, help="the index's FIFO budget (default: none)")
    parser.add_argument("--out", default="bench_suffix.json")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(resolve_path(args.target))
    config = SuffixConfig()
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    sequences = []
    for text in corpus.train_documents():
        ids = encode(text)
        sequences += [ids[i:i + ANSWER_TOKENS] for i in range(0, len(ids), ANSWER_TOKENS)]
        if sum(map(len, sequences)) >= args.tokens:
            break
    contexts = [encode(text)[:512] for text in corpus.heldout_documents()[:40]]
    index, allocated, build_s = build_index(sequences, args.tokens, config, args.max_tokens)
    times, drafted = time_lookups(index, contexts, args.lookups, config)
    times.sort()
    result = {"indexed_tokens": index.num_tokens, "bytes": allocated,
              "bytes_per_token": round(allocated / max(index.num_tokens, 1), 1),
              "build_s": round(build_s, 3), "lookups": len(times),
              "lookup_ms": {"median": round(1e3 * times[len(times) // 2], 4),
                            "p90": round(1e3 * times[int(0.9 * len(times))], 4),
                            "mean": round(1e3 * sum(times) / len(times), 4)},
              "mean_drafted_nodes": round(drafted / len(times), 2), "config": vars(config)}
    write_text_atomic(writable_path(args.out), json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
