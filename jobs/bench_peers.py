"""eyas's decoding, plain and speculative, beside the peer engines', one run: the same prompt tokens, greedy, single
request.

    python -m jobs.bench_peers [--engines eyas,llamacpp,vllm] [--dtypes bfloat16,float32,q8_0] [--threads 1,2,auto]
        [--eyas-methods vanilla,ngram,...] [--llamacpp-methods vanilla,ngram-simple,...] [--vllm-methods vanilla,...]
        [--spec YAML ...] [--ngram-match 3] [--ngram-draft 8] [--num-draft 1] [--drafter DIR]
        [--suite humaneval,chat | --prompts-file FILE.jsonl] [--num-prompts 8] [--max-new-tokens 128]
        [--target PATH] [--gguf-dir DIR]
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
per suite and overall, against the 1.3x goal (jobs.bench_peers_report). q8_0 is eyas's and llama.cpp's (vLLM has
no int8 path here): eyas quantizes the target's float weights with GGUF's Q8_0 rounding, the same weights llama.cpp's
converter writes. The JSON also records the CPU (``machine.cpu_features``), the commit and the load average before
and after each measurement.
``--from a.json,b.json`` renders several runs into one page (docs/bench-peers-smollm2.md: the vanilla run, then
the speculative one).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from transformers import AutoConfig

from eyas.config import ConfigError, eyas_home, resolve_path
from eyas.cpu import cpu_features
from eyas.methods import SpecConfig
from eyas.models import CheckpointError, load_tokenizer
from jobs.bench import available, default_drafter, git_commit, spec_for
from jobs.bench_inputs import load_prompts, spec_overrides
from jobs.bench_peers_measure import (EYAS_POLICY, LLAMACPP_TIMING, VLLM_TIMING, DrafterExports, EyasMethod,
                                      Measurement, Prompts, RunSetup, run_eyas, run_llamacpp, run_vllm, target_gguf,
                                      vllm_module)
from jobs.bench_peers_methods import (DRAFTER_FORMAT, EYAS_METHODS, PEER_METHODS, VANILLA, PeerSizes,
                                      llamacpp_spec_args, peer_settings, vllm_speculative_config)
from jobs.bench_peers_report import DTYPES, ENGINE_DTYPES, ENGINE_NAMES, ENGINES, best_vs_best, markdown, summary
from jobs.peers import llamacpp
from jobs.peers.cli import add_report_args, cpu_lock, loadavg, parse_list, report_main

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SPECS = tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "jobs/configs/bench-smollm2").glob("*.yaml")))


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


# -- the run -------------------------------------------------------------------------------------------------------



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


def plan(engines: list[str], dtypes: list[str], threads: list[int | str],
         peer_methods: dict[str, list[str]] | None = None) -> list[tuple[str, str, int | str, str]]:
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
            "results": rows, "summary": summary(rows), "goal": best_vs_best(rows, list(prompts))}


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
    parser.add_argument("--prompts-file", help='JSONL with one {"prompt": "..."} per line, instead of --suite')
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts per suite")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--target", default=str(eyas_home() / "targets" / "smollm2-135m"))
    parser.add_argument("--gguf-dir", default=str(eyas_home() / "gguf"), help="where the target's GGUFs are cached")
    parser.add_argument("--workdir", default="out/bench_peers", help="drafter exports and engine logs go here")
    add_report_args(parser, "bench_peers.json", lock_help="for each measurement")
    args = parser.parse_args(argv)
    return report_main(args, "bench_peers", run, markdown)


if __name__ == "__main__":
    sys.exit(main())
