"""Clients that leave, and a watch on the replica they leave: what jobs.soak and tests/integration/test_chaos.py
share. ``leave_at`` sends a request and hangs up at one of HANGUP_POINTS; ``Watch`` polls /health and the replica's
processes while a load runs (a restart is a replica process that was not there at the start); ``worker_occupancy``
reads what each TP worker still holds once it stops (``serving.worker.TPWorker.occupancy``).
"""
from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

HANGUP_POINTS = ("before_headers", "mid_stream", "timeout")
HEALTH_POLL_S = 1.0


async def leave_at(client, route: str, body: dict[str, Any], point: str, rng: random.Random,
                   num_events: int | None = None):
    """Send ``body`` to ``route`` and leave at ``point`` (one of HANGUP_POINTS):

    - ``before_headers``: a stream dropped before its first chunk arrives (the answer's headers wait for the first
      token), so while it waits for a row, prefills, or is in its first round; after 20-600 ms;
    - ``mid_stream``: a stream closed after ``num_events`` chunks (1-3 when None);
    - ``timeout``: a whole-answer request whose client gives up after 20-600 ms.

    Returns None when the client left, else the (read) httpx response of an answer that came first (a 4xx, or a
    finished one)."""
    if point == "mid_stream":
        async with client.stream("POST", route, json={**body, "stream": True}) as response:
            if response.status_code != 200:
                await response.aread()
                return response
            events, limit = 0, num_events or rng.randint(1, 3)
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
                if events >= limit:
                    return None  # leaving the block closes the connection mid-stream
        return response
    if point not in HANGUP_POINTS:
        raise ValueError(f"point={point!r}: must be one of {HANGUP_POINTS}")
    try:
        return await asyncio.wait_for(client.post(route, json={**body, "stream": point == "before_headers"}),
                                      rng.uniform(0.02, 0.6))
    except asyncio.TimeoutError:  # the cancelled request closed its connection
        return None


def process_rss(app: str) -> dict[str, int | None]:
    """Resident bytes of the app's replica and TP worker processes, by actor name (None: on another node).

    Reads the actor table of the Ray this process is connected to (ray.util.state would need the dashboard, and
    without an address it may pick another cluster on the machine)."""
    import psutil
    import ray
    from ray._private import state

    here = ray.get_runtime_context().get_node_id()
    out: dict[str, int | None] = {}
    for actor in state.actors().values():
        name = actor.get("Name") or ""
        if actor.get("State") != "ALIVE" or not name.startswith((f"eyas-worker-{app}-",
                                                                  f"SERVE_REPLICA::{app}#EyasServer#")):
            continue
        rss = None
        if actor["Address"].get("NodeID") == here:
            try:
                rss = psutil.Process(actor["Pid"]).memory_info().rss
            except psutil.NoSuchProcess:  # it died between the table read and now: the caller reports the change
                continue
        out[name] = rss
    return out


def worker_occupancy(app: str) -> dict[str, dict[str, int]]:
    """``TPWorker.occupancy`` of each live TP worker of ``app``, by actor name."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"eyas-worker-{app}-")]
    handles = [ray.get_actor(name, namespace="eyas-serving") for name in names]
    return dict(zip(names, ray.get([h.occupancy.remote() for h in handles], timeout=60)))


class Watch:
    """Polls /health and the replica's processes once a second while the soak runs: every non-200 answer, and
    every replica or TP worker process that was not there at the start (a restart)."""

    def __init__(self, base_url: str, app: str) -> None:
        self.url, self.app = base_url, app
        self.start = set(process_rss(app))
        self.seen = set(self.start)
        self.unhealthy: list[str] = []
        self.num_polls = 0

    async def run(self, stop: asyncio.Event) -> None:
        import httpx

        async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
            while not stop.is_set():
                try:
                    response = await client.get("/health")
                    if response.status_code != 200:
                        self.unhealthy.append(f"HTTP {response.status_code}: {response.text[:120]}")
                except httpx.HTTPError as err:
                    self.unhealthy.append(repr(err))
                self.seen |= set(await asyncio.to_thread(process_rss, self.app))
                self.num_polls += 1
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), HEALTH_POLL_S)

    @property
    def restarts(self) -> int:
        return len({name for name in self.seen - self.start if name.startswith("SERVE_REPLICA::")})
