"""eyas's decoding, plain and speculative, beside the peer engines', one run: the same prompt tokens, greedy, single
request.

    python -m jobs.bench_peers [--engines eyas,llamacpp,vllm] [--dtypes bfloat16,float32,q8_0] [--threads 1,2,auto]
        [--eyas-methods vanilla,ngram,...] [--llamacpp-methods vanilla,ngram-simple,...] [--vllm-methods vanilla,...]
        [--spec YAML ...] [--ngram-match 3] [--ngram-draft 8] [--num-draft 1] [--drafter DIR]
        [--suite humaneval,chat] [--num-prompts 8] [--max-new-tokens 128] [--target PATH] [--gguf-dir DIR]
        [--workdir out/bench_peers] [--out bench_peers.json] [--report bench_peers.md] [--lock /tmp/eyas-cpu.lock]
    python -m jobs.bench_peers --from bench_peers.json[,more.json] --report bench_peers.md

Prompts are jobs.bench's (eyas.datasets suites, chat prompts in the target's chat template), tokenized once by the
target's tokenizer and sent to every engine as token ids, so all of them decode the very same prompt. Each engine
runs each (dtype, threads, method) over all prompts, after one untimed warm-up request.

Methods (jobs.bench_peers_methods): vanilla by default only. eyas's are jobs.bench's labels built from the ``--spec``
YAMLs jobs.bench reads (default: jobs/configs/bench-smollm2/*.yaml, the README table's); the peers' are their own
speculation: llama-server's ``--spec-type`` draftless types and draft-eagle3, vLLM's ngram, eagle3 and suffix. Both
peers' eagle3 read the drafter eyas's eagle3 reads (``--drafter``; default: eagle3-<target> in $EYAS_HOME/drafters,
else the shipped one), exported by jobs.export into ``--workdir``. A method an engine will not start is a row with
its reason (``refused``). Every row says how many prompts decoded its engine's own vanilla tokens
(``same_as_vanilla``) and eyas's vanilla tokens (``same_as_eyas``), and the acceptance the engine reports.

How each is timed (each counts prefill plus decode, never the engine's start-up):
- eyas: in process, ``eyas.decoding.generate.generate`` (jobs.bench's path), wall time.
- llama.cpp: llama-server with one slot; its own ``timings`` (prompt_ms + predicted_ms), which leave out HTTP and
  JSON; the request's wall time is kept beside it. The target is converted to GGUF (bf16, f32, q8_0) by llama.cpp's
  converter, cached in --gguf-dir.
- vLLM (where .venv-tools/vllm exists and jobs.peers.vllm is present): its OpenAI server, /v1/completions, the
  request's wall time (HTTP on localhost included: its server reports no per-request timing).
Every engine stops at the target's end-of-sequence tokens; tok/s is the tokens it generated over its time.

The summary takes each engine's best thread count per dtype and gives eyas's vanilla tok/s over each peer's (eyas/peer:
1.0 is parity, above 1 eyas is faster); with methods, eyas's best lossless row over the best peer row of any method,
per suite and overall, against the 1.3x goal (jobs.bench_peers_report). q8_0 is llama.cpp's alone. The JSON also
records the CPU (``machine.cpu_features``), the commit and the load average before and after each measurement.
``--from a.json,b.json`` renders several runs into one page (docs/bench-peers-smollm2.md: the vanilla run, then
the speculative one).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager

from transformers import AutoConfig

from eyas.config import ConfigError, eyas_home, resolve_path
from eyas.cpu import cpu_features
from eyas.decoding.generate import generate
from eyas.methods import SpecConfig, build_drafter
from eyas.models import CheckpointError, load_target, load_tokenizer, torch_dtype
from eyas.threads import OPENMP_KNOBS, configure_threads
from jobs.bench import available, default_drafter, git_commit, load_prompts, spec_for, spec_overrides
from jobs.bench_peers_methods import (DRAFTER_FORMAT, EYAS_METHODS, PEER_METHODS, VANILLA, PeerSizes,
                                      llamacpp_spec_args, peer_settings, refusal_reason, vllm_speculative_config)
from jobs.bench_peers_report import DTYPES, ENGINE_DTYPES, ENGINE_NAMES, ENGINES, GGUF_TYPE, markdown, summary
from jobs.export import export_drafter
from jobs.peers import llamacpp
from jobs.peers.acceptance import Acceptance, delta, from_llamacpp_timings
from jobs.peers.cli import add_report_args, cpu_lock, loadavg, parse_list, report_main
from jobs.peers.endpoint import read_vllm_counters

ROOT = Path(__file__).resolve().parents[1]
LLAMACPP_TIMING = "llama-server timings (prompt + decode)"
VLLM_TIMING = "HTTP wall time"
DEFAULT_SPECS = tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "jobs/configs/bench-smollm2").glob("*.yaml")))


@dataclass
class Measurement:
    """One engine running one method at one dtype and thread count over every prompt (or refusing to)."""
    engine: str
    dtype: str
    threads: int | str  # a count, or "auto": eyas's own policy
    timing: str
    method: str = VANILLA
    refused: str | None = None  # the engine's reason where it would not run the method
    seconds: float = 0.0
    new_tokens: int = 0
    wall_seconds: float = 0.0  # client-side, HTTP included (equal to seconds for eyas)
    per_suite: dict[str, list[float]] = field(default_factory=dict)  # suite -> [seconds, tokens]
    outputs: list[list[int]] = field(default_factory=list)
    acceptance: Acceptance = field(default_factory=Acceptance)
    tau: float | None = None  # where the engine counts draft rounds (eyas: SpecStats.tau)
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

    def row(self, eyas_vanilla: list[list[int]] | None, own_vanilla: list[list[int]] | None) -> dict:
        """The JSON row. ``same_as_eyas``: the share of prompts whose tokens equal eyas vanilla's at this dtype (None
        for eyas vanilla itself); ``same_as_vanilla``: equal to this engine's vanilla at this dtype and threads."""
        def share(reference: list[list[int]] | None) -> float | None:
            if not reference or not self.outputs:
                return None
            return round(sum(a == b for a, b in zip(self.outputs, reference)) / len(reference), 3)

        drafted = self.acceptance.summary()
        is_reference = self.engine == "eyas" and self.method == VANILLA
        return {"engine": self.engine, "method": self.method, "dtype": self.dtype, "threads": self.threads,
                "timing": self.timing, "refused": self.refused, "new_tokens": self.new_tokens,
                "seconds": round(self.seconds, 4),
                "tokens_per_s": round(self.new_tokens / self.seconds, 2) if self.seconds else 0.0,
                "wall_tokens_per_s": round(self.new_tokens / self.wall_seconds, 2) if self.wall_seconds else 0.0,
                "suites": {s: round(n / t, 2) if t else 0.0 for s, (t, n) in self.per_suite.items()},
                "same_as_eyas": None if is_reference else share(eyas_vanilla),
                "same_as_vanilla": None if self.method == VANILLA else share(own_vanilla),
                "acceptance": None if drafted["acceptance"] is None else round(drafted["acceptance"], 3),
                "tau": None if self.tau is None else round(self.tau, 3),
                "num_draft_tokens": drafted["num_draft_tokens"], "num_accepted": drafted["num_accepted"],
                "load_before": self.load_before, "load_after": self.load_after}


