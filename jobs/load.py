"""Serving load test: speculative against vanilla serving, throughput and latency at several concurrencies, one run.

    python -m jobs.load [--config serving/configs/tiny.yaml] [--target PATH] [--arg KEY=VALUE ...]
        [--concurrency 1,4,8] [--requests-per-level N] [--max-tokens N] [--passes N]
        [--suite code|prose|all|chat|humaneval | --prompts-file FILE.jsonl] [--max-prompt-chars N]
        [--temperature T] [--baseline replica|twin] [--out load.json]
    python -m jobs.load --soak MINUTES [--soak-concurrency N] [--max-rss-growth-mb MB] [--config ...] [--out soak.json]
    python -m jobs.load --endpoint URL [--engine eyas|vllm|llamacpp|other] [--model NAME] [--concurrency 1,4,8]
        [--requests-per-level N] [--max-tokens N] [--passes N] [--suite ...|--prompts-file FILE.jsonl] [--label NAME]
        [--out ...]

``--endpoint URL`` loads a server that is already running instead, any OpenAI-compatible one (eyas's, vLLM's,
llama-server; jobs.peers.endpoint), with the ``openai`` client: per concurrency level tokens/s, p50/p99 latency and
time to first token, and acceptance where the engine reports it (eyas's ``spec`` field, vLLM's
``vllm:spec_decode_*`` counters at /metrics, llama-server's ``timings``: jobs.peers.acceptance). URL is the server
(``http://127.0.0.1:8000``, or with its route, ``.../spec``; a trailing ``/v1`` is fine). It writes
``{"commit", "machine", "config", "results": [...]}`` too, one row per level; ``--label`` names the run in the
rows (e.g. ``vllm-eagle3``), so reports of several engines concatenate into one side-by-side table.

Measures the config's application (``spec``) against vanilla decoding, each on exactly one replica (autoscaling
off, so both numbers are per replica). ``--baseline`` says what vanilla is:

- ``replica`` (the default): the very same replica with drafting switched off. jobs.load deploys the application
  once (route /spec) and, before each measurement, sets its schedule through a deployment handle
  (``EyasServer.set_speculation``, what a ``user_config`` update does): the configured schedule for ``spec``,
  ``{1: 0}`` for ``vanilla``, where every cycle is a plain decode step (the engine's budget-0 cycle is vanilla's
  cycle, and its output is vanilla's: tests/unit/decoding/test_batch.py). Same process, same cores, same memory:
  the ratio measures speculation and nothing else.
- ``twin``: a second application with ``spec.method: vanilla`` (route /vanilla) beside the first. It runs the
  vanilla method itself, but two replicas on a small machine do not get the same share of it: on a 2-core box two
  replicas doing the very same work measured up to 10% apart.

At concurrency c, c closed-loop clients stream completions over loopback (a client sends its next request when its
last one ends) until ``--requests-per-level`` requests are done; spec and vanilla alternate, in a rotating order
per level, so slow drifts of the machine hit both alike. Greedy by default, so both modes generate the very same
tokens (in float32, and in bfloat16 where ``Decoder.verify_is_exact`` holds for the batch's rows; elsewhere in
bfloat16 near-ties in the argmax can flip). At temperature 0 the report checks it: ``greedy_identical`` is the share
of a level's requests whose speculative text equals vanilla's for the same request (same prompt, same seed) at the
same concurrency (and pass).

The traffic (``--suite``, ``--prompts-file``) and ``--passes N``, which sends the same traffic N times and reports
each pass against vanilla's of the same pass: jobs/traffic.py.

Per (mode, c, pass): tokens/s (generated tokens over the level's wall time), p50/p99 request latency, p50 time to
first token, mean tau, mean drafted nodes per sequence and cycle (``draft_nodes``: 0 for vanilla); ``speedup`` = spec
tokens/s over vanilla tokens/s at the same c and pass; ``scaling`` = tokens/s over the same mode's at the lowest
concurrency. Writes load.json ``{"commit", "machine", "config", "results": [...]}``; ``config.shares_answers`` says
whether the replica drafts from a shared index of its answers.

``--soak MINUTES`` instead deploys the configured application alone (one replica, route /spec) and runs jobs.soak's
mixed load on it for that long (streaming, non-streaming, chat, sampled, seeded, over-long, malformed, dropped
streams); it writes ``{"commit", "machine", "config", "soak": {...}}`` and exits 1 when the soak found a 5xx, a
greedy output that differs from the single request's, rows left held, or RSS growth past ``--max-rss-growth-mb``.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from ray import serve

from eyas.config import ConfigError, apply_overrides
from eyas.datasets import DatasetError
from eyas.decoding.tp import free_port
from eyas.files import writable_path, write_text_atomic
from eyas.methods import reads_history
from eyas_ray.cluster import init_ray
from eyas_ray.deploy import run_config
from eyas_ray.serve_config import LiveSettings, ServeArgs
from jobs.bench import git_commit, machine
from jobs.peers.endpoint import ENGINES, WARMUP_PROMPT, measure, print_rows
from jobs.soak import percentile, print_report, soak
from jobs.traffic import MODES, SUITES, concurrency_levels, rounds, traffic_prompts

BASELINES = ("replica", "twin")
DRAFTING_OFF = {1: 0}  # the replica baseline's schedule: no row drafts at any batch size


def app_configs(config: dict[str, Any], target: str | None, port: int, overrides: list[str] = ()
                ) -> dict[str, dict[str, Any]]:
    """mode -> a one-application Serve config: the first application as configured (``overrides`` are dotted
    ``KEY=VALUE`` strings applied to its args), and its vanilla twin."""
    if not config.get("applications"):
        raise ConfigError("the serve config has no `applications:`")
    base = copy.deepcopy(config["applications"][0])
    base["args"] = apply_overrides(base.get("args") or {}, list(overrides))
    if target:
        base["args"]["target"] = target
    deployments = [d for d in base.get("deployments") or [] if d.get("name") == "EyasServer"] or [
        {"name": "EyasServer"}]
    for deployment in deployments:
        deployment.pop("autoscaling_config", None)
        deployment["num_replicas"] = 1
    base["deployments"] = deployments
    out = {}
    for mode in MODES:
        app = copy.deepcopy(base)
        app.update(name=f"load-{mode}", route_prefix=f"/{mode}")
        if mode == "vanilla":
            app["args"].pop("spec_file", None)
            app["args"]["spec"] = {"method": "vanilla"}
        out[mode] = {"http_options": {"host": "127.0.0.1", "port": port}, "proxy_location": "HeadOnly",
                     "applications": [app]}
    return out


def configured_schedule(app: dict[str, Any]) -> dict[int, int | None]:
    """The schedule the application serves with: its deployment's ``user_config`` (LiveSettings) when that sets
    one, else ``args.speculation_by_batch``."""
    for deployment in app.get("deployments") or []:
        live = LiveSettings.from_user_config(deployment.get("user_config"))
        if live.speculation_by_batch is not None:
            return live.speculation_by_batch
    return ServeArgs.from_args(app["args"]).speculation_by_batch


async def one_request(client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Stream one completion; returns latency, time to first token, generated tokens and tau."""
    start = time.perf_counter()
    first = None
    final: dict[str, Any] = {}
    text = []
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']['message']}")
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter() - start if first is None else first
                text.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                final = chunk
    latency = time.perf_counter() - start
    return {"latency": latency, "ttft": first if first is not None else latency,
            "tokens": final["usage"]["completion_tokens"], "tau": final["spec"]["tau"],
            "draft_nodes": final["spec"]["mean_draft_nodes"], "text": "".join(text)}


