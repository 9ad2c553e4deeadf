"""The serving wire format and arguments without Ray: request validation into OpenAI-shaped 4xx errors, stop strings
in the incremental detokenizer, the chat fallback template, ServeArgs and the shipped Serve config files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from eyas.config import ConfigError
from serving.config import ServeArgs
from serving.protocol import (ApiError, ChatBody, CompletionBody, Limits, TextStream, chat_prompt_ids, check_lengths,
                              check_model, check_sampling, parse_body)

REPO = Path(__file__).resolve().parents[3]
LIMITS = Limits(model_name="m", vocab_size=100, max_len=64, tree_room=16, max_tokens_limit=40, default_max_tokens=16)


class CharTokenizer:
    """One token per character (ids = code points), no chat template."""
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def error_of(call) -> ApiError:
    with pytest.raises(ApiError) as info:
        call()
    return info.value


@pytest.mark.parametrize("raw, status, param, text", [
    (b"{oops", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    (b"\xff\xfe", 400, None, "not valid JSON"),
    (json.dumps({"prompt": "x"}).encode(), 400, "model", "missing required field 'model'"),
    (json.dumps({"model": "m"}).encode(), 400, "prompt", "missing required field 'prompt'"),
    (json.dumps({"model": "m", "prompt": "x", "max_tokens": "5"}).encode(), 400, "max_tokens", "valid integer"),
    (json.dumps({"model": "m", "prompt": "x", "max_tokens": True}).encode(), 400, "max_tokens", "valid integer"),
    (json.dumps({"model": "m", "prompt": {"a": 1}}).encode(), 400, "prompt", "'prompt'"),
    (json.dumps({"model": "m", "prompt": "x", "stream": "yes"}).encode(), 400, "stream", "boolean"),
    (b'{"model": "m", "prompt": "x", "temperature": NaN}', 400, None, "finite"),
    (b"x" * (2 << 20), 413, None, "limit"),
])
def test_parse_body_rejects_malformed_and_mistyped_bodies(raw, status, param, text):
    err = error_of(lambda: parse_body(raw, CompletionBody))
    assert (err.status, err.param) == (status, param) and text in err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_parse_body_accepts_openai_fields_and_ignores_unknown_ones():
    body = parse_body(json.dumps({"model": "m", "prompt": [1, 2], "temperature": 0, "stream": True, "user": "u",
                                  "stream_options": {"include_usage": True}}).encode(), CompletionBody)
    assert body.prompt == [1, 2] and body.temperature == 0.0 and body.stream
    chat = parse_body(json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}]}).encode(), ChatBody)
    assert chat.messages[0].text() == "hi"
    assert error_of(lambda: parse_body(b'{"model": "m", "messages": []}', ChatBody)).param == "messages"


def test_model_and_sampling_checks():
    def body(**extra):
        return CompletionBody(model="m", prompt="x", **extra)

    assert error_of(lambda: check_model(body().model_copy(update={"model": "other"}), LIMITS)).status == 404
    for extra, param in (({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                         ({"top_k": -2}, "top_k"), ({"n": 3}, "n"), ({"stop": [""]}, "stop"),
                         ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"seed": -1}, "seed"),
                         ({"seed": 2 ** 64}, "seed")):
        err = error_of(lambda: check_sampling(body(**extra)))
        assert (err.status, err.param) == (400, param)
    assert check_sampling(body(stop="\n")) == ["\n"] and check_sampling(body(top_k=-1)) == []


def test_length_checks():
    assert check_lengths([1, 2], None, LIMITS, default=16) == 16
    assert check_lengths([1] * 40, None, LIMITS) == 64 - 16 - 40  # chat: up to the context
    for ids, max_tokens, param, code in (([], 4, "prompt", None), ([1, 100], 4, "prompt", None),
                                         ([1] * 48, 4, "prompt", "context_length_exceeded"),
                                         ([1], 0, "max_tokens", None), ([1], -1, "max_tokens", None),
                                         ([1], 41, "max_tokens", None),
                                         ([1] * 30, 20, "max_tokens", "context_length_exceeded")):
        err = error_of(lambda: check_lengths(ids, max_tokens, LIMITS))
        assert (err.status, err.param, err.code) == (400, param, code), (ids[:3], max_tokens)


def test_text_stream_holds_back_possible_stop_strings_and_cuts_at_them():
    stream = TextStream(CharTokenizer(), ["END"])
    pieces = [stream.push([ord(c) for c in chunk]) for chunk in ("hello E", "N", "d wor", "ld E", "NDmore")]
    assert pieces == ["hello ", "", "ENd wor", "ld ", ""]
    assert stream.stopped and stream.text == "hello ENd world " and stream.num_tokens == len("hello ENd world END")
    plain = TextStream(CharTokenizer(), [])
    assert plain.push([104, 105]) + plain.flush() == "hi" and plain.num_tokens == 2


def test_chat_fallback_template():
    from serving.protocol import ChatMessage

    ids = chat_prompt_ids(CharTokenizer(), [ChatMessage(role="system", content="be brief"),
                                            ChatMessage(role="user", content="hi")])
    assert CharTokenizer().decode(ids) == "system: be brief\nuser: hi\nassistant:"


# ---------------------------------------------------------------- ServeArgs and the config files


def test_serve_args_merge_spec_file_and_validate(tmp_path):
    best = tmp_path / "best.yaml"
    best.write_text(yaml.safe_dump({"spec": {"method": "ngram", "num_draft": 3, "max_matches": 2},
                                    "metrics": {"tau": 2.1}}))
    args = ServeArgs.from_args({"target": "/x/tiny", "spec_file": str(best), "spec": {"num_draft": 5},
                                "speculation_by_batch": {"1": None, "4": 2}, "tensor_parallel_size": 2,
                                "worker_gpus": 1})
    assert (args.spec.method, args.spec.num_draft, args.spec.max_matches) == ("ngram", 5, 2)
    assert args.speculation_by_batch == {1: None, 4: 2} and args.served_name == "tiny"
    assert args.bundles() == [{"CPU": 0.5}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    best.write_text(yaml.safe_dump({"target": "/sweeps/target-tiny", "spec": {"method": "ngram"}, "sweep": {}}))
    assert ServeArgs.from_args({"spec_file": str(best)}).target == "/sweeps/target-tiny"  # tune.sweep's best.yaml
    with pytest.raises(ConfigError, match="args.target is missing"):
        ServeArgs.from_args({"spec": {"method": "ngram"}})
    for bad, field in (({"tensor_parallel_size": 0}, "tensor_parallel_size"), ({"spec": {"method": "nope"}},
                       "spec.method"), ({"speculation_by_batch": {2: 0}}, "speculation_by_batch"),
                       ({"bogus": 1}, "bogus"), ({"spec_file": str(tmp_path / "none.yaml")}, "spec_file"),
                       ({"device": "cuda"}, "device")):
        with pytest.raises(ConfigError, match=field):
            ServeArgs.from_args({"target": "/x", **bad})


def test_api_key_comes_from_the_environment(monkeypatch):
    args = ServeArgs.from_args({"target": "/x", "api_key_env": "EYAS_UNIT_KEY"})
    monkeypatch.delenv("EYAS_UNIT_KEY", raising=False)
    with pytest.raises(ConfigError, match="EYAS_UNIT_KEY"):
        args.api_key
    monkeypatch.setenv("EYAS_UNIT_KEY", "s3cret")
    assert args.api_key == "s3cret" and ServeArgs(target="/x").api_key is None


@pytest.mark.parametrize("name", ["tiny.yaml", "micro.yaml"])
def test_shipped_serve_configs_are_valid(name):
    config = yaml.safe_load((REPO / "serving" / "configs" / name).read_text())
    assert config["http_options"]["host"] == "127.0.0.1"
    app = config["applications"][0]
    assert app["import_path"] == "serving.app:build_app"
    args = ServeArgs.from_args(app["args"])
    assert args.max_batch_size >= 1
    deployment = app["deployments"][0]
    assert deployment["name"] == "EyasServer"
    autoscaling = deployment["autoscaling_config"]
    assert autoscaling["min_replicas"] <= autoscaling["max_replicas"]
    assert deployment["max_ongoing_requests"] >= args.max_batch_size
