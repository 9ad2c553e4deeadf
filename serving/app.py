"""The Serve application: an OpenAI-style FastAPI ingress in front of tensor-parallel speculative workers.

    serve run serving/configs/tiny.yaml          (RAY_AUTH_MODE=token when joining a `ray start` cluster)

A replica is one placement group: bundle 0 holds this deployment's replica (HTTP, tokenizer, the batching loop in
serving.scheduler) and bundles 1..tp hold the TP worker actors (serving.worker), which shard the target and run
the speculative loop SPMD with the drafter on rank 0. Routes:

    POST /v1/completions        {model, prompt (text or token ids), max_tokens, temperature, top_p, top_k, stop,
                                 seed, stream}
    POST /v1/chat/completions   {model, messages, max_tokens | max_completion_tokens, ...same sampling fields}
    GET  /v1/models             the served model, its context and speculative settings
    GET  /health                200 {"status": "ok", running, waiting, capacity, cancelled}; 503 once workers failed

Every completion carries ``usage`` and ``spec`` (method, cycles, tau, accepted_per_position,
acceptance_per_position, mean_draft_nodes, batch_size_max); streams send them in a last chunk with empty
``choices``, then ``data: [DONE]``. A client error is a 4xx in OpenAI's error shape and never reaches the workers.
With ``api_key_env`` set, /v1 routes need ``Authorization: Bearer <key>``.
"""

import asyncio
import contextlib
import hmac
import json
import time
from pathlib import Path
from typing import Any, AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve import Application
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from starlette.exceptions import HTTPException as StarletteHTTPException

from eyas.config import to_dict
from eyas.models import ModelConfig, load_tokenizer
from eyas.decoding.requests import SequenceRequest
from eyas.decoding.generate import SamplingParams
from eyas.decoding.stats import SpecStats
from serving.config import ServeArgs
from serving.metrics import ServingMetrics
from serving.protocol import (GREEDY_BELOW, ApiError, ChatBody, CompletionBody, Limits, TextStream, chat_prompt_ids,
                              check_lengths, check_model, check_sampling, choice, encode_text, envelope, error_body,
                              new_id, parse_body, usage)
from serving.scheduler import ReplicaBroken, Scheduler
from serving.worker import TPWorker, resolve_location

WORKER_NAMESPACE = "eyas-serving"  # TP workers are named eyas-worker-<app>-<replica>-rank<r> there
HEALTH_PING_TIMEOUT_S = 30.0

app = FastAPI(title="eyas", description="Speculative decoding behind an OpenAI-style API")


