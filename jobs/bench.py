"""Side-by-side benchmark: every method on the same prompts, interleaved, in one run.

    python -m jobs.bench [--methods a,b,...] [--suite code|prose|chat|humaneval[,...]|all] [--prompts-file FILE.jsonl]
        [--num-prompts N] [--max-new-tokens N] [--target PATH] [--out bench.json] [--report results.md]
    python -m jobs.bench --from a.json[,b.json ...] [--report docs/results.md] [--update-tables README.md]

Suites (eyas.datasets.suite_prompts): code, prose (held-out stdlib/pydoc corpus), chat (held-out ShareGPT first
turns in the target's chat template; over-long ones skipped, not cut) and humaneval (code completion). ``all`` is
code + prose, plus chat + humaneval when the target is a chat model (its template opens an assistant turn), so a
self-trained base target never downloads a data set. ``--num-prompts N`` (default 8) takes the first N of each
suite: for humaneval the first N of a fixed, seeded permutation of its 164 problems (the same subset on every run).

Speedup is tokens/s over eyas ``vanilla`` on the same suite in the same run; methods run in a rotating order per
prompt so slow drifts of this machine hit all of them alike. Each speculative method's row says how many prompts it
decoded to vanilla's very tokens (``same_as_vanilla``, the "same" column; 1.00 is lossless) and whether the target's
verify was exact for its trees (``exact_verify``: ``Decoder.verify_is_exact``). Writes bench.json (DESIGN.md
schema), a figure next to it (speedup and tau per method and suite), and prints the table. ``--report`` writes a
Markdown results page too, and ``--from`` renders pages and the README's generated tables from bench.json files
already written, without measuring anything (jobs.bench_report).

The cost model (eyas.decoding.costs; off with ``--cost-repeats 0``): before the methods run, the bench measures the
target's t(N) over N new tokens (N = 1 ... 64) after a context as long as the mean prompt plus half the new tokens,
and the memory read bandwidth. Each method's row then carries its time split per cycle (draft: the drafter's
propose + commit; verify: the target forward; other: the engine's own overhead), the curve's t(N) at its mean tree
size and its predicted limit tau * t(1) / (t(N) + t_draft) next to the measured speedup; vanilla is set against
the bandwidth limit (weight bytes per decode step / read bandwidth) and against transformers ``generate()``. Every
repeated measurement reports min and median. The bench warns that the machine was busy when the samples spread
wide, or when other processes used more than half a core of ours on average from the cost model to the last method
(/proc/stat's busy time less our own CPU time; where there is no /proc/stat, a high load average).
"""
from __future__ import annotations

import argparse
import json
import platform as host
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from eyas import datasets
from eyas.config import ConfigError, eyas_home, from_dict, resolve_path
from eyas.decoding import costs
from eyas.decoding.tree import MAX_TREE_NODES
from eyas.methods import HYBRID_PROPOSERS, METHODS, SpecConfig, build_drafter
from eyas.models import CheckpointError, load_target, load_tokenizer
from eyas.models.dtypes import WEIGHT_FORMAT_DTYPES, target_dtype
from eyas.decoding.generate import generate
from eyas.decoding.stats import SpecStats
from eyas.files import writable_path, write_text_atomic
from eyas.cpu import cpu_features
from eyas.threads import configure_threads, current_settings
from eyas.train.config import SHIPPED_DRAFTERS, shipped_drafter
from jobs.bench_costs import CostMeasurement, finish_costs, measure_costs
from jobs.bench_inputs import load_prompts, spec_overrides
from jobs.bench_report import plot, print_table, write_page, write_tables
from jobs.bench_hf import HF_METHODS, HFRunner
from jobs.common import git_commit

SHIPPED = "@shipped"  # eagle3@shipped: the drafter eyas ships (serving/drafters), beside one trained in $EYAS_HOME
ALL_METHODS = ("vanilla", "hf", "hf-assisted", "hf-prompt-lookup", "ngram", "suffix", "draft-lm", "medusa", "eagle1",
               "eagle2", "eagle3", "dflash", "dflash-ddtree", "dspark", "dflash2", "eagle3.1", "peagle", "hybrid")


