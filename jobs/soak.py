"""The soak behind ``python -m jobs.load --soak MINUTES``: one replica under a mixed, bounded loopback load.

Closed-loop clients draw request kinds from ``KINDS`` until the time is up: greedy completions (plain and
streamed), greedy chat, sampled and seeded-sampled streams, an over-long prompt (400), malformed bodies (400) and
hang-ups: a client that leaves at a random point (``HANGUP_POINTS``: before the answer's headers, while queued or
in prefill; mid-stream; a whole-answer request whose client times out). Hang-ups start in the first second, on a
replica that has answered nothing yet (``COLD_HANGUPS`` of them, while the reference answers are taken): a cold
replica is where one client's hang-up once took the replica down (serving.scheduler's docstring).
The run fails (the report lists every failure) when:

- any answer is a 5xx, or any status other than the kind's expected one (a 429 with Retry-After is back-pressure,
  counted, and the client waits as told);
- a greedy answer differs from that prompt's single-request output, taken from the same replica before the load;
- the replica's and its TP workers' resident memory grew past ``max_rss_growth_mb`` from start to end;
- rows are still running or waiting once the load stops (a dropped stream that kept its row), or a TP worker
  still holds a row, KV slots or a drafter (``TPWorker.occupancy``);
- the replica restarted (a replica or TP worker process that was not there at the start), or /health answered
  anything but 200 at any of its once-a-second polls.

Reports p50/p99 latency per kind, requests per kind and status, hang-ups per point, replica restarts, unhealthy
polls, RSS per process at start and end.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from jobs.chaos import HANGUP_POINTS, Watch, leave_at, process_rss, worker_occupancy

# kind -> weight in the mix; the kind's expected status is in EXPECTED
KINDS = {"greedy": 3, "greedy_stream": 3, "chat": 2, "sampled_stream": 2, "seeded": 2, "over_long": 1,
         "malformed": 1, "disconnect": 2}
EXPECTED = {"over_long": 400, "malformed": 400}
CHAT_PROMPTS = ["hello", "write a python function that adds two numbers", "what is a list?"]
WARMUP_S = 5.0
COLD_HANGUPS = 8  # the cold start's hang-ups, within its first second
MALFORMED = [b"{not json", b'{"prompt": "x", "max_tokens": -3}', b'{"prompt": 7}', b"[]",
             b'{"prompt": "x", "temperature": "hot"}']


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = q / 100 * (len(ordered) - 1)
    low, high = int(rank), min(int(rank) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class Soak:
    def __init__(self, base_url: str, model: str, prompts: list[str], max_tokens: int, seed: int) -> None:
        self.url, self.model, self.prompts, self.max_tokens = base_url, model, prompts, max_tokens
        self.rng = random.Random(seed)
        self.reference: dict[tuple[str, str], list[int]] = {}  # (kind, prompt) -> greedy token ids
        self.records: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.max_len = 0

    # ------------------------------------------------------------ requests

    def body(self, kind: str, prompt: str) -> dict[str, Any]:
        base = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0, "return_token_ids": True}
        if kind == "chat":
            return {**base, "messages": [{"role": "user", "content": prompt}]}
        body = {**base, "prompt": prompt}
        if kind in ("greedy_stream", "sampled_stream", "disconnect"):
            body.update(stream=True, stream_options={"include_usage": True})
        if kind == "sampled_stream":
            body.update(temperature=0.8, top_p=0.9)
        if kind == "seeded":
            body.update(temperature=0.7, top_k=20, seed=self.rng.randrange(2 ** 32))
        if kind == "over_long":
            body.update(prompt=[1] * (self.max_len + 8))
        if kind == "disconnect":
            body["max_tokens"] = max(self.max_tokens, 64)
        return body

    async def hang_up(self, client, prompt: str, point: str | None = None) -> dict[str, Any]:
        """A streamed completion whose client leaves at ``point`` (drawn from HANGUP_POINTS when None)."""
        point = point or self.rng.choice(HANGUP_POINTS)
        body = self.body("disconnect", prompt)
        start = time.perf_counter()
        response = await leave_at(client, "/v1/completions", body, point, self.rng)
        if response is None:
            record = self._done("disconnect", prompt, start, 200, None, None)
        else:
            record = self._done("disconnect", prompt, start, response.status_code, None, response)
        record["point"] = point if response is None else "answered"
        return record

    async def cold_hangups(self, count: int) -> None:
        """``count`` hang-ups at random points within the first second, each on a connection of its own."""
        import httpx

        async def one(delay_s: float) -> None:
            await asyncio.sleep(delay_s)
            async with httpx.AsyncClient(base_url=self.url, timeout=300) as client:
                record = await self.hang_up(client, self.rng.choice(self.prompts))
                self.records.append({**record, "cold": True})

        await asyncio.gather(*[one(self.rng.uniform(0, 1)) for _ in range(count)])

    async def send(self, client, kind: str, prompt: str) -> dict[str, Any]:
        """One request of ``kind``: status, latency, token ids (None when not read to the end)."""
        route = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        start = time.perf_counter()
        if kind == "malformed":
            response = await client.post(route, content=self.rng.choice(MALFORMED),
                                         headers={"content-type": "application/json"})
            return self._done(kind, prompt, start, response.status_code, None, response)
        if kind == "disconnect":
            return await self.hang_up(client, prompt)
        body = self.body(kind, prompt)
        if not body.get("stream"):
            response = await client.post(route, json=body)
            ids = response.json()["choices"][0].get("token_ids") if response.status_code == 200 else None
            return self._done(kind, prompt, start, response.status_code, ids, response)
        ids: list[int] = []
        async with client.stream("POST", route, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return self._done(kind, prompt, start, response.status_code, None, response)
            events = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # an error after the 200: a server failure mid-stream
                    return self._done(kind, prompt, start, 500, None, None, chunk["error"]["message"])
                for part in chunk.get("choices") or []:
                    ids.extend(part.get("token_ids") or [])
                events += 1
        return self._done(kind, prompt, start, 200, ids, None)

    def _done(self, kind: str, prompt: str, start: float, status: int, ids: list[int] | None, response,
              detail: str = "") -> dict[str, Any]:
        record = {"kind": kind, "status": status, "latency": time.perf_counter() - start, "prompt": prompt,
                  "ids": ids, "retry_after": None}
        if response is not None and status >= 400:
            detail = response.text[:200]
            record["retry_after"] = response.headers.get("retry-after")
        if status >= 500 or status not in (EXPECTED.get(kind, 200), 429):
            self.failures.append(f"{kind}: HTTP {status} (expected {EXPECTED.get(kind, 200)}): {detail}")
        elif status == 429 and record["retry_after"] is None:
            self.failures.append(f"{kind}: 429 without a Retry-After header")
        return record

    # ------------------------------------------------------------ phases

    async def take_reference(self, client) -> None:
        """Greedy output of every prompt as a single request (one at a time) before the load starts; the cold
        hang-ups run alongside, so these are a cold replica's first answers."""
        self.max_len = (await client.get("/v1/models")).json()["data"][0]["max_model_len"]
        for kind, prompts in (("greedy", self.prompts), ("chat", CHAT_PROMPTS)):
            for prompt in prompts:
                record = await self.send(client, kind, prompt)
                if record["status"] != 200:
                    raise RuntimeError(f"the reference request ({kind}, {prompt!r}) got HTTP {record['status']}; "
                                       f"{self.failures[-1:]}")
                self.reference[(kind, prompt)] = record["ids"]

    def check_greedy(self, record: dict[str, Any]) -> None:
        if record["status"] != 200 or record["ids"] is None or record["kind"] not in ("greedy", "greedy_stream",
                                                                                       "chat"):
            return
        key = ("chat" if record["kind"] == "chat" else "greedy", record["prompt"])
        if record["ids"] != self.reference[key]:
            self.failures.append(f"{record['kind']} {record['prompt']!r}: greedy output under load differs from "
                                 f"the single-request output ({record['ids'][:12]}... vs "
                                 f"{self.reference[key][:12]}...)")

    async def load(self, client, seconds: float, concurrency: int) -> None:
        kinds, weights = list(KINDS), list(KINDS.values())
        deadline = time.monotonic() + seconds

        async def client_loop() -> None:
            while time.monotonic() < deadline:
                kind = self.rng.choices(kinds, weights)[0]
                prompt = self.rng.choice(CHAT_PROMPTS if kind == "chat" else self.prompts)
                record = await self.send(client, kind, prompt)
                self.check_greedy(record)
                record.pop("ids", None)
                self.records.append(record)
                if record["status"] == 429 and record["retry_after"]:
                    await asyncio.sleep(float(record["retry_after"]))

        await asyncio.gather(*[client_loop() for _ in range(concurrency)])

    def summary(self) -> dict[str, Any]:
        by_kind: dict[str, Any] = {}
        for kind in KINDS:
            rows = [r for r in self.records if r["kind"] == kind]
            statuses: dict[str, int] = {}
            for r in rows:
                statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
            done = [r["latency"] for r in rows if r["status"] == EXPECTED.get(kind, 200)]
            by_kind[kind] = {"num_requests": len(rows), "statuses": statuses,
                             "latency_p50_s": percentile(done, 50) if done else None,
                             "latency_p99_s": percentile(done, 99) if done else None}
        full = [r["latency"] for r in self.records if r["status"] == 200 and r["kind"] in (
            "greedy", "greedy_stream", "chat", "sampled_stream", "seeded")]
        points: dict[str, int] = {}
        for r in self.records:
            if "point" in r:
                points[r["point"]] = points.get(r["point"], 0) + 1
        return {"num_requests": len(self.records), "num_5xx": sum(r["status"] >= 500 for r in self.records),
                "num_429": sum(r["status"] == 429 for r in self.records),
                "num_disconnects": sum(n for point, n in points.items() if point != "answered"),
                "hangups_by_point": points,
                "num_greedy_checked": sum(r["status"] == 200 and r["kind"] in ("greedy", "greedy_stream", "chat")
                                          for r in self.records),
                "latency_p50_s": percentile(full, 50) if full else None,
                "latency_p99_s": percentile(full, 99) if full else None, "by_kind": by_kind}