Prompts = dict[str, list[list[int]]]  # suite -> prompt token ids


@dataclass(frozen=True)
class RunSetup:
    """What every measurement reads: the prompts, the sizes, and where exports and logs go."""
    target_path: str
    prompts: Prompts
    max_new_tokens: int
    eos: list[int]
    workdir: Path


# -- eyas ------------------------------------------------------------------------------------------------------------

EyasMethod = tuple[str, SpecConfig | None, str | None]  # (label, its spec, why it cannot run)


def eyas_methods(labels: list[str], args: argparse.Namespace, target_path: str) -> list[EyasMethod]:
    """jobs.bench's spec for each label from the --spec YAMLs (vanilla first: every row's reference); a method it
    cannot run here (jobs.bench.available: no drafter, no draft LM) carries the reason."""
    overrides = spec_overrides(args.spec)
    out: list[EyasMethod] = [(VANILLA, None, None)]
    for label in [m for m in labels if m != VANILLA]:
        spec = spec_for(label, args, Path(target_path).name, overrides)
        out.append((label, spec, available(label, spec, args)))
    return out


def spec_settings(spec: SpecConfig | None) -> str:
    """The settings a spec sets (its non-empty fields but the method), for the report."""
    if spec is None:
        return "-"
    fields = {k: v for k, v in vars(spec).items() if k != "method" and v not in (None, (), [])}
    return ", ".join(f"{k} {list(v) if isinstance(v, tuple) else v}" for k, v in fields.items()) or "defaults"