@dataclass
class Tally:
    seconds: float = 0.0
    new_tokens: int = 0
    num_prompts: int = 0
    num_runs: int = 0  # generate() calls, repeats included: each has one prefill, the rest are cycles
    stats: SpecStats = field(default_factory=SpecStats)
    pass_seconds: list[float] = field(default_factory=list)  # per pass over the prompts (--repeats)
    pass_tokens: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # the first pass's new tokens per prompt (eyas methods)


def machine() -> dict:
    return {"host": host.node(), "cpu": host.processor() or host.machine(), "cpu_model": cpu_features().model,
            "cpu_features": cpu_features().to_dict(),  # eyas.cpu: the kind its kernels run (avx512_bf16, ...), AMX
            "torch_threads": torch.get_num_threads(),
            "threads": current_settings().to_dict(),  # eyas.threads: policy, count and its source, OpenMP env
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}




def base_method(label: str) -> str:
    """``eagle3@shipped`` -> ``eagle3``: a bench row's method, less the suffix that picks the shipped drafter."""
    return label.removesuffix(SHIPPED)


def default_drafter(label: str, args: argparse.Namespace, target_name: str) -> str:
    """The drafter a trained method's row reads: ``<family>-<target>`` in ``--drafters-dir``; where that holds none
    and the directory is $EYAS_HOME's, the drafter eyas ships of that name; for ``<method>@shipped``, always that."""
    name = f"{METHODS[base_method(label)].family}-{target_name}"
    built = Path(args.drafters_dir) / name
    shipped = shipped_drafter(name)
    if label.endswith(SHIPPED):
        return str(shipped or SHIPPED_DRAFTERS / name)
    home = Path(args.drafters_dir) == eyas_home() / "drafters"
    return str(shipped if shipped is not None and home and not (built / "config.json").is_file() else built)


@dataclass(frozen=True)
class RowParts:
    """What a bench row runs: its proposers (a hybrid's, else the row's own method) and what they read."""
    proposers: tuple[str, ...]
    trained: tuple[str, ...]  # the proposers that read a trained drafter (spec.drafter), in order
    reads_draft_lm: bool      # a proposer reads the draft LM (spec.draft_model; hf-assisted's assistant model)


def row_parts(label: str, proposers: Sequence[str] | None = None) -> RowParts:
    """Row ``label``'s parts (a hybrid's: ``proposers``, else HYBRID_PROPOSERS), for spec_for and available()."""
    method = base_method(label)
    names = tuple(proposers or HYBRID_PROPOSERS) if method == "hybrid" else (method,)
    entries = {p: METHODS[p] for p in names if p in METHODS and p != "hybrid"}  # hybrid: the union of its parts'
    return RowParts(names, tuple(p for p, entry in entries.items() if entry.trained),
                    any("draft_model" in entry.settings for entry in entries.values()) or method == "hf-assisted")


def spec_for(label: str, args: argparse.Namespace, target_name: str, overrides: dict) -> SpecConfig:
    method = base_method(label)
    data = dict(overrides.get(method, {}))
    data["method"] = method
    if METHODS[method].trained and ("drafter" not in data or label.endswith(SHIPPED)):  # its family's drafter
        data["drafter"] = default_drafter(label, args, target_name)
    parts = row_parts(label, data.get("proposers"))
    if method == "hybrid" and parts.trained and "drafter" not in data:  # its learned proposer's family drafter
        data["drafter"] = default_drafter(parts.trained[0], args, target_name)
    if parts.reads_draft_lm and "draft_model" not in data:
        data["draft_model"] = args.draft_model
    return from_dict(SpecConfig, data, prefix="spec.")


