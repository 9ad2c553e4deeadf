"""eyas's vanilla decoding beside the peer engines, one run: the same prompt tokens, greedy, single request.

    python -m jobs.bench_peers [--engines eyas,llamacpp,vllm] [--dtypes bfloat16,float32,q8_0] [--threads 1,2,auto]
        [--suite humaneval,chat] [--num-prompts 8] [--max-new-tokens 128] [--target PATH] [--gguf-dir DIR]
        [--out bench_peers.json] [--report bench_peers.md] [--lock /tmp/eyas-cpu.lock]
    python -m jobs.bench_peers --from bench_peers.json --report bench_peers.md

Prompts are jobs.bench's (eyas.datasets suites, chat prompts in the target's chat template), tokenized once by the
target's tokenizer and sent to every engine as token ids, so all of them decode the very same prompt. Each engine
runs each (dtype, threads) pair over all prompts, after one untimed warm-up request.

How each is timed (each counts prefill plus decode, never the engine's start-up):
- eyas: in process, ``eyas.decoding.generate.generate`` with no drafter (jobs.bench's vanilla path), wall time.
- llama.cpp: llama-server with one slot; its own ``timings`` (prompt_ms + predicted_ms), which leave out HTTP and
  JSON; the request's wall time is kept beside it. The target is converted to GGUF (bf16, f32, q8_0) by llama.cpp's
  converter, cached in --gguf-dir.
- vLLM (where .venv-tools/vllm exists and jobs.peers.vllm is present): its OpenAI server, /v1/completions, the
  request's wall time (HTTP on localhost included: its server reports no per-request timing).
Every engine stops at the target's end-of-sequence tokens; tok/s is the tokens it generated over its time.

The summary takes each engine's best thread count per dtype and gives eyas's tok/s over each peer's (eyas/peer:
1.0 is parity, above 1 eyas is faster). q8_0 is eyas's and llama.cpp's (vLLM has no int8 path here): eyas quantizes
the target's float weights with GGUF's Q8_0 rounding, the same weights llama.cpp's converter writes. The JSON
also records the CPU (``machine.cpu_features``: eyas.cpu's model, kind and ISA flags), the commit and the load
average before and after each measurement.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from transformers import AutoConfig

from eyas.config import ConfigError, eyas_home, resolve_path
from eyas.cpu import cpu_features
from eyas.decoding.generate import generate
from eyas.models import load_target, load_tokenizer
from eyas.models.dtypes import target_dtype
from eyas.threads import OPENMP_KNOBS, configure_threads
from jobs.bench import git_commit, load_prompts
from jobs.bench_peers_report import DTYPES, ENGINE_DTYPES, ENGINE_NAMES, ENGINES, GGUF_TYPE, markdown, summary
from jobs.peers import llamacpp
from jobs.peers.cli import add_report_args, cpu_lock, loadavg, parse_list, report_main


@dataclass
class Measurement:
    """One engine at one dtype and thread count over every prompt."""
    engine: str
    dtype: str
    threads: int | str  # a count, or "auto": eyas's own policy
    timing: str
    seconds: float = 0.0
    new_tokens: int = 0
    wall_seconds: float = 0.0  # client-side, HTTP included (equal to seconds for eyas)
    per_suite: dict[str, list[float]] = field(default_factory=dict)  # suite -> [seconds, tokens]
    outputs: list[list[int]] = field(default_factory=list)
    load_before: list[float] = field(default_factory=list)
    load_after: list[float] = field(default_factory=list)

    def add(self, suite: str, new_tokens: list[int], seconds: float, wall_seconds: float) -> None:
        self.seconds += seconds
        self.wall_seconds += wall_seconds
        self.new_tokens += len(new_tokens)
        totals = self.per_suite.setdefault(suite, [0.0, 0])
        totals[0] += seconds
        totals[1] += len(new_tokens)
        self.outputs.append(list(new_tokens))

    def row(self, reference: list[list[int]] | None) -> dict:
        """The JSON row; ``same_as_eyas``: the share of prompts whose tokens equal eyas's at this dtype."""
        same = (round(sum(a == b for a, b in zip(self.outputs, reference)) / len(reference), 3)
                if reference and self.engine != "eyas" else None)
        return {"engine": self.engine, "dtype": self.dtype, "threads": self.threads, "timing": self.timing,
                "new_tokens": self.new_tokens, "seconds": round(self.seconds, 4),
                "tokens_per_s": round(self.new_tokens / self.seconds, 2) if self.seconds else 0.0,
                "wall_tokens_per_s": round(self.new_tokens / self.wall_seconds, 2) if self.wall_seconds else 0.0,
                "suites": {s: round(n / t, 2) if t else 0.0 for s, (t, n) in self.per_suite.items()},
                "same_as_eyas": same, "load_before": self.load_before, "load_after": self.load_after}


# -- the engines ---------------------------------------------------------------------------------------------------

Prompts = dict[str, list[list[int]]]  # suite -> prompt token ids


