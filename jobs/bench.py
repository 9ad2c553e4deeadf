"""Side-by-side benchmark: every method on the same prompts, interleaved, in one run.

    python -m jobs.bench [--methods a,b,...] [--suite code|prose|chat|humaneval|all] [--prompts-file FILE.jsonl]
        [--num-prompts N] [--max-new-tokens N] [--target PATH] [--out bench.json]

Suites (eyas.datasets.suite_prompts): code, prose (held-out stdlib/pydoc corpus), chat (held-out ShareGPT first
turns in the target's chat template; over-long ones skipped, not cut) and humaneval (code completion). ``all`` is
code + prose, plus chat + humaneval when the target is a chat model (its template opens an assistant turn), so a
self-trained base target never downloads a data set.

Speedup is tokens/s over eyas ``vanilla`` on the same suite in the same run; methods run in a rotating order per
prompt so slow drifts of this machine hit all of them alike. Writes bench.json (DESIGN.md schema), a figure next
to it (speedup and tau per method and suite), and prints the table.
"""
from __future__ import annotations

import argparse
import json
import platform as host
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import yaml

from eyas import datasets
from eyas.config import ConfigError, eyas_home, from_dict, resolve_path
from eyas.decoding.tree import MAX_TREE_NODES
from eyas.methods import METHODS, SpecConfig, build_drafter
from eyas.models import CheckpointError, load_target, load_tokenizer
from eyas.decoding.generate import generate
from eyas.decoding.stats import SpecStats
from eyas.threads import configure_threads, current_settings

# transformers' own generate() as a baseline: method -> the extra generate() arguments it runs with
HF_METHODS = {
    "hf": lambda runner: {},
    "hf-assisted": lambda runner: {"assistant_model": runner.draft},
    "hf-prompt-lookup": lambda runner: {"prompt_lookup_num_tokens": runner.num_lookup},
}
ALL_METHODS = ("vanilla", "hf", "hf-assisted", "hf-prompt-lookup", "ngram", "draft-lm", "medusa", "eagle1",
               "eagle2", "eagle3", "dflash", "dflash-ddtree")


@dataclass
class Tally:
    seconds: float = 0.0
    new_tokens: int = 0
    num_prompts: int = 0
    stats: SpecStats = field(default_factory=SpecStats)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict:
    return {"host": host.node(), "cpu": host.processor() or host.machine(), "torch_threads": torch.get_num_threads(),
            "threads": current_settings().to_dict(),  # eyas.threads: policy, count and its source, OpenMP env
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def load_prompts(args: argparse.Namespace, tokenizer=None, max_prompt_tokens: int | None = None
                 ) -> dict[str, list[str]]:
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise ConfigError(f"--prompts-file {path}: file does not exist")
        prompts = []
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                prompts.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f'{path}:{n}: expected one JSON object {{"prompt": "..."}} per line') from None
        if not prompts:
            raise ConfigError(f"{path}: no prompts")
        return {"custom": prompts[: args.num_prompts] if args.num_prompts else prompts}
    try:
        return {s: datasets.suite_prompts(s, args.num_prompts, tokenizer, max_prompt_tokens)
                for s in datasets.bench_suites(args.suite, tokenizer)}
    except datasets.DatasetError as err:  # a registry that cannot be reached: the message says what to do
        raise ConfigError(str(err)) from None


class HFRunner:
    """transformers generate() on the same checkpoint: plain, assisted by the draft LM, and prompt lookup."""

    def __init__(self, target_path: str, draft_path: str | None, num_lookup: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
        self.draft = (AutoModelForCausalLM.from_pretrained(draft_path, dtype=torch.float32).eval()
                      if draft_path else None)
        self.num_lookup = num_lookup

    @torch.inference_mode()
    def run(self, method: str, prompt_ids: list[int], max_new_tokens: int, eos: list[int]) -> int:
        extra = HF_METHODS[method](self)
        input_ids = torch.tensor([prompt_ids])
        out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                  max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                                  pad_token_id=eos[0] if eos else 0, **extra)
        return out.shape[1] - input_ids.shape[1]


