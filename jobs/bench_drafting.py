"""What drafting costs per speculative cycle, and where it goes: a trained drafter generates on a suite's prompts
beside its target, and the drafter's calls are timed inside those real cycles (the target's forwards between them
evict the drafter's weights from the caches, as in serving).

    python -m jobs.bench_drafting --drafter serving/drafters/eagle3-smollm2-135m [--target PATH] [--method eagle3]
        [--tree chain] [--depth 1] [--top-k K] [--num-nodes N] [--dtype bfloat16] [--suite humaneval]
        [--num-prompts 4] [--max-new-tokens 128] [--out drafting.json]

Prints and writes {"commit", "config", "cycles", "draft_ms", "verify_ms", "other_ms", "draft_share", "sections",
"trees"}: the engine's time split per cycle (``SpecStats``: draft = the drafter's catch-up and propose), the
drafter's own calls (propose, commit, begin) in ms per cycle, and each cycle's tree (tokens, scores), so that two
runs (two commits: run each with its own PYTHONPATH, alternately, under the same load) can be compared tree for tree.
The script reads only the drafter protocol (drafters/base.py) and the engine's stats, so it runs on older commits.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from eyas import datasets
from eyas.config import eyas_home, resolve_path
from eyas.decoding.generate import generate
from eyas.drafters.trees import TreeSpec
from eyas.methods import checkpoint_factory
from eyas.models import load_target, load_tokenizer, torch_dtype

SECTIONS = ("begin", "propose", "commit")


class TimedDrafter:
    """A drafter whose protocol calls are timed (perf_counter, seconds per call name) and whose trees are kept."""

    def __init__(self, drafter, seconds: dict[str, float], trees: list[dict]) -> None:
        self.drafter, self.seconds, self.trees = drafter, seconds, trees

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def _timed(self, name: str, *args):
        start = time.perf_counter()
        result = getattr(self.drafter, name)(*args)
        self.seconds[name] += time.perf_counter() - start
        return result

    def begin(self, prompt_ids, taps):
        return self._timed("begin", prompt_ids, taps)

    def commit(self, tokens, taps):
        return self._timed("commit", tokens, taps)

    def propose(self, root_token, context_ids, temperature=0.0, generator=None):
        tree = self._timed("propose", root_token, context_ids, temperature, generator)
        self.trees.append({"tokens": tree.tokens_list, "parents": tree.parents_list,
                           "scores": tree.scores_N.tolist()})
        return tree


def tree_spec(args: argparse.Namespace) -> TreeSpec | None:
    settings = {"depth": args.depth, "top_k": args.top_k, "num_nodes": args.num_nodes}
    if args.tree is None:
        return None
    return TreeSpec(mode=args.tree, **{k: v for k, v in settings.items() if v is not None})


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    target_path = str(resolve_path(args.target))
    target = load_target(target_path, dtype=torch_dtype(args.dtype, "--dtype"))
    tokenizer = load_tokenizer(target_path)
    make = checkpoint_factory(resolve_path(args.drafter), target, args.method, tree_spec(args))
    prompts = [tokenizer.encode(p) for p in datasets.suite_prompts(args.suite, args.num_prompts, tokenizer)]
    generate(target, prompts[0], 16, make())  # warm: kernels built, first-call costs paid
    seconds: dict[str, float] = defaultdict(float)
    trees: list[dict] = []
    split = {"draft": 0.0, "verify": 0.0, "other": 0.0}
    outputs = []
    for ids in prompts:
        gen = generate(target, ids, args.max_new_tokens, TimedDrafter(make(), seconds, trees))
        split["draft"] += gen.stats.draft_s
        split["verify"] += gen.stats.verify_s
        split["other"] += gen.stats.other_s
        outputs.append(gen.token_ids)
    cycles = len(trees)
    per_cycle = {name: round(1e3 * s / cycles, 3) for name, s in split.items()}
    return {"config": {**{k: str(v) for k, v in vars(args).items()}}, "cycles": cycles,
            "draft_ms": per_cycle["draft"], "verify_ms": per_cycle["verify"], "other_ms": per_cycle["other"],
            "draft_share": round(split["draft"] / sum(split.values()), 4),
            "sections": {name: round(1e3 * seconds[name] / cycles, 3) for name in SECTIONS},
            "tokens_per_cycle": round(sum(len(o) for o in outputs) / cycles, 3), "trees": trees, "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True, help="a trained drafter's checkpoint directory")
    parser.add_argument("--target", default=str(eyas_home() / "targets" / "smollm2-135m"))
    parser.add_argument("--method", default=None, help="default: the checkpoint family's own")
    parser.add_argument("--tree", default=None, help="tree mode (default: the method's tree)")
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--num-nodes", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--suite", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args(argv)
    result = run(args)
    summary = {k: v for k, v in result.items() if k not in ("trees", "outputs", "config")}
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
