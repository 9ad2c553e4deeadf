"""Load on any OpenAI-compatible endpoint (eyas, vLLM, llama-server) with the official ``openai`` client:
``python -m jobs.load --endpoint URL`` (jobs/load.py's docstring has the options).

At concurrency c, c closed-loop clients stream completions until the level's requests are done. Per level:
generated tokens/s over the level's wall time, p50/p99 latency and time to first token, and the engine's
acceptance where it reports it (jobs.peers.acceptance: eyas's ``spec`` field, vLLM's /metrics counters read before
and after the level, llama-server's per-response ``timings``). Greedy by default, with a seed per request.

The engine is told by GET /v1/models (``owned_by``: eyas, vllm, llamacpp), or named with ``--engine``. Requests to
llama-server each open a connection of their own: its HTTP server drops a second request on a kept-alive connection.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from typing import Any

from jobs.peers.acceptance import Acceptance, delta, from_eyas_spec, from_llamacpp_timings, vllm_counters
from jobs.soak import percentile

ENGINES = ("eyas", "vllm", "llamacpp", "other")
# the warm-up's prompt, none of the traffic's: a server that drafts from its earlier answers (eyas's shared suffix
# index) must not have seen the traffic before the first pass
WARMUP_PROMPT = "Warm-up: count from one to ten."


def api_base(endpoint: str) -> str:
    """The endpoint without a trailing ``/v1`` or slash: the OpenAI API is under ``{base}/v1``."""
    base = endpoint.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def served_model(base: str) -> tuple[str, str]:
    """(model id, engine) from GET /v1/models: the first model, its ``owned_by`` as the engine (else ``other``)."""
    models = get_json(f"{base}/v1/models").get("data") or []
    if not models:
        raise RuntimeError(f"{base}/v1/models lists no model")
    owner = str(models[0].get("owned_by", "")).lower()
    return models[0]["id"], owner if owner in ENGINES else "other"


def metrics_root(base: str) -> str:
    """vLLM's /metrics lives at the server's root, also when the API is served under a route prefix."""
    scheme, _, rest = base.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"


def read_vllm_counters(base: str) -> Acceptance | None:
    """vLLM's spec-decode counters from its /metrics; None where the server has none (vLLM behind Ray Serve LLM
    exports them through Ray's metrics instead)."""
    try:
        return vllm_counters(get_text(f"{metrics_root(base)}/metrics"))
    except urllib.error.URLError:
        return None


def openai_client(base: str, engine: str, concurrency: int):
    import httpx
    import openai

    keepalive = 0 if engine == "llamacpp" else concurrency  # llama-server: one connection per request
    http_client = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 2,
                                                                       max_keepalive_connections=keepalive))
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", http_client=http_client, max_retries=0)


async def one_request(client, model: str, prompt: str | list[int], max_tokens: int, temperature: float, seed: int
                      ) -> dict[str, Any]:
    """Stream one completion: latency, time to first token, generated tokens, text, and the acceptance the
    engine reported in the response (eyas ``spec``, llama-server ``timings``)."""
    start = time.perf_counter()
    first = None
    text: list[str] = []
    tokens = None
    reported = Acceptance()
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                             temperature=temperature, seed=seed, stream=True,
                                             stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - start if first is None else first
            text.append(chunk.choices[0].text)
        extra = chunk.model_extra or {}
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if extra.get("spec"):
            reported = reported.add(from_eyas_spec(extra["spec"]))
        if extra.get("timings"):
            reported = reported.add(from_llamacpp_timings(extra["timings"]))
            tokens = tokens if tokens is not None else extra["timings"].get("predicted_n")
    latency = time.perf_counter() - start
    if tokens is None:
        raise RuntimeError("the stream reported no usage (completion_tokens): is stream_options.include_usage "
                           "supported by this server?")
    return {"latency": latency, "ttft": first if first is not None else latency, "tokens": tokens,
            "text": "".join(text), "acceptance": reported}