def run_eyas(setup: RunSetup, dtype: str, threads: int | str, methods: list[EyasMethod]) -> list[Measurement]:
    """Every method on one target load: each drafter built, warmed up on the first prompt, then timed."""
    configure_threads(None if threads == EYAS_POLICY else threads)
    target = load_target(setup.target_path, dtype=torch_dtype(dtype, "--dtypes"))
    first = next(iter(setup.prompts.values()))[0]
    out = []
    for label, spec, why_not in methods:
        result = Measurement("eyas", dtype, threads, "in-process wall time", method=label, refused=why_not)
        drafter = None
        try:  # one drafter for every prompt, as jobs.bench runs it (generate() starts its sequence afresh)
            drafter = build_drafter(target, spec) if spec is not None and not why_not else None
            generate(target, first, 8, drafter=drafter, eos_token_ids=setup.eos)  # kernels compiled, caches made
        except (ConfigError, CheckpointError, FileNotFoundError) as err:
            result.refused = result.refused or f"{type(err).__name__}: {err}"
        if result.refused:
            out.append(result)
            continue
        result.load_before = loadavg()
        for suite, suite_prompts in setup.prompts.items():
            for prompt_ids in suite_prompts:
                start = time.perf_counter()
                generation = generate(target, prompt_ids, setup.max_new_tokens, drafter=drafter,
                                      eos_token_ids=setup.eos)
                seconds = time.perf_counter() - start
                result.add(suite, generation.token_ids, seconds, seconds)
                if spec is not None:
                    stats = generation.stats
                    result.acceptance = result.acceptance.add(Acceptance(
                        stats.cycles, stats.num_draft_nodes, sum(stats.accepted_per_cycle), list(stats.depth_accepted)))
        result.tau = result.acceptance.summary()["tau"] if spec is not None else None
        result.load_after = loadavg()
        out.append(result)
    return out


# -- the peers -------------------------------------------------------------------------------------------------------

def target_gguf(target_path: str, dtype: str, gguf_dir: Path) -> Path:
    """The target converted by llama.cpp's converter, cached: DIR/<target>-<type>.gguf."""
    path = gguf_dir / f"{Path(target_path).name}-{GGUF_TYPE[dtype]}.gguf"
    if not path.is_file():
        print(f"[bench_peers] converting {target_path} to {path}", file=sys.stderr, flush=True)
        llamacpp.convert_to_gguf(target_path, path, GGUF_TYPE[dtype])
    return path


def start_or_refuse(stack: contextlib.ExitStack, server: ContextManager[str], log: Path) -> tuple[str | None, str | None]:
    """(base URL, None) once the server is healthy, or (None, the engine's reason from its log) when it exits or
    never gets healthy: the engine refused the method. Anything after start-up still raises."""
    try:
        return stack.enter_context(server), None
    except (RuntimeError, TimeoutError) as err:
        text = log.read_text(errors="replace") if log.is_file() else str(err)
        return None, refusal_reason(text)


