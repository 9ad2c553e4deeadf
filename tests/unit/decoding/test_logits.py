"""A request's adjusted logits (eyas.decoding.logits) through the engine: logit_bias and presence / frequency
penalties applied per tree node keep speculation lossless (greedy speculative output equals plain greedy output with
the same settings, for every drafter the losslessness tests cover), and the logprobs a request reports are the
target's own scores of the emitted tokens (the same numbers vanilla decoding reports), prompt tokens included."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from decoding_testing import TRAINED_METHODS, UNTRAINED_METHODS, run_collecting, spec_for
from eyas.decoding.engine import SpecEngine
from eyas.decoding.generate import generate
from eyas.decoding.logits import TokenLogprob, adjusted_logits, prompt_logprobs, token_logprobs
from eyas.decoding.requests import SequenceRequest, SpeculationSchedule
from eyas.decoding.sampling import SamplingParams
from eyas.decoding.tree import from_paths
from eyas.methods import build_drafter

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_NEW = 16
ATOL = 1e-4  # a tree forward and a one-token forward round differently in float32


# ---------------------------------------------------------------- the adjustment itself


def test_penalties_count_each_nodes_own_path():
    #  root(7) -> 1 -> 1 ; root -> 2 -> 7     generated so far: [7, 3, 3] (the root, 7, is its last token)
    tree = from_paths(7, [[1, 1], [2, 7]])
    assert tree.tokens_list == [7, 1, 2, 1, 7] and tree.parents_list == [-1, 0, 0, 1, 2]
    sampling = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((4, -3.0), (1, 2.0)))
    logits_NV = torch.randn(5, 9)
    out_NV = adjusted_logits(logits_NV, sampling, [7, 3, 3], tree)
    paths = [[], [1], [2], [1, 1], [2, 7]]
    for i, path in enumerate(paths):
        want_V = logits_NV[i].clone()
        want_V[4] -= 3.0
        want_V[1] += 2.0
        for token in set([7, 3, 3] + path):
            count = ([7, 3, 3] + path).count(token)
            want_V[token] -= 0.25 * count + 0.5
        torch.testing.assert_close(out_NV[i], want_V)
    assert adjusted_logits(logits_NV, SamplingParams(), [7], tree) is logits_NV  # nothing asked: no copy
    one_V = adjusted_logits(logits_NV[:1], sampling, [], None)  # a prefill's row: nothing generated yet
    torch.testing.assert_close(one_V[0], logits_NV[0] + torch.tensor([0, 2.0, 0, 0, -3.0, 0, 0, 0, 0]))


def test_logprob_reports_and_sampling_checks():
    logits_NV = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    [first, second] = token_logprobs(logits_NV, [0, 1], [1, 2], num_top=2)
    logprobs_NV = logits_NV.log_softmax(-1)
    assert first.logprob == pytest.approx(logprobs_NV[0, 1].item()) and [t for t, _ in first.top] == [0, 1]
    assert second.top[0] == (2, pytest.approx(logprobs_NV[1, 2].item()))
    assert token_logprobs(logits_NV, [1], [0], num_top=0) == [TokenLogprob(pytest.approx(logprobs_NV[1, 0].item()), ())]
    prompt = prompt_logprobs(logits_NV, [5, 2], SamplingParams(logit_bias=((2, 1.0),)), num_top=1)
    assert prompt[0] is None and prompt[1].logprob == pytest.approx(
        torch.tensor([2.0, 1.0, 1.0]).log_softmax(-1)[2].item())
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": float("nan")}, {"logit_bias": ((1, 101.0),)},
                {"logit_bias": ((1, 1.0), (1, 2.0))}, {"logit_bias": ((-1, 1.0),)}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ---------------------------------------------------------------- through the engine: lossless greedy

ADJUSTMENTS = st.builds(
    lambda presence, frequency, bias: SamplingParams(presence_penalty=presence, frequency_penalty=frequency,
                                                     logit_bias=tuple(bias.items())),
    st.sampled_from([0.0, -2.0, 2.0]) | st.floats(-2.0, 2.0), st.sampled_from([0.0, 2.0]) | st.floats(-2.0, 2.0),
    st.dictionaries(st.integers(0, 319), st.sampled_from([-100.0, 100.0]) | st.floats(-8.0, 8.0), max_size=4))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(method=st.sampled_from(UNTRAINED_METHODS + tuple(TRAINED_METHODS)), sampling=ADJUSTMENTS,
       prompt=st.integers(0, 4))
# negative penalties make the random target repeat itself: long accepted n-gram drafts, whose nodes' counts differ
# from their root's (a verifier that ignored the path's tokens fails these); positive ones accept almost nothing
@example(method="ngram", sampling=SamplingParams(frequency_penalty=-1.0), prompt=1)
@example(method="ngram", sampling=SamplingParams(frequency_penalty=-1.0, logit_bias=((99, 4.0),)), prompt=3)
@example(method="eagle3", sampling=SamplingParams(presence_penalty=-2.0, logit_bias=((5, 8.0),)), prompt=1)
def test_greedy_speculative_with_penalties_equals_plain_greedy(setup, random_drafters, random_draft_checkpoint,
                                                               datastore_dir, method, sampling, prompt):
    target, prompts, eos = setup
    ids = prompts[prompt]
    plain = generate(target, ids, NUM_NEW, sampling=sampling, eos_token_ids=eos).token_ids
    spec = spec_for(method, random_draft_checkpoint, datastore_dir, random_drafters)
    drafter = build_drafter(target, spec) if method != "vanilla" else None
    assert generate(target, ids, NUM_NEW, drafter=drafter, sampling=sampling, eos_token_ids=eos).token_ids == plain


def test_batched_rows_keep_their_own_settings(setup, random_drafters):
    """Rows with different penalties in one batch, under a load-adaptive schedule: each emits its plain greedy
    output under its own settings."""
    target, prompts, eos = setup
    settings_ = [SamplingParams(frequency_penalty=1.5), SamplingParams(), SamplingParams(presence_penalty=2.0,
                 logit_bias=((3, 5.0),)), SamplingParams(frequency_penalty=-1.0)]
    expected = [generate(target, prompts[i], NUM_NEW, sampling=s, eos_token_ids=eos).token_ids
                for i, s in enumerate(settings_)]
    assert expected[0] != generate(target, prompts[0], NUM_NEW, eos_token_ids=eos).token_ids
    spec = spec_for("eagle3", None, drafters=random_drafters)
    engine = SpecEngine(target, capacity=3, max_len=256, drafter_factory=lambda: build_drafter(target, spec),
                        schedule=SpeculationSchedule({1: None, 3: 2}), eos_token_ids=eos)
    done = engine.run([SequenceRequest(str(i), prompts[i], NUM_NEW, s) for i, s in enumerate(settings_)])
    assert [done[str(i)][0] for i in range(len(settings_))] == expected


# ---------------------------------------------------------------- logprobs: the target's own scores


def reference_logprobs(target, prompt: list[int], out: list[int], sampling: SamplingParams, num_top: int
                       ) -> tuple[list[TokenLogprob | None], list[TokenLogprob]]:
    """What plain decoding computes for these tokens: one causal forward over prompt + output, each position's
    row adjusted with the tokens generated before it."""
    tokens = prompt + out
    logits_TV, _ = target(torch.tensor([tokens]), torch.arange(len(tokens))[None], target.new_cache(1, len(tokens)))
    logits_TV = logits_TV[0]
    prompt_part = prompt_logprobs(logits_TV[:len(prompt)], prompt, sampling, num_top)
    out_part = []
    for k, token in enumerate(out):
        row_1V = adjusted_logits(logits_TV[len(prompt) - 1 + k][None], sampling, out[:k])
        out_part += token_logprobs(row_1V, [0], [token], num_top)
    return prompt_part, out_part


def assert_same_reports(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.logprob == pytest.approx(w.logprob, abs=ATOL)
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=ATOL)
        assert [t for t, _ in g.top] == [t for t, _ in w.top]


@pytest.mark.parametrize("method", ["vanilla", "ngram", "eagle3", "dflash"])
def test_logprobs_are_the_targets_scores_of_the_emitted_tokens(setup, random_drafters, method):
    """Greedy and seeded sampling, with and without penalties, batched: every emitted token's logprob (and top 3)
    and every prompt token's are what a plain forward over prompt + output gives, so speculation reports what
    vanilla decoding reports for the same tokens; a request that did not ask gets none."""
    target, prompts, eos = setup
    cases = [SamplingParams(), SamplingParams(frequency_penalty=0.7, logit_bias=((11, 3.0),)),
             SamplingParams(temperature=0.9, seed=5), SamplingParams(temperature=1.2, top_p=0.9, seed=6,
                                                                       presence_penalty=1.0)]
    spec = spec_for(method, None, drafters=random_drafters)
    factory = (lambda: build_drafter(target, spec)) if method != "vanilla" else None
    engine = SpecEngine(target, capacity=3, max_len=256, drafter_factory=factory, eos_token_ids=eos)
    requests = [SequenceRequest(str(i), prompts[i], NUM_NEW, s, logprobs=3, prompt_logprobs=3 if i % 2 else None)
                for i, s in enumerate(cases)]
    requests.append(SequenceRequest("silent", prompts[4], NUM_NEW))
    got = run_collecting(engine, requests)
    for i, sampling in enumerate(cases):
        entry = got[str(i)]
        assert len(entry["tokens"]) == NUM_NEW or entry["tokens"][-1] in eos
        want_prompt, want_out = reference_logprobs(target, prompts[i], entry["tokens"], sampling, 3)
        assert_same_reports(entry["logprobs"], want_out)
        if i % 2:
            assert_same_reports(entry["prompt_logprobs"], want_prompt)
        else:
            assert entry["prompt_logprobs"] is None
        if sampling.greedy:  # the emitted token is the top one
            assert all(lp.top[0][0] == token for lp, token in zip(entry["logprobs"], entry["tokens"]))
    assert got["silent"]["logprobs"] == [] and got["silent"]["prompt_logprobs"] is None
    assert got["0"]["tokens"] == generate(target, prompts[0], NUM_NEW, eos_token_ids=eos).token_ids