async def run_level(base_url: str, mode: str, model: str, prompts: list[str | list[int]], concurrency: int,
                    num_requests: int, max_tokens: int, temperature: float, route: str | None = None
                    ) -> dict[str, Any]:
    """One (mode, concurrency) measurement against ``route`` (default: the mode's own, /spec or /vanilla)."""
    import httpx

    url = f"{base_url}{route or '/' + mode}/v1/completions"
    queue = list(range(num_requests))
    records: list[dict[str, Any]] = []

    async def client_loop(client) -> None:
        while queue:
            i = queue.pop(0)
            body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                    "temperature": temperature, "seed": i, "stream": True,
                    "stream_options": {"include_usage": True}}  # OpenAI sends the usage chunk only when asked
            records.append({"index": i, **await one_request(client, url, body)})

    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*[client_loop(client) for _ in range(concurrency)])
        seconds = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in records)
    taus = [r["tau"] for r in records if r["tau"] is not None]
    return {"mode": mode, "concurrency": concurrency, "num_requests": len(records), "new_tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds,
            "latency_p50_s": percentile([r["latency"] for r in records], 50),
            "latency_p99_s": percentile([r["latency"] for r in records], 99),
            "ttft_p50_s": percentile([r["ttft"] for r in records], 50),
            "tau": statistics.fmean(taus) if taus else None,
            "draft_nodes": statistics.fmean(r["draft_nodes"] for r in records),
            "texts": {r["index"]: r["text"] for r in records}}


