"""Every parameter of the official `openai` client's ``completions.create`` and ``chat.completions.create`` against
the HTTP layer on loopback (conftest.local_server: a real engine, n-gram speculation): each one is honoured (its
effect checked, against the library's own decoding where there is a number to compare), refused with a 400 whose
``param`` and message name it, or on serving.protocol's short list of harmless fields that are accepted and change
nothing. The parameters come from the installed client's signatures, so a client release that adds one fails
``test_parameter`` until a case says what eyas does with it."""
from __future__ import annotations

import inspect
from typing import Any, Callable

import httpx
import openai
import pytest
import torch

from eyas.decoding.engine import SpecEngine
from eyas.decoding.logits import adjusted_logits
from eyas.decoding.prefixes import MIN_REUSE
from eyas.decoding.requests import SequenceRequest
from eyas.decoding.sampling import SamplingParams
from eyas.models import load_target, load_tokenizer
from serving import protocol
from serving_loopback import MODEL

PROMPT = "def add(a, b):\n    return"
OTHER = "import os\nimport sys\n"
NEW = 12
TRANSPORT = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}  # the client's, not the API's
ATOL = 1e-4  # a tree forward and a plain forward round differently in float32


def client_parameters(route: str) -> list[str]:
    from openai.resources.chat.completions import Completions as Chat
    from openai.resources.completions import Completions

    create = (Chat if route == "chat" else Completions).create
    return [name for name in inspect.signature(create).parameters if name not in TRANSPORT]


