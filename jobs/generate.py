"""Generate from a target, with or without a drafter.

    python -m jobs.generate --target PATH [--drafter PATH|models:/NAME@ALIAS] [--method M] [tree options]
        (--prompt TEXT | --prompt-ids 1,2,3) --max-new-tokens N [--temperature T] [--top-p P] [--seed S] [--json]
        [--dtype float32|bfloat16|float16] [--threads N]

``--config FILE.yaml`` reads a ``spec:`` section (and optionally ``target:``), e.g. the best configuration that
``tune.sweep`` writes; command-line flags override it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from eyas.config import ConfigError, eyas_home, from_dict, resolve_path, to_dict
from eyas.methods import METHODS, TREES, SpecConfig, build_drafter
from eyas.models import CheckpointError, load_target, load_tokenizer
from eyas.models.dtypes import TARGET_DTYPES, target_dtype
from eyas.threads import configure_threads
from eyas.decoding.generate import SamplingParams, generate

# flag -> SpecConfig field; a flag left unset keeps the --config value (or the default)
SPEC_FLAGS = {"method": "method", "drafter": "drafter", "draft_model": "draft_model", "tree": "tree",
              "tree_depth": "depth", "tree_top_k": "top_k", "tree_nodes": "num_nodes", "num_draft": "num_draft"}


def default_target() -> str:
    return str(eyas_home() / "targets" / "tiny")


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML with a `spec:` section (e.g. tune.sweep's best config)")
    parser.add_argument("--target", help=f"HF checkpoint directory (default {default_target()})")
    parser.add_argument("--method", help="vanilla, ngram, suffix, draft-lm, eagle1, eagle2, eagle3, eagle3.1, peagle, "
                                         "medusa, dflash, dflash-ddtree, dspark, dflash2, hybrid (--config: "
                                         "spec.proposers)")
    parser.add_argument("--drafter", help="trained drafter: checkpoint dir or models:/NAME@ALIAS")
    parser.add_argument("--draft-model", help="draft-lm: HF checkpoint dir sharing the target's tokenizer")
    parser.add_argument("--tree", choices=TREES, help="override the method's tree shape")
    parser.add_argument("--tree-depth", type=int, help="dynamic / best-first / chain depth")
    parser.add_argument("--tree-top-k", type=int, help="children per expanded node")
    parser.add_argument("--tree-nodes", type=int, help="node budget N")
    parser.add_argument("--num-draft", type=int, help="chain length for ngram / draft-lm")


def spec_from_args(args: argparse.Namespace) -> tuple[SpecConfig, str]:
    """(SpecConfig, target path) from --config, then the individual flags."""
    spec_data: dict = {}
    target = None
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"--config {path}: file does not exist")
        data = yaml.safe_load(path.read_text()) or {}
        spec_data = dict(data.get("spec") or {})
        target = data.get("target")
    for flag, field in SPEC_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            spec_data[field] = value
    if getattr(args, "drafter", None) and "method" not in spec_data:
        raise ConfigError("--drafter needs --method (eagle1, eagle2, eagle3, eagle3.1, peagle, medusa, dflash, "
                          "dflash-ddtree, dspark or dflash2)")
    return from_dict(SpecConfig, spec_data, prefix="spec."), str(resolve_path(args.target or target
                                                                                or default_target()))


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--prompt-ids {text!r}: expected comma-separated integers like 1,2,3") from None
    if not ids:
        raise ConfigError("--prompt-ids is empty")
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_spec_arguments(parser)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="sampling top-k (0 = off)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dtype", choices=TARGET_DTYPES, default="float32",
                        help="the target's (and drafter's) dtype: float32 or bfloat16 on CPU, float16/bfloat16 on "
                             "GPU; q8_0 on CPU: the target's linear weights in GGUF's Q8_0 around float32; greedy "
                             "speculative output is exact against vanilla in float32 (docs/threads-and-dtypes.md)")
    parser.add_argument("--threads", type=int, help="torch threads (default: eyas.threads' policy)")
    args = parser.parse_args(argv)
    try:
        configure_threads(args.threads)
        spec, target_path = spec_from_args(args)
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
        activation_dtype, weight_format = target_dtype(args.dtype, "--dtype")
        target = load_target(target_path, dtype=activation_dtype, weight_format=weight_format)
        tokenizer = load_tokenizer(target_path)
        prompt_ids = (parse_prompt_ids(args.prompt_ids) if args.prompt_ids
                      else tokenizer.encode(args.prompt))
        drafter = build_drafter(target, spec)
        eos = set(target.config.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None
                                                  else set())
        result = generate(target, prompt_ids, args.max_new_tokens, drafter=drafter, sampling=sampling,
                          eos_token_ids=eos)
    except (ConfigError, CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = tokenizer.decode(result.token_ids)
    if args.json:
        print(json.dumps({"text": text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          "spec": to_dict(spec), "stats": result.stats.to_dict()}))
    else:
        print(text)
        if METHODS[spec.method].speculates:
            stats = result.stats
            print(f"\n[{spec.method}] cycles={stats.cycles} tau={stats.tau:.2f} tokens={len(result.token_ids)}",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