async def run_level(base: str, engine: str, model: str, prompts: list[str | list[int]], concurrency: int,
                    num_requests: int, max_tokens: int, temperature: float) -> dict[str, Any]:
    """One concurrency level; the row jobs.load reports (``texts``: request index -> text, for comparisons)."""
    queue = list(range(num_requests))
    records: list[dict[str, Any]] = []
    client = openai_client(base, engine, concurrency)

    async def client_loop() -> None:
        while queue:
            i = queue.pop(0)
            record = await one_request(client, model, prompts[i % len(prompts)], max_tokens, temperature, seed=i)
            records.append({"index": i, **record})

    before = read_vllm_counters(base) if engine == "vllm" else None
    async with client:
        start = time.perf_counter()
        await asyncio.gather(*[client_loop() for _ in range(concurrency)])
        seconds = time.perf_counter() - start
    if engine == "vllm":
        after = read_vllm_counters(base)
        accepted = delta(after, before) if after and before else Acceptance(None)
    else:
        accepted = Acceptance()
        for record in records:
            accepted = accepted.add(record["acceptance"])
    return level_row(engine, concurrency, records, seconds, accepted)


def level_row(engine: str, concurrency: int, records: list[dict[str, Any]], seconds: float, accepted: Acceptance
              ) -> dict[str, Any]:
    tokens = sum(r["tokens"] for r in records)
    summary = accepted.summary()
    return {"engine": engine, "concurrency": concurrency, "num_requests": len(records), "new_tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds,
            "latency_p50_s": percentile([r["latency"] for r in records], 50),
            "latency_p99_s": percentile([r["latency"] for r in records], 99),
            "ttft_p50_s": percentile([r["ttft"] for r in records], 50),
            "ttft_p99_s": percentile([r["ttft"] for r in records], 99),
            "tau": summary["tau"], "acceptance": summary["acceptance"],
            "acceptance_per_position": summary["per_position"], "drafts": summary,
            "texts": {r["index"]: r["text"] for r in records}}


def measure(endpoint: str, prompts: list[str | list[int]], levels: list[int], requests_per_level: int,
            max_tokens: int, temperature: float, engine: str | None = None, model: str | None = None,
            passes: int = 1) -> tuple[dict[str, Any], list]:
    """Warm-up (a prompt of its own), then every level in turn, ``passes`` times: ({"endpoint", "engine",
    "model"}, rows, each with its ``pass``)."""
    base = api_base(endpoint)
    found_model, found_engine = served_model(base)
    engine, model = engine or found_engine, model or found_model
    asyncio.run(run_level(base, engine, model, [WARMUP_PROMPT], 1, 2, 8, temperature))  # lazy initialisation
    rows = []
    for n in range(1, passes + 1):
        for concurrency in levels:
            row = asyncio.run(run_level(base, engine, model, prompts, concurrency,
                                        max(requests_per_level, concurrency), max_tokens, temperature))
            row["pass"] = n
            rate = f" acceptance={row['acceptance']:.3f}" if row["acceptance"] is not None else ""
            print(f"[load] {engine} c={concurrency} pass {n}: {row['tokens_per_s']:.1f} tok/s "
                  f"p50={row['latency_p50_s']:.3f}s ttft50={row['ttft_p50_s']:.3f}s{rate}", flush=True)
            rows.append(row)
    return {"endpoint": endpoint, "engine": engine, "model": model}, rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'engine':9} {'conc':>4} {'pass':>4} {'tok/s':>8} {'p50 s':>7} {'p99 s':>7} {'ttft50':>7} {'ttft99':>7} "
          f"{'tau':>5} {'accept':>6}  per position")
    for r in rows:
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        rate = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        positions = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"] or []) or "-"
        print(f"{r['engine']:9} {r['concurrency']:>4} {r.get('pass', 1):>4} {r['tokens_per_s']:>8.1f} "
              f"{r['latency_p50_s']:>7.3f} {r['latency_p99_s']:>7.3f} {r['ttft_p50_s']:>7.3f} {r['ttft_p99_s']:>7.3f} "
              f"{tau:>5} {rate:>6}  {positions}")
    print("accept: accepted over drafted tokens; per position: the share of draft rounds accepting position k")
