"""Test helpers: the HTTP layer (serving.api) served for real on loopback without Ray: uvicorn in a thread, over a
Scheduler whose one "worker" runs a real SpecEngine on the random checkpoint in-process (the Ray actor's stand-in)."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from eyas.decoding.engine import SpecEngine
from eyas.decoding.tp import free_port
from eyas.methods import SpecConfig, drafter_factory, history_index
from eyas.models import load_target, load_tokenizer
from serving.api import Frontend, build_api
from eyas_ray.serve_config import ServeArgs
from serving.metrics import ServingMetrics
from serving.protocol import Limits
from serving.scheduler import Scheduler
from serving.worker import SharedAnswers

MODEL = "eyas-unit"


class EngineWorker:
    """``worker.step.remote(joins, leaves)`` as an awaitable, like a TP worker's Ray actor handle: a short pause (a
    round in flight, so other requests interleave), then one engine step; its finished answers go into the
    replica's shared suffix index as the leader's do (``shared``)."""

    def __init__(self, engine: SpecEngine, pause_s: float, shared: SharedAnswers | None = None) -> None:
        self.engine, self.pause_s, self.shared = engine, pause_s, shared
        self.step = self

    def remote(self, joins, leaves):
        async def run():
            await asyncio.sleep(self.pause_s)
            outputs = self.engine.step(joins, leaves)
            if self.shared is not None:
                self.shared.record(joins, leaves, outputs)
            return outputs
        return run()


class LoopbackServer:
    """build_api(frontend) under uvicorn on 127.0.0.1 in a background thread."""

    def __init__(self, frontend: Frontend, worker: EngineWorker) -> None:
        import uvicorn

        self.frontend, self.worker = frontend, worker
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_api(frontend), host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LoopbackServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the loopback uvicorn server did not start within 30 s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextlib.contextmanager
def serve_locally(checkpoint: Path, capacity: int = 2, max_waiting: int = 2, pause_s: float = 0.002,
                  api_key: str | None = None, max_tokens_limit: int | None = None,
                  make_drafter: Callable[[Any], Any] | None = None, spec: SpecConfig = SpecConfig(method="ngram"),
                  share_answers: bool = True) -> Iterator[LoopbackServer]:
    """``make_drafter(target)``: one drafter per row instead of ``spec``'s (a test's stand-in)."""
    target = load_target(checkpoint)
    tokenizer = load_tokenizer(checkpoint)
    args = ServeArgs(target=str(checkpoint), model_name=MODEL, spec=spec, max_batch_size=capacity,
                     max_waiting_requests=max_waiting, share_answers=share_answers)
    history = history_index(spec, args.shared_answer_tokens) if args.share_answers else None
    factory = drafter_factory(target, spec, history)
    engine = SpecEngine(target, capacity, 512, factory if make_drafter is None else lambda: make_drafter(target),
                        eos_token_ids=set(target.config.eos_token_ids), prefix_cache_tokens=args.prefix_cache_tokens)
    limits = Limits(MODEL, target.config.vocab_size, engine.max_len, engine.max_tree_nodes,
                    max_tokens_limit or engine.max_len, args.default_max_tokens)
    worker = EngineWorker(engine, pause_s, SharedAnswers(history) if history is not None else None)
    scheduler = Scheduler([worker], capacity, step_timeout_s=60)
    frontend = Frontend(args, tokenizer, limits, scheduler, ServingMetrics(MODEL), api_key)
    with LoopbackServer(frontend, worker) as server:
        yield server
