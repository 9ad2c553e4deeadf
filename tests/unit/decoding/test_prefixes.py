"""The prefix cache (eyas.decoding.prefixes): prompts that share leading tokens with an earlier prompt copy its K/V
and drafter taps instead of prefilling them, and every output stays the one the prompt gets without the cache."""
from __future__ import annotations

import pytest
import torch

from decoding_testing import NUM_NEW, spec_for
from eyas.decoding.engine import SpecEngine
from eyas.decoding.generate import generate
from eyas.decoding.prefixes import MIN_REUSE, PrefixCache, common_length
from eyas.decoding.requests import SequenceRequest
from eyas.methods import SpecConfig, build_drafter
from eyas.models import panels

pytestmark = pytest.mark.usefixtures("one_thread")


def shared_prompts(prompts: list[list[int]]) -> dict[str, list[int]]:
    """A prompt, itself again, itself extended, one sharing only its opening, and one sharing nothing."""
    base = prompts[0] + prompts[1]
    assert len(prompts[0]) >= MIN_REUSE > common_length(tuple(base), prompts[4])
    return {"first": base, "again": list(base), "longer": base + prompts[2], "opening": prompts[0] + prompts[3],
            "other": prompts[4]}


def run(engine: SpecEngine, requests: list[SequenceRequest]) -> dict[str, tuple[list[int], int | None]]:
    """Serve one request at a time (each joins after the last finished): {id: (tokens, cached prompt tokens)}."""
    got = {}
    for request in requests:
        tokens, cached = [], None
        for out in engine.step([request]):
            tokens += out.new_token_ids
            cached = out.cached_prompt_tokens
            assert out.error is None, out.error
        while engine.rows:
            for out in engine.step():
                tokens += out.new_token_ids
                assert out.cached_prompt_tokens is None, "reported once, in the first output"
        got[request.request_id] = (tokens, cached)
    return got


@pytest.mark.parametrize("method, family", [("vanilla", None), ("ngram", None), ("eagle3", "eagle3"),
                                            ("dflash", "dflash")])
@pytest.mark.parametrize("dtype_setup", ["setup", "setup_bfloat16"])
def test_prefix_cache_keeps_every_output(request, random_drafters, method, family, dtype_setup):
    """Greedy output with the cache is plain greedy decoding's, request by request, in float32 and bfloat16; each
    first output says how many prompt tokens came from the cache."""
    target, prompts, eos = request.getfixturevalue(dtype_setup)
    spec = SpecConfig(method=method, drafter=str(random_drafters[family]) if family else None)
    factory = (lambda: build_drafter(target, spec)) if method != "vanilla" else None
    named = shared_prompts(prompts)
    expected = {name: generate(target, ids, NUM_NEW, eos_token_ids=eos).token_ids for name, ids in named.items()}
    engine = SpecEngine(target, capacity=2, max_len=256, drafter_factory=factory, eos_token_ids=eos,
                        prefix_cache_tokens=1000)
    got = run(engine, [SequenceRequest(name, ids, NUM_NEW) for name, ids in named.items()])
    assert {name: tokens for name, (tokens, _) in got.items()} == expected
    base = len(named["first"])
    opening = common_length(tuple(named["first"]), named["opening"])
    assert {name: cached for name, (_, cached) in got.items()} == {
        "first": 0, "again": base - 1, "longer": base, "opening": opening, "other": 0}
    assert engine.prefixes.hits == 3
    kept = engine.prefixes.entries  # every prompt; with no taps to keep, each answer after its prompt too
    assert all(any(key[:len(ids)] == tuple(ids) for key in kept) for ids in named.values())
    assert (len(kept) > 4) == (method in ("vanilla", "ngram"))


def test_drafter_gets_the_targets_own_taps_after_a_hit(setup, random_drafters):
    """The taps a drafter begins with after a hit (the cached part and the prefilled part together) are those it
    gets without the cache, bit for bit, and the target's over the whole prompt."""
    target, prompts, eos = setup
    spec = spec_for("eagle3", None, drafters=random_drafters)
    named = shared_prompts(prompts)

    def begun_taps(prefix_cache_tokens: int) -> tuple[list[int], dict[int, torch.Tensor]]:
        begun = []

        def factory():
            drafter = build_drafter(target, spec)
            begin = drafter.begin
            drafter.begin = lambda ids, taps: (begun.append((list(ids), {l: h.clone() for l, h in taps.items()})),
                                               begin(ids, taps))[1]
            return drafter

        engine = SpecEngine(target, capacity=1, max_len=256, drafter_factory=factory,
                            prefix_cache_tokens=prefix_cache_tokens)
        run(engine, [SequenceRequest(name, named[name], 4) for name in ("first", "longer")])
        assert engine.prefixes is None or engine.prefixes.hits == 1
        return begun[1]

    ids, taps = begun_taps(1000)
    assert ids == named["longer"]
    _, plain = begun_taps(0)
    _, want = target(torch.tensor([ids]), torch.arange(len(ids))[None], target.new_cache(1, len(ids)),
                     taps=sorted(taps))
    for layer, hidden in taps.items():
        assert torch.equal(hidden, plain[layer]), f"tap {layer}"
        torch.testing.assert_close(hidden, want[layer][0], atol=1e-4, rtol=1e-4)


def test_prompt_logprobs_bypass_the_cache(setup):
    """A request for prompt logprobs needs logits over its whole prompt: it prefills everything."""
    target, prompts, eos = setup
    named = shared_prompts(prompts)
    engine = SpecEngine(target, capacity=1, max_len=256, prefix_cache_tokens=1000)
    run(engine, [SequenceRequest("first", named["first"], 4)])
    out = engine.step([SequenceRequest("scored", named["first"], 4, prompt_logprobs=0)])
    assert out[0].cached_prompt_tokens == 0 and len(out[0].prompt_logprobs) == len(named["first"])