def run_llamacpp(model_gguf: Path, dtype: str, threads: int, setup: RunSetup, method: str = VANILLA,
                 spec_args: tuple[str, ...] = (), draft_gguf: Path | None = None) -> Measurement:
    result = Measurement("llamacpp", dtype, threads, LLAMACPP_TIMING, method=method)
    log = setup.workdir / f"llama-server-{dtype}-{threads}t-{method}.log"
    with contextlib.ExitStack() as stack:
        base_url, result.refused = start_or_refuse(
            stack, llamacpp.llama_server(model_gguf, threads, draft_gguf, spec_args, log_path=log), log)
        if base_url is None:
            return result
        llamacpp.complete(base_url, next(iter(setup.prompts.values()))[0], 8)  # warm-up
        result.load_before = loadavg()
        for suite, suite_prompts in setup.prompts.items():
            for prompt_ids in suite_prompts:
                answer = llamacpp.complete(base_url, prompt_ids, setup.max_new_tokens)
                result.add(suite, answer.token_ids, answer.server_s, answer.wall_s)
                result.acceptance = result.acceptance.add(from_llamacpp_timings(answer.timings))
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


def run_vllm(vllm, dtype: str, threads: int, setup: RunSetup, method: str = VANILLA,
             speculative_config: dict[str, Any] | None = None) -> Measurement:
    result = Measurement("vllm", dtype, threads, VLLM_TIMING, method=method)
    log = setup.workdir / f"vllm-{dtype}-{threads}t-{method}.log"
    with contextlib.ExitStack() as stack:
        stack.enter_context(without_openmp_policy())
        base_url, result.refused = start_or_refuse(
            stack, vllm.vllm_server(setup.target_path, dtype, threads, speculative_config, log_path=log), log)
        if base_url is None:
            return result
        vllm_complete(base_url, vllm.SERVED_NAME, next(iter(setup.prompts.values()))[0], 8)  # warm-up
        before = read_vllm_counters(base_url)
        result.load_before = loadavg()
        for suite, suite_prompts in setup.prompts.items():
            for prompt_ids in suite_prompts:
                tokens, seconds = vllm_complete(base_url, vllm.SERVED_NAME, prompt_ids, setup.max_new_tokens)
                result.add(suite, tokens, seconds, seconds)
        result.load_after = loadavg()
        after = read_vllm_counters(base_url)
        if speculative_config and before is not None and after is not None:
            result.acceptance = delta(after, before)
            result.tau = result.acceptance.summary()["tau"]
    return result


class DrafterExports:
    """The EAGLE-3 drafter in each peer's format (jobs.export, with its train/serve checks), written once a run
    into the workdir: ``gguf`` at the dtype's GGUF type, ``vllm`` a directory."""

    def __init__(self, drafter_dir: str, target_path: str, workdir: Path) -> None:
        self.drafter_dir, self.target_path, self.workdir = drafter_dir, target_path, workdir
        self.paths: dict[tuple[str, str], Path] = {}

    def get(self, fmt: str, dtype: str) -> Path:
        gguf_type = GGUF_TYPE[dtype] if fmt == "gguf" else "f32"
        key = (fmt, gguf_type if fmt == "gguf" else "")
        if key not in self.paths:
            out = self.workdir / (f"drafter-{gguf_type}.gguf" if fmt == "gguf" else f"drafter-{fmt}")
            if out.is_dir():
                shutil.rmtree(out)
            out.unlink(missing_ok=True)
            self.paths[key] = export_drafter(self.drafter_dir, fmt, out, self.target_path, gguf_type)[1]
        return self.paths[key]


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