def available(method: str, spec: SpecConfig | None, args: argparse.Namespace) -> str | None:
    """None if the method can run, else why not."""
    if method in HF_METHODS and args.dtype in WEIGHT_FORMAT_DTYPES:
        return f"transformers runs float weights: no {args.dtype} target to compare"
    entry = METHODS.get(base_method(method))
    reads_drafter = entry is not None and (entry.trained or spec.drafter is not None)
    if reads_drafter and not str(spec.drafter).startswith(("models:/", "runs:/")) and not Path(spec.drafter).is_dir():
        if method.endswith(SHIPPED):
            return f"eyas ships no drafter {Path(spec.drafter).name} (serving/drafters holds the shipped ones)"
        return f"no drafter at {spec.drafter} (train it: python -m jobs.train_drafter --config ...)"
    if row_parts(method, spec and spec.proposers).reads_draft_lm and not Path(args.draft_model).is_dir():
        return f"no draft LM at {args.draft_model} (build it: python -m jobs.train_target --config " \
               "jobs/configs/draft-<target>.yaml, e.g. draft-smollm2.yaml)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(ALL_METHODS))
    parser.add_argument("--suite", default="all", help=f"{', '.join(datasets.SUITES)} or several joined by commas "
                        "(humaneval,chat); all: code + prose, + chat + humaneval for a chat-model target")
    parser.add_argument("--prompts-file", help='JSONL with one {"prompt": "..."} per line')
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, help="cut prompts to their first N tokens")
    parser.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    parser.add_argument("--target", default=str(eyas_home() / "targets" / "smollm2-135m"),
                        help="default: the embedded target (python -m jobs.fetch_target smollm2-135m, or make demo)")
    parser.add_argument("--draft-model", default=str(eyas_home() / "targets" / "draft-smollm2"))
    parser.add_argument("--drafters-dir", default=str(eyas_home() / "drafters"))
    parser.add_argument("--spec", action="append", default=[], metavar="YAML",
                        help="a YAML with a `spec:` section (e.g. tune.sweep's best config) for its method")
    parser.add_argument("--out", default="bench.json")
    parser.add_argument("--cost-repeats", type=int, default=5,
                        help="samples per t(N) size and of the read bandwidth (0: no cost model)")
    parser.add_argument("--threads", type=int, help="torch threads (default: eyas.threads' policy)")
    parser.add_argument("--dtype", default="float32", help="the target's (and its drafters') dtype: float32, the "
                        "exact reference, or bfloat16 / float16 (docs/threads-and-dtypes.md); hf runs the same; "
                        "q8_0: the target's linear weights in GGUF's Q8_0 around float32 (no hf rows)")
    parser.add_argument("--strict", action="store_true", help="fail instead of skipping unavailable methods")
    parser.add_argument("--from", dest="sources", metavar="JSON[,JSON...]",
                        help="render these bench.json files (--report, --update-tables) instead of measuring")
    parser.add_argument("--report", metavar="PATH", help="write a Markdown results page (e.g. docs/results.md) from "
                        "--from's files, or from this run's --out")
    parser.add_argument("--update-tables", action="append", default=[], metavar="FILE",
                        help="rewrite FILE's <!-- bench-table JSON --> blocks from the JSON each one names")
    args = parser.parse_args(argv)
    try:
        if args.sources is not None:
            return render(args, [s.strip() for s in args.sources.split(",") if s.strip()])
        configure_threads(args.threads)
        writable_path(args.out)  # before the measurements, not after them
        if args.report:
            writable_path(args.report, "--report")
        report = run_bench(args)
        print_table(report)
        return render(args, [args.out]) if args.report or args.update_tables else 0
    except (ConfigError, CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def render(args: argparse.Namespace, sources: list[str]) -> int:
    """Write the results page and the generated tables (jobs.bench_report); measures nothing."""
    if not (args.report or args.update_tables):
        raise ConfigError("--from renders bench.json files: give --report PATH and/or --update-tables FILE")
    if not sources:
        raise ConfigError("--from: no bench.json named")
    written = [write_page(sources, args.report)] if args.report else []
    written += [write_tables(file) for file in args.update_tables]
    print(f"[bench] wrote {', '.join(map(str, written))}", file=sys.stderr)
    return 0


def run_bench(args: argparse.Namespace) -> dict:
    target_path = str(resolve_path(args.target))
    target_name = Path(target_path).name
    # paths as configs write them ('$EYAS_HOME/...', ~) resolve here as everywhere else
    args.draft_model, args.drafters_dir = str(resolve_path(args.draft_model)), str(resolve_path(args.drafters_dir))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if base_method(m) not in METHODS and m not in HF_METHODS]
    if unknown:
        raise ConfigError(f"--methods: unknown {unknown}; known: {list(ALL_METHODS)}, and <trained method>{SHIPPED}")
    untrained = [m for m in methods if m.endswith(SHIPPED) and not METHODS[base_method(m)].trained]
    if untrained:
        raise ConfigError(f"--methods: {untrained}: {SHIPPED} picks the shipped drafter of a trained method")
    if "vanilla" not in methods:
        methods.insert(0, "vanilla")  # speedup is relative to vanilla measured in the same run
    overrides = spec_overrides(args.spec)
    activation_dtype, weight_format = target_dtype(args.dtype, "--dtype")
    target = load_target(target_path, dtype=activation_dtype, weight_format=weight_format)
    tokenizer = load_tokenizer(target_path)
    eos = sorted(set(target.config.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None
                                                     else set()))
    drafters, skipped = {}, {}
    for method in methods:
        spec = spec_for(method, args, target_name, overrides) if base_method(method) in METHODS else None
        why = available(method, spec, args)
        if why:
            if args.strict:
                raise ConfigError(f"{method}: {why}")
            skipped[method] = why
            print(f"[bench] skipping {method}: {why}", file=sys.stderr)
            continue
        drafters[method] = (spec, build_drafter(target, spec) if spec is not None else None)
    hf = None
    if any(m in drafters for m in HF_METHODS):
        hf = HFRunner(target_path, args.draft_model if "hf-assisted" in drafters else None,
                      num_lookup=spec_for("ngram", args, target_name, overrides).setting("num_draft"),
                      dtype=target.dtype)
    # long prompts keep their first tokens: room for the new tokens and a draft tree must stay in the context
    max_prompt_tokens = min(args.max_prompt_tokens or 10**9,
                            target.config.max_position_embeddings - args.max_new_tokens - MAX_TREE_NODES)
    if max_prompt_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the target's "
                          f"context of {target.config.max_position_embeddings} tokens")
    suites = load_prompts(args, tokenizer, max_prompt_tokens)
    # a chat prompt is already rendered by the chat template, special tokens included
    encoded = {suite: [tokenizer.encode(p, add_special_tokens=suite != "chat")[:max_prompt_tokens] for p in prompts]
               for suite, prompts in suites.items()}
    cpu_start = costs.cpu_reading()  # who else used the CPU while we measured: the cost model's warnings
    cost = measure_costs(target, encoded, args) if args.cost_repeats > 0 else None
    tallies = {(m, s): Tally() for m in drafters for s in suites}
    order = list(drafters)
    total = sum(len(p) for p in suites.values()) * args.repeats
    done = 0
    for rep in range(args.repeats):
        for tally in tallies.values():
            tally.pass_seconds.append(0.0)
            tally.pass_tokens.append(0)
        for suite, prompts in encoded.items():
            for prompt_ids in prompts:
                order = order[1:] + order[:1]  # rotate: no method always runs first
                for method in order:
                    spec, drafter = drafters[method]
                    tally = tallies[(method, suite)]
                    start = time.perf_counter()
                    if method in HF_METHODS:
                        new_tokens = hf.run(method, prompt_ids, args.max_new_tokens, eos)
                    else:
                        result = generate(target, prompt_ids, args.max_new_tokens, drafter=drafter,
                                          eos_token_ids=eos)
                        new_tokens = len(result.token_ids)
                        tally.stats = tally.stats.merge(result.stats)
                        if rep == 0:
                            tally.outputs.append(result.token_ids)
                    seconds = time.perf_counter() - start
                    tally.seconds += seconds
                    tally.new_tokens += new_tokens
                    tally.pass_seconds[-1] += seconds
                    tally.pass_tokens[-1] += new_tokens
                    tally.num_runs += 1
                    tally.num_prompts += rep == 0
                done += 1
                print(f"[bench] {done}/{total} prompts", file=sys.stderr, flush=True)
    results = [result_row(method, suite, tallies, cost) for suite in suites for method in drafters]
    for row in results:  # lossless here? (a method's speedup only counts where its text is vanilla's)
        _, drafter = drafters[row["method"]]
        if drafter is not None:
            row["exact_verify"] = target.verify_is_exact(drafter.max_draft_nodes + 1)
    cost_model = finish_costs(cost, results, tallies, cpu_start, args) if cost is not None else None
    report = {"commit": git_commit(), "machine": machine(),
              "config": {"target": target_path, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
                         "repeats": args.repeats,
                         "num_prompts": args.num_prompts, "suites": list(suites), "skipped": skipped,
                         "specs": {m: (vars(s) if s else None) for m, (s, _) in drafters.items()},
                         "command": " ".join(sys.argv)},
              "results": results, "cost_model": cost_model}
    out = Path(args.out)
    write_text_atomic(out, json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    print(f"[bench] wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return report


def result_row(method: str, suite: str, tallies: dict, cost: CostMeasurement | None) -> dict:
    """One method on one suite: speed, acceptance and (for eyas methods) the cycle against the cost model."""
    t, base = tallies[(method, suite)], tallies[("vanilla", suite)]
    base_tps = base.new_tokens / base.seconds
    tps = t.new_tokens / t.seconds if t.seconds else 0.0
    speculates = base_method(method) in METHODS and METHODS[base_method(method)].speculates
    row = {"method": method, "suite": suite, "num_prompts": t.num_prompts, "new_tokens": t.new_tokens,
           "seconds": round(t.seconds, 4), "tokens_per_s": round(tps, 2), "speedup": round(tps / base_tps, 3),
           "tau": round(t.stats.tau, 3) if speculates and t.stats.tau else None,
           "per_depth_accept": [round(a, 3) for a in t.stats.per_depth_accept] if speculates else None,
           # a hybrid's acceptance per proposer and depth (SpecStats.per_proposer_accept)
           "per_proposer_accept": ({name: [round(a, 3) for a in rates]
                                    for name, rates in t.stats.per_proposer_accept.items()} or None)
           if speculates else None,
           # the share of prompts whose greedy output is vanilla's, token for token (eyas's speculative methods)
           "same_as_vanilla": (round(sum(o == v for o, v in zip(t.outputs, base.outputs)) / len(t.outputs), 3)
                               if speculates and t.outputs else None)}
    if len(t.pass_seconds) > 1:
        passes = [n / s for n, s in zip(t.pass_tokens, t.pass_seconds) if s > 0]
        row["passes_tokens_per_s"] = {"best": round(max(passes), 2),
                                      "median": round(costs.Timing(tuple(passes)).median, 2)}
    if method in HF_METHODS:  # transformers' own loop: no cycle split
        return row
    stats = t.stats
    cycles = stats.cycles if speculates else t.new_tokens - t.num_runs  # vanilla: a forward per token but the first
    mean_nodes = stats.num_draft_nodes / stats.cycles + 1 if speculates and stats.cycles else 1.0
    row.update(costs.method_costs(stats.draft_s, stats.verify_s, stats.other_s, cycles, mean_nodes,
                                  stats.tau if speculates else None, cost.curve_s() if cost else None))
    predicted = row.get("predicted_speedup")
    row["of_limit"] = round(row["speedup"] / predicted, 3) if predicted else None
    return row


if __name__ == "__main__":
    sys.exit(main())
