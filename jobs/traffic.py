"""The traffic jobs.load sends: its prompts, and the order of a run's rounds over passes, concurrency levels and
modes.

The prompts: ``--prompts-file`` (one ``{"prompt": ...}`` a line), else ``--num-prompts`` held-out prompts of
``--suite``: ``code``, ``prose`` or ``all`` (the stdlib/pydoc corpus), ``humaneval``, or ``chat``: held-out ShareGPT
first turns rendered by the target's chat template and sent as their token ids, as jobs.bench's chat suite runs
them (the template wrote the special tokens; with ``--endpoint`` give ``--target`` for the template). Completion
prompts keep their last ``--max-prompt-chars`` characters; chat prompts over ``--max-prompt-tokens`` tokens are
skipped, not cut (the assistant header ends them).

``--passes N`` sends the same traffic N times, every level of it in each pass, and reports each pass on rows of its
own (``pass``: 1..N), each compared with vanilla's rows of the same pass. What it shows: a replica that drafts from
its earlier answers (the ``suffix`` proposer with ``share_answers``: docs/serving.md) drafts more in pass 2 than in
pass 1, and with sharing off every pass drafts alike. So that pass 1 meets the traffic first, the warm-up sends a
prompt of its own, and at the first level of the first pass spec runs before vanilla (whose answers, on the same
replica, enter the same index); later levels of pass 1 already find the earlier levels' answers to the same prompts
(measure one level to see a clean first pass).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from eyas import corpus, datasets
from eyas.config import ConfigError
from eyas.methods import resolve_checkpoint
from eyas.models import load_tokenizer
from jobs.bench_inputs import prompts_file

SUITES = ("code", "prose", "all", "chat", "humaneval")
MODES = ("spec", "vanilla")


def concurrency_levels(args: argparse.Namespace) -> list[int]:
    """--concurrency's levels (with --passes checked too)."""
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        raise ConfigError(f"--concurrency {args.concurrency!r}: give positive integers like 1,4,8")
    if args.passes < 1:
        raise ConfigError(f"--passes {args.passes}: give at least 1")
    return levels


def traffic_prompts(args: argparse.Namespace, target: str | None) -> list[str | list[int]]:
    """The prompts every pass sends (the module docstring says which): texts, or a chat prompt's token ids."""
    if args.prompts_file:
        prompts = prompts_file(Path(args.prompts_file))[:args.num_prompts]
    elif args.suite == "chat":
        if not target:
            raise ConfigError("--suite chat renders ShareGPT prompts with the target's chat template: give --target")
        tokenizer = load_tokenizer(resolve_checkpoint(target, "target"))
        return [ids for _, ids in datasets.chat_prompt_ids("heldout", args.num_prompts, tokenizer,
                                                            args.max_prompt_tokens)]
    elif args.suite == "humaneval":
        prompts = datasets.humaneval_prompts(args.num_prompts)
    else:
        prompts = corpus.heldout_prompts(args.suite, args.num_prompts)
    return [p[-args.max_prompt_chars:] for p in prompts]


def rounds(levels: list[int], passes: int) -> list[tuple[int, int, str]]:
    """(pass, concurrency, mode) in the order they run: passes outermost, then levels; at each level spec and
    vanilla alternate, in an order that rotates with level and pass, spec first at the first level of pass 1."""
    order = []
    for p in range(1, passes + 1):
        for n, concurrency in enumerate(levels):
            modes = MODES if (n + p - 1) % 2 == 0 else MODES[::-1]
            order += [(p, concurrency, mode) for mode in modes]
    return order
