"""Test helpers shared by the engine's tests (conftest.py holds the fixtures built from them): the prompts, the
speculative configuration of each method the losslessness tests cover, and a step loop that keeps what every
StepOutput carried."""
from __future__ import annotations

from eyas.decoding.engine import SpecEngine
from eyas.decoding.requests import SequenceRequest
from eyas.methods import SpecConfig

PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n", "The quick brown fox", "class A:\n    def",
           "for i in range(10):\n"]
NUM_NEW = 32
# the methods whose losslessness the engine's tests check; the trained families read random_drafters[family]
UNTRAINED_METHODS = ("vanilla", "ngram", "ngram-datastore", "draft-lm")
TRAINED_METHODS = {"eagle2": "eagle1", "eagle3": "eagle3", "medusa": "medusa", "dflash": "dflash",
                   "dflash-ddtree": "dflash", "dspark": "dspark", "dflash2": "dflash2",
                   "eagle3.1": "eagle3.1", "peagle": "peagle"}


def spec_for(method: str, draft_dir, datastore_dir=None, drafters: dict | None = None) -> SpecConfig:
    if method == "ngram-datastore":  # prompt lookup + retrieval under a node budget
        return SpecConfig(method="ngram", num_nodes=4, num_draft=6, datastore=(str(datastore_dir),))
    if method in TRAINED_METHODS:
        return SpecConfig(method=method, drafter=str(drafters[TRAINED_METHODS[method]]))
    return SpecConfig(method=method, draft_model=str(draft_dir) if method == "draft-lm" else None)


def run_collecting(engine: SpecEngine, requests: list[SequenceRequest]) -> dict[str, dict]:
    """``engine.run`` that keeps every output's tokens, logprobs and prompt logprobs: {request_id: {"tokens",
    "logprobs", "prompt_logprobs", "final"}}."""
    pending = list(requests)
    got = {r.request_id: {"tokens": [], "logprobs": [], "prompt_logprobs": None, "final": None} for r in requests}
    while pending or engine.rows:
        joins, pending = pending[:engine.num_free], pending[engine.num_free:]
        for out in engine.step(joins):
            assert out.error is None, out.error
            entry = got[out.request_id]
            entry["tokens"] += out.new_token_ids
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.new_token_ids)
                entry["logprobs"] += out.logprobs
            if out.prompt_logprobs is not None:
                assert entry["prompt_logprobs"] is None, "prompt logprobs come once"
                entry["prompt_logprobs"] = out.prompt_logprobs
            if out.finished:
                entry["final"] = out
    return got


def assert_seeded_sampling_alone_equals_batched(target, prompts, eos, spec: SpecConfig) -> None:
    """Three seeded sampled requests: batched in one engine, each gets the tokens it gets alone (``generate``)."""
    from eyas.decoding.generate import SamplingParams, generate
    from eyas.methods import build_drafter

    sampling = [SamplingParams(temperature=0.8, top_p=0.9, seed=11 + i) for i in range(3)]
    expected = [generate(target, prompts[i], NUM_NEW, drafter=build_drafter(target, spec), sampling=sampling[i],
                         eos_token_ids=eos).token_ids for i in range(3)]
    engine = SpecEngine(target, capacity=3, max_len=256, drafter_factory=lambda: build_drafter(target, spec),
                        eos_token_ids=eos)
    done = engine.run([SequenceRequest(str(i), prompts[i], NUM_NEW, sampling[i]) for i in range(3)])
    assert [done[str(i)][0] for i in range(3)] == expected
