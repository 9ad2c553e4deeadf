"""One engine running one method over every prompt, as jobs.bench_peers measures it: the Measurement and its JSON
row, and a runner per engine (eyas in process; llama-server and vLLM's OpenAI server started, warmed up, timed, and
stopped). A server that will not start is a refused measurement carrying the engine's reason
(jobs.bench_peers_methods.refusal_reason); a failure after start-up raises. Timing notes: jobs.bench_peers."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ContextManager

from eyas.config import ConfigError
from eyas.decoding.generate import generate
from eyas.methods import SpecConfig, build_drafter
from eyas.models import CheckpointError, load_target
from eyas.models.dtypes import target_dtype
from eyas.threads import OPENMP_KNOBS, configure_threads
from jobs.bench_peers_methods import VANILLA, refusal_reason
from jobs.bench_peers_report import GGUF_TYPE
from jobs.export import export_drafter
from jobs.peers import llamacpp
from jobs.peers.acceptance import Acceptance, delta, from_llamacpp_timings
from jobs.peers.cli import loadavg
from jobs.peers.endpoint import read_vllm_counters

EYAS_POLICY = "auto"  # a threads value: eyas's own thread policy (eyas.threads: its kernels adapt), eyas only
LLAMACPP_TIMING = "llama-server timings (prompt + decode)"
VLLM_TIMING = "HTTP wall time"
EyasMethod = tuple[str, SpecConfig | None, str | None]  # (label, its spec, why it cannot run)


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

def run_eyas(setup: RunSetup, dtype: str, threads: int | str, methods: list[EyasMethod]) -> list[Measurement]:
    """Every method on one target load: each drafter built, warmed up on the first prompt, then timed."""
    configure_threads(None if threads == EYAS_POLICY else threads)
    activation_dtype, weight_format = target_dtype(dtype, "--dtypes")
    target = load_target(setup.target_path, dtype=activation_dtype, weight_format=weight_format)
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


def start_or_refuse(stack: contextlib.ExitStack, server: ContextManager[str], log: Path
                    ) -> tuple[str | None, str | None]:
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
