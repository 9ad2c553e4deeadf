"""eyas.models.fused: the decoder layers in one C call compute what torch's layer loop does, give a verified token (and
a prompt token, prefilled in chunks) a decode step's bits at any thread count, and step aside where they do not
serve."""
from __future__ import annotations

import pytest
import torch

from eyas.models import attention, fused, load_target, panels
from eyas.models.fused import FusedLayers

DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not panels.available(torch.bfloat16), reason="no AVX512_BF16 here: torch's kernels"))]
pytestmark = pytest.mark.skipif(not panels.available() or not attention.available(), reason="no C compiler here")

TOKENS = [7, 3, 90, 12, 5, 8, 1, 44, 61, 9, 30, 2]


@pytest.fixture()
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def forward(target, tokens: list[int], start_tokens: list[int], fused: bool = True, taps=(), mask=None,
            depths: list[int] | None = None):
    """Prefill ``start_tokens``, then one forward over ``tokens`` (at these depths after them: a tree's nodes, else
    one after another); returns its (logits_BTV, taps)."""
    saved = target._fused
    target._fused = saved if fused else None
    try:
        cache = target.new_cache(1, 128)
        with torch.inference_mode():
            if start_tokens:
                target(torch.tensor([start_tokens]), torch.arange(len(start_tokens))[None], cache)
            depths = depths if depths is not None else list(range(len(tokens)))
            positions_BT = len(start_tokens) + torch.tensor([depths])
            return target(torch.tensor([tokens]), positions_BT, cache, mask=mask, taps=taps)
    finally:
        target._fused = saved


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_layers_compute_what_the_layer_loop_does(random_checkpoint, dtype):
    target = load_target(random_checkpoint, dtype=dtype)
    assert target._fused is not None
    taps = (0, 1, 2, target.config.num_layers)
    ours, our_taps = forward(target, TOKENS[4:], TOKENS[:4], taps=taps)
    theirs, their_taps = forward(target, TOKENS[4:], TOKENS[:4], fused=False, taps=taps)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(ours.float(), theirs.float(), **tolerance)
    assert sorted(our_taps) == sorted(taps)
    for tap in taps:
        torch.testing.assert_close(our_taps[tap].float(), their_taps[tap].float(), **tolerance)
    assert torch.equal(our_taps[0], their_taps[0])  # the embedding


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_a_verified_token_gets_a_decode_steps_bits(random_checkpoint, threads, dtype, num_threads):
    threads(num_threads)
    target = load_target(random_checkpoint, dtype=dtype)
    assert target.verify_is_exact(len(TOKENS))
    prefix, new = TOKENS[:3], TOKENS[3:]
    decoded = [forward(target, [token], prefix + new[:i])[0][0, 0] for i, token in enumerate(new)]
    verified_TV = forward(target, new, prefix)[0][0]
    for i, logits_V in enumerate(decoded):
        assert torch.equal(verified_TV[i], logits_V), f"token {i}"
    # a tree: nodes 0 -> 1 and 0 -> 2 (2 does not see 1) verify like the paths they stand for
    mask_TT = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    tree_TV = forward(target, new[:3], prefix, mask=mask_TT, depths=[0, 1, 1])[0][0]
    assert torch.equal(tree_TV[1], forward(target, new[:2], prefix)[0][0, 1])
    assert torch.equal(tree_TV[2], forward(target, [new[0], new[2]], prefix)[0][0, 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_thread_count_does_not_change_the_bits(random_checkpoint, threads, dtype):
    target = load_target(random_checkpoint, dtype=dtype)
    by_threads = []
    for num_threads in (1, 2, 3):
        threads(num_threads)
        by_threads.append(forward(target, TOKENS[5:], TOKENS[:5])[0])
    assert all(torch.equal(logits, by_threads[0]) for logits in by_threads[1:])


def test_a_long_prefill_is_chunked_only_where_the_kernels_thread_count_adapts(monkeypatch):
    num_tokens = panels.MAX_ROWS + 6
    monkeypatch.setattr(fused, "kernels_adapt", lambda: False)  # a fixed count: torch's prefill is the faster
    with torch.inference_mode():
        assert FusedLayers.chunk(1, num_tokens, None) == num_tokens
    monkeypatch.setattr(fused, "kernels_adapt", lambda: True)  # the governor may give the kernels more cores
    assert FusedLayers.chunk(1, num_tokens, None) == num_tokens  # gradients wanted: torch's layers
    with torch.inference_mode():
        assert FusedLayers.chunk(1, num_tokens, None) == panels.MAX_ROWS


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_long_prefill_runs_fused_in_chunks_and_gives_a_decode_steps_bits(random_checkpoint, monkeypatch, dtype):
    monkeypatch.setattr(fused, "kernels_adapt", lambda: True)
    target = load_target(random_checkpoint, dtype=dtype)
    num_tokens = panels.MAX_ROWS + 6
    tokens = [(7 * i + 3) % target.config.vocab_size for i in range(num_tokens)]
    with torch.inference_mode():
        assert FusedLayers.chunk(1, num_tokens, None) == panels.MAX_ROWS  # two passes: 64 rows, then 6
        assert FusedLayers.chunk(2, num_tokens, None) == panels.MAX_ROWS // 2  # a batch's rows count together
        assert FusedLayers.chunk(1, panels.MAX_ROWS, None) == panels.MAX_ROWS  # short enough: one pass
    taps = (0, 2, target.config.num_layers)
    logits_TV, prompt_taps = forward(target, tokens, [], taps=taps)
    logits_TV = logits_TV[0]
    assert {tap: tuple(h.shape) for tap, h in prompt_taps.items()} == {
        tap: (1, num_tokens, target.config.hidden_size) for tap in taps}
    for i in (num_tokens - 1, panels.MAX_ROWS, 9):  # after a chunked prefill, at the chunk border, after a short one
        assert torch.equal(forward(target, [tokens[i]], tokens[:i])[0][0, 0], logits_TV[i]), f"token {i}"
    theirs_TV = forward(target, tokens, [], fused=False)[0][0]  # torch's layer loop, in one pass
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(logits_TV.float(), theirs_TV.float(), **tolerance)


def test_the_layer_loop_serves_gradients_long_masked_inputs_and_unfused_targets(random_checkpoint, monkeypatch):
    target = load_target(random_checkpoint)
    calls = []
    monkeypatch.setattr(FusedLayers, "__call__", lambda self, *a: calls.append(1) or pytest.fail("fused"))
    monkeypatch.setattr(fused, "kernels_adapt", lambda: True)
    many = torch.zeros(1, panels.MAX_ROWS + 1, dtype=torch.long)
    mask_TT = torch.ones(many.shape[1], many.shape[1], dtype=torch.bool).tril()
    with torch.inference_mode():
        assert FusedLayers.chunk(1, many.shape[1], mask_TT) == many.shape[1]  # a mask: one pass, torch's layers
        target(many, torch.arange(many.shape[1])[None], target.new_cache(1, 128), mask=mask_TT)
    target(torch.tensor([[1, 2]]), torch.arange(2)[None], target.new_cache(1, 8))  # grad mode: training
    assert not calls
    unfused = load_target(random_checkpoint)
    unfused.layers[0].self_attn.fused_qkv = None
    assert FusedLayers.build(unfused) is None
    assert FusedLayers.build(load_target(random_checkpoint, dtype=torch.float16)) is None