class Reference:
    """The library's own answers for the served checkpoint: plain greedy decoding and the target's scores."""

    def __init__(self, checkpoint) -> None:
        self.target = load_target(checkpoint)
        self.tokenizer = load_tokenizer(checkpoint)
        self.eos = set(self.target.config.eos_token_ids)

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def chat_ids(self, content: str) -> list[int]:
        return protocol.chat_prompt_ids(self.tokenizer, [protocol.ChatMessage(role="user", content=content)])

    def greedy(self, prompt_ids: list[int], num_new: int, sampling: SamplingParams = SamplingParams()) -> list[int]:
        engine = SpecEngine(self.target, capacity=1, max_len=256, eos_token_ids=self.eos)
        return engine.run([SequenceRequest("ref", prompt_ids, num_new, sampling)])["ref"][0]

    def scores(self, ids: list[int], sampling: SamplingParams = SamplingParams(), start: int = 1) -> list[float]:
        """log p(ids[t] | ids[:t]) for t >= start, from one forward (penalties count the tokens from ``start``)."""
        cache = self.target.new_cache(1, len(ids))
        logits_TV, _ = self.target(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
        out = []
        for t in range(start, len(ids)):
            row_1V = adjusted_logits(logits_TV[0, t - 1][None], sampling, ids[start:t])
            out.append(row_1V.log_softmax(-1)[0, ids[t]].item())
        return out


@pytest.fixture(scope="module")
def ref(random_checkpoint) -> Reference:
    return Reference(random_checkpoint)


@pytest.fixture(scope="module")
def client(local_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{local_server.url}/v1", api_key="unused", max_retries=0)


def complete(client, **kwargs) -> Any:
    return client.completions.create(**{"model": MODEL, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0,
                                        **kwargs})


def chat(client, **kwargs) -> Any:
    return client.chat.completions.create(**{"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": NEW, "temperature": 0, **kwargs})


def ids_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def assert_refused(call: Callable[[], Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.param == param and param in info.value.message, info.value.message


def refused(value: Any, accepted: Any = None) -> Callable:
    """A field eyas does not serve: ``value`` gets a 400 naming it; ``accepted`` (the value that asks for nothing,
    when there is one besides null) is served as if absent."""
    def check(create, param, ref, client):
        assert_refused(lambda: create(client, **{param: value}), param)
        if accepted is not None:
            assert same_as_plain(create(client, **{param: accepted}), create(client))
    check.kind = "refused"
    return check


def ignored(value: Any) -> Callable:
    """A harmless field (serving.protocol's documented list): accepted, and the answer is the plain one."""
    def check(create, param, ref, client):
        assert param in protocol.__doc__.split("  ignored")[1], f"{param} is not on serving.protocol's ignored list"
        assert same_as_plain(create(client, **{param: value}), create(client))
    check.kind = "ignored"
    return check


def same_as_plain(answer, plain) -> bool:
    message = getattr(answer.choices[0], "message", None)
    text = message.content if message is not None else answer.choices[0].text
    plain_message = getattr(plain.choices[0], "message", None)
    return text == (plain_message.content if plain_message is not None else plain.choices[0].text)


def honoured(check: Callable) -> Callable:
    check.kind = "honoured"
    return check


# ---------------------------------------------------------------- honoured: what each check asserts


@honoured
def model_named(create, param, ref, client):
    assert create(client).model == MODEL
    with pytest.raises(openai.NotFoundError):
        create(client, model="another-model")


@honoured
def prompt_forms(create, param, ref, client):
    one, other = complete(client, **return_token_ids(True)), complete(client, prompt=OTHER, **return_token_ids(True))
    assert ids_of(one.choices[0]) == ref.greedy(ref.ids(PROMPT), NEW)
    as_ids = complete(client, prompt=ref.ids(PROMPT), **return_token_ids(True))
    assert ids_of(as_ids.choices[0]) == ids_of(one.choices[0])
    # the same prompt again: all but its last token from the replica's prefix cache (eyas.decoding.prefixes)
    assert as_ids.usage.prompt_tokens_details.cached_tokens == len(ref.ids(PROMPT)) - 1 >= MIN_REUSE
    for prompts in ([PROMPT, OTHER], [ref.ids(PROMPT), ref.ids(OTHER)]):
        both = complete(client, prompt=prompts, **return_token_ids(True))
        assert [c.index for c in both.choices] == [0, 1]
        assert [ids_of(c) for c in both.choices] == [ids_of(one.choices[0]), ids_of(other.choices[0])]
        assert both.usage.prompt_tokens == len(ref.ids(PROMPT)) + len(ref.ids(OTHER))


def return_token_ids(flag: bool) -> dict:
    return {"extra_body": {"return_token_ids": flag}}


@honoured
def best_of_equal_to_n(create, param, ref, client):
    assert len(complete(client, n=2, best_of=2).choices) == 2
    assert_refused(lambda: complete(client, n=1, best_of=3), "best_of")


@honoured
def echo_prompt(create, param, ref, client):
    plain = complete(client)
    echoed = complete(client, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    scored = complete(client, echo=True, logprobs=1, max_tokens=0)  # the prompt alone, scored (lm-eval's way)
    logprobs = scored.choices[0].logprobs
    assert scored.choices[0].text == PROMPT and scored.usage.completion_tokens == 0
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(ref.scores(ref.ids(PROMPT)), abs=ATOL)
    # the prompt's tokens, special ones included (<|bos|>), each at its place in the text (a special token has none)
    assert "".join(logprobs.tokens) == ref.tokenizer.decode(ref.ids(PROMPT), skip_special_tokens=False)
    assert [PROMPT[offset:] for offset in logprobs.text_offset[-2:]] == [
        ref.tokenizer.decode(ref.ids(PROMPT)[-2:]), ref.tokenizer.decode(ref.ids(PROMPT)[-1:])]
    assert_refused(lambda: complete(client, max_tokens=0), "max_tokens")


def penalty(param: str, value: float) -> Callable:
    @honoured
    def check(create, param_, ref, client):
        sampling = SamplingParams(**{param: value})
        want = ref.greedy(ref.ids(PROMPT), NEW, sampling)
        assert want != ref.greedy(ref.ids(PROMPT), NEW), "the setting must change greedy output to test it"
        if create is complete:
            assert ids_of(complete(client, **{param: value}, **return_token_ids(True)).choices[0]) == want
        else:  # chat: the same setting changes the answer the same way
            want_chat = ref.greedy(ref.chat_ids("hi"), NEW, sampling)
            assert ids_of(chat(client, **{param: value}, **return_token_ids(True)).choices[0]) == want_chat
        assert_refused(lambda: create(client, **{param: 2.5}), param)
    return check


@honoured
def logit_bias_map(create, param, ref, client):
    favoured = ref.ids(" x")[-1]
    answer = create(client, logit_bias={str(favoured): 100}, **return_token_ids(True))
    assert set(ids_of(answer.choices[0])) == {favoured}
    assert_refused(lambda: create(client, logit_bias={str(ref.target.config.vocab_size): 5}), "logit_bias")
    assert_refused(lambda: create(client, logit_bias={str(favoured): 101}), "logit_bias")


@honoured
def completion_logprobs(create, param, ref, client):
    answer = complete(client, logprobs=3, **return_token_ids(True))
    ids, logprobs = ids_of(answer.choices[0]), answer.choices[0].logprobs
    prompt_ids = ref.ids(PROMPT)
    assert logprobs.token_logprobs == pytest.approx(ref.scores(prompt_ids + ids)[len(prompt_ids) - 1:], abs=ATOL)
    assert all(len(top) <= 4 and max(top.values()) == pytest.approx(lp)  # greedy: the chosen token is the top one
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    assert "".join(logprobs.tokens) == answer.choices[0].text
    streamed = list(complete(client, logprobs=3, stream=True))
    assert [lp for c in streamed if c.choices and c.choices[0].logprobs
            for lp in c.choices[0].logprobs.token_logprobs] == pytest.approx(logprobs.token_logprobs, abs=1e-6)
    assert_refused(lambda: complete(client, logprobs=6), "logprobs")


@honoured
def chat_logprobs(create, param, ref, client):
    answer = chat(client, logprobs=True, top_logprobs=2, **return_token_ids(True))
    content = answer.choices[0].logprobs.content
    assert len(content) == len(ids_of(answer.choices[0])) == answer.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
               for entry in content)
    template_ids = ref.chat_ids("hi")
    scores = ref.scores(template_ids + ids_of(answer.choices[0]))[len(template_ids) - 1:]
    assert [entry.logprob for entry in content] == pytest.approx(scores, abs=ATOL)
    assert chat(client, logprobs=False).choices[0].logprobs is None
    streamed = list(chat(client, logprobs=True, stream=True))
    assert [e.logprob for c in streamed if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content] == pytest.approx([e.logprob for e in content], abs=1e-6)
    assert_refused(lambda: chat(client, top_logprobs=2), "top_logprobs")


def token_budget(param: str) -> Callable:
    @honoured
    def check(create, param_, ref, client):
        answer = create(client, **{"max_tokens": None, param: 5})
        assert answer.usage.completion_tokens == 5 and answer.choices[0].finish_reason == "length"
        assert_refused(lambda: create(client, **{param: -1}), param)
    return check


@honoured
def n_choices(create, param, ref, client):
    greedy = create(client, n=3, **return_token_ids(True))
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({tuple(ids_of(c)) for c in greedy.choices}) == 1  # greedy: n copies
    sampled = create(client, n=3, temperature=1.0, seed=7, **return_token_ids(True))
    assert len({tuple(ids_of(c)) for c in sampled.choices}) > 1  # seed + j per choice: n samples
    assert greedy.usage.completion_tokens == sum(len(ids_of(c)) for c in greedy.choices)
    assert_refused(lambda: create(client, n=0), "n")
    assert_refused(lambda: create(client, n=5), "n")  # more than the replica holds at once (2 rows + 2 waiting)


@honoured
def seeded(create, param, ref, client):
    first, again = (create(client, temperature=1.0, seed=11, **return_token_ids(True)) for _ in range(2))
    assert ids_of(first.choices[0]) == ids_of(again.choices[0])


@honoured
def stop_strings(create, param, ref, client):
    plain = create(client)
    text = plain.choices[0].message.content if create is chat else plain.choices[0].text
    cut = text[2:4]
    assert cut, text
    stopped = create(client, stop=[cut])
    got = stopped.choices[0].message.content if create is chat else stopped.choices[0].text
    assert got == text[:text.index(cut)] and stopped.choices[0].finish_reason == "stop"


@honoured
def streamed(create, param, ref, client):
    whole = create(client, n=2, **return_token_ids(True))
    chunks = list(create(client, n=2, stream=True, **return_token_ids(True)))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert [t for c in mine for t in c.model_extra.get("token_ids") or []] == ids_of(whole.choices[index])
        assert mine[-1].finish_reason == whole.choices[index].finish_reason


@honoured
def stream_usage(create, param, ref, client):
    chunks = list(create(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == create(client).usage.completion_tokens
    assert_refused(lambda: create(client, stream=True, stream_options={"include_usage": True, "bogus": 1}),
                   "stream_options")


@honoured
def temperature_zero_is_greedy(create, param, ref, client):
    if create is complete:
        assert ids_of(complete(client, **return_token_ids(True)).choices[0]) == ref.greedy(ref.ids(PROMPT), NEW)
    assert_refused(lambda: create(client, temperature=-1), "temperature")


@honoured
def top_p_nucleus(create, param, ref, client):
    greedy = create(client, **return_token_ids(True))
    nucleus = create(client, temperature=1.0, top_p=1e-9, seed=3, **return_token_ids(True))  # the top token alone
    assert ids_of(nucleus.choices[0]) == ids_of(greedy.choices[0])
    assert_refused(lambda: create(client, top_p=0), "top_p")


@honoured
def messages_given(create, param, ref, client):
    answer = chat(client, **return_token_ids(True))
    assert ids_of(answer.choices[0]) == ref.greedy(ref.chat_ids("hi"), NEW)
    assert_refused(lambda: chat(client, messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]),
                   "messages")


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
COMMON = {"model": model_named, "frequency_penalty": penalty("frequency_penalty", -1.0),
          "presence_penalty": penalty("presence_penalty", 1.0), "logit_bias": logit_bias_map, "n": n_choices,
          "seed": seeded, "stop": stop_strings, "stream": streamed, "stream_options": stream_usage,
          "temperature": temperature_zero_is_greedy, "top_p": top_p_nucleus, "user": ignored("end-user-42")}
CASES: dict[str, dict[str, Callable]] = {
    "completions": {**COMMON, "prompt": prompt_forms, "best_of": best_of_equal_to_n, "echo": echo_prompt,
                    "logprobs": completion_logprobs, "max_tokens": token_budget("max_tokens"),
                    "suffix": refused("\n    pass", accepted="")},
    "chat": {**COMMON, "messages": messages_given, "logprobs": chat_logprobs, "top_logprobs": chat_logprobs,
             "max_tokens": token_budget("max_tokens"), "max_completion_tokens": token_budget("max_completion_tokens"),
             "audio": refused({"voice": "alloy", "format": "wav"}),
             "function_call": refused("auto", accepted="none"),
             "functions": refused([{"name": "f", "parameters": {}}], accepted=[]),
             "metadata": ignored({"run": "unit"}), "modalities": refused(["text", "audio"], accepted=["text"]),
             "moderation": refused({"model": "omni-moderation-latest"}),
             "parallel_tool_calls": refused(True),
             "prediction": refused({"type": "content", "content": "x"}),
             "prompt_cache_key": ignored("k"), "prompt_cache_options": ignored({"ttl": "30m"}),
             "prompt_cache_retention": ignored("24h"), "reasoning_effort": refused("low"),
             "response_format": refused({"type": "json_object"}, accepted={"type": "text"}),
             "safety_identifier": ignored("user-7"), "service_tier": ignored("auto"),
             "store": refused(True, accepted=False), "tool_choice": refused("auto", accepted="none"),
             "tools": refused(TOOLS, accepted=[]), "verbosity": refused("low"),
             "web_search_options": refused({})},
}


@pytest.mark.parametrize("route, param", [(route, param) for route in ("completions", "chat")
                                          for param in client_parameters(route)])
def test_parameter(route, param, ref, client):
    check = CASES[route].get(param)
    assert check is not None, (f"the openai client's {route} parameter '{param}' has no case here: honour it or "
                               "refuse it by name (serving.protocol), then say which in CASES")
    check(complete if route == "completions" else chat, param, ref, client)


def test_every_case_is_a_client_parameter():
    """No stale cases: a parameter the client dropped leaves CASES too."""
    for route in CASES:
        assert set(CASES[route]) <= set(client_parameters(route)), route


def test_refused_and_unknown_fields_are_named_over_http(local_server):
    """Raw bodies (no client in the way): an unknown field, a nested one, and a refused one."""
    for path, body, param in (
            ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 2}, "best_of"),
            ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_json": {}}, "guided_json"),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x", "name": "a"}]},
             "messages"),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "tools": TOOLS}, "tools")):
        answer = httpx.post(f"{local_server.url}{path}", json=body, timeout=30)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def test_streams_of_several_prompts_interleave_by_index_with_echo_and_logprobs(client, ref):
    prompts = [PROMPT, OTHER]
    whole = complete(client, prompt=prompts, n=2, echo=True, logprobs=1, **return_token_ids(True))
    chunks = list(complete(client, prompt=prompts, n=2, echo=True, logprobs=1, stream=True))
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert choice.text.startswith(prompts[choice.index // 2])
        token_logprobs = [lp for c in mine if c.logprobs for lp in c.logprobs.token_logprobs]
        assert token_logprobs[0] is None is choice.logprobs.token_logprobs[0]  # the prompt's first token
        assert token_logprobs[1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-6)
        offsets = [o for c in mine if c.logprobs for o in c.logprobs.text_offset]
        assert offsets == choice.logprobs.text_offset