def plan(engines: list[str], dtypes: list[str], threads: list[int | str], peer_methods: dict[str, list[str]] | None = None
         ) -> list[tuple[str, str, int | str, str]]:
    """(engine, dtype, threads, method) in run order: per dtype and thread count, the engines side by side, each
    with its methods (eyas's all in one entry, method "*": they share one target load)."""
    peer_methods = peer_methods or {}
    return [(engine, dtype, t, method) for dtype in dtypes for t in threads for engine in engines
            if dtype in ENGINE_DTYPES[engine] and (t != EYAS_POLICY or engine == "eyas")
            for method in (["*"] if engine == "eyas" else peer_methods.get(engine, [VANILLA]))]


def rows_of(measured: list[Measurement]) -> list[dict]:
    """The JSON rows, each set against eyas's vanilla at its dtype (same threads where measured) and its own
    engine's vanilla at its dtype and threads."""
    vanilla = {(m.engine, m.dtype, m.threads): m.outputs for m in measured if m.method == VANILLA and not m.refused}
    eyas_any = {m.dtype: m.outputs for m in measured if m.engine == "eyas" and m.method == VANILLA and not m.refused}
    return [m.row(vanilla.get(("eyas", m.dtype, m.threads), eyas_any.get(m.dtype)),
                  vanilla.get((m.engine, m.dtype, m.threads))) for m in measured]


def peer_runners(args: argparse.Namespace, setup: RunSetup, vllm, sizes: PeerSizes, drafter: str
                 ) -> dict[str, Callable[[str, int, str], Measurement]]:
    exports = DrafterExports(drafter, setup.target_path, setup.workdir)
    gguf_dir = Path(resolve_path(args.gguf_dir))

    def llama(dtype: str, threads: int, method: str) -> Measurement:
        try:
            draft = exports.get(DRAFTER_FORMAT["llamacpp"], dtype) if method == "eagle3" else None
        except (ConfigError, CheckpointError) as err:  # the drafter has no llama.cpp form: the row says why
            return Measurement("llamacpp", dtype, threads, LLAMACPP_TIMING, method, refused=f"jobs.export: {err}")
        return run_llamacpp(target_gguf(setup.target_path, dtype, gguf_dir), dtype, threads, setup, method,
                            llamacpp_spec_args(method, sizes), draft)

    def vllm_run(dtype: str, threads: int, method: str) -> Measurement:
        try:
            config = vllm_speculative_config(method, sizes, lambda: exports.get(DRAFTER_FORMAT["vllm"], dtype))
        except (ConfigError, CheckpointError) as err:
            return Measurement("vllm", dtype, threads, VLLM_TIMING, method, refused=f"jobs.export: {err}")
        return run_vllm(vllm, dtype, threads, setup, method, config)

    return {"llamacpp": llama, "vllm": vllm_run}


