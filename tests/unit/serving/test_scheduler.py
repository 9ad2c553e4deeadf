"""The replica's batching loop (serving.scheduler) over a real SpecEngine behind fake worker handles, without Ray:
requests beyond capacity wait and join as rows free up, rounds go out ahead of the last one's outputs, a consumer
that leaves frees its row (also when it leaves while its join is in flight), and a failed round fails every waiter
and marks the replica broken."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars

import pytest

from eyas.methods import SpecConfig, build_drafter
from eyas.models import load_target, load_tokenizer
from eyas.decoding.engine import SpecEngine
from eyas.decoding.requests import SequenceRequest
from eyas.decoding.generate import generate
from serving.scheduler import ROUNDS_AHEAD, ReplicaBroken, Scheduler

PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n", "The quick brown fox"]


class FakeWorker:
    """``worker.step.remote(joins, leaves)`` as an awaitable that runs the engine after a short pause (a round in
    flight), like a Ray actor handle: calls run one at a time, in the order they were made. ``fail`` makes the next
    round raise; ``calls`` records each round's (joins, leaves) ids."""

    def __init__(self, engine: SpecEngine, pause_s: float = 0.005) -> None:
        self.engine, self.pause_s, self.fail = engine, pause_s, False
        self.step = self
        self.calls: list[tuple[list[str], list[str]]] = []
        self._last: asyncio.Future | None = None
        self.sent = self.done = self.most_in_flight = 0

    def remote(self, joins, leaves):
        before = self._last
        self.sent += 1
        self.most_in_flight = max(self.most_in_flight, self.sent - self.done)

        async def run():
            if before is not None:
                with contextlib.suppress(BaseException):
                    await before
            await asyncio.sleep(self.pause_s)
            if self.fail:
                raise RuntimeError("worker died")
            self.calls.append(([r.request_id for r in joins], list(leaves)))
            try:
                return self.engine.step(joins, leaves)
            finally:
                self.done += 1
        self._last = asyncio.ensure_future(run())
        return self._last


@pytest.fixture(scope="module")
def setup(random_checkpoint):
    target = load_target(random_checkpoint)
    tokenizer = load_tokenizer(random_checkpoint)
    return target, [tokenizer.encode(p) for p in PROMPTS], set(target.config.eos_token_ids)


def make(setup, capacity: int = 2) -> tuple[Scheduler, FakeWorker]:
    target, _, eos = setup
    spec = SpecConfig(method="ngram")
    engine = SpecEngine(target, capacity, 512, lambda: build_drafter(target, spec), eos_token_ids=eos)
    worker = FakeWorker(engine)
    return Scheduler([worker], capacity, step_timeout_s=30), worker


async def collect(scheduler: Scheduler, request: SequenceRequest) -> list[int]:
    tokens = []
    async for out in scheduler.generate(request):
        tokens += out.new_token_ids
    return tokens


def test_requests_beyond_capacity_wait_and_each_gets_its_own_output(setup):
    target, prompts, eos = setup
    expected = [generate(target, ids, 20, drafter=build_drafter(target, SpecConfig(method="ngram")),
                         eos_token_ids=eos).token_ids for ids in prompts]
    scheduler, worker = make(setup, capacity=2)

    async def main():
        return await asyncio.gather(*[collect(scheduler, SequenceRequest(str(i), ids, 20))
                                      for i, ids in enumerate(prompts)])

    assert asyncio.run(main()) == expected
    assert worker.engine.rows == [] and scheduler.load()["running"] == 0
    # the next round goes out before the last one's outputs are back, never more than ROUNDS_AHEAD
    assert worker.most_in_flight == ROUNDS_AHEAD


def test_a_consumer_that_leaves_frees_its_row_even_mid_join(setup):
    _, prompts, _ = setup
    scheduler, worker = make(setup)

    async def main():
        async with contextlib.aclosing(scheduler.generate(SequenceRequest("early", prompts[0], 200))) as outputs:
            async for _ in outputs:
                break  # leaves after its first tokens
        task = asyncio.create_task(collect(scheduler, SequenceRequest("joining", prompts[1], 200)))
        while "joining" not in scheduler.joining:  # cancel while its join round is in flight
            await asyncio.sleep(0.001)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not worker.engine.rows and not scheduler.active:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert worker.engine.rows == [] and scheduler.load()["cancelled"] == 2


def test_a_failed_round_fails_every_waiter_and_breaks_the_replica(setup):
    _, prompts, _ = setup
    scheduler, worker = make(setup)

    async def main():
        tasks = [asyncio.create_task(collect(scheduler, SequenceRequest(str(i), ids, 200)))
                 for i, ids in enumerate(prompts)]
        await asyncio.sleep(0.05)
        worker.fail = True
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, ReplicaBroken) for r in results), results
    assert scheduler.broken is not None

    async def again():
        return await collect(scheduler, SequenceRequest("late", prompts[0], 4))

    with pytest.raises(ReplicaBroken):
        asyncio.run(again())


# Ray reads the parent of an actor call an async actor makes from a context variable of the calling asyncio task
# (ray._raylet.async_task_id), and Serve cancels a disconnected request's children. This one stands in for it.
REQUEST_CONTEXT = contextvars.ContextVar("request_context", default=None)


class ContextRecordingWorker(FakeWorker):
    """Records the request context each ``step`` call is made in: the parent Ray would give it."""

    def __init__(self, engine: SpecEngine) -> None:
        super().__init__(engine)
        self.parents: list[str | None] = []

    def remote(self, joins, leaves):
        self.parents.append(REQUEST_CONTEXT.get())
        return super().remote(joins, leaves)


def test_the_loop_and_its_steps_belong_to_no_request_so_the_first_ones_hang_up_cancels_nothing(setup):
    _, prompts, _ = setup
    target, _, eos = setup
    engine = SpecEngine(target, 2, 512, lambda: build_drafter(target, SpecConfig(method="ngram")), eos_token_ids=eos)
    worker = ContextRecordingWorker(engine)
    scheduler = Scheduler([worker], 2, step_timeout_s=30)

    async def request(name: str, ids: list[int], num_new: int) -> list[int]:
        REQUEST_CONTEXT.set(name)  # what Serve and Ray set in each request's task
        return await collect(scheduler, SequenceRequest(name, ids, num_new))

    async def main():
        first = asyncio.create_task(request("first", prompts[0], 200))  # it starts the loop
        while not worker.parents:
            await asyncio.sleep(0.001)
        first.cancel()  # the first request's client hangs up
        with contextlib.suppress(asyncio.CancelledError):
            await first
        return await request("second", prompts[1], 8)

    assert len(asyncio.run(main())) == 8
    assert worker.parents and set(worker.parents) == {None}, set(worker.parents)  # no request is their parent
    assert scheduler.broken is None and engine.rows == []


def test_shielded_work_runs_to_its_end_when_its_caller_is_cancelled():
    from serving.scheduler import shielded

    done: list[str | None] = []

    async def every_rank() -> None:
        await asyncio.sleep(0.05)
        done.append(REQUEST_CONTEXT.get())

    async def main():
        async def caller():
            REQUEST_CONTEXT.set("caller")
            await shielded(every_rank())

        task = asyncio.create_task(caller())
        await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert done == [None]  # it finished, outside the caller's context
