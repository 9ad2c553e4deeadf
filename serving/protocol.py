"""The OpenAI-style wire format of requests: bodies and their validation into ``ApiError``s (serving.responses
writes the answers).

Every user mistake becomes an ``ApiError`` with OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}`` and a 4xx status; nothing a client sends reaches the workers
unchecked. Chat prompts use the tokenizer's chat template when it has one, else this documented default:
``"<role>: <content>\n"`` per message, then ``"assistant:"``.

What a body may hold. The models below are the one definition (serving.api publishes them as /openapi.json), and
no field a client sends is silently dropped: each is honoured, refused with a 400 whose ``param`` and message name
it, or on the short list of harmless ones that are accepted and ignored.

  honoured      model, prompt (a text, token ids, or a list of either: one choice set per prompt), messages,
                max_tokens, max_completion_tokens, temperature, top_p, seed, stop, stream, stream_options
                (include_usage), n, presence_penalty, frequency_penalty, logit_bias, logprobs (completions: 0..5;
                chat: true/false with top_logprobs 0..20), echo (completions), best_of (only equal to n)
  extensions    top_k (vLLM's), return_token_ids (each choice's generated ids)
  refused       anything eyas does not do, unless null (or the value that asks for nothing: tools [], tool_choice
                "none", response_format {"type": "text"}, modalities ["text"], suffix "", store false):
                response_format, tools, tool_choice, functions, function_call, parallel_tool_calls, audio,
                modalities, prediction, reasoning_effort, verbosity, web_search_options, moderation, suffix,
                best_of != n, store true, logit_bias ids outside the vocabulary (checked against the replica), and
                every field not named here (extra="forbid", in nested objects too: a message's ``name``)
  ignored       fields that change nothing a client gets back: ``user`` and ``safety_identifier`` (end-user ids
                for abuse monitoring), ``metadata`` (tags for stored completions), ``service_tier`` (a billing
                tier), ``prompt_cache_key`` / ``prompt_cache_retention`` / ``prompt_cache_options`` (prompt-cache
                hints; eyas caches no prompts), and ``stream_options.include_obfuscation`` (padding on stream events)

Penalties count the tokens a choice generated (not the prompt), as OpenAI and vLLM; logit_bias maps a token id (a
JSON string key) to a bias in [-100, 100]; both change the logits the choice is drawn from, and speculation stays
lossless with respect to them (eyas.decoding.logits). Logprobs are the log-softmax of those logits, before
temperature / top_p / top_k. With n > 1 and a seed, choice j of a prompt uses seed + j.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from eyas.decoding.sampling import SamplingParams

MAX_BODY_BYTES = 1 << 20
MAX_STOP_STRINGS = 4
MAX_CHOICES = 128  # n, as OpenAI
MAX_PROMPTS = 128  # prompts in one completion request
MAX_LOGIT_BIAS = 1024  # entries in logit_bias
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs, as OpenAI
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI
GREEDY_BELOW = 1e-5  # a temperature this small is greedy decoding (as in vLLM); dividing by it would overflow


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error",  # noqa: A002 (OpenAI's field name)
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.retry_after_s = retry_after_s  # sent as the Retry-After header (429, 503)

    @property
    def headers(self) -> dict[str, str] | None:
        return None if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,  # noqa: A002
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------- request bodies
# The models are the one definition of what a body may hold: they validate it, and serving.api publishes their JSON
# schema as the OpenAPI request bodies (which the schemathesis fuzz tests generate from).

NonEmpty = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]  # below the vocabulary: check_lengths
TokenKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")]  # a token id, as JSON object keys are strings
Bias = Annotated[float, Field(ge=-100, le=100)]
Tag = Annotated[str, Field(max_length=512)]
_STRICT = ConfigDict(strict=True, extra="forbid")


def _refused(why: str, accepted: str = "null") -> Any:
    """A field eyas does not serve: only null (or the value that asks for nothing) passes; the 400 says why."""
    return Field(None, description=f"not supported: {why}; send {accepted} or leave it out")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = Field(False, description="send a last chunk with empty `choices` and the `usage` (and "
                                                   "`spec`) of the whole request, before `data: [DONE]`")
    include_obfuscation: bool | None = Field(None, description="ignored: eyas pads no stream events")


class _Body(BaseModel):
    # strict: "16" is not a number and true is not 1; a field not declared here is a 400 (module docstring)
    model_config = _STRICT

    model: str
    temperature: float = Field(1.0, ge=0, description="0 is greedy decoding")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="extension (vLLM's): 0 or -1 turn it off")
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"at most {MAX_STOP_STRINGS} non-empty strings")
    seed: int | None = Field(None, ge=0, lt=2 ** 64, description="with n > 1, choice j uses seed + j")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices per prompt")
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="minus this from a token's logit once the "
                                                                  "choice has generated it")
    frequency_penalty: float = Field(0.0, ge=-2, le=2, description="minus this times the number of times the "
                                                                   "choice has generated the token")
    logit_bias: Annotated[dict[TokenKey, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="token id (a string key, inside the vocabulary) -> a bias in [-100, 100] added to its "
                          "logit")
    return_token_ids: bool = Field(False, description="extension: the generated token ids in each choice")
    user: str | None = Field(None, description="ignored: an end-user id for abuse monitoring")

    @field_validator("*", mode="before")
    @classmethod
    def _integral(cls, value: Any) -> Any:
        """46.0 is the integer 46, as JSON Schema's "integer" (the schema /openapi.json publishes) counts it; 46.5
        and true still are not integers. A float field takes the int as the same number."""
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, list):  # token ids, and lists of them
            return [cls._integral(v) for v in value]
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionBody(_Body):
    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)] = Field(
        description=f"a text, token ids (at least one), or a list of up to {MAX_PROMPTS} of either (n choices each)")
    max_tokens: int | None = Field(None, ge=0, description="0 only with echo: the prompt (and its logprobs) alone")
    echo: bool = Field(False, description="the prompt before each choice's text (and its tokens first in logprobs)")
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS,
                                 description="each token's logprob and this many most likely tokens")
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES,
                                description="only equal to n: eyas returns every choice it generates")
    suffix: Literal[""] | None = _refused("eyas does not insert text before a suffix", 'null or ""')


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormatText(BaseModel):
    model_config = _STRICT
    type: Literal["text"]


NoTools = Annotated[list[dict[str, Any]], Field(max_length=0)]


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="each generated token's logprob")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="with logprobs: this many most likely tokens at each position")
    # refused unless they ask for nothing (module docstring)
    response_format: ResponseFormatText | None = _refused(
        'eyas answers plain text, with no JSON mode or schema', 'null or {"type": "text"}')
    tools: NoTools | None = _refused("eyas does not call tools", "null or []")
    tool_choice: Literal["none"] | None = _refused("eyas does not call tools", 'null or "none"')
    functions: NoTools | None = _refused("eyas does not call functions", "null or []")
    function_call: Literal["none"] | None = _refused("eyas does not call functions", 'null or "none"')
    parallel_tool_calls: None = _refused("eyas does not call tools")
    audio: None = _refused("eyas answers text only")
    modalities: list[Literal["text"]] | None = _refused("eyas answers text only", 'null or ["text"]')
    prediction: None = _refused("eyas takes no predicted output (its drafters predict)")
    reasoning_effort: None = _refused("eyas's models do not reason in hidden tokens")
    verbosity: None = _refused("eyas does not steer answer length but by max_tokens")
    web_search_options: None = _refused("eyas does not search the web")
    moderation: None = _refused("eyas runs no moderation")
    store: Literal[False] | None = _refused("eyas stores no completions", "null or false")
    # accepted and ignored: they change nothing a client gets back (module docstring)
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Tag], Field(max_length=16)] | None = Field(
        None, description="ignored: tags for stored completions (eyas stores none)")
    safety_identifier: str | None = Field(None, description="ignored: an end-user id for abuse monitoring")
    service_tier: Annotated[str, Field(max_length=64)] | None = Field(None, description="ignored: a billing tier")
    prompt_cache_key: str | None = Field(None, description="ignored: a prompt-cache hint (eyas caches no prompts)")
    prompt_cache_retention: Annotated[str, Field(max_length=64)] | None = Field(
        None, description="ignored: a prompt-cache hint (eyas caches no prompts)")
    prompt_cache_options: dict[str, Any] | None = Field(
        None, description="ignored: prompt-cache hints (eyas caches no prompts)")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: every 4xx (and a 503 from a failed replica) has this body."""
    error: ErrorDetail


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Bytes -> a validated body, or an ApiError(400) naming the offending field."""
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
    try:
        data = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError, and an integer past Python's 4300 digits
        raise ApiError(400, f"the request body is not valid JSON ({err})") from None
    except RecursionError:
        raise ApiError(400, "the request body nests JSON too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise _field_error(err.errors()[0], model) from None


def _field_error(first: dict[str, Any], model: type[BaseModel]) -> ApiError:
    """pydantic's first complaint as a message about the field, without its type names."""
    loc = list(first["loc"])
    param = str(loc[0]) if loc else None
    # a union reports each alternative under a tag ('str', 'list[int]', 'constrained-str'); keep field names and
    # list indices only
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc
                    if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS)).lstrip(".")
    if first["type"] == "missing":
        return ApiError(400, f"missing required field '{where or param}'", param)
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"unknown field '{where}': eyas does not support it (the fields it accepts are the "
                             "request body's in /openapi.json; serving.protocol lists what is honoured, refused or "
                             "ignored)", param)
    field = model.model_fields.get(param or "")
    hint = f"; {field.description}" if field is not None and field.description else ""
    message = first["msg"]
    if len(loc) > 1 and isinstance(loc[1], str) and not (loc[1].isidentifier() and loc[1] not in _TYPE_TAGS):
        # one alternative's complaint (the first one tried) would mislead: the value fits none of them
        where, message = param, "fits none of the forms this field takes"
    try:
        got = json.dumps(first.get("input"))[:80]
    except (TypeError, ValueError):
        got = repr(first.get("input"))[:80]
    return ApiError(400, f"'{where or param}': {message} (got {got}){hint}", param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _reject_constant(name: str) -> float:
    raise ApiError(400, f"the request body holds {name}; numbers must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf
        raise ApiError(400, f"the request body holds {text[:40]}, which overflows a float; numbers must be finite")
    return value


@dataclass(frozen=True)
class Limits:
    """What this replica can serve; the request checks below need them."""
    model_name: str
    vocab_size: int
    max_len: int
    tree_room: int
    max_tokens_limit: int
    default_max_tokens: int


def check_model(body: _Body, limits: Limits) -> None:
    if body.model != limits.model_name:
        raise ApiError(404, f"the model '{body.model}' does not exist; this server serves '{limits.model_name}'",
                       "model", "model_not_found")


def check_options(body: CompletionBody | ChatBody, limits: Limits) -> None:
    """What the body's schema cannot say: fields that depend on each other or on the served model."""
    if isinstance(body, CompletionBody):
        if body.best_of is not None and body.best_of != body.n:
            raise ApiError(400, f"best_of={body.best_of} with n={body.n}: eyas returns every choice it generates, so "
                                "best_of must equal n (or be left out)", "best_of")
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens=0 asks for nothing: it is allowed only with echo=true (the prompt, and "
                                "its logprobs with logprobs set)", "max_tokens")
    elif body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, f"top_logprobs={body.top_logprobs} needs logprobs=true", "top_logprobs")
    bad = [key for key in body.logit_bias or {} if int(key) >= limits.vocab_size]
    if bad:
        raise ApiError(400, f"logit_bias token ids {bad[:5]} lie outside the vocabulary [0, {limits.vocab_size})",
                       "logit_bias")


def sampling_params(body: CompletionBody | ChatBody, limits: Limits) -> SamplingParams:
    """The body's sampling fields as the engine takes them (the seed is each choice's: serving.api)."""
    temperature = body.temperature if body.temperature >= GREEDY_BELOW else 0.0
    # a top_k past the vocabulary keeps every token: the same as off
    top_k = body.top_k if 0 < body.top_k < limits.vocab_size else 0
    # a top_p at or below 1/V keeps the top token alone either way; raised to 1/(2V) it stays a float32
    # (5e-324 rounds to 0 there, which dropped every token: NaN probabilities broke the replica's round)
    top_p = max(body.top_p, 0.5 / limits.vocab_size)
    logit_bias = tuple((int(token), bias) for token, bias in (body.logit_bias or {}).items())
    return SamplingParams(temperature, top_p, top_k, body.seed, body.presence_penalty, body.frequency_penalty,
                          logit_bias)


def stop_strings(body: _Body) -> list[str]:
    """The stop strings as a list (the body's model already checked them)."""
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def check_lengths(prompt_ids: list[int], max_tokens: int | None, limits: Limits, default: int | None = None,
                  param: str = "prompt") -> int:
    """Token ids and budget against the vocabulary and the context; returns max_tokens. ``param``: the field the
    prompt came from (a chat's is ``messages``)."""
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty; give at least one token", param)
    bad = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ApiError(400, f"prompt token ids {bad[:5]} lie outside the vocabulary [0, {limits.vocab_size})",
                       param)
    room = limits.max_len - limits.tree_room - len(prompt_ids)
    if room < 1:
        raise ApiError(400, f"the prompt is {len(prompt_ids)} tokens, longer than this model's context of "
                            f"{limits.max_len} tokens allows ({limits.tree_room} are reserved for a draft tree)",
                       param, "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(default or room, room, limits.max_tokens_limit)
    if max_tokens <= 0:
        raise ApiError(400, f"max_tokens={max_tokens}: must be >= 1", "max_tokens")
    if max_tokens > limits.max_tokens_limit:
        raise ApiError(400, f"max_tokens={max_tokens}: must be <= {limits.max_tokens_limit}", "max_tokens")
    if max_tokens > room:
        raise ApiError(400, f"the prompt ({len(prompt_ids)} tokens) plus max_tokens={max_tokens} exceeds this "
                            f"model's context of {limits.max_len} tokens ({limits.tree_room} reserved for a draft "
                            f"tree); ask for at most {room}", "max_tokens", "context_length_exceeded")
    return max_tokens


def encode_text(tokenizer: Any, text: str, param: str, **kwargs: Any) -> list[int]:
    try:
        return list(tokenizer.encode(text, **kwargs))
    except (TypeError, ValueError) as err:  # e.g. a lone surrogate ("\ud800") the tokenizer cannot encode
        raise ApiError(400, f"the {param} cannot be tokenized ({err}); send valid Unicode text", param) from None


def completion_prompts(tokenizer: Any, prompt: Any) -> list[tuple[list[int], str | None]]:
    """A completion body's prompt as (token ids, its text: None for ids) per prompt."""
    if isinstance(prompt, str):
        return [(encode_text(tokenizer, prompt, "prompt"), prompt)]
    if prompt and isinstance(prompt[0], str):
        return [(encode_text(tokenizer, text, f"prompt[{i}]"), text) for i, text in enumerate(prompt)]
    if prompt and isinstance(prompt[0], list):
        return [(list(ids), None) for ids in prompt]
    return [(list(prompt), None)]


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    plain = [{"role": m.role, "content": m.text()} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        from jinja2 import TemplateError

        try:
            text = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        except (TemplateError, ValueError, TypeError, KeyError) as err:  # the template refuses these messages
            raise ApiError(400, f"the model's chat template rejected these messages: {err}", "messages") from None
        return encode_text(tokenizer, text, "messages", add_special_tokens=False)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant:"
    return encode_text(tokenizer, text, "messages")
