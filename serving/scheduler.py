"""The replica's side of continuous batching: one asyncio loop that drives the TP workers round by round.

Each round sends every rank the same ``step(joins, leaves)``: new requests join (as many as free batch rows allow,
first come first served), cancelled ones leave (a client that disconnected, a stop string that matched), then the
workers run one speculative cycle over the whole batch. Rank 0's outputs are routed to each request's queue. The
next round goes out before the last one's outputs are back (``ROUNDS_AHEAD``), so the workers never wait for the
replica between two rounds. When nothing is queued or running the loop sleeps until a request arrives.

A failed round (a dead worker, a timeout) breaks the replica: every waiting request gets a 503, and
``broken`` makes the health check fail so Serve replaces the replica; the TP group cannot be repaired in place.

The loop belongs to no request (``detached``). Ray makes every actor call an async actor method submits a child
of the request it serves (``ray._raylet.async_task_id``, a context variable an asyncio task copies when it is
created), and Serve cancels a disconnected request's children recursively. A loop started inside the first
request's context made every later ``step`` that request's child: 8 hang-ups on a fresh replica cancelled a round
(``TaskCancelledError``) and broke the replica for every other client. A client's cancellation reaches only its
own ``generate``, whose ``finally`` frees its queue, its waiting place or its row at the next round.
"""
from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
from typing import Any, AsyncIterator, Callable, Coroutine, TypeVar

from eyas.decoding.requests import SequenceRequest, StepOutput

logger = logging.getLogger("ray.serve")
ROUNDS_AHEAD = 2  # rounds sent before the oldest one's outputs are awaited (``Scheduler._loop``)
Result = TypeVar("Result")


def detached(work: Coroutine[Any, Any, Result]) -> asyncio.Task[Result]:
    """``work`` as a task of no request's: it runs in an empty ``contextvars.Context``, so the Ray calls it makes
    are children of no request (Ray reads the parent from ``ray._raylet.async_task_id``, which tasks copy at
    creation), and neither Serve's cancellation of a request nor its request context (logs) reaches them."""
    return asyncio.get_running_loop().create_task(work, context=contextvars.Context())


async def shielded(work: Coroutine[Any, Any, Result]) -> Result:
    """Await ``work`` as a detached task that the caller's cancellation cannot interrupt: a cancelled caller stops
    waiting, and ``work`` still runs to its end (used where stopping half-way would leave the ranks disagreeing)."""
    return await asyncio.shield(detached(work))


async def _first(results: Coroutine[Any, Any, list[Result]]) -> Result:
    """Rank 0's result of a round: only the leader returns outputs (the other ranks return None)."""
    return (await results)[0]


class ReplicaBroken(RuntimeError):
    """The replica's workers failed; it is being replaced."""


