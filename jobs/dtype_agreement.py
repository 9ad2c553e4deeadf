"""Greedy speculative output against greedy vanilla output, token for token, per dtype.

    python -m jobs.dtype_agreement [--target PATH] [--dtypes float32,bfloat16] [--methods ngram,eagle3]
        [--suite code|prose|chat|humaneval] [--num-prompts N] [--max-new-tokens N] [--drafters-dir DIR]
        [--out dtype_agreement.json]

In each dtype the target (and every method's drafter, which follows the target's dtype) decodes every prompt
greedily, plainly and with each method, with no EOS stop (every prompt runs the full budget). A method's output
equals vanilla's in that dtype or first differs at some token. Where the target's forward gives a verified token
the bits of a decode step (``Decoder.verify_is_exact``: CPU, one thread, eyas's panel and attention kernels, in
float32 and, where the CPU has AVX512_BF16, bfloat16) every method must equal vanilla, and a difference is a bug
(exit code 1); so must every method in float32 anywhere, as the engine promises. Elsewhere (more threads, trees of
more than 64 rows, float16, CPUs without AVX512_BF16) reduced precision runs differently shaped kernels for a verify
and a decode step, so a near-tie in the target's argmax can flip; the report counts how often, and where ("exact"
says which rows were held to equality), and each method's tokens/s in each dtype. Each dtype's vanilla output is
also set against float32's (what the dtype itself changes).
Drafters are found as jobs.bench finds them (``<drafters-dir>/<family>-<target dir name>``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from eyas import datasets
from eyas.config import ConfigError, eyas_home, resolve_path
from eyas.methods import METHODS, build_drafter
from eyas.models import DTYPES, CheckpointError, load_target, load_tokenizer, torch_dtype
from eyas.decoding.generate import generate
from eyas.files import writable_path, write_text_atomic
from eyas.threads import configure_threads, current_settings
from jobs.bench import available, spec_for


def first_difference(ours: list[int], reference: list[int]) -> int | None:
    """The first token index where two outputs differ (a shorter one differs where it ends); None if equal."""
    for index, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            return index
    return None if len(ours) == len(reference) else min(len(ours), len(reference))


def summary(differences: list[int | None]) -> dict:
    """How many outputs differ, and where they first do."""
    at = [d for d in differences if d is not None]
    return {"num_prompts": len(differences), "num_differ": len(at), "differ_rate": round(len(at) / len(differences), 3),
            "first_difference_at": at, "median_first_difference": statistics.median(at) if at else None}


def run(args: argparse.Namespace) -> dict:
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for name in dtypes:
        torch_dtype(name, "--dtypes")
    unknown = [m for m in methods if m not in METHODS or not METHODS[m].speculates]
    if unknown:
        raise ConfigError(f"--methods: {unknown} are not speculative methods; known: "
                          f"{sorted(m for m in METHODS if METHODS[m].speculates)}")
    target_path = resolve_path(args.target)
    tokenizer = load_tokenizer(target_path)
    prompts = [tokenizer.encode(p, add_special_tokens=args.suite != "chat")[:args.max_prompt_tokens]
               for p in datasets.suite_prompts(args.suite, args.num_prompts, tokenizer)]
    specs = {m: spec_for(m, args, target_path.name, {}) for m in methods}
    for method, spec in specs.items():
        why = available(method, spec, args)
        if why:
            raise ConfigError(f"{method}: {why}")
    outputs: dict[str, dict[str, list[list[int]]]] = {}
    seconds: dict[str, dict[str, float]] = {}
    exact: dict[str, dict[str, bool]] = {}
    for name in dtypes:
        target = load_target(target_path, dtype=torch_dtype(name))
        drafters = {"vanilla": None, **{m: build_drafter(target, spec) for m, spec in specs.items()}}
        outputs[name] = {m: [] for m in drafters}
        exact[name] = {m: name == "float32" or target.verify_is_exact(d.max_draft_nodes + 1)
                       for m, d in drafters.items() if d is not None}
        seconds[name] = dict.fromkeys(drafters, 0.0)
        for drafter in drafters.values():  # warm-up: first-call allocations, not timed
            generate(target, prompts[0], 4, drafter=drafter)
        for number, prompt_ids in enumerate(prompts, start=1):
            for method, drafter in drafters.items():
                start = time.perf_counter()
                outputs[name][method].append(generate(target, prompt_ids, args.max_new_tokens,
                                                      drafter=drafter).token_ids)
                seconds[name][method] += time.perf_counter() - start
            print(f"[dtype_agreement] {name}: {number}/{len(prompts)} prompts", file=sys.stderr, flush=True)
    speed = {name: {m: round(sum(map(len, outputs[name][m])) / s, 2) for m, s in per_method.items()}
             for name, per_method in seconds.items()}
    rows = []
    for name in dtypes:
        vanilla = outputs[name]["vanilla"]
        for method in methods:
            rows.append({"dtype": name, "method": method, "against": f"vanilla {name}", "exact": exact[name][method],
                         **summary([first_difference(o, v) for o, v in zip(outputs[name][method], vanilla)])})
        if name != "float32" and "float32" in outputs:
            rows.append({"dtype": name, "method": "vanilla", "against": "vanilla float32", "exact": False,
                         **summary([first_difference(o, v) for o, v in zip(vanilla, outputs["float32"]["vanilla"])])})
    return {"target": str(target_path), "suite": args.suite, "num_prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "threads": current_settings().to_dict(), "tokens_per_s": speed,
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(eyas_home() / "targets" / "tiny"))
    parser.add_argument("--dtypes", default="float32,bfloat16", help=f"of {list(DTYPES)}")
    parser.add_argument("--methods", default="ngram")
    parser.add_argument("--suite", choices=datasets.SUITES, default="code")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="cut prompts to their first N tokens")
    parser.add_argument("--drafters-dir", default=str(eyas_home() / "drafters"))
    parser.add_argument("--draft-model", default=str(eyas_home() / "targets" / "draft-tiny"), help="for draft-lm")
    parser.add_argument("--threads", type=int, help="torch threads (default: eyas.threads' policy)")
    parser.add_argument("--out", default="dtype_agreement.json")
    args = parser.parse_args(argv)
    try:
        writable_path(args.out)
        configure_threads(args.threads)
        report = run(args)
    except (ConfigError, CheckpointError, ValueError, datasets.DatasetError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    write_text_atomic(Path(args.out), json.dumps(report, indent=2) + "\n")
    print(f"{'dtype':<9} {'method':<14} {'against':<16} {'exact':>5} {'differ':>9} {'median first difference':>24}")
    for row in report["rows"]:
        print(f"{row['dtype']:<9} {row['method']:<14} {row['against']:<16} {'yes' if row['exact'] else 'no':>5} "
              f"{row['num_differ']:>3}/{row['num_prompts']:<5} {str(row['median_first_difference']):>24}")
    print(f"\ntokens/s ({report['threads']['num_threads']} threads): " + "; ".join(
        f"{name}: " + ", ".join(f"{m} {v}" for m, v in per_method.items())
        for name, per_method in report["tokens_per_s"].items()))
    broken = [r for r in report["rows"] if r["exact"] and r["num_differ"]]
    if broken:
        print(f"error: {[(r['dtype'], r['method']) for r in broken]} differ from vanilla: a bug in the engine, the "
              "drafter or the kernels (greedy speculative decoding is exact there)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