def run_eyas(target_path: str, dtype: str, threads: int | str, prompts: Prompts, max_new_tokens: int,
             eos: list[int]) -> Measurement:
    configure_threads(None if threads == EYAS_POLICY else threads)
    activation_dtype, weight_format = target_dtype(dtype, "--dtypes")
    target = load_target(target_path, dtype=activation_dtype, weight_format=weight_format)
    first = next(iter(prompts.values()))[0]
    generate(target, first, 8, eos_token_ids=eos)  # warm-up: kernels compiled, caches allocated
    result = Measurement("eyas", dtype, threads, "in-process wall time", load_before=loadavg())
    for suite, suite_prompts in prompts.items():
        for prompt_ids in suite_prompts:
            start = time.perf_counter()
            out = generate(target, prompt_ids, max_new_tokens, eos_token_ids=eos)
            seconds = time.perf_counter() - start
            result.add(suite, out.token_ids, seconds, seconds)
    result.load_after = loadavg()
    return result


def target_gguf(target_path: str, dtype: str, gguf_dir: Path) -> Path:
    """The target converted by llama.cpp's converter, cached: DIR/<target>-<type>.gguf."""
    path = gguf_dir / f"{Path(target_path).name}-{GGUF_TYPE[dtype]}.gguf"
    if not path.is_file():
        print(f"[bench_peers] converting {target_path} to {path}", file=sys.stderr, flush=True)
        llamacpp.convert_to_gguf(target_path, path, GGUF_TYPE[dtype])
    return path


def run_llamacpp(model_gguf: Path, dtype: str, threads: int, prompts: Prompts, max_new_tokens: int) -> Measurement:
    with llamacpp.llama_server(model_gguf, threads) as base_url:
        llamacpp.complete(base_url, next(iter(prompts.values()))[0], 8)  # warm-up
        result = Measurement("llamacpp", dtype, threads, "llama-server timings (prompt + decode)",
                             load_before=loadavg())
        for suite, suite_prompts in prompts.items():
            for prompt_ids in suite_prompts:
                answer = llamacpp.complete(base_url, prompt_ids, max_new_tokens)
                result.add(suite, answer.token_ids, answer.server_s, answer.wall_s)
        result.load_after = loadavg()
    return result


def vllm_module():
    """jobs.peers.vllm when it and its tool venv exist, else None (the bench then leaves vLLM out)."""
    try:
        # local: jobs.peers.vllm is optional (the vLLM half of the peers may not be in this checkout)
        from jobs.peers import vllm
        vllm.vllm_python()
    except (ImportError, ConfigError) as err:
        print(f"[bench_peers] leaving out vLLM: {err}", file=sys.stderr)
        return None
    return vllm