@app.exception_handler(ApiError)
async def _api_error(request: Request, err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


@app.exception_handler(ReplicaBroken)
async def _broken(request: Request, err: ReplicaBroken) -> JSONResponse:
    return JSONResponse(error_body(str(err), "server_error", code="replica_unavailable"), status_code=503)


@app.exception_handler(RequestValidationError)
async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
    return JSONResponse(error_body(f"invalid request: {err.errors()[:1]}"), status_code=400)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if err.status_code < 500 else "server_error"
    return JSONResponse(error_body(str(err.detail), kind), status_code=err.status_code)


class RequestRun:
    """One request's generation as text pieces, with stop strings applied and its speculative metrics kept."""

    def __init__(self, scheduler: Scheduler, request: SequenceRequest, tokenizer: Any, stop: list[str],
                 metrics: ServingMetrics) -> None:
        self.scheduler, self.request, self.metrics = scheduler, request, metrics
        self.text = TextStream(tokenizer, stop)
        self.stats = SpecStats()
        self.num_cycles = 0
        self.finish_reason: str | None = None
        self.start = time.perf_counter()
        self.first_token_s: float | None = None
        self.batch_size_max = 0  # the most sequences this request shared a round with (itself included)

    async def pieces(self) -> AsyncIterator[tuple[str, list[int]]]:
        """(text delta, new token ids) as tokens arrive; ends at EOS, the budget or a stop string."""
        async with contextlib.aclosing(self.scheduler.generate(self.request)) as outputs:
            async for out in outputs:
                self.batch_size_max = max(self.batch_size_max, self.scheduler.batch_size)
                if self.first_token_s is None and out.new_token_ids:
                    self.first_token_s = time.perf_counter() - self.start
                    self.metrics.first_token(self.first_token_s)
                for num_accepted, judged_depth, num_drafted in out.cycles:
                    self.num_cycles += 1
                    self.stats.record_cycle(num_accepted, judged_depth, [], num_drafted)
                before = len(self.text.ids)
                delta = self.text.push(out.new_token_ids)
                new_ids = self.text.ids[before:self.text.num_tokens] if self.text.stopped else out.new_token_ids
                if self.text.stopped:
                    self.finish_reason = "stop"
                    yield delta, new_ids
                    return  # aclosing frees the batch row now
                if out.finished:
                    self.finish_reason = out.finish_reason
                    delta += self.text.flush()
                yield delta, new_ids

    @property
    def token_ids(self) -> list[int]:
        return self.text.ids[:self.text.num_tokens]

    def usage(self) -> dict[str, int]:
        return usage(len(self.request.prompt_ids), len(self.token_ids))

    def spec_metrics(self, method: str) -> dict[str, Any]:
        speculative = method != "vanilla"
        return {"method": method, "cycles": self.num_cycles,
                "tau": self.stats.tau if speculative else None,
                "accepted_per_position": list(self.stats.depth_accepted),
                "acceptance_per_position": self.stats.per_depth_accept,
                "mean_draft_nodes": self.stats.num_draft_nodes / max(self.stats.cycles, 1),
                "batch_size_max": self.batch_size_max}

    def record(self, method: str) -> None:
        spec = self.spec_metrics(method)
        self.metrics.finished(len(self.token_ids), spec["accepted_per_position"], spec["tau"],
                              time.perf_counter() - self.start)


@serve.deployment(name="EyasServer", health_check_period_s=5.0, health_check_timeout_s=60.0)
@serve.ingress(app)
class EyasServer:
    async def __init__(self, args: ServeArgs | dict[str, Any]) -> None:
        self.args = ServeArgs.from_args(args)
        target_dir = Path(resolve_location(self.args.target))
        self.tokenizer = load_tokenizer(target_dir)
        config = ModelConfig.from_file(target_dir / "config.json")
        eos = set(config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.api_key = self.args.api_key
        self.workers: list[Any] = []
        try:
            info = await self._start_workers(sorted(eos))
        except BaseException:
            self._kill_workers()
            raise
        self.limits = Limits(self.args.served_name, info["vocab_size"], info["max_len"], info["tree_room"],
                             self.args.max_tokens_limit or info["max_len"], self.args.default_max_tokens)
        self.metrics = ServingMetrics(self.args.served_name)
        self.scheduler = Scheduler(self.workers, self.args.max_batch_size, self.args.step_timeout_s,
                                   on_round=self.metrics.batch)
        self.created = int(time.time())

    async def _start_workers(self, eos: list[int]) -> dict[str, Any]:
        """One TPWorker per rank in bundles 1..tp of this replica's placement group, then the TP rendezvous."""
        placement_group = ray.util.get_current_placement_group()
        context = serve.get_replica_context()
        base = f"eyas-worker-{context.app_name}-{context.replica_id.unique_id}"
        for rank in range(self.args.tensor_parallel_size):
            options: dict[str, Any] = {"num_cpus": self.args.worker_cpus, "num_gpus": self.args.worker_gpus,
                                       "name": f"{base}-rank{rank}", "namespace": WORKER_NAMESPACE}
            if placement_group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group, placement_group_bundle_index=1 + rank)
            self.workers.append(TPWorker.options(**options).remote(rank, self.args, eos))
        host, port = await self.workers[0].rendezvous.remote()
        infos = await asyncio.gather(*[worker.setup.remote(host, port) for worker in self.workers])
        return infos[0]

    def _kill_workers(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):
                ray.kill(worker)

    def __del__(self) -> None:
        self._kill_workers()

    async def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising makes it replace the replica."""
        if self.scheduler.broken is not None:
            raise RuntimeError(f"eyas workers failed: {self.scheduler.broken!r}")
        await asyncio.wait_for(asyncio.gather(*[w.ping.remote() for w in self.workers]), HEALTH_PING_TIMEOUT_S)

    # ------------------------------------------------------------ routes

    @app.get("/health")
    async def health(self) -> dict[str, Any]:
        if self.scheduler.broken is not None:
            raise ReplicaBroken(f"this replica's workers failed ({type(self.scheduler.broken).__name__})")
        return {"status": "ok", "model": self.limits.model_name, **self.scheduler.load()}

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return {"object": "list", "data": [{
            "id": self.limits.model_name, "object": "model", "created": self.created, "owned_by": "eyas",
            "max_model_len": self.limits.max_len, "tensor_parallel_size": self.args.tensor_parallel_size,
            "max_batch_size": self.args.max_batch_size, "spec": to_dict(self.args.spec),
            "speculation_by_batch": self.args.speculation_by_batch}]}

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._complete(request, chat=True)

    # ------------------------------------------------------------ helpers

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    def _parse(self, raw: bytes, chat: bool) -> tuple[Any, SequenceRequest, list[str]]:
        body = parse_body(raw, ChatBody if chat else CompletionBody)
        check_model(body, self.limits)
        stop = check_sampling(body)
        if chat:
            prompt_ids = chat_prompt_ids(self.tokenizer, body.messages)
            asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            default = None  # chat: up to the context, as OpenAI
        else:
            prompt = body.prompt
            prompt_ids = list(prompt) if isinstance(prompt, list) else encode_text(self.tokenizer, prompt, "prompt")
            asked, default = body.max_tokens, self.limits.default_max_tokens
        max_tokens = check_lengths(prompt_ids, asked, self.limits, default)
        temperature = body.temperature if body.temperature >= GREEDY_BELOW else 0.0
        sampling = SamplingParams(temperature, body.top_p, max(body.top_k, 0), body.seed)
        request = SequenceRequest(new_id("chatcmpl" if chat else "cmpl"), prompt_ids, max_tokens, sampling)
        return body, request, stop

    async def _complete(self, request: Request, chat: bool):
        route = "chat" if chat else "completions"
        try:
            self._authorize(request)
            body, sequence, stop = self._parse(await request.body(), chat)
            if self.scheduler.broken is not None:
                raise ReplicaBroken("this replica's workers failed; retry shortly")
        except (ApiError, ReplicaBroken) as err:
            self.metrics.request(route, getattr(err, "status", 503))
            raise
        run = RequestRun(self.scheduler, sequence, self.tokenizer, stop, self.metrics)
        if body.stream:
            return StreamingResponse(self._stream(run, body, chat, route), media_type="text/event-stream")
        try:
            text = "".join([delta async for delta, _ in run.pieces()])
        except ReplicaBroken:
            self.metrics.request(route, 503)
            raise
        except asyncio.CancelledError:  # the client went away; aclosing already freed the row
            self.metrics.request(route, 499)
            raise
        run.record(self.args.spec.method)
        self.metrics.request(route, 200)
        result = envelope(chat, sequence.request_id, self.limits.model_name, stream=False)
        result["choices"] = [choice(chat, text, run.finish_reason, run.token_ids if body.return_token_ids else None)]
        result["usage"] = run.usage()
        result["spec"] = run.spec_metrics(self.args.spec.method)
        return JSONResponse(result)

    async def _stream(self, run: RequestRun, body: Any, chat: bool, route: str) -> AsyncIterator[str]:
        head = envelope(chat, run.request.request_id, self.limits.model_name, stream=True)

        def event(payload: dict[str, Any]) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        try:
            async for delta, new_ids in run.pieces():
                if delta or body.return_token_ids:
                    piece = choice(chat, delta, None, new_ids if body.return_token_ids else None, delta=True)
                    yield event({**head, "choices": [piece]})
            yield event({**head, "choices": [choice(chat, "", run.finish_reason, delta=True)]})
            yield event({**head, "choices": [], "usage": run.usage(), "spec": run.spec_metrics(self.args.spec.method)})
            yield "data: [DONE]\n\n"
        except ReplicaBroken as err:
            self.metrics.request(route, 503)
            yield event(error_body(str(err), "server_error", code="replica_unavailable"))
            return
        except (asyncio.CancelledError, GeneratorExit):  # client disconnected mid-stream: its row is freed
            self.metrics.request(route, 499)
            raise
        run.record(self.args.spec.method)
        self.metrics.request(route, 200)


def build_app(args: dict[str, Any]) -> Application:
    """The application builder ``import_path: serving.app:build_app`` names (Serve passes exactly the ``args``).

    The placement group (bundle 0 for the replica, one bundle per TP rank) follows from the args; a config file's
    ``deployments:`` entry (autoscaling_config, max_ongoing_requests, ...) overrides these options as usual."""
    return application(args)


def application(args: dict[str, Any] | ServeArgs, deployment_options: dict[str, Any] | None = None) -> Application:
    """``build_app`` with deployment options applied on top, for Python callers (``run_config``)."""
    serve_args = ServeArgs.from_args(args)
    options: dict[str, Any] = {"ray_actor_options": {"num_cpus": serve_args.replica_cpus},
                               "placement_group_bundles": serve_args.bundles(),
                               "placement_group_strategy": serve_args.placement_strategy,
                               "max_ongoing_requests": 2 * serve_args.max_batch_size}
    options.update(deployment_options or {})
    return EyasServer.options(**options).bind(serve_args)


def run_config(config: dict[str, Any]) -> list[str]:
    """Deploy a Serve config (as ``serve run FILE`` would, on the Ray this process is connected to) and return the
    application names. Only this application's own deployment, EyasServer, takes ``deployments:`` options."""
    serve.start(http_options=config.get("http_options") or {"host": "127.0.0.1"},
                proxy_location=config.get("proxy_location", "HeadOnly"))
    names = []
    for entry in config["applications"]:
        options = {}
        for deployment in entry.get("deployments") or []:
            deployment = dict(deployment)
            if deployment.pop("name") == "EyasServer":
                options = deployment
        serve.run(application(entry.get("args") or {}, options), name=entry.get("name", "default"),
                  route_prefix=entry.get("route_prefix", "/"))
        names.append(entry.get("name", "default"))
    return names