def run(args: argparse.Namespace) -> dict:
    commit = git_commit()  # the code this process imported, not HEAD after a long run
    target_path = str(resolve_path(args.target))
    engines = parse_list(args.engines, ENGINES, "--engines")
    dtypes = parse_list(args.dtypes, DTYPES, "--dtypes")
    threads = parse_threads(args.threads)
    methods = {"eyas": parse_list(args.eyas_methods, None, "--eyas-methods"),
               **{e: parse_list(getattr(args, f"{e}_methods"), known, f"--{e}-methods")
                  for e, known in PEER_METHODS.items()}}
    sizes = PeerSizes(args.ngram_match, args.ngram_draft, args.num_draft)
    args.spec = args.spec or list(DEFAULT_SPECS)
    args.drafters_dir, args.draft_model = str(resolve_path(args.drafters_dir)), str(resolve_path(args.draft_model))
    drafter = str(resolve_path(args.drafter)) if args.drafter else default_drafter("eagle3", args,
                                                                                   Path(target_path).name)
    vllm = vllm_module() if "vllm" in engines else None
    if "vllm" in engines and vllm is None:
        engines.remove("vllm")
    if "llamacpp" in engines:
        llamacpp.llama_server_bin()  # a missing build fails now, not after eyas's measurements
    workdir = Path(resolve_path(args.workdir))
    workdir.mkdir(parents=True, exist_ok=True)
    prompts, eos = encoded_prompts(args, target_path)
    setup = RunSetup(target_path, prompts, args.max_new_tokens, eos, workdir)
    eyas_plan = eyas_methods(methods["eyas"], args, target_path) if "eyas" in engines else []
    runners = peer_runners(args, setup, vllm, sizes, drafter)
    measured: list[Measurement] = []
    for engine, dtype, t, method in plan(engines, dtypes, threads, methods):
        print(f"[bench_peers] {ENGINE_NAMES[engine]} {dtype} {t} thread(s) {method}", file=sys.stderr, flush=True)
        with cpu_lock(args.lock):
            done = run_eyas(setup, dtype, t, eyas_plan) if engine == "eyas" else [runners[engine](dtype, t, method)]
        measured += done
        for m in done:
            speed = f"refused: {m.refused}" if m.refused else f"{m.new_tokens / m.seconds:.1f} tok/s"
            print(f"[bench_peers]   {m.method}: {speed}", file=sys.stderr, flush=True)
    rows = rows_of(measured)
    features = cpu_features()
    settings = {"eyas": {label: spec_settings(spec) for label, spec, _ in eyas_plan}} if eyas_plan else {}
    settings.update({e: {m: peer_settings(e, m, sizes) for m in methods[e]} for e in PEER_METHODS if e in engines})
    return {"commit": commit,
            "machine": {"cpu_model": features.model, "cpu_features": features.to_dict(), "num_cpus": os.cpu_count(),
                        "load_start": loadavg()},
            "config": {"target": target_path, "engines": engines, "dtypes": dtypes, "threads": threads,
                       "methods": {e: methods[e] for e in engines}, "suites": list(prompts),
                       "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                       "drafter": drafter, "specs": args.spec, "settings": settings,
                       "command": " ".join(["python -m jobs.bench_peers", *sys.argv[1:]])},
            "results": rows, "summary": summary(rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench_peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--threads", default="1,2,auto", help="thread counts each engine runs at, joined by commas; "
                        "auto: eyas's own policy (eyas only)")
    parser.add_argument("--eyas-methods", default=VANILLA, help=f"jobs.bench's labels, e.g. {','.join(EYAS_METHODS)}")
    for engine, known in PEER_METHODS.items():
        parser.add_argument(f"--{engine}-methods", default=VANILLA, help=f"of {','.join(known)}")
    parser.add_argument("--spec", action="append", default=[], metavar="YAML", help="jobs.bench's --spec files for "
                        "eyas's methods (default: jobs/configs/bench-smollm2/*.yaml)")
    parser.add_argument("--ngram-match", type=int, default=PeerSizes.ngram_match, help="the peers' n-gram lookup")
    parser.add_argument("--ngram-draft", type=int, default=PeerSizes.ngram_draft, help="tokens a peer's n-gram drafts")
    parser.add_argument("--num-draft", type=int, default=PeerSizes.num_draft, help="the peers' EAGLE-3 chain")
    parser.add_argument("--drafter", help="the EAGLE-3 the peers draft with (default: the one eyas's eagle3 reads)")
    parser.add_argument("--drafters-dir", default=str(eyas_home() / "drafters"))
    parser.add_argument("--draft-model", default=str(eyas_home() / "targets" / "draft-smollm2"))
    parser.add_argument("--suite", default="humaneval,chat")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts per suite")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--target", default=str(eyas_home() / "targets" / "smollm2-135m"))
    parser.add_argument("--gguf-dir", default=str(eyas_home() / "gguf"), help="where the target's GGUFs are cached")
    parser.add_argument("--workdir", default="out/bench_peers", help="drafter exports and engine logs go here")
    add_report_args(parser, "bench_peers.json", lock_help="for each measurement")
    args = parser.parse_args(argv)
    args.prompts_file = None  # jobs.bench.load_prompts' other source
    return report_main(args, "bench_peers", run, markdown)


if __name__ == "__main__":
    sys.exit(main())