def vllm_complete(base_url: str, model: str, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """One greedy /v1/completions request by token ids: (the generated token ids, wall seconds)."""
    body = json.dumps({"model": model, "prompt": prompt_ids, "max_tokens": max_new_tokens, "temperature": 0.0,
                       "return_token_ids": True}).encode()
    request = urllib.request.Request(f"{base_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", "Connection": "close"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    seconds = time.perf_counter() - start
    tokens = answer["choices"][0].get("token_ids")
    if tokens is None:
        raise RuntimeError("vLLM answered without choices[0].token_ids: its /v1/completions needs "
                           "return_token_ids (vLLM >= 0.10.2)")
    return [int(t) for t in tokens], seconds


@contextlib.contextmanager
def without_openmp_policy():
    """os.environ without the OpenMP variables while a peer starts: eyas.threads' OMP_WAIT_POLICY=PASSIVE is eyas's
    own choice for its torch (read once, at its import); each peer runs at its own defaults (llama-server drops
    them itself: jobs.peers.llamacpp.server_env). Spinning defaults suffer most when another process competes for
    the cores, so time the peers on a quiet machine (--lock)."""
    saved = {k: os.environ.pop(k) for k in OPENMP_KNOBS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def run_vllm(vllm, target_path: str, dtype: str, threads: int, prompts: Prompts,
             max_new_tokens: int) -> Measurement:
    with without_openmp_policy(), vllm.vllm_server(target_path, dtype, threads) as base_url:
        vllm_complete(base_url, vllm.SERVED_NAME, next(iter(prompts.values()))[0], 8)  # warm-up
        result = Measurement("vllm", dtype, threads, "HTTP wall time", load_before=loadavg())
        for suite, suite_prompts in prompts.items():
            for prompt_ids in suite_prompts:
                tokens, seconds = vllm_complete(base_url, vllm.SERVED_NAME, prompt_ids, max_new_tokens)
                result.add(suite, tokens, seconds, seconds)
        result.load_after = loadavg()
    return result


# -- the run -------------------------------------------------------------------------------------------------------

EYAS_POLICY = "auto"  # --threads item: eyas's own thread policy (eyas.threads: its kernels adapt), eyas only


def parse_threads(text: str) -> list[int | str]:
    """Thread counts, and ``auto`` for eyas's own policy (measured for eyas alone: the peers take counts)."""
    items = parse_list(text, None, "--threads")
    try:
        threads = [x if x == EYAS_POLICY else int(x) for x in items]
    except ValueError:
        raise ConfigError(f"--threads {text!r}: give counts (or {EYAS_POLICY}) joined by commas, e.g. 1,2,auto") \
            from None
    if any(t != EYAS_POLICY and t < 1 for t in threads):
        raise ConfigError(f"--threads {text!r}: counts must be >= 1")
    return threads


def encoded_prompts(args: argparse.Namespace, target_path: str) -> tuple[Prompts, list[int]]:
    """jobs.bench's prompts as the target's token ids (chat prompts carry their template's special tokens), and
    the end-of-sequence ids eyas stops at."""
    tokenizer = load_tokenizer(target_path)
    context = AutoConfig.from_pretrained(target_path).max_position_embeddings
    max_prompt_tokens = context - args.max_new_tokens - 64
    suites = load_prompts(args, tokenizer, max_prompt_tokens)
    prompts = {suite: [tokenizer.encode(p, add_special_tokens=suite != "chat")[:max_prompt_tokens] for p in texts]
               for suite, texts in suites.items()}
    eos = AutoConfig.from_pretrained(target_path).eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    return prompts, sorted(eos_ids)


def plan(engines: list[str], dtypes: list[str], threads: list[int | str]) -> list[tuple[str, str, int | str]]:
    """(engine, dtype, threads) in run order: per dtype and thread count, the engines side by side."""
    return [(engine, dtype, t) for dtype in dtypes for t in threads for engine in engines
            if dtype in ENGINE_DTYPES[engine] and (t != EYAS_POLICY or engine == "eyas")]


def run(args: argparse.Namespace) -> dict:
    commit = git_commit()  # the code this process imported, not HEAD after a long run
    target_path = str(resolve_path(args.target))
    engines = parse_list(args.engines, ENGINES, "--engines")
    dtypes = parse_list(args.dtypes, DTYPES, "--dtypes")
    threads = parse_threads(args.threads)
    vllm = vllm_module() if "vllm" in engines else None
    if "vllm" in engines and vllm is None:
        engines.remove("vllm")
    if "llamacpp" in engines:
        llamacpp.llama_server_bin()  # a missing build fails now, not after eyas's measurements
    prompts, eos = encoded_prompts(args, target_path)
    gguf_dir = Path(resolve_path(args.gguf_dir))
    runners: dict[str, Callable[[str, int], Measurement]] = {
        "eyas": lambda d, t: run_eyas(target_path, d, t, prompts, args.max_new_tokens, eos),
        "llamacpp": lambda d, t: run_llamacpp(target_gguf(target_path, d, gguf_dir), d, t, prompts,
                                              args.max_new_tokens),
        "vllm": lambda d, t: run_vllm(vllm, target_path, d, t, prompts, args.max_new_tokens),
    }
    measured: list[Measurement] = []
    for engine, dtype, t in plan(engines, dtypes, threads):
        print(f"[bench_peers] {ENGINE_NAMES[engine]} {dtype} {t} thread(s)", file=sys.stderr, flush=True)
        with cpu_lock(args.lock):
            measured.append(runners[engine](dtype, t))
        print(f"[bench_peers]   {measured[-1].new_tokens / measured[-1].seconds:.1f} tok/s", file=sys.stderr,
              flush=True)
    references = {m.dtype: m.outputs for m in measured if m.engine == "eyas"}
    rows = [m.row(references.get(m.dtype)) for m in measured]
    features = cpu_features()
    return {"commit": commit,
            "machine": {"cpu_model": features.model, "cpu_features": features.to_dict(), "num_cpus": os.cpu_count(),
                        "load_start": loadavg()},
            "config": {"target": target_path, "engines": engines, "dtypes": dtypes, "threads": threads,
                       "suites": list(prompts), "num_prompts": args.num_prompts,
                       "max_new_tokens": args.max_new_tokens, "command": " ".join(["python -m jobs.bench_peers",
                                                                                    *sys.argv[1:]])},
            "results": rows, "summary": summary(rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench_peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--threads", default="1,2,auto", help="thread counts each engine runs at, joined by commas; "
                        "auto: eyas's own policy (eyas only)")
    parser.add_argument("--suite", default="humaneval,chat")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts per suite")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--target", default=str(eyas_home() / "targets" / "smollm2-135m"))
    parser.add_argument("--gguf-dir", default=str(eyas_home() / "gguf"), help="where the target's GGUFs are cached")
    add_report_args(parser, "bench_peers.json", lock_help="for each measurement")
    args = parser.parse_args(argv)
    args.prompts_file = None  # jobs.bench.load_prompts' other source
    return report_main(args, "bench_peers", run, markdown)


if __name__ == "__main__":
    sys.exit(main())
