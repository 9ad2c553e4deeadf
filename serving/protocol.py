"""The OpenAI-style wire format: request bodies, validation into ``ApiError``s, response and stream chunks, and the
incremental detokenizer that applies stop strings.

Every user mistake becomes an ``ApiError`` with OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}`` and a 4xx status; nothing a client sends reaches the workers
unchecked. Chat prompts use the tokenizer's chat template when it has one, else this documented default:
``"<role>: <content>\n"`` per message, then ``"assistant:"``.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_BODY_BYTES = 1 << 20
MAX_STOP_STRINGS = 4
GREEDY_BELOW = 1e-5  # a temperature this small is greedy decoding (as in vLLM); dividing by it would overflow


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:  # noqa: A002 (OpenAI's field name)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,  # noqa: A002
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------- request bodies


class _Body(BaseModel):
    # strict: "16" is not a number and true is not 1; unknown fields (user, logit_bias, ...) are ignored
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension (vLLM's): 0 or -1 = off
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = 1
    return_token_ids: bool = False  # extension: the generated token ids in each choice


class CompletionBody(_Body):
    prompt: str | list[int]
    max_tokens: int | None = None


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
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Bytes -> a validated body, or an ApiError(400) naming the offending field."""
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [str(part) for part in first["loc"]]
        param = loc[0] if loc else None
        if first["type"] == "missing":
            raise ApiError(400, f"missing required field '{'.'.join(loc)}'", param) from None
        # a union reports each alternative; name the field and the value's problem, not pydantic's type names
        where = ".".join(p for p in loc if not any(c in p for c in "[]|") and p not in ("str", "int"))
        raise ApiError(400, f"'{where or param}': {first['msg']} (got {json.dumps(first.get('input'))[:80]})",
                       param) from None


def _reject_constant(name: str) -> float:
    raise ApiError(400, f"the request body holds {name}; numbers must be finite")


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


def check_sampling(body: _Body) -> list[str]:
    """Sampling parameters; returns the stop strings."""
    if body.n != 1:
        raise ApiError(400, f"n={body.n}: only n=1 is supported", "n")
    if body.temperature < 0:
        raise ApiError(400, f"temperature={body.temperature}: must be >= 0 (0 is greedy)", "temperature")
    if not 0 < body.top_p <= 1:
        raise ApiError(400, f"top_p={body.top_p}: must be in (0, 1]", "top_p")
    if body.top_k < -1:
        raise ApiError(400, f"top_k={body.top_k}: must be >= 0 (0 or -1 turn it off)", "top_k")
    if body.seed is not None and not 0 <= body.seed < 2 ** 64:
        raise ApiError(400, f"seed={body.seed}: must be in [0, 2**64)", "seed")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    return stop


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
            self.stopped = True
            self.text = self.text[:cut]
            self.num_tokens = next(k for k in range(1, len(self.ids) + 1)
                                   if any(s in self._decode(self.ids[:k]) for s in self.stop))
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
