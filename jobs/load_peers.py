"""eyas, vLLM and llama.cpp serving side by side: each engine serves the target plainly, with prompt lookup (ngram)
and with the same eyas EAGLE-3 drafter, and jobs.load --endpoint's loop loads each over HTTP at every concurrency.

    python -m jobs.load_peers [--engines eyas,vllm,llamacpp] [--methods vanilla,ngram,eagle3] [--concurrency 1,4,8]
        [--target DIR] [--drafter DIR|models:/NAME@ALIAS] [--dtype float32|bfloat16] [--threads 1] [--num-draft 3]
        [--suite chat|code|prose|humaneval | --prompts-file FILE.jsonl] [--num-prompts 8] [--requests-per-level 8]
        [--max-tokens 64] [--workdir out/load_peers] [--lock /tmp/eyas-cpu.lock]
        [--out load_peers.json] [--report load_peers.md]
    python -m jobs.load_peers --from load_peers.json --report load_peers.md

One cell is one (engine, method): its server starts, jobs.peers.endpoint.measure warms it up and runs every
concurrency level (c closed-loop clients streaming /v1/completions through the openai client, greedy, a seed per
request; tokens/s, latency and TTFT percentiles, and the acceptance the engine reports), then the server stops.
The servers, each the engine's own:

- eyas: its Ray Serve application (serving.app, deployed as ``serve run`` would, on a local Ray started once), one
  replica, ``max_batch_size`` the highest concurrency, ``share_answers`` off (an ngram cell would otherwise draft
  from the answers of earlier levels to the very same prompts), ``torch_threads`` = --threads.
- vLLM: its OpenAI server from .venv-tools/vllm (jobs.peers.vllm), ``max_num_seqs`` 8.
- llama.cpp: llama-server from .venv-tools/llama.cpp (jobs.peers.llamacpp), one slot per client of the highest
  concurrency, the target converted to GGUF at --dtype (cached in --workdir).

Every engine drafts the same shapes: ngram a chain of 4 tokens from a prompt match; EAGLE-3 a chain of --num-draft
from the drafter, exported with jobs.export (``--to vllm``; ``--to gguf`` for llama.cpp). The report keeps each
cell's settings, and per speculative level ``same_as_vanilla``: the share of requests whose text equals the same
engine's vanilla text for the same request (greedy: 1.0 in float32 where the engine is lossless). --lock takes a
flock around each cell (start-up and measurement), not around the whole run. Writes ``{"commit", "machine",
"config", "results": [one row per engine, method and level]}`` and its Markdown (jobs.load_peers_report).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager

import ray
from ray import serve

from eyas.config import ConfigError, eyas_home, resolve_path
from eyas.cpu import cpu_features
from eyas.datasets import SUITES, suite_prompts
from eyas.decoding.tp import free_port
from eyas.files import writable_path
from eyas.methods import resolve_checkpoint
from eyas.models import load_tokenizer
from eyas_ray.cluster import init_ray
from eyas_ray.deploy import run_config
from jobs.bench import git_commit
from jobs.bench_inputs import prompts_file
from jobs.bench_peers_measure import target_gguf, without_openmp_policy
from jobs.export import export_drafter
from jobs.load_peers_report import ENGINES, METHODS, markdown
from jobs.peers import llamacpp, vllm
from jobs.peers.cli import add_report_args, cpu_lock, loadavg, parse_list, report_main
from jobs.peers.endpoint import measure

NGRAM_DRAFT = 4        # tokens an ngram cell drafts, in every engine
NGRAM_MATCH = 3        # the longest prompt n-gram matched (vLLM's prompt_lookup_max, llama.cpp's size-n)
CONTEXT_TOKENS = 2048  # context per sequence in every engine


@dataclass
class Cell:
    """What every (engine, method) cell gets: the target, the drafter and its exports, the run's sizes."""
    target_dir: Path
    drafter_dir: Path | None      # None when no EAGLE-3 cell runs
    workdir: Path                 # exports and GGUFs go here
    dtype: str
    threads: int
    num_draft: int
    levels: list[int]             # concurrencies
    eyas_port: int                # the local Serve's HTTP port, one for every eyas cell
    exports: dict[str, Path] = field(default_factory=dict)

    @property
    def max_concurrency(self) -> int:
        return max(self.levels)

    def export(self, fmt: str) -> Path:
        """The drafter in an engine's format (jobs.export, with its train/serve checks), written once a run."""
        if fmt not in self.exports:
            gguf_type = {"float32": "f32", "bfloat16": "bf16"}[self.dtype]
            out = self.workdir / (f"drafter-{gguf_type}.gguf" if fmt == "gguf" else f"drafter-{fmt}")
            if out.is_dir():
                shutil.rmtree(out)
            out.unlink(missing_ok=True)
            self.exports[fmt] = export_drafter(str(self.drafter_dir), fmt, out, str(self.target_dir), gguf_type)[1]
        return self.exports[fmt]


# -- eyas ------------------------------------------------------------------------------------------------------------

