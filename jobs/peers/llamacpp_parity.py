"""Acceptance parity, llama.cpp side: one eyas EAGLE-3 drafter, a chain of the same length, the same prompts, float32.

    python -m jobs.peers.llamacpp_parity --drafter DIR|models:/NAME@ALIAS [--target DIR] [--depth 3]
        [--suite humaneval,chat] [--num-prompts 2] [--max-new-tokens 64] [--threads 2] [--tolerance 0.05]
        [--work-dir DIR] [--out parity_llamacpp.json]

- eyas: ``generate`` with the drafter as a chain of ``--depth`` (SpecConfig tree=chain), and plainly; per-depth
  acceptance is SpecStats' n-alpha.
- llama.cpp: the target converted to an f32 GGUF and the drafter to GGUF (``jobs.export --to gguf``), served by
  llama-server with ``--spec-type draft-eagle3 --spec-draft-n-max DEPTH`` and ``LLAMA_TRACE=1``; per-depth
  acceptance comes from its per-step ``accepted A/N draft tokens`` log lines, in the same n-alpha terms. A second
  llama-server without the drafter gives llama.cpp's own vanilla output. The speculating server also answers one
  chat request through the openai client (the way a user talks to it).

Passes when, at every depth, the two acceptances differ by at most ``--tolerance``, and each engine's speculative
output equals its own vanilla on every prompt. Writes the figures to ``--out``; exits 0 on a pass, 1 on a miss.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import openai

from eyas.config import ConfigError, eyas_home, resolve_path
from eyas.decoding.generate import generate
from eyas.decoding.stats import SpecStats
from eyas.files import write_text_atomic
from eyas.methods import SpecConfig, build_drafter
from eyas.models import CheckpointError, load_target
from eyas.threads import configure_threads
from jobs.bench import git_commit
from jobs.bench_peers import encoded_prompts, target_gguf
from jobs.export import export_drafter
from jobs.peers import llamacpp


@dataclass(frozen=True)
class EngineRun:
    """One engine's speculative run beside its own vanilla, on the same prompts."""
    per_depth_accept: list[float]
    spec_outputs: list[list[int]]
    vanilla_outputs: list[list[int]]

    @property
    def same_as_vanilla(self) -> float:
        pairs = list(zip(self.spec_outputs, self.vanilla_outputs))
        return sum(a == b for a, b in pairs) / len(pairs)


def eyas_run(target_dir: str, drafter: str, depth: int, prompts: list[list[int]], max_new_tokens: int,
             eos: list[int]) -> EngineRun:
    target = load_target(target_dir)  # float32, the exact reference
    spec = SpecConfig(method="eagle3", drafter=drafter, tree="chain", depth=depth)
    stats, spec_outputs, vanilla_outputs = SpecStats(), [], []
    for prompt_ids in prompts:
        result = generate(target, prompt_ids, max_new_tokens, drafter=build_drafter(target, spec), eos_token_ids=eos)
        stats = stats.merge(result.stats)
        spec_outputs.append(result.token_ids)
        vanilla_outputs.append(generate(target, prompt_ids, max_new_tokens, eos_token_ids=eos).token_ids)
    accept = stats.per_depth_accept
    return EngineRun(list(accept) + [0.0] * (depth - len(accept)), spec_outputs, vanilla_outputs)


