"""A real client no one here wrote: lm-evaluation-harness's ``local-completions`` model against the HTTP layer on
loopback (uvicorn in a thread over an in-process engine with n-gram speculation: seconds, where a Ray Serve
deployment would take a minute), on the four-document tasks in lm_eval_tasks/. Its loglikelihoods (echo + logprobs
over token ids, batched as lists of prompts) equal eyas's own scores of the same tokens from one target forward, its
is_greedy flags equal the target's argmax, and its generate_until answers equal eyas's greedy decoding cut at the
task's stop string."""
from __future__ import annotations

import json
import math
from pathlib import Path

import lm_eval
import pytest
import torch
from lm_eval.tasks import TaskManager

from eyas.decoding.generate import generate
from eyas.models import load_target, load_tokenizer
from serving_loopback import MODEL, serve_locally

TASKS = Path(__file__).parent / "lm_eval_tasks"
ATOL = 1e-4  # a tree forward and a plain forward round differently in float32

pytestmark = pytest.mark.timeout(300)


def own_scores(target, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
    """eyas's loglikelihood of the continuation after the context, and whether it is the target's greedy choice."""
    ids = context_ids + continuation_ids
    logits_TV, _ = target(torch.tensor([ids]), torch.arange(len(ids))[None], target.new_cache(1, len(ids)))
    logprobs_TV = logits_TV[0, len(context_ids) - 1:-1].log_softmax(-1)
    chosen = logprobs_TV.gather(1, torch.tensor(continuation_ids)[:, None])[:, 0]
    return chosen.sum().item(), bool((logprobs_TV.argmax(-1) == torch.tensor(continuation_ids)).all())


def test_lm_eval_scores_and_generations_equal_eyas(random_checkpoint, monkeypatch, tmp_path):
    target, tokenizer = load_target(random_checkpoint), load_tokenizer(random_checkpoint)
    # the tasks read docs.jsonl from the working directory: the task's four documents, and a fifth whose first
    # choice is this target's own greedy continuation (its is_greedy is true)
    fifth = _greedy_doc(target, tokenizer)
    (tmp_path / "docs.jsonl").write_text((TASKS / "docs.jsonl").read_text() + json.dumps(fifth) + "\n")
    monkeypatch.chdir(tmp_path)
    with serve_locally(random_checkpoint, capacity=2, max_waiting=2) as server:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": MODEL, "base_url": f"{server.url}/v1/completions",
                        "tokenizer": str(random_checkpoint), "tokenizer_backend": "huggingface",
                        "tokenized_requests": True, "batch_size": 2, "max_length": 256, "max_retries": 1,
                        "timeout": 60},
            tasks=["eyas_micro_loglikelihood", "eyas_micro_generate"],
            task_manager=TaskManager(include_path=str(TASKS)), log_samples=True, bootstrap_iters=0)
    loglikelihood, generated = (results["samples"][name]
                                for name in ("eyas_micro_loglikelihood", "eyas_micro_generate"))
    assert len(loglikelihood) == len(generated) == 5
    greedy_flags = []

    for sample in loglikelihood:  # one request per choice: (context, continuation) -> (loglikelihood, is_greedy)
        assert len(sample["arguments"]) == len(sample["doc"]["choices"])
        for (context, continuation), [(score, is_greedy)] in zip(_pairs(sample), sample["resps"]):
            context_ids, continuation_ids = _split(tokenizer, context, continuation)
            want_score, want_greedy = own_scores(target, context_ids, continuation_ids)
            assert math.isclose(score, want_score, abs_tol=ATOL), (context, continuation, score, want_score)
            assert is_greedy == want_greedy
            greedy_flags.append(is_greedy)
    assert greedy_flags.count(True) >= 1 and greedy_flags.count(False) >= 1
    assert {"acc,none"} <= set(results["results"]["eyas_micro_loglikelihood"])

    for sample in generated:
        context_ids = tokenizer(sample["arguments"][0][0], add_special_tokens=False).input_ids
        ids = generate(target, context_ids, 8, eos_token_ids=set(target.config.eos_token_ids)).token_ids
        want = tokenizer.decode(ids, skip_special_tokens=True).split("\n\n")[0]
        assert sample["resps"] == [[want]], (sample["arguments"][0][0], sample["resps"], want)


def _greedy_doc(target, tokenizer) -> dict:
    """A document whose first choice is the target's greedy next tokens after its context, as text that tokenizes
    back to them (a random target often emits part of a UTF-8 character, which does not)."""
    for context in ("class B:", "return", "def f(x):", "x = 1"):
        context_ids = tokenizer(context, add_special_tokens=False).input_ids
        for num_new in (3, 2, 1):
            text = tokenizer.decode(generate(target, context_ids, num_new).token_ids)
            if own_scores(target, *_split(tokenizer, context, text))[1]:
                return {"context": context, "choices": [text, " y"], "answer": 0, "target": text}
    raise AssertionError("no context whose greedy continuation tokenizes back to itself")


def _split(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The tokens lm-eval sends for a pair (its documented split, TemplateLM._encode_pair): the context's trailing
    whitespace moves to the continuation; the context's own tokens, then the rest of the whole text's."""
    kept = context.rstrip()
    context, continuation = kept, context[len(kept):] + continuation
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids):]


def _pairs(sample: dict) -> list[tuple[str, str]]:
    """A sample's loglikelihood requests as (context, continuation); lm-eval logs them as lists or as dicts."""
    pairs = []
    for argument in sample["arguments"]:
        if isinstance(argument, dict):
            argument = (argument["arg_0"], argument["arg_1"])
        pairs.append((argument[0], argument[1]))
    return pairs
