"""The HTTP layer: an OpenAI-style FastAPI app over one replica's scheduler, tokenizer and limits.

``build_api(frontend)`` makes the app; serving.app's deployment builds it on the replica (Serve's
``__serve_build_asgi_app__``), and unit tests build it over an in-process engine. Routes:

    POST /v1/completions        CompletionBody (serving.protocol): prompt (text or token ids), max_tokens, ...
    POST /v1/chat/completions   ChatBody: messages, max_tokens | max_completion_tokens, ...same sampling fields
    GET  /v1/models             the served model, its context and speculative settings
    GET  /health                200 {"status": "ok", running, waiting, capacity, cancelled}; 503 once workers failed

The OpenAPI schema at /openapi.json describes the request bodies (the pydantic models that validate them) and the
error responses. Every error is OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: a client mistake
is a 4xx and never reaches the workers; a replica past ``max_batch_size + max_waiting_requests`` requests answers 429
with ``Retry-After`` instead of queueing without bound; a replica whose workers failed answers 503 with
``Retry-After`` while Serve replaces it; a request the engine failed alone (a bug that hit its row) answers 500
``request_failed`` while the rest of its batch goes on. A body past MAX_BODY_BYTES is a 413 before it is read. With
``api_key_env`` set, /v1 routes need ``Authorization: Bearer <key>`` (compared in constant time, never logged).

A completion carries ``usage`` and eyas's ``spec`` (method, cycles, tau, accepted_per_position,
acceptance_per_position, mean_draft_nodes, batch_size_max). A stream follows OpenAI's contract: chunks with one
choice each, the last of them carrying ``finish_reason`` and the ``spec`` field; with
``stream_options: {"include_usage": true}`` every chunk has ``"usage": null`` and one more chunk with empty
``choices`` carries ``usage`` (and ``spec`` again); then ``data: [DONE]``.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from eyas.config import to_dict
from eyas.decoding.requests import SequenceRequest
from eyas.decoding.sampling import SamplingParams
from eyas.decoding.stats import SpecStats
from eyas_ray.serve_config import ServeArgs
from serving.metrics import ServingMetrics
from serving.protocol import (GREEDY_BELOW, MAX_BODY_BYTES, ApiError, ChatBody, CompletionBody, ErrorResponse, Limits,
                              TextStream, chat_prompt_ids, check_lengths, check_model, choice, encode_text, envelope,
                              error_body, new_id, parse_body, stop_strings, usage)
from serving.scheduler import ReplicaBroken, Scheduler

RETRY_AFTER_BUSY_S = 1  # a row frees as soon as any running request ends
RETRY_AFTER_BROKEN_S = 5  # Serve replaces a broken replica within seconds


class JsonResponse(JSONResponse):
    """JSON with non-ASCII escaped, so text a client sent (a lone surrogate, quoted in an error) always encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class RequestFailed(RuntimeError):
    """The engine failed this request alone (StepOutput.error); the replica and its other requests go on."""


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
                if out.error is not None:
                    raise RequestFailed(out.error)
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
        self.stats.emitted(max(len(self.token_ids) - 1, 0))  # tau: what was sent (after the prefill's token)
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


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refused with 413 as soon as it is past ``limit`` bytes: by its Content-Length before a byte
    is read, or while it streams in (chunked), so a huge body is never held in memory."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is over {limit} bytes, the limit")
        chunks.append(chunk)
    return b"".join(chunks)