def eyas_spec(method: str, cell: Cell) -> dict[str, Any]:
    """eyas.methods.SpecConfig for each method, drafting the shapes the peers draft."""
    return {"vanilla": {"method": "vanilla"},
            "ngram": {"method": "ngram", "num_draft": NGRAM_DRAFT, "max_matches": 1},
            "eagle3": {"method": "eagle3", "drafter": str(cell.drafter_dir), "tree": "chain",
                       "depth": cell.num_draft}}[method]


@contextlib.contextmanager
def eyas_server(method: str, cell: Cell) -> Any:
    """eyas's Serve application for the ``with`` block, on the local Ray and Serve port this run started."""
    name = f"load-peers-{method}"
    app = {"name": name, "route_prefix": "/", "import_path": "serving.app:build_app",
           "args": {"target": str(cell.target_dir), "model_name": "target", "spec": eyas_spec(method, cell),
                    "dtype": cell.dtype, "max_batch_size": cell.max_concurrency,
                    "max_waiting_requests": cell.max_concurrency, "max_len": CONTEXT_TOKENS,
                    "share_answers": False, "replica_cpus": 0.5,
                    "worker_cpus": 1, "torch_threads": cell.threads},
           "deployments": [{"name": "EyasServer", "num_replicas": 1,
                            "max_ongoing_requests": 2 * cell.max_concurrency + 2}]}
    run_config({"http_options": {"host": "127.0.0.1", "port": cell.eyas_port}, "proxy_location": "HeadOnly",
                "applications": [app]})
    try:
        yield f"http://127.0.0.1:{cell.eyas_port}"
    finally:
        serve.delete(name)


@contextlib.contextmanager
def local_ray() -> Any:
    """A local Ray for eyas's cells (jobs.load's way: eyas_ray.cluster.init_ray), shut down after them."""
    init_ray(num_cpus=max(os.cpu_count() or 1, 4), log_to_driver=False, include_dashboard=False)
    try:
        yield
    finally:
        ray.shutdown()  # a local Ray stops with its Serve; a cluster's (RAY_ADDRESS) is only disconnected from


# -- the peers -------------------------------------------------------------------------------------------------------

def vllm_config(method: str, cell: Cell) -> dict[str, Any] | None:
    """vLLM's speculative_config for each method (None: vanilla)."""
    if method == "ngram":
        return vllm.ngram_config(NGRAM_DRAFT, NGRAM_MATCH)
    if method == "eagle3":
        return vllm.eagle3_config(cell.export("vllm"), cell.num_draft)
    return None


@contextlib.contextmanager
def vllm_server(method: str, cell: Cell) -> Any:
    with without_openmp_policy(), vllm.vllm_server(cell.target_dir, cell.dtype, cell.threads,
                                                   vllm_config(method, cell)) as url:
        yield url


@contextlib.contextmanager
def llamacpp_server(method: str, cell: Cell) -> Any:
    """llama-server with one slot per client; ngram-simple or the drafter's GGUF drafting an EAGLE-3 chain."""
    target = target_gguf(str(cell.target_dir), cell.dtype, cell.workdir)
    draft, spec_args = None, ()
    if method == "ngram":
        spec_args = llamacpp.ngram_spec_args(NGRAM_MATCH, NGRAM_DRAFT)
    elif method == "eagle3":
        draft, spec_args = cell.export("gguf"), llamacpp.eagle3_spec_args(cell.num_draft)
    with llamacpp.llama_server(target, cell.threads, draft, spec_args, slots=cell.max_concurrency,
                               ctx_size=CONTEXT_TOKENS) as url:
        yield url


SERVERS: dict[str, Callable[[str, Cell], ContextManager[str]]] = {
    "eyas": eyas_server, "vllm": vllm_server, "llamacpp": llamacpp_server}
TOOLS: dict[str, Callable[[], Path] | None] = {"eyas": None, "vllm": vllm.vllm_python,
                                               "llamacpp": llamacpp.llama_server_bin}
SETTINGS = {
    "eyas": {"vanilla": "-", "ngram": f"spec.method ngram, num_draft {NGRAM_DRAFT}, max_matches 1",
             "eagle3": "spec.method eagle3, tree chain, depth {n}"},
    "vllm": {"vanilla": "-", "ngram": f"ngram, num_speculative_tokens {NGRAM_DRAFT}, prompt_lookup_max "
             f"{NGRAM_MATCH}", "eagle3": "eagle3 (jobs.export --to vllm), num_speculative_tokens {n}"},
    "llamacpp": {"vanilla": "-", "ngram": f"ngram-simple, size-n {NGRAM_MATCH}, size-m {NGRAM_DRAFT}",
                 "eagle3": "draft-eagle3 (jobs.export --to gguf), spec-draft-n-max {n}, p-min 0"}}


# -- the run ---------------------------------------------------------------------------------------------------------

