"""The OpenAI-style answers: the incremental detokenizer that applies stop strings, envelopes, choices, usage,
and logprobs in each route's format.

Logprobs (the engine's TokenLogprob per token, eyas.decoding.logits) are written as OpenAI writes them:

  completions  ``{"tokens": [str], "token_logprobs": [float | null], "top_logprobs": [{str: float} | null],
               "text_offset": [int]}``: ``top_logprobs`` holds the ``logprobs`` most likely tokens and the chosen one
               (up to logprobs + 1 entries, as OpenAI's); with ``echo`` the prompt's tokens come first, the first of
               them with null (nothing precedes it).
  chat         ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
               "refusal": null}``: ``top_logprobs`` holds exactly ``top_logprobs`` entries.

A token's string is ``tokenizer.decode([id])`` (special tokens included); ``bytes`` is its UTF-8, and ``text_offset``
where it starts in the choice's text: the running length of the tokens' text before it, as the text shows them
(special tokens have none). A token that splits a multi-byte character shows U+FFFD.
A logprob is finite: one below LOGPROB_FLOOR (an underflow to -inf) is written as LOGPROB_FLOOR, as vLLM does.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Iterable

from eyas.decoding.logits import TokenLogprob

LOGPROB_FLOOR = -9999.0


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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache supplied."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def choice(chat: bool, index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
           logprobs: dict[str, Any] | None = None, delta: bool = False) -> dict[str, Any]:
    if chat:
        body = {"index": index, ("delta" if delta else "message"): {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        body = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        body["token_ids"] = token_ids
    return body


def envelope(chat: bool, request_id: str, model: str, stream: bool, created: int | None = None) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    return {"id": request_id, "object": kind, "created": created or int(time.time()), "model": model}


def _finite(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf (and NaN) compare False


class LogprobsWriter:
    """One choice's logprobs in its route's format, a piece at a time (a stream's chunks, or the whole answer at
    once); it keeps the running text offset between pieces."""

    def __init__(self, tokenizer: Any, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0

    def _text(self, token_id: int, shown: bool = False) -> str:
        """The token's string; ``shown``: as the choice's text shows it (special tokens skipped)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=shown)

    def write(self, entries: Iterable[tuple[int, TokenLogprob | None]]) -> dict[str, Any]:
        """(token id, its report: None for the prompt's first token) pairs -> this route's logprobs object."""
        entries = list(entries)
        return self._chat(entries) if self.chat else self._completion(entries)

    def _completion(self, entries: list[tuple[int, TokenLogprob | None]]) -> dict[str, Any]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, report in entries:
            text = self._text(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(self._text(token_id, shown=True))
            if report is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top: dict[str, float] = {}
            for top_id, logprob in report.top:  # most likely first: a string two ids decode to keeps the larger
                top.setdefault(self._text(top_id), _finite(logprob))
            top.setdefault(text, _finite(report.logprob))
            out["token_logprobs"].append(_finite(report.logprob))
            out["top_logprobs"].append(top)
        return out

    def _chat(self, entries: list[tuple[int, TokenLogprob | None]]) -> dict[str, Any]:
        content = []
        for token_id, report in entries:
            assert report is not None, "chat reports no prompt tokens"
            content.append({**self._entry(token_id, report.logprob),
                            "top_logprobs": [self._entry(t, lp) for t, lp in report.top]})
        return {"content": content, "refusal": None}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8", "replace"))}