def add_ratios(results: list[dict[str, Any]], greedy: bool = False) -> None:
    """Each row's speedup over vanilla (same concurrency and pass) and scaling over its mode's lowest concurrency
    (same pass); with ``greedy``, the spec rows' ``greedy_identical`` (the share of requests whose text is
    vanilla's at the same concurrency and pass). The rows' ``texts`` are dropped. A row without ``pass`` is pass 1."""
    for r in results:
        r.setdefault("pass", 1)
    by_key = {(r["mode"], r["concurrency"], r["pass"]): r for r in results}
    lowest = min(r["concurrency"] for r in results)
    for r in results:
        vanilla = by_key.get(("vanilla", r["concurrency"], r["pass"]))
        r["speedup"] = r["tokens_per_s"] / vanilla["tokens_per_s"] if vanilla else None
        r["scaling"] = r["tokens_per_s"] / by_key[(r["mode"], lowest, r["pass"])]["tokens_per_s"]
        r["greedy_identical"] = None
        if greedy and r["mode"] != "vanilla" and vanilla and r.get("texts") and vanilla.get("texts"):
            same = [text == vanilla["texts"].get(i) for i, text in r["texts"].items()]
            r["greedy_identical"] = sum(same) / len(same)
    for r in results:
        r.pop("texts", None)


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"{'mode':8} {'conc':>4} {'pass':>4} {'tok/s':>8} {'speedup':>7} {'scaling':>7} {'p50 s':>7} {'p99 s':>7} "
          f"{'ttft50':>7} {'tau':>5} {'nodes':>5} {'same':>5}")
    for r in sorted(results, key=lambda r: (r["concurrency"], r["pass"], r["mode"])):
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        same = f"{r['greedy_identical']:.2f}" if r.get("greedy_identical") is not None else "-"
        print(f"{r['mode']:8} {r['concurrency']:>4} {r['pass']:>4} {r['tokens_per_s']:>8.1f} {r['speedup']:>7.2f} "
              f"{r['scaling']:>7.2f} {r['latency_p50_s']:>7.3f} {r['latency_p99_s']:>7.3f} {r['ttft_p50_s']:>7.3f} "
              f"{tau:>5} {r.get('draft_nodes', 0.0):>5.2f} {same:>5}")
    print("nodes: drafted nodes per sequence and cycle; same: the share of a level's requests whose speculative text "
          "equals vanilla's in the same pass (greedy runs only)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="serving/configs/tiny.yaml", help="a Serve config (serving/configs)")
    parser.add_argument("--target", help="override the application's args.target (with --endpoint: the chat "
                        "suite's tokenizer)")
    parser.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                        help="override an application arg, e.g. max_batch_size=4 or spec.num_draft=6")
    parser.add_argument("--concurrency", default="1,4,8", help="comma-separated client counts")
    parser.add_argument("--requests-per-level", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--passes", type=int, default=1, help="send the same traffic this many times")
    parser.add_argument("--suite", choices=SUITES, default="all")
    parser.add_argument("--prompts-file", help="one {\"prompt\": ...} JSON object a line, instead of --suite")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-prompt-chars", type=int, default=400,
                        help="cut longer completion prompts to their end (small contexts)")
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer chat prompts")
    parser.add_argument("--port", type=int, help="HTTP port (default: a free one)")
    parser.add_argument("--baseline", choices=BASELINES, default="replica",
                        help="vanilla is the same replica with drafting off (replica), or a second, vanilla-method "
                             "application beside it (twin)")
    parser.add_argument("--out", help="the report (default: load.json, or soak.json with --soak)")
    parser.add_argument("--soak", type=float, metavar="MINUTES", help="run the mixed soak this long instead")
    parser.add_argument("--endpoint", metavar="URL", help="load this running OpenAI-compatible server instead")
    parser.add_argument("--engine", choices=ENGINES, help="with --endpoint: the engine (default: /v1/models' owned_by)")
    parser.add_argument("--model", help="with --endpoint: the model name (default: the first of /v1/models)")
    parser.add_argument("--label", help="with --endpoint: the run's name in the report's rows (default: the engine)")
    parser.add_argument("--soak-concurrency", type=int, default=6, help="closed-loop clients in the soak")
    parser.add_argument("--max-rss-growth-mb", type=float, default=256.0,
                        help="fail the soak when the replica's and workers' RSS grows more than this")
    args = parser.parse_args(argv)
    args.out = args.out or ("soak.json" if args.soak is not None else "load.json")
    if args.endpoint:
        return run_endpoint(args)
    try:
        levels = concurrency_levels(args)
        if args.soak is not None and not (args.soak > 0 and args.soak_concurrency >= 1):
            raise ConfigError(f"--soak {args.soak} --soak-concurrency {args.soak_concurrency}: give minutes > 0 "
                              "and at least one client")
        writable_path(args.out)
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"--config {path}: file does not exist")
        config = yaml.safe_load(path.read_text()) or {}
        port = args.port or free_port()
        configs = app_configs(config, args.target, port, args.arg)
        model = configs["spec"]["applications"][0]["args"].get("model_name")
        schedules = {"spec": configured_schedule(configs["spec"]["applications"][0]), "vanilla": DRAFTING_OFF}
        prompts = traffic_prompts(args, configs["spec"]["applications"][0]["args"].get("target"))
        if args.soak is not None and not all(isinstance(p, str) for p in prompts):
            raise ConfigError("--soak writes chat and completion requests around prompt texts: give --suite "
                              "code|prose|all|humaneval or --prompts-file")
    except (ConfigError, ValueError, DatasetError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    deployed = ("spec",) if args.soak is not None or args.baseline == "replica" else MODES
    serve_args = {mode: ServeArgs.from_args(configs[mode]["applications"][0]["args"]) for mode in deployed}
    ray_options: dict[str, Any] = {"log_to_driver": False}
    if not os.environ.get("RAY_ADDRESS"):
        # a local Ray gets enough logical CPUs for the applications: deployed side by side (twin) but measured one
        # at a time, so an idle one only holds its reservation
        reserved = sum(bundle.get("CPU", 0) for a in serve_args.values() for bundle in a.bundles())
        ray_options["num_cpus"] = max(os.cpu_count() or 1, math.ceil(reserved) + 1)
    init_ray(**ray_options)
    model = model or serve_args["spec"].served_name
    for mode in deployed:
        print(f"[load] deploying {mode} ...", flush=True)
        run_config(configs[mode])
    base_url = f"http://127.0.0.1:{port}"
    if args.soak is not None:
        return run_soak(args, path, configs["spec"], base_url, model, prompts)
    handle = serve.get_app_handle("load-spec") if args.baseline == "replica" else None

    def measure(mode: str, traffic: list[str | list[int]], concurrency: int, num_requests: int, max_tokens: int
                ) -> dict[str, Any]:
        route = None
        if handle is not None:  # one replica plays both modes: set its schedule first (between two rounds)
            handle.set_speculation.remote(schedules[mode]).result()
            route = "/spec"
        return asyncio.run(run_level(base_url, mode, model, traffic, concurrency, num_requests, max_tokens,
                                     args.temperature, route))

    results = []
    try:
        for mode in MODES:  # warm-up (first requests pay for lazy initialisation), off the traffic's prompts
            measure(mode, [WARMUP_PROMPT], 1, 2, 8)
        for n, concurrency, mode in rounds(levels, args.passes):
            result = measure(mode, prompts, concurrency, max(args.requests_per_level, concurrency), args.max_tokens)
            result["pass"] = n
            tau = f" tau={result['tau']:.2f}" if result["tau"] is not None else ""
            print(f"[load] {mode} c={concurrency} pass {n}: {result['tokens_per_s']:.1f} tok/s "
                  f"p50={result['latency_p50_s']:.3f}s p99={result['latency_p99_s']:.3f}s{tau}", flush=True)
            results.append(result)
    finally:
        for mode in deployed:
            serve.delete(f"load-{mode}")
    add_ratios(results, greedy=args.temperature == 0)
    report = {"commit": git_commit(), "machine": machine(),
              "config": {"serve_config": str(path), "app": configs["spec"]["applications"][0],
                         "concurrency": levels, "requests_per_level": args.requests_per_level,
                         "baseline": args.baseline, "schedules": {m: {str(k): v for k, v in schedules[m].items()}
                                                                  for m in MODES},
                         "passes": args.passes, "shares_answers": shares_answers(serve_args["spec"]),
                         "prompts": args.prompts_file or args.suite, "num_prompts": len(prompts),
                         "max_prompt_chars": args.max_prompt_chars, "max_prompt_tokens": args.max_prompt_tokens,
                         "max_tokens": args.max_tokens, "temperature": args.temperature, "suite": args.suite},
              "results": results}
    out = Path(args.out)
    write_text_atomic(out, json.dumps(report, indent=2))  # never a half-written report
    print_table(results)
    print(f"[load] wrote {out}")
    return 0


def run_soak(args: argparse.Namespace, path: Path, config: dict[str, Any], base_url: str, model: str,
             prompts: list[str]) -> int:
    print(f"[load] soak: {args.soak:g} min, {args.soak_concurrency} clients ...", flush=True)
    try:
        result = asyncio.run(soak(f"{base_url}/spec", "load-spec", model, prompts, args.soak,
                                  args.soak_concurrency, args.max_tokens, args.max_rss_growth_mb))
    finally:
        serve.delete("load-spec")
    report = {"commit": git_commit(), "machine": machine(),
              "config": {"serve_config": str(path), "app": config["applications"][0], "minutes": args.soak,
                         "max_prompt_chars": args.max_prompt_chars, "suite": args.suite}, "soak": result}
    out = args.out
    write_text_atomic(Path(out), json.dumps(report, indent=2))
    print_report(result)
    print(f"[load] wrote {out}; soak {'passed' if result['ok'] else 'FAILED'}")
    return 0 if result["ok"] else 1


def shares_answers(args: ServeArgs) -> bool:
    """Whether the replica keeps a shared index of its finished answers that its drafters read."""
    return args.share_answers and reads_history(args.spec)


def run_endpoint(args: argparse.Namespace) -> int:
    """--endpoint: load a running server (no Ray), write the report, print the table."""
    try:
        levels = concurrency_levels(args)
        writable_path(args.out)
        prompts = traffic_prompts(args, args.target)
    except (ConfigError, ValueError, DatasetError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    server, rows = measure(args.endpoint, prompts, levels, args.requests_per_level, args.max_tokens,
                           args.temperature, args.engine, args.model, args.passes)
    for row in rows:
        row["label"] = args.label or server["engine"]
        row.pop("texts")
    report = {"commit": git_commit(), "machine": machine(),
              "config": {**server, "concurrency": levels, "requests_per_level": args.requests_per_level,
                         "max_tokens": args.max_tokens, "temperature": args.temperature, "passes": args.passes,
                         "prompts": args.prompts_file or args.suite, "num_prompts": len(prompts),
                         "max_prompt_chars": args.max_prompt_chars, "max_prompt_tokens": args.max_prompt_tokens},
              "results": rows}
    write_text_atomic(Path(args.out), json.dumps(report, indent=2))
    print_rows(rows)
    print(f"[load] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