class Scheduler:
    def __init__(self, workers: list[Any], capacity: int, step_timeout_s: float,
                 on_round: Callable[[int], None] | None = None) -> None:
        self.workers = workers
        self.on_round = on_round  # called with the batch size after every round (a metrics gauge)
        self.capacity = capacity
        self.step_timeout_s = step_timeout_s
        self.pending: list[SequenceRequest] = []
        self.active: set[str] = set()  # request ids holding a batch row on the workers
        self.joining: set[str] = set()  # request ids joining in the round under way
        self.leaving: set[str] = set()
        self.queues: dict[str, asyncio.Queue] = {}
        self.broken: BaseException | None = None
        self.batch_size = 0  # rows in the last round
        self.num_cancelled = 0  # requests that left before finishing (disconnects, stop strings)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the batching loop, detached from whichever request calls this, on the running event loop (the
        one the requests' queues live on: ``generate`` starts it)."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = detached(self._loop())

    async def generate(self, request: SequenceRequest) -> AsyncIterator[StepOutput]:
        """The request's StepOutputs as its tokens arrive; leaving early (or being cancelled) frees its row."""
        if self.broken is not None:
            raise ReplicaBroken(f"this replica's workers failed ({self.broken}); retry shortly")
        self.start()
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request.request_id] = queue
        self.pending.append(request)
        self._wake.set()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.cancel(request.request_id)

    def cancel(self, request_id: str) -> None:
        """Drop a request: dequeue it if waiting, or free its row at the next round if it holds one (or is joining
        in the round under way)."""
        self.queues.pop(request_id, None)
        self.pending = [r for r in self.pending if r.request_id != request_id]
        holds_row = request_id in self.active or request_id in self.joining
        if holds_row and request_id not in self.leaving:
            self.num_cancelled += 1
            self.leaving.add(request_id)
            if self._wake is not None:
                self._wake.set()

    @property
    def num_admitted(self) -> int:
        """Requests holding a batch row, joining one or waiting for one; the HTTP layer's admission limit counts
        these (a row that is leaving counts as free: it is freed at the next round, before any new join)."""
        return len(self.pending) + len((self.active | self.joining) - self.leaving)

    def load(self) -> dict[str, int]:
        return {"running": len(self.active), "waiting": len(self.pending), "capacity": self.capacity,
                "cancelled": self.num_cancelled}

    async def _loop(self) -> None:
        """Rounds go out ``ROUNDS_AHEAD`` deep: the next round is sent before the last one's outputs are back, so a
        worker (a Ray actor, which runs its calls one at a time in the order they were sent) starts it the moment it
        finishes the last, instead of idling while the outputs travel to the replica and the next call travels back.
        A round is planned from what the replica knows when it sends it: rows that finish in a round still in flight
        are freed for joins one round later."""
        rounds: collections.deque[tuple[set[str], asyncio.Future]] = collections.deque()
        while True:
            if not rounds and not self._has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                if self._has_work() and len(rounds) < ROUNDS_AHEAD:
                    rounds.append(self._send())
                    if len(rounds) < ROUNDS_AHEAD:
                        continue
                joined, outputs = rounds.popleft()
                self._receive(joined, await asyncio.wait_for(outputs, timeout=self.step_timeout_s))
            except Exception as err:  # noqa: BLE001 (any failure breaks the replica; it is logged and reported)
                for _, outputs in rounds:
                    outputs.cancel()
                self._break(err)
                return

    def _has_work(self) -> bool:
        return bool(self.pending or self.active or self.joining or self.leaving)

    def _send(self) -> tuple[set[str], asyncio.Future]:
        """Plan one round (its leaves and joins) and send it to every worker; returns the ids that join in it and the
        future of its outputs (rank 0's)."""
        holding = self.active | self.joining
        leaves = sorted(self.leaving & holding)
        free = self.capacity - len(holding) + len(leaves)
        joins, self.pending = self.pending[:free], self.pending[free:]
        joined = {r.request_id for r in joins}
        self.leaving -= set(leaves)
        self.active -= set(leaves)
        self.joining = (self.joining - set(leaves)) | joined
        refs = [worker.step.remote(joins, leaves) for worker in self.workers]
        return joined, asyncio.ensure_future(_first(asyncio.gather(*refs)))

    def _receive(self, joined: set[str], outputs: list[StepOutput]) -> None:
        """Route a round's outputs to their requests' queues; its joins now hold rows (unless they left since)."""
        self.active |= joined & self.joining
        self.joining -= joined
        for out in outputs:
            if out.finished:
                self.active.discard(out.request_id)
            queue = self.queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        self.batch_size = len(self.active)
        if self.on_round is not None:
            self.on_round(self.batch_size)
        for request_id in list(self.leaving):  # a row that finished before its leave was sent
            if request_id not in self.active and request_id not in self.joining:
                self.leaving.discard(request_id)

    def _break(self, err: BaseException) -> None:
        logger.error("eyas: a scheduling round failed, marking the replica unhealthy: %r", err)
        self.broken = err
        failure = ReplicaBroken(f"this replica's workers failed ({type(err).__name__}); retry shortly")
        for queue in self.queues.values():
            queue.put_nowait(failure)
        self.queues.clear()
        self.pending.clear()
        self.active.clear()
        self.joining.clear()
        self.leaving.clear()
