"""The HTTP layer: an OpenAI-style FastAPI app over one replica's scheduler, tokenizer and limits.

``build_api(frontend)`` makes the app; serving.app's deployment builds it on the replica (Serve's
``__serve_build_asgi_app__``), and unit tests build it over an in-process engine. Routes:

    POST /v1/completions        CompletionBody (serving.protocol: what is honoured, refused, ignored): prompt (a text,
                                token ids, or a list of either), max_tokens, n, echo, logprobs, penalties, ...
    POST /v1/chat/completions   ChatBody: messages, max_tokens | max_completion_tokens, logprobs, ...
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
acceptance_per_position, mean_draft_nodes, accepted_per_proposer and acceptance_per_proposer (a hybrid's, from the
requests that ran to their end; {} otherwise), batch_size_max) over all its choices. A stream follows OpenAI's contract:
chunks with one choice each (its ``index``; n * prompts choices interleave as their tokens arrive), each choice's
last chunk carrying its ``finish_reason``, the response's last of these the ``spec`` field; with
``stream_options: {"include_usage": true}`` every chunk has ``"usage": null`` and one more chunk with empty
``choices`` carries ``usage`` (and ``spec`` again); then ``data: [DONE]``.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from eyas.config import to_dict
from eyas.decoding.requests import SequenceRequest
from eyas_ray.serve_config import ServeArgs
from serving.metrics import ServingMetrics
from serving.protocol import (MAX_BODY_BYTES, ApiError, ChatBody, CompletionBody, ErrorResponse, Limits, chat_prompt_ids,
                              check_lengths, check_model, check_options, completion_prompts, error_body, parse_body,
                              sampling_params, stop_strings)
from serving.responses import LogprobsWriter, choice, envelope, new_id
from serving.runs import END, ChoicePlan, RequestFailed, RequestRun, merged, spec_metrics, total_usage
from serving.scheduler import ReplicaBroken, Scheduler

RETRY_AFTER_BUSY_S = 1  # a row frees as soon as any running request ends
RETRY_AFTER_BROKEN_S = 5  # Serve replaces a broken replica within seconds


class JsonResponse(JSONResponse):
    """JSON with non-ASCII escaped, so text a client sent (a lone surrogate, quoted in an error) always encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


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
            body, plans, stop = self._parse(raw, chat)
            self._admit(len(plans))
        except (ApiError, ReplicaBroken) as err:
            self.metrics.request(route, getattr(err, "status", 503))
            raise
        runs = [RequestRun(self.scheduler, plan, self.tokenizer, stop, self.metrics) for plan in plans]
        pieces = merged([run.pieces() for run in runs])
        if body.stream:
            return await self._start_stream(runs, pieces, body, chat, route)
        try:
            async with contextlib.aclosing(pieces):
                async for _ in pieces:  # each run keeps its text, tokens and logprobs
                    pass
        except ReplicaBroken:
            self.metrics.request(route, 503)
            raise
        except RequestFailed as err:
            self.metrics.request(route, 500)
            raise request_failed(err) from None
        except asyncio.CancelledError:  # the client went away; aclosing already freed the rows
            self.metrics.request(route, 499)
            raise
        for run in runs:
            run.record(self.method)
        self.metrics.request(route, 200)
        result = envelope(chat, runs[0].plan.response_id, self.limits.model_name, stream=False)
        result["choices"] = [self._whole_choice(run, body, chat) for run in runs]
        result["usage"] = total_usage(runs)
        result["spec"] = spec_metrics(runs, self.method)
        return JsonResponse(result)

    # ------------------------------------------------------------ steps

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    def _parse(self, raw: bytes, chat: bool) -> tuple[Any, list[ChoicePlan], list[str]]:
        """The body, one plan per choice (n per prompt), and the stop strings."""
        body = parse_body(raw, ChatBody if chat else CompletionBody)
        check_model(body, self.limits)
        check_options(body, self.limits)
        if chat:
            prompts = [(chat_prompt_ids(self.tokenizer, body.messages), None)]
            asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            default = None  # chat: up to the context, as OpenAI
            logprobs, echo = ((body.top_logprobs or 0) if body.logprobs else None), False
        else:
            prompts = completion_prompts(self.tokenizer, body.prompt)
            asked, default = body.max_tokens, self.limits.default_max_tokens
            logprobs, echo = body.logprobs, body.echo
        silent = asked == 0  # echo alone (check_options): the engine generates one token, dropped
        base = sampling_params(body, self.limits)
        rid = new_id("chatcmpl" if chat else "cmpl")
        plans = []
        for i, (prompt_ids, text) in enumerate(prompts):
            try:
                max_tokens = check_lengths(prompt_ids, 1 if silent else asked, self.limits, default,
                                           "messages" if chat else "prompt")
            except ApiError as err:
                if len(prompts) > 1:
                    err.message = f"prompt[{i}]: {err.message}"
                raise
            echo_text = None
            if echo:
                echo_text = text if text is not None else self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
            for j in range(body.n):
                index = i * body.n + j
                seed = None if body.seed is None else (body.seed + j) % 2 ** 64  # n samples, not n copies
                request = SequenceRequest(rid if len(prompts) * body.n == 1 else f"{rid}-{index}", prompt_ids,
                                          max_tokens, replace(base, seed=seed), logprobs,
                                          logprobs if echo else None)
                plans.append(ChoicePlan(rid, index, i, request, echo_text, silent))
        return body, plans, stop_strings(body)

    def _admit(self, num_sequences: int) -> None:
        """Back-pressure: past max_batch_size running plus max_waiting_requests waiting sequences, a new request
        gets 429; one that could never fit (n * prompts past that sum) a 400."""
        if self.scheduler.broken is not None:
            raise ReplicaBroken("this replica's workers failed; retry shortly")
        limit = self.scheduler.capacity + self.args.max_waiting_requests
        if num_sequences > limit:
            raise ApiError(400, f"this request asks for {num_sequences} choices (n times the prompts); this replica "
                                f"holds at most {limit} sequences at once (max_batch_size={self.scheduler.capacity} + "
                                f"max_waiting_requests={self.args.max_waiting_requests}): send fewer", "n")
        if self.scheduler.num_admitted + num_sequences > limit:
            load = self.scheduler.load()
            raise ApiError(429, f"this replica is busy: {load['running']} requests running and {load['waiting']} "
                                f"waiting for a batch row (max_batch_size={self.scheduler.capacity}, "
                                f"max_waiting_requests={self.args.max_waiting_requests}); retry after "
                                f"{RETRY_AFTER_BUSY_S} s", type="server_overloaded", code="server_busy",
                           retry_after_s=RETRY_AFTER_BUSY_S)

    def _whole_choice(self, run: RequestRun, body: Any, chat: bool) -> dict[str, Any]:
        logprobs = None
        if run.request.logprobs is not None:
            entries = run.logprob_entries(first=True) + list(zip(run.token_ids, run.logprobs))
            logprobs = LogprobsWriter(self.tokenizer, chat).write(entries)
        return choice(chat, run.plan.index, (run.plan.echo_text or "") + run.sent, run.finish_reason,
                      run.token_ids if body.return_token_ids else None, logprobs)

    async def _start_stream(self, runs: list[RequestRun], pieces: AsyncIterator[tuple[int, Any]], body: Any,
                            chat: bool, route: str) -> StreamingResponse:
        """Waits for the first piece before answering: the request holds its place in the scheduler from now on
        (so admission counts it), and a failure before the first token is still an HTTP status."""
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
        return StreamingResponse(self._events(runs, first, pieces, body, chat, route),
                                 media_type="text/event-stream")

    async def _events(self, runs: list[RequestRun], first: tuple[int, Any], pieces: AsyncIterator[tuple[int, Any]],
                      body: Any, chat: bool, route: str) -> AsyncIterator[str]:
        head = envelope(chat, runs[0].plan.response_id, self.limits.model_name, stream=True)
        usage_field = {"usage": None} if body.include_usage else {}  # OpenAI: null on every chunk but the last
        writers = [LogprobsWriter(self.tokenizer, chat) for _ in runs]
        started = [False] * len(runs)
        ended = 0

        def event(payload: dict[str, Any]) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        def chunk(i: int, item: Any) -> str | None:
            """A choice's piece as an event (None: nothing to send), or its finish once it ended."""
            nonlocal ended
            run = runs[i]
            if item is END:
                ended += 1
                spec = {"spec": spec_metrics(runs, self.method)} if ended == len(runs) else {}
                return event({**head, "choices": [choice(chat, run.plan.index, "", run.finish_reason, delta=True)],
                              **usage_field, **spec})
            text, new_ids, new_logprobs = item
            entries = run.logprob_entries(first=not started[i]) + list(zip(new_ids, new_logprobs))
            if not started[i]:
                text, started[i] = (run.plan.echo_text or "") + text, True
            if not text and not body.return_token_ids and not entries:
                return None
            logprobs = writers[i].write(entries) if run.request.logprobs is not None else None
            part = choice(chat, run.plan.index, text, None, new_ids if body.return_token_ids else None, logprobs,
                          delta=True)
            return event({**head, "choices": [part], **usage_field})

        try:
            async with contextlib.aclosing(pieces):
                if (line := chunk(*first)) is not None:
                    yield line
                async for i, item in pieces:
                    if (line := chunk(i, item)) is not None:
                        yield line
            if body.include_usage:
                spec = spec_metrics(runs, self.method)
                yield event({**head, "choices": [], "usage": total_usage(runs), "spec": spec})
            yield "data: [DONE]\n\n"
        except ReplicaBroken as err:
            self.metrics.request(route, 503)
            yield event(error_body(str(err), "server_error", code="replica_unavailable"))
            return
        except RequestFailed as err:
            self.metrics.request(route, 500)
            yield event(request_failed(err).body())
            return
        except (asyncio.CancelledError, GeneratorExit):  # client disconnected mid-stream: its rows are freed
            self.metrics.request(route, 499)
            raise
        for run in runs:
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

    max_sequences = frontend.scheduler.capacity + frontend.args.max_waiting_requests
    api.openapi = lambda: _openapi(api, frontend.limits, max_sequences)  # type: ignore[method-assign]
    return api


def _openapi(api: FastAPI, limits: Limits, max_sequences: int) -> dict[str, Any]:
    """FastAPI's schema plus the request-body models (routes that read raw bytes do not name them to FastAPI), with
    this replica's bounds: its ``model``, its vocabulary (prompt token ids), the sequences it holds at once (n) and
    its token budget (max_tokens)."""
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
        _, defs = models_json_schema([(m, "validation") for m in BODY_MODELS],
                                     ref_template="#/components/schemas/{model}")
        for model in BODY_MODELS:
            properties = defs["$defs"][model.__name__]["properties"]
            properties["model"] = {
                "type": "string", "enum": [limits.model_name], "description": "the served model (GET /v1/models)"}
            properties["n"]["maximum"] = min(properties["n"]["maximum"], max_sequences)
            for budget in ("max_tokens", "max_completion_tokens"):
                if budget in properties:
                    properties[budget]["anyOf"][0]["maximum"] = limits.max_tokens_limit
        for form in defs["$defs"]["CompletionBody"]["properties"]["prompt"]["anyOf"]:  # token ids, or lists of them
            items = form.get("items", {})
            token_id = items.get("items", items)
            if token_id.get("type") == "integer":
                token_id["maximum"] = limits.vocab_size - 1
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
