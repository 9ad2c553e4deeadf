"""One response's choices through the replica's scheduler: a ChoicePlan per choice (n per prompt), a RequestRun
that turns its engine outputs into text pieces (stop strings applied, logprobs and speculative metrics kept), and
``merged``, which interleaves a response's runs as their pieces arrive."""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, NamedTuple

from eyas.decoding.logits import TokenLogprob
from eyas.decoding.requests import SequenceRequest
from eyas.decoding.stats import SpecStats
from serving.metrics import ServingMetrics
from serving.responses import TextStream, usage
from serving.scheduler import Scheduler


class RequestFailed(RuntimeError):
    """The engine failed this request alone (StepOutput.error); the replica and its other requests go on."""


@dataclass(frozen=True)
class ChoicePlan:
    """One choice of a response: the response's id, the choice's OpenAI index (prompt i's choice j is i * n + j),
    its prompt's index, its engine request, the text ``echo`` puts before it (None: no echo), and whether its
    generated tokens are dropped (max_tokens=0 with echo: the engine still prefills, for the prompt's logprobs)."""
    response_id: str
    index: int
    prompt_index: int
    request: SequenceRequest
    echo_text: str | None = None
    silent: bool = False


class Piece(NamedTuple):
    text: str  # the text delta, safe to send
    token_ids: list[int]  # the new tokens
    logprobs: list[TokenLogprob]  # theirs (empty unless asked)


class RequestRun:
    """One choice's generation as text pieces, with stop strings applied and its speculative metrics kept."""

    def __init__(self, scheduler: Scheduler, plan: ChoicePlan, tokenizer: Any, stop: list[str],
                 metrics: ServingMetrics) -> None:
        self.scheduler, self.plan, self.request, self.metrics = scheduler, plan, plan.request, metrics
        self.text = TextStream(tokenizer, stop)
        self.sent = ""  # the text sent so far (its pieces joined)
        self.logprobs: list[TokenLogprob] = []  # of token_ids, when asked
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.stats = SpecStats()
        self.finish_reason: str | None = None
        self.start = time.perf_counter()
        self.first_token_s: float | None = None
        self.batch_size_max = 0  # the most sequences this request shared a round with (itself included)
        self.cached_tokens = 0  # prompt tokens the engine's prefix cache supplied

    async def pieces(self) -> AsyncIterator[Piece]:
        """Pieces as tokens arrive; ends at EOS, the budget or a stop string."""
        async with contextlib.aclosing(self.scheduler.generate(self.request)) as outputs:
            async for out in outputs:
                self.batch_size_max = max(self.batch_size_max, self.scheduler.batch_size)
                if self.first_token_s is None and out.new_token_ids:
                    self.first_token_s = time.perf_counter() - self.start
                    self.metrics.first_token(self.first_token_s)
                for num_accepted, judged_depth, num_drafted in out.cycles:
                    self.stats.record_cycle(num_accepted, judged_depth, [], num_drafted)
                if out.stats is not None:  # the request's own, at its end: a hybrid's per-proposer counts
                    self.stats.proposer_offered = {k: list(v) for k, v in out.stats.proposer_offered.items()}
                    self.stats.proposer_accepted = {k: list(v) for k, v in out.stats.proposer_accepted.items()}
                if out.error is not None:
                    raise RequestFailed(out.error)
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs = out.prompt_logprobs
                if out.cached_prompt_tokens is not None:
                    self.cached_tokens = out.cached_prompt_tokens
                    self.metrics.prompt(len(self.request.prompt_ids), self.cached_tokens)
                if self.plan.silent:  # its one generated token is dropped
                    if out.finished:
                        self.finish_reason = "length"
                        yield Piece("", [], [])
                    continue
                before = len(self.text.ids)
                delta = self.text.push(out.new_token_ids)
                new_ids = self.text.ids[before:self.text.num_tokens] if self.text.stopped else out.new_token_ids
                new_logprobs = (out.logprobs or [])[:len(new_ids)]
                self.logprobs += new_logprobs
                if self.text.stopped:
                    self.finish_reason = "stop"
                    yield self._sent(Piece(delta, new_ids, new_logprobs))
                    return  # aclosing frees the batch row now
                if out.finished:
                    self.finish_reason = out.finish_reason
                    delta += self.text.flush()
                yield self._sent(Piece(delta, new_ids, new_logprobs))

    def _sent(self, piece: Piece) -> Piece:
        self.sent += piece.text
        return piece

    @property
    def token_ids(self) -> list[int]:
        return self.text.ids[:self.text.num_tokens]

    def logprob_entries(self, first: bool) -> list[tuple[int, TokenLogprob | None]]:
        """(token id, report) for the prompt (with echo, when ``first``: the choice's first piece) and no more."""
        if not first or self.plan.echo_text is None or self.request.prompt_logprobs is None:
            return []
        return list(zip(self.request.prompt_ids, self.prompt_logprobs or [None] * len(self.request.prompt_ids)))

    def record(self, method: str) -> None:
        spec = spec_metrics([self], method)
        self.metrics.finished(len(self.token_ids), spec["accepted_per_position"], spec["tau"],
                              time.perf_counter() - self.start, self.stats.proposer_offered,
                              self.stats.proposer_accepted)


def spec_metrics(runs: list[RequestRun], method: str) -> dict[str, Any]:
    """eyas's ``spec`` field over a response's choices (their cycles together)."""
    stats = SpecStats()
    for run in runs:
        run.stats.emitted(max(len(run.token_ids) - 1, 0))  # tau: what was sent (after the prefill's token)
        stats = stats.merge(run.stats)
    return {"method": method, "cycles": stats.cycles,
            "tau": stats.tau if method != "vanilla" else None,
            "accepted_per_position": list(stats.depth_accepted),
            "acceptance_per_position": stats.per_depth_accept,
            "mean_draft_nodes": stats.num_draft_nodes / max(stats.cycles, 1),
            # a hybrid's: proposer -> per depth, the cycles where an accepted node was its, and their rate
            "accepted_per_proposer": {name: list(counts) for name, counts in stats.proposer_accepted.items()},
            "acceptance_per_proposer": stats.per_proposer_accept,
            "batch_size_max": max(run.batch_size_max for run in runs)}


def total_usage(runs: list[RequestRun]) -> dict[str, Any]:
    """Each prompt's tokens once (not once per choice), as OpenAI, with the cached ones among them (the most any of
    its choices found in the prefix cache); every choice's generated tokens."""
    prompt_tokens = {run.plan.prompt_index: len(run.request.prompt_ids) for run in runs}
    cached: dict[int, int] = {}
    for run in runs:
        cached[run.plan.prompt_index] = max(cached.get(run.plan.prompt_index, 0), run.cached_tokens)
    return usage(sum(prompt_tokens.values()), sum(len(run.token_ids) for run in runs), sum(cached.values()))


END = object()  # merged(): a stream ended


async def merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(i, item) from several async iterators as their items arrive, and (i, END) when stream i ends. The first
    error ends them all; closing this iterator closes every stream (each frees its batch row)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait((i, item, None))
        except Exception as err:  # noqa: BLE001 (handed to the consumer, which raises it)
            queue.put_nowait((i, None, err))
        else:
            queue.put_nowait((i, END, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            remaining -= item is END
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