def openai_chat(base_url: str) -> str:
    """One chat request through the openai client, as a user would send it; the answer's text."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    answer = client.chat.completions.create(model="target", max_tokens=24, temperature=0.0,
                                            messages=[{"role": "user", "content": "Write a haiku about hawks."}])
    return answer.choices[0].message.content or ""


def llamacpp_run(target_gguf_path: Path, drafter_gguf: Path, depth: int, prompts: list[list[int]],
                 max_new_tokens: int, threads: int, log_path: Path) -> tuple[EngineRun, str]:
    """(the run, the openai client's answer from the speculating server)."""
    with llamacpp.llama_server(target_gguf_path, threads, drafter_gguf, llamacpp.eagle3_spec_args(depth),
                               log_path=log_path, trace=True) as base_url:
        spec_outputs = [llamacpp.complete(base_url, p, max_new_tokens).token_ids for p in prompts]
        chat = openai_chat(base_url)
    steps = llamacpp.draft_steps(log_path.read_text(errors="replace"))
    if not steps:
        raise RuntimeError(f"llama-server logged no draft steps ({log_path}): did it load the draft model?")
    with llamacpp.llama_server(target_gguf_path, threads) as base_url:
        vanilla_outputs = [llamacpp.complete(base_url, p, max_new_tokens).token_ids for p in prompts]
    return EngineRun(llamacpp.per_depth_accept(steps, depth), spec_outputs, vanilla_outputs), chat


def verdict(eyas: EngineRun, peer: EngineRun, tolerance: float) -> dict:
    """The parity figures and whether they pass."""
    gaps = [abs(a - b) for a, b in zip(eyas.per_depth_accept, peer.per_depth_accept)]
    passed = max(gaps) <= tolerance and eyas.same_as_vanilla == 1.0 and peer.same_as_vanilla == 1.0
    return {"eyas_per_depth_accept": [round(a, 4) for a in eyas.per_depth_accept],
            "llamacpp_per_depth_accept": [round(a, 4) for a in peer.per_depth_accept],
            "max_gap": round(max(gaps), 4), "tolerance": tolerance,
            "eyas_same_as_vanilla": eyas.same_as_vanilla, "llamacpp_same_as_vanilla": peer.same_as_vanilla,
            "vanilla_eyas_equals_llamacpp": sum(a == b for a, b in zip(eyas.vanilla_outputs, peer.vanilla_outputs))
            / len(eyas.vanilla_outputs),
            "passed": passed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="an eyas EAGLE-3 drafter (directory, models:/ or runs:/)")
    parser.add_argument("--target", default=str(eyas_home() / "targets" / "smollm2-135m"))
    parser.add_argument("--depth", type=int, default=3, help="the chain's length in both engines")
    parser.add_argument("--suite", default="humaneval,chat")
    parser.add_argument("--num-prompts", type=int, default=2, help="prompts per suite")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--work-dir", default=str(eyas_home() / "gguf"),
                        help="where the GGUFs (cached) and the server log are written")
    parser.add_argument("--out", default="parity_llamacpp.json")
    args = parser.parse_args(argv)
    args.prompts_file = None  # jobs.bench.load_prompts' other source
    try:
        llamacpp.llama_server_bin()  # a missing build fails before any export
        configure_threads(args.threads)
        target_dir = str(resolve_path(args.target))
        work = Path(resolve_path(args.work_dir))
        work.mkdir(parents=True, exist_ok=True)
        drafter_gguf = work / f"{Path(str(args.drafter)).name}-f32.gguf"
        drafter_gguf.unlink(missing_ok=True)  # the drafter may have been retrained since: convert it afresh
        export_drafter(str(args.drafter), "gguf", drafter_gguf, target_dir, "f32")
        by_suite, eos = encoded_prompts(args, target_dir)
        prompts = [p for suite in by_suite.values() for p in suite]
        ours = eyas_run(target_dir, str(args.drafter), args.depth, prompts, args.max_new_tokens, eos)
        theirs, chat = llamacpp_run(target_gguf(target_dir, "float32", work), drafter_gguf, args.depth, prompts,
                                    args.max_new_tokens, args.threads, work / "parity-llama-server.log")
    except (ConfigError, CheckpointError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = {"commit": git_commit(), "command": " ".join(["python -m jobs.peers.llamacpp_parity", *sys.argv[1:]]),
              "depth": args.depth, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "openai_chat_answer": chat, **verdict(ours, theirs, args.tolerance)}
    write_text_atomic(Path(args.out), json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