async def wait_idle(client, timeout_s: float) -> dict[str, Any]:
    """The replica's /health once nothing runs or waits (or at the timeout: the caller reports it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = (await client.get("/health")).json()
        if (health.get("running"), health.get("waiting")) == (0, 0) or time.monotonic() > deadline:
            return health
        await asyncio.sleep(0.2)


def rss_total(rss: dict[str, int | None]) -> int:
    return sum(v for v in rss.values() if v is not None)


async def soak(base_url: str, app: str, model: str, prompts: list[str], minutes: float, concurrency: int,
               max_tokens: int, max_rss_growth_mb: float, seed: int = 0) -> dict[str, Any]:
    """Run the soak against the deployed application ``app`` at ``base_url``, freshly started (nothing answered
    yet: the cold hang-ups need that); returns the report (``ok``, ``failures``, counts, latencies, restarts, RSS)."""
    import httpx

    run = Soak(base_url, model, prompts, max_tokens, seed)
    watch = Watch(base_url, app)
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch.run(stop))
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        await asyncio.gather(run.take_reference(client), run.cold_hangups(COLD_HANGUPS))
        await run.load(client, WARMUP_S, concurrency)  # first requests pay for lazy init and allocator growth
        run.records = [r for r in run.records if r.get("cold")]
        rss_start = process_rss(app)
        start = time.monotonic()
        await run.load(client, minutes * 60, concurrency)
        seconds = time.monotonic() - start
        health = await wait_idle(client, 30)
        rss_end = process_rss(app)
    stop.set()
    await watcher
    occupancy = worker_occupancy(app)
    report = {"seconds": seconds, "concurrency": concurrency, "max_tokens": max_tokens, **run.summary(),
              "num_cold_hangups": COLD_HANGUPS, "replica_restarts": watch.restarts,
              "num_health_polls": watch.num_polls, "num_unhealthy_polls": len(watch.unhealthy),
              "health_after": health, "occupancy_after": occupancy, "rss_start": rss_start, "rss_end": rss_end,
              "rss_start_mb": rss_total(rss_start) / 2 ** 20, "rss_end_mb": rss_total(rss_end) / 2 ** 20,
              "max_rss_growth_mb": max_rss_growth_mb}
    failures = list(run.failures)
    if (health.get("running"), health.get("waiting")) != (0, 0):
        failures.append(f"after the load, /health still shows rows held: {health} (a dropped stream kept its row?)")
    held = {name: held for name, held in occupancy.items() if any(held.values())}
    if held or not occupancy:
        failures.append(f"after the load, TP workers still hold rows, KV slots or drafters: {occupancy}")
    if watch.restarts or watch.seen != watch.start:
        failures.append(f"the replica restarted {watch.restarts} time(s) during the soak: processes at the start "
                        f"{sorted(watch.start)}, new ones {sorted(watch.seen - watch.start)}")
    if watch.unhealthy:
        failures.append(f"/health failed {len(watch.unhealthy)} of {watch.num_polls} polls, first: "
                        f"{watch.unhealthy[0]}")
    if not rss_start or set(rss_start) != set(rss_end):
        failures.append(f"the replica's processes changed during the soak (a replica was replaced?): start "
                        f"{sorted(rss_start)}, end {sorted(rss_end)}")
    growth = report["rss_end_mb"] - report["rss_start_mb"]
    report["rss_growth_mb"] = growth
    if growth > max_rss_growth_mb:
        failures.append(f"resident memory of the replica and its workers grew {growth:.1f} MB over the soak "
                        f"({report['rss_start_mb']:.1f} -> {report['rss_end_mb']:.1f} MB), past "
                        f"--max-rss-growth-mb {max_rss_growth_mb:g}: a leak, or raise the bound for this target")
    report["failures"] = failures[:50]
    report["num_failures"] = len(failures)
    report["ok"] = not failures
    return report


def print_report(report: dict[str, Any]) -> None:
    print(f"{'kind':15} {'requests':>8} {'p50 s':>7} {'p99 s':>7}  statuses")
    for kind, row in report["by_kind"].items():
        p50 = f"{row['latency_p50_s']:.3f}" if row["latency_p50_s"] is not None else "-"
        p99 = f"{row['latency_p99_s']:.3f}" if row["latency_p99_s"] is not None else "-"
        print(f"{kind:15} {row['num_requests']:>8} {p50:>7} {p99:>7}  {row['statuses']}")
    p50, p99 = report["latency_p50_s"], report["latency_p99_s"]
    print(f"[soak] {report['num_requests']} requests in {report['seconds']:.0f}s at concurrency "
          f"{report['concurrency']}: 5xx={report['num_5xx']} 429={report['num_429']} "
          f"hang-ups={report['num_disconnects']} {report['hangups_by_point']} "
          f"greedy checked={report['num_greedy_checked']}; replica restarts={report['replica_restarts']}, "
          f"unhealthy polls={report['num_unhealthy_polls']}/{report['num_health_polls']}; "
          f"p50={p50 if p50 is None else round(p50, 3)}s p99={p99 if p99 is None else round(p99, 3)}s; "
          f"RSS {report['rss_start_mb']:.1f} -> {report['rss_end_mb']:.1f} MB ({report['rss_growth_mb']:+.1f} MB, "
          f"bound {report['max_rss_growth_mb']:g})")
    for failure in report["failures"]:
        print(f"[soak] FAIL: {failure}")