def test_eviction_is_least_recently_used_within_the_budget(setup):
    target, prompts, _ = setup
    cache = target.new_cache(1, 256)
    prefixes = PrefixCache(max_tokens=2 * 12)
    a, b, c = ([k] * 12 for k in (5, 6, 7))

    def prefill(prompt):
        cache.reset_row(0)
        target(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)
        prefixes.store(prompt, cache, 0, {})

    prefill(a)
    prefill(b)
    assert prefixes.longest(a + [1], ())[0] == 12
    prefixes.restore(prefixes.longest(a + [1], ())[1], 12, cache, 0)  # a is now the most recently used
    prefill(c)  # evicts b
    assert list(prefixes.entries) == [tuple(a), tuple(c)] and prefixes.num_tokens == 24
    assert prefixes.longest(b + [1], ()) == (0, None)
    prefill([9] * 25)  # longer than the whole budget: not kept
    assert prefixes.num_tokens == 24
    assert prefixes.longest(a[:MIN_REUSE - 1] + [1], ()) == (0, None)  # too short to pay
    assert prefixes.longest(a, (3,)) == (0, None)  # stored without the taps a drafter needs
    with pytest.raises(ValueError, match="at least 1"):
        PrefixCache(0)


def test_restore_fills_the_row_with_the_stored_slots(setup):
    target, prompts, _ = setup
    cache = target.new_cache(2, 64)
    prompt = prompts[0] + prompts[1]
    target(torch.tensor([prompt, prompt]), torch.arange(len(prompt)).repeat(2, 1), cache)
    prefixes = PrefixCache(100)
    prefixes.store(prompt, cache.rows(0, 1, [len(prompt)]), 0, {})
    fresh = target.new_cache(1, 64)
    prefixes.restore(tuple(prompt), len(prompt) - 1, fresh, 0)
    assert fresh.lengths == [len(prompt) - 1]
    assert torch.equal(fresh.k_LBHSD[:, 0, :, :len(prompt) - 1], cache.k_LBHSD[:, 0, :, :len(prompt) - 1])
    with pytest.raises(ValueError, match="holds"):
        cache.row_slots(0, 999)


def test_long_prompts_prefill_with_decode_bits_and_reuse(setup):
    """A prompt longer than the fused kernels' rows prefills in chunks with decode bits when the cache is on (torch's
    prefill would block its products by the prompt's length), so what a request gets does not depend on what
    earlier requests left in the cache: served after its prefix, it decodes what it decodes alone."""
    target, prompts, eos = setup
    long = (prompts[0] + prompts[1]) * 3
    with torch.inference_mode():
        assert len(long) > panels.MAX_ROWS and target.prefill_is_exact(len(long), decode_bits=True)
        assert not target.prefill_is_exact(len(long))  # torch's prefill at a fixed thread count
    requests = [SequenceRequest("a", long, 8), SequenceRequest("b", long + prompts[2], 8)]

    def served(batch: list[SequenceRequest]) -> dict[str, tuple[list[int], int | None]]:
        engine = SpecEngine(target, capacity=1, max_len=512, eos_token_ids=eos, prefix_cache_tokens=2000)
        return run(engine, batch)

    together = served(requests)
    assert together["b"][1] == len(long)
    assert {r.request_id: together[r.request_id][0] for r in requests} == {
        r.request_id: served([r])[r.request_id][0] for r in requests}


@pytest.mark.parametrize("method", ["vanilla", "ngram"])
def test_a_conversations_next_turn_reuses_the_answer(setup, method):
    """A finished answer's K/V are kept: the next turn (prompt + answer + a new user turn) prefills only the new
    turn, and decodes what it decodes with nothing cached."""
    target, prompts, eos = setup
    factory = (lambda: build_drafter(target, SpecConfig(method=method))) if method != "vanilla" else None

    def engine() -> SpecEngine:
        return SpecEngine(target, capacity=2, max_len=256, drafter_factory=factory, eos_token_ids=eos,
                          prefix_cache_tokens=1000)

    serving = engine()
    answer = run(serving, [SequenceRequest("turn 1", prompts[0], 12)])["turn 1"][0]
    second = prompts[0] + answer + prompts[1]
    tokens, cached = run(serving, [SequenceRequest("turn 2", second, 8)])["turn 2"]
    assert cached >= len(prompts[0]) + len(answer) - 1  # all but the answer's last token, which no forward saw
    assert tokens == run(engine(), [SequenceRequest("turn 2", second, 8)])["turn 2"][0]


def test_answers_are_kept_only_from_decode_bit_forwards(setup, random_drafters, monkeypatch):
    """No answer is kept where a drafter reads taps (only the prompt's taps are at hand), nor after a forward whose
    bits depend on the batch; prompts still are."""
    target, prompts, eos = setup
    spec = spec_for("eagle3", None, drafters=random_drafters)
    tapped = SpecEngine(target, capacity=1, max_len=256, drafter_factory=lambda: build_drafter(target, spec),
                        eos_token_ids=eos, prefix_cache_tokens=1000)
    run(tapped, [SequenceRequest("a", prompts[0], 6)])
    assert list(tapped.prefixes.entries) == [tuple(prompts[0])]
    monkeypatch.setattr(type(target), "verify_is_exact", lambda self, num_rows: False)
    plain = SpecEngine(target, capacity=1, max_len=256, eos_token_ids=eos, prefix_cache_tokens=1000)
    run(plain, [SequenceRequest("a", prompts[0], 6)])
    assert list(plain.prefixes.entries) == [tuple(prompts[0])]