def spec_for(method: str, args: argparse.Namespace, target_name: str, overrides: dict) -> SpecConfig:
    data = dict(overrides.get(method, {}))
    data["method"] = method
    entry = METHODS[method]
    if entry.trained and "drafter" not in data:  # a method reads its family's drafter
        data["drafter"] = str(Path(args.drafters_dir) / f"{entry.family}-{target_name}")
    if "draft_model" in entry.settings and "draft_model" not in data:
        data["draft_model"] = args.draft_model
    return from_dict(SpecConfig, data, prefix="spec.")


def available(method: str, spec: SpecConfig | None, args: argparse.Namespace) -> str | None:
    """None if the method can run, else why not."""
    entry = METHODS.get(method)
    if entry is not None and entry.trained and not str(spec.drafter).startswith(("models:/", "runs:/")) \
            and not Path(spec.drafter).is_dir():
        return f"no drafter at {spec.drafter} (train it: python -m jobs.train_drafter --config ...)"
    needs_draft_lm = (entry is not None and "draft_model" in entry.settings) or method == "hf-assisted"
    if needs_draft_lm and not Path(args.draft_model).is_dir():
        return f"no draft LM at {args.draft_model} (build it: python -m jobs.train_target --config " \
               "jobs/configs/draft-tiny.yaml)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(ALL_METHODS))
    parser.add_argument("--suite", choices=(*datasets.SUITES, "all"), default="all",
                        help="all: code + prose, + chat + humaneval for a chat-model target")
    parser.add_argument("--prompts-file", help='JSONL with one {"prompt": "..."} per line')
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, help="cut prompts to their first N tokens")
    parser.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    parser.add_argument("--target", default=str(eyas_home() / "targets" / "tiny"))
    parser.add_argument("--draft-model", default=str(eyas_home() / "targets" / "draft-tiny"))
    parser.add_argument("--drafters-dir", default=str(eyas_home() / "drafters"))
    parser.add_argument("--spec", action="append", default=[], metavar="YAML",
                        help="a YAML with a `spec:` section (e.g. tune.sweep's best config) for its method")
    parser.add_argument("--out", default="bench.json")
    parser.add_argument("--threads", type=int, help="torch threads (default: eyas.threads' policy)")
    parser.add_argument("--strict", action="store_true", help="fail instead of skipping unavailable methods")
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    try:
        report = run_bench(args)
    except (ConfigError, CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print_table(report)
    return 0


def run_bench(args: argparse.Namespace) -> dict:
    target_path = str(resolve_path(args.target))
    target_name = Path(target_path).name
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS and m not in HF_METHODS]
    if unknown:
        raise ConfigError(f"--methods: unknown {unknown}; known: {list(ALL_METHODS)}")
    if "vanilla" not in methods:
        methods.insert(0, "vanilla")  # speedup is relative to vanilla measured in the same run
    overrides: dict = {}
    for file in args.spec:
        spec_data = (yaml.safe_load(Path(file).read_text()) or {}).get("spec") or {}
        if "method" not in spec_data:
            raise ConfigError(f"--spec {file}: the spec section names no method")
        overrides[spec_data["method"]] = spec_data
    target = load_target(target_path)
    tokenizer = load_tokenizer(target_path)
    eos = sorted(set(target.config.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None
                                                     else set()))
    drafters, skipped = {}, {}
    for method in methods:
        spec = spec_for(method, args, target_name, overrides) if method in METHODS else None
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
                      num_lookup=spec_for("ngram", args, target_name, overrides).setting("num_draft"))
    # long prompts keep their first tokens: room for the new tokens and a draft tree must stay in the context
    max_prompt_tokens = min(args.max_prompt_tokens or 10**9,
                            target.config.max_position_embeddings - args.max_new_tokens - MAX_TREE_NODES)
    if max_prompt_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the target's "
                          f"context of {target.config.max_position_embeddings} tokens")
    suites = load_prompts(args, tokenizer, max_prompt_tokens)
    tallies = {(m, s): Tally() for m in drafters for s in suites}
    order = list(drafters)
    total = sum(len(p) for p in suites.values()) * args.repeats
    done = 0
    for rep in range(args.repeats):
        for suite, prompts in suites.items():
            for prompt in prompts:
                # a chat prompt is already rendered by the chat template, special tokens included
                prompt_ids = tokenizer.encode(prompt, add_special_tokens=suite != "chat")[:max_prompt_tokens]
                order = order[1:] + order[:1]  # rotate: no method always runs first
                for method in order:
                    spec, drafter = drafters[method]
                    tally = tallies[(method, suite)]
                    start = time.perf_counter()
                    if method in HF_METHODS:
                        tally.new_tokens += hf.run(method, prompt_ids, args.max_new_tokens, eos)
                    else:
                        result = generate(target, prompt_ids, args.max_new_tokens, drafter=drafter,
                                          eos_token_ids=eos)
                        tally.new_tokens += len(result.token_ids)
                        tally.stats = tally.stats.merge(result.stats)
                    tally.seconds += time.perf_counter() - start
                    tally.num_prompts += rep == 0
                done += 1
                print(f"[bench] {done}/{total} prompts", file=sys.stderr, flush=True)
    results = []
    for suite in suites:
        base = tallies[("vanilla", suite)]
        base_tps = base.new_tokens / base.seconds
        for method in drafters:
            t = tallies[(method, suite)]
            tps = t.new_tokens / t.seconds if t.seconds else 0.0
            speculates = method in METHODS and METHODS[method].speculates
            results.append({"method": method, "suite": suite, "num_prompts": t.num_prompts,
                            "new_tokens": t.new_tokens, "seconds": round(t.seconds, 4),
                            "tokens_per_s": round(tps, 2), "speedup": round(tps / base_tps, 3),
                            "tau": round(t.stats.tau, 3) if speculates and t.stats.tau else None,
                            "per_depth_accept": [round(a, 3) for a in t.stats.per_depth_accept]
                            if speculates else None})
    report = {"commit": git_commit(), "machine": machine(),
              "config": {"target": target_path, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                         "num_prompts": args.num_prompts, "suites": list(suites), "skipped": skipped,
                         "specs": {m: (vars(s) if s else None) for m, (s, _) in drafters.items()},
                         "command": " ".join(sys.argv)},
              "results": results}
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    print(f"[bench] wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = report["config"]["suites"]
    methods = list(dict.fromkeys(r["method"] for r in report["results"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(suites)
    for j, suite in enumerate(suites):
        rows = {r["method"]: r for r in report["results"] if r["suite"] == suite}
        xs = [i + j * width for i in range(len(methods))]
        axes[0].bar(xs, [rows[m]["speedup"] if m in rows else 0 for m in methods], width, label=suite)
        axes[1].bar(xs, [(rows[m]["tau"] or 0) if m in rows else 0 for m in methods], width, label=suite)
    for ax, title in zip(axes, ("speedup over eyas vanilla", "tau (accepted + 1 per cycle)")):
        ax.set_xticks([i + width * (len(suites) - 1) / 2 for i in range(len(methods))], methods, rotation=45,
                      ha="right")
        ax.set_title(title)
        ax.legend()
    axes[0].axhline(1.0, color="gray", lw=0.8, ls="--")
    fig.suptitle(f"eyas bench @ {report['commit']}, {report['config']['max_new_tokens']} new tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(report: dict) -> None:
    print(f"{'method':<18}{'suite':<10}{'tok/s':>9}{'speedup':>9}{'tau':>7}  per-depth accept")
    for r in report["results"]:
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        depth = " ".join(f"{a:.2f}" for a in (r["per_depth_accept"] or [])[:6])
        print(f"{r['method']:<18}{r['suite']:<10}{r['tokens_per_s']:>9.1f}{r['speedup']:>8.2f}x{tau:>7}  {depth}")
    print(f"commit {report['commit']}; {report['config']['command']}")


if __name__ == "__main__":
    sys.exit(main())