class Frontend:
    """What the routes do, over one replica's scheduler: authorize, validate, admit, run, answer or stream."""

    def __init__(self, args: ServeArgs, tokenizer: Any, limits: Limits, scheduler: Scheduler,
                 metrics: ServingMetrics, api_key: str | None) -> None:
        self.args, self.tokenizer, self.limits = args, tokenizer, limits
        self.scheduler, self.metrics, self.api_key = scheduler, metrics, api_key
        self.method = args.spec.method
        self.created = int(time.time())

    def health(self) -> dict[str, Any]:
        if self.scheduler.broken is not None:
            raise ReplicaBroken(f"this replica's workers failed ({type(self.scheduler.broken).__name__})")
        return {"status": "ok", "model": self.limits.model_name, **self.scheduler.load()}

    def models(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return {"object": "list", "data": [{
            "id": self.limits.model_name, "object": "model", "created": self.created, "owned_by": "eyas",
            "max_model_len": self.limits.max_len, "tensor_parallel_size": self.args.tensor_parallel_size,
            "max_batch_size": self.args.max_batch_size, "max_waiting_requests": self.args.max_waiting_requests,
            "spec": to_dict(self.args.spec), "speculation_by_batch": self.args.speculation_by_batch}]}

    async def complete(self, request: Request, chat: bool) -> Any:
        route = "chat" if chat else "completions"
        try:
            raw = await read_body(request)  # read before any refusal: an unread body would reset a kept-alive link
            self._authorize(request)
            body, sequence, stop = self._parse(raw, chat)
            self._admit()
        except (ApiError, ReplicaBroken) as err:
            self.metrics.request(route, getattr(err, "status", 503))
            raise
        run = RequestRun(self.scheduler, sequence, self.tokenizer, stop, self.metrics)
        if body.stream:
            return await self._start_stream(run, body, chat, route)
        try:
            text = "".join([delta async for delta, _ in run.pieces()])
        except ReplicaBroken:
            self.metrics.request(route, 503)
            raise
        except RequestFailed as err:
            self.metrics.request(route, 500)
            raise request_failed(err) from None
        except asyncio.CancelledError:  # the client went away; aclosing already freed the row
            self.metrics.request(route, 499)
            raise
        run.record(self.method)
        self.metrics.request(route, 200)
        result = envelope(chat, sequence.request_id, self.limits.model_name, stream=False)
        result["choices"] = [choice(chat, text, run.finish_reason, run.token_ids if body.return_token_ids else None)]
        result["usage"] = run.usage()
        result["spec"] = run.spec_metrics(self.method)
        return JsonResponse(result)

    # ------------------------------------------------------------ steps

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
        # a top_k past the vocabulary keeps every token: the same as off
        top_k = body.top_k if 0 < body.top_k < self.limits.vocab_size else 0
        # a top_p at or below 1/V keeps the top token alone either way; raised to 1/(2V) it stays a float32
        # (5e-324 rounds to 0 there, which dropped every token: NaN probabilities broke the replica's round)
        top_p = max(body.top_p, 0.5 / self.limits.vocab_size)
        sampling = SamplingParams(temperature, top_p, top_k, body.seed)
        request = SequenceRequest(new_id("chatcmpl" if chat else "cmpl"), prompt_ids, max_tokens, sampling)
        return body, request, stop_strings(body)

    def _admit(self) -> None:
        """Back-pressure: past max_batch_size running plus max_waiting_requests waiting, a new request gets 429."""
        if self.scheduler.broken is not None:
            raise ReplicaBroken("this replica's workers failed; retry shortly")
        limit = self.scheduler.capacity + self.args.max_waiting_requests
        if self.scheduler.num_admitted >= limit:
            load = self.scheduler.load()
            raise ApiError(429, f"this replica is busy: {load['running']} requests running and {load['waiting']} "
                                f"waiting for a batch row (max_batch_size={self.scheduler.capacity}, "
                                f"max_waiting_requests={self.args.max_waiting_requests}); retry after "
                                f"{RETRY_AFTER_BUSY_S} s", type="server_overloaded", code="server_busy",
                           retry_after_s=RETRY_AFTER_BUSY_S)

    async def _start_stream(self, run: RequestRun, body: Any, chat: bool, route: str) -> StreamingResponse:
        """Waits for the first piece before answering: the request holds its place in the scheduler from now on
        (so admission counts it), and a failure before the first token is still an HTTP status."""
        pieces = run.pieces()
        try:
            first = await anext(pieces)
        except ReplicaBroken:
            self.metrics.request(route, 503)
            raise
        except RequestFailed as err:
            self.metrics.request(route, 500)
            raise request_failed(err) from None
        except asyncio.CancelledError:
            self.metrics.request(route, 499)
            raise
        return StreamingResponse(self._events(run, first, pieces, body, chat, route), media_type="text/event-stream")

    async def _events(self, run: RequestRun, first: tuple[str, list[int]],
                      pieces: AsyncIterator[tuple[str, list[int]]], body: Any, chat: bool,
                      route: str) -> AsyncIterator[str]:
        head = envelope(chat, run.request.request_id, self.limits.model_name, stream=True)
        usage_field = {"usage": None} if body.include_usage else {}  # OpenAI: null on every chunk but the last

        def event(payload: dict[str, Any]) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        def piece(delta: str, new_ids: list[int]) -> str | None:
            if not delta and not body.return_token_ids:
                return None
            part = choice(chat, delta, None, new_ids if body.return_token_ids else None, delta=True)
            return event({**head, "choices": [part], **usage_field})

        try:
            async with contextlib.aclosing(pieces):
                if (chunk := piece(*first)) is not None:
                    yield chunk
                async for delta, new_ids in pieces:
                    if (chunk := piece(delta, new_ids)) is not None:
                        yield chunk
            spec = run.spec_metrics(self.method)
            yield event({**head, "choices": [choice(chat, "", run.finish_reason, delta=True)], **usage_field,
                         "spec": spec})
            if body.include_usage:
                yield event({**head, "choices": [], "usage": run.usage(), "spec": spec})
            yield "data: [DONE]\n\n"
        except ReplicaBroken as err:
            self.metrics.request(route, 503)
            yield event(error_body(str(err), "server_error", code="replica_unavailable"))
            return
        except RequestFailed as err:
            self.metrics.request(route, 500)
            yield event(request_failed(err).body())
            return
        except (asyncio.CancelledError, GeneratorExit):  # client disconnected mid-stream: its row is freed
            self.metrics.request(route, 499)
            raise
        run.record(self.method)
        self.metrics.request(route, 200)


def request_failed(err: RequestFailed) -> ApiError:
    return ApiError(500, f"this request failed in the engine ({err}); this is a bug in eyas, other requests are "
                         "unaffected", type="server_error", code="request_failed")


# ---------------------------------------------------------------- the app

BODY_MODELS = (CompletionBody, ChatBody)
ERRORS = {status: {"model": ErrorResponse, "description": what} for status, what in (
    (400, "a bad request body or parameter"), (401, "a missing or wrong API key"), (404, "an unknown model"),
    (413, "a request body past the size limit"), (429, "busy: retry after the Retry-After header's seconds"),
    (503, "the replica's workers failed: retry after the Retry-After header's seconds"))}


def _json_body(model: type) -> dict[str, Any]:
    """An operation's requestBody for ``openapi_extra``: the routes read raw bytes (parse_body gives the errors)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _completion_responses(kind: str) -> dict[int | str, dict[str, Any]]:
    return {200: {"description": f"a {kind}, or with `stream: true` a text/event-stream of chunks",
                  "content": {"application/json": {}, "text/event-stream": {}}}, **ERRORS}


def build_api(frontend: Frontend) -> FastAPI:
    api = FastAPI(title="eyas", description="Speculative decoding behind an OpenAI-style API",
                  default_response_class=JsonResponse)
    _install_error_handlers(api)

    @api.get("/health", responses={503: ERRORS[503]})
    async def health() -> dict[str, Any]:
        return frontend.health()

    @api.get("/v1/models", responses={401: ERRORS[401]})
    async def models(request: Request) -> dict[str, Any]:
        return frontend.models(request)

    @api.post("/v1/completions", openapi_extra=_json_body(CompletionBody),
              responses=_completion_responses("text_completion"))
    async def completions(request: Request) -> Any:
        return await frontend.complete(request, chat=False)

    @api.post("/v1/chat/completions", openapi_extra=_json_body(ChatBody),
              responses=_completion_responses("chat.completion"))
    async def chat_completions(request: Request) -> Any:
        return await frontend.complete(request, chat=True)

    api.openapi = lambda: _openapi(api, frontend.limits.model_name)  # type: ignore[method-assign]
    return api


def _openapi(api: FastAPI, model_name: str) -> dict[str, Any]:
    """FastAPI's schema plus the request-body models (routes that read raw bytes do not name them to FastAPI),
    whose ``model`` is the one this replica serves."""
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
        _, defs = models_json_schema([(m, "validation") for m in BODY_MODELS],
                                     ref_template="#/components/schemas/{model}")
        for model in BODY_MODELS:
            defs["$defs"][model.__name__]["properties"]["model"] = {
                "type": "string", "enum": [model_name], "description": "the served model (GET /v1/models)"}
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        api.openapi_schema = schema
    return api.openapi_schema


def _install_error_handlers(api: FastAPI) -> None:
    @api.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> JsonResponse:
        return JsonResponse(err.body(), status_code=err.status, headers=err.headers)

    @api.exception_handler(ReplicaBroken)
    async def _broken(request: Request, err: ReplicaBroken) -> JsonResponse:
        return JsonResponse(error_body(str(err), "server_error", code="replica_unavailable"), status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_BROKEN_S)})

    @api.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JsonResponse:
        return JsonResponse(error_body(f"invalid request: {err.errors()[:1]}"), status_code=400)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JsonResponse:
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        return JsonResponse(error_body(str(err.detail), kind), status_code=err.status_code, headers=err.headers)

    @api.exception_handler(Exception)
    async def _bug(request: Request, err: Exception) -> JsonResponse:  # a bug: still OpenAI's shape, and logged
        return JsonResponse(error_body(f"internal error ({type(err).__name__}); this is a bug in eyas",
                                       "server_error"), status_code=500)