def load_prompts(args: argparse.Namespace, target_dir: Path) -> list[str]:
    """--prompts-file's prompts, else the suite's (chat prompts in the target's chat template, as text)."""
    if args.prompts_file:
        prompts = prompts_file(Path(args.prompts_file))[:args.num_prompts]
    else:
        prompts = suite_prompts(args.suite, args.num_prompts, load_tokenizer(target_dir), max_prompt_tokens=512)
    if not prompts:
        raise ConfigError("no prompts: give --prompts-file with one {\"prompt\": ...} a line, or a --suite")
    return prompts


def same_as_vanilla(rows: list[dict[str, Any]]) -> None:
    """Each speculative row's share of requests whose text equals its engine's vanilla text at the same level; the
    rows' texts are dropped."""
    vanilla = {(r["engine"], r["concurrency"]): r["texts"] for r in rows if r["method"] == "vanilla"}
    for r in rows:
        plain = vanilla.get((r["engine"], r["concurrency"]))
        r["same_as_vanilla"] = None
        if r["method"] != "vanilla" and plain:
            r["same_as_vanilla"] = sum(t == plain.get(i) for i, t in r["texts"].items()) / len(r["texts"])
    for r in rows:
        r.pop("texts")


def run_engine(engine: str, methods: list[str], cell: Cell, prompts: list[str], args: argparse.Namespace
               ) -> list[dict[str, Any]]:
    """Every method on one engine, each cell (server start and measurement) under the lock."""
    rows = []
    for method in methods:
        print(f"[load_peers] {engine} {method}", file=sys.stderr, flush=True)
        with cpu_lock(args.lock):
            load_before = loadavg()
            with SERVERS[engine](method, cell) as url:
                _, levels = measure(url, prompts, cell.levels, args.requests_per_level, args.max_tokens, 0.0,
                                    engine=engine, model="target")
        rows += [{"engine": engine, "method": method, **row, "load_before": load_before} for row in levels]
    return rows


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1 or max(levels) > vllm.MAX_NUM_SEQS:
        raise ConfigError(f"--concurrency {text!r}: give integers in 1..{vllm.MAX_NUM_SEQS}, e.g. 1,4,8")
    return levels


def run(args: argparse.Namespace) -> dict[str, Any]:
    commit = git_commit()  # the code this process imported, not HEAD after a long run
    engines = parse_list(args.engines, ENGINES, "--engines")
    methods = parse_list(args.methods, METHODS, "--methods")
    levels = parse_levels(args.concurrency)
    for flag in ("threads", "num_draft", "num_prompts", "requests_per_level", "max_tokens"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    for engine in engines:
        if TOOLS[engine] is not None:
            TOOLS[engine]()  # a missing tool build fails now, naming its make target
    target_dir = resolve_path(args.target)
    drafter = args.drafter or str(eyas_home() / "drafters" / f"eagle3-{target_dir.name}")
    drafter_dir = resolve_checkpoint(drafter, "--drafter") if "eagle3" in methods else None
    workdir = resolve_path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    writable_path(args.out)
    prompts = load_prompts(args, target_dir)
    cell = Cell(target_dir, drafter_dir, workdir, args.dtype, args.threads, args.num_draft, levels, free_port())
    rows: list[dict[str, Any]] = []
    for engine in engines:
        with local_ray() if engine == "eyas" else contextlib.nullcontext():
            rows += run_engine(engine, methods, cell, prompts, args)
    same_as_vanilla(rows)
    settings = {e: {m: SETTINGS[e][m].format(n=args.num_draft) for m in methods} for e in engines}
    return {"commit": commit,
            "machine": {"cpu_features": cpu_features().to_dict(), "num_cpus": os.cpu_count(),
                        "load_start": loadavg()},
            "config": {"command": " ".join(["python -m jobs.load_peers", *sys.argv[1:]]), "target": str(target_dir),
                       "drafter": str(drafter_dir) if drafter_dir else None, "engines": engines,
                       "methods": methods, "concurrency": levels, "dtype": args.dtype,
                       "threads": args.threads, "num_draft": args.num_draft,
                       "requests_per_level": args.requests_per_level, "max_tokens": args.max_tokens,
                       "prompts": args.prompts_file or args.suite, "num_prompts": len(prompts), "settings": settings},
            "results": rows}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.load_peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--concurrency", default="1,4,8", help="comma-separated client counts")
    parser.add_argument("--target", default=str(eyas_home() / "targets" / "smollm2-135m"))
    parser.add_argument("--drafter", help="an eyas EAGLE-3 (default: $EYAS_HOME/drafters/eagle3-<target name>)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=1, help="threads each engine computes with")
    parser.add_argument("--num-draft", type=int, default=3, help="the EAGLE-3 chain every engine drafts")
    parser.add_argument("--suite", choices=SUITES, default="chat")
    parser.add_argument("--prompts-file", help="one {\"prompt\": ...} JSON object a line")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--requests-per-level", type=int, default=8, help="requests at each concurrency (at least c)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--workdir", default="out/load_peers", help="exports and GGUFs go here")
    add_report_args(parser, "load_peers.json", lock_help="around each cell")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return report_main(parse_args(argv), "load_peers", run, markdown)


if __name__ == "__main__":
    sys.exit(main())
