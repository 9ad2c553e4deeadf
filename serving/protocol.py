"""The OpenAI-style wire format: request bodies, validation into ``ApiError``s, response and stream chunks, and the
incremental detokenizer that applies stop strings.

Every user mistake becomes an ``ApiError`` with OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}`` and a 4xx status; nothing a client sends reaches the workers
unchecked. Chat prompts use the tokenizer's chat template when it has one, else this documented default:
``"<role>: <content>\n"`` per message, then ``"assistant:"``.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_BODY_BYTES = 1 << 20
MAX_STOP_STRINGS = 4
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


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = Field(False, description="send a last chunk with empty `choices` and the `usage` (and "
                                                   "`spec`) of the whole request, before `data: [DONE]`")


class _Body(BaseModel):
    # strict: "16" is not a number and true is not 1; unknown fields (user, logit_bias, ...) are ignored
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0, description="0 is greedy decoding")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="extension (vLLM's): 0 or -1 turn it off")
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"at most {MAX_STOP_STRINGS} non-empty strings")
    seed: int | None = Field(None, ge=0, lt=2 ** 64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    return_token_ids: bool = Field(False, description="extension: the generated token ids in each choice")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionBody(_Body):
    prompt: str | list[int] = Field(description="text, or token ids")
    max_tokens: int | None = Field(None, ge=1)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


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
    field = model.model_fields.get(param or "")
    hint = f"; {field.description}" if field is not None and field.description else ""
    try:
        got = json.dumps(first.get("input"))[:80]
    except (TypeError, ValueError):
        got = repr(first.get("input"))[:80]
    return ApiError(400, f"'{where or param}': {first['msg']} (got {got}){hint}", param)


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


def stop_strings(body: _Body) -> list[str]:
    """The stop strings as a list (the body's model already checked them)."""
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def check_lengths(prompt_ids: list[int], max_tokens: int | None, limits: Limits, default: int | None = None) -> int:
    """Token ids and budget against the vocabulary and the context; returns max_tokens."""
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty; give at least one token", "prompt")
    bad = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ApiError(400, f"prompt token ids {bad[:5]} lie outside the vocabulary [0, {limits.vocab_size})",
                       "prompt")
    room = limits.max_len - limits.tree_room - len(prompt_ids)
    if room < 1:
        raise ApiError(400, f"the prompt is {len(prompt_ids)} tokens, longer than this model's context of "
                            f"{limits.max_len} tokens allows ({limits.tree_room} are reserved for a draft tree)",
                       "prompt", "context_length_exceeded")
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


# ---------------------------------------------------------------- detokenizing with stop strings


class TextStream:
    """Generated ids -> text that is safe to send: held back while it may still grow into a stop string or ends in
    an incomplete UTF-8 character; cut before the first stop string, which ends the sequence."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already sent
        self.text = ""
        self.stopped = False
        self.num_tokens = 0  # tokens the sent text needs (all of them, unless a stop string cut it)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids += new_ids
        self.num_tokens = len(self.ids)
        self.text = self._decode(self.ids)
        cut = min((i for i in (self.text.find(s, max(0, self.sent - len(s))) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            # as if the tokens had come one at a time (a speculative cycle emits several): the sequence ends at the
            # first token whose text holds a stop string, and the text is cut before the earliest stop in it. (A
            # longer stop that starts earlier but completes later, ["DNb", "N"] in "DN|b", never completes.)
            self.stopped = True
            self.num_tokens = next(k for k in range(1, len(self.ids) + 1)
                                   if any(s in self._decode(self.ids[:k]) for s in self.stop))
            first = self._decode(self.ids[:self.num_tokens])
            self.text = first[:min(i for i in (first.find(s, max(0, self.sent - len(s))) for s in self.stop)
                                   if i >= 0)]
            return self._take(len(self.text))
        safe = len(self.text) - (1 if self.text.endswith("\ufffd") else 0)
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    safe = min(safe, len(self.text) - k)
                    break
        return self._take(safe)

    def flush(self) -> str:
        """Everything not yet sent (the sequence ended)."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:end], end
        return delta


# ---------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(chat: bool, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
           delta: bool = False) -> dict[str, Any]:
    if chat:
        body = {"index": 0, ("delta" if delta else "message"): {"role": "assistant", "content": text},
                "finish_reason": finish_reason}
    else:
        body = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        body["token_ids"] = token_ids
    return body


def envelope(chat: bool, request_id: str, model: str, stream: bool, created: int | None = None) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    return {"id": request_id, "object": kind, "created": created or int(time.time()), "model": model}
