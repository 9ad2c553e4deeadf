"""KV-cache rollback: after a tree forward, keep(accepted path) leaves exactly the cache of plain decoding.

Shape legend: B batch, T new tokens, N tree nodes, V vocab, L layers, H kv heads, S cache slots, D head dim.
"""
from __future__ import annotations

import random

import pytest
import torch

from eyas.models import Decoder, KVCache, ModelConfig

VOCAB = 96
CONFIGS = {
    "llama": ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=12, max_position_embeddings=128),
    # a window shorter than the prefix: cached slots must keep meaning "position = slot" after compaction
    "mistral-window": ModelConfig(model_type="mistral", vocab_size=VOCAB, hidden_size=48, intermediate_size=64,
                                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12,
                                  max_position_embeddings=128, sliding_window=8),
}
TREE_TOKENS = [5, 17, 23, 17, 40, 41, 2, 9, 60, 33]
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 4, 6]  # depths 0 1 1 2 2 2 3 3 3 4
ACCEPTED = [0, 1, 3, 6, 9]  # a root-to-leaf path that skips siblings, so keep() has to move K/V


@pytest.fixture(scope="module", params=list(CONFIGS))
def target(request) -> Decoder:
    torch.manual_seed(0)
    return Decoder(CONFIGS[request.param]).eval().requires_grad_(False)


def tree_inputs(prefix_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens_1N, positions_1N (prefix_len + depth) and the ancestor-or-self mask_NN of the fixed tree."""
    num_nodes = len(TREE_TOKENS)
    mask_NN = torch.eye(num_nodes, dtype=torch.bool)
    depth = [0] * num_nodes
    for i in range(1, num_nodes):
        mask_NN[i] |= mask_NN[TREE_PARENTS[i]]
        depth[i] = depth[TREE_PARENTS[i]] + 1
    return torch.tensor([TREE_TOKENS]), torch.tensor([depth]) + prefix_len, mask_NN


def prefill(target: Decoder, tokens: list[int], max_len: int = 64) -> tuple[KVCache, torch.Tensor]:
    cache = target.new_cache(1, max_len)
    logits_1TV, _ = target(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache)
    return cache, logits_1TV


def decode(target: Decoder, cache: KVCache, token: int) -> torch.Tensor:
    """One plain decode step at the next position; returns logits_V."""
    position = cache.lengths[0]
    logits_1TV, _ = target(torch.tensor([[token]]), torch.tensor([[position]]), cache)
    return logits_1TV[0, -1]


def random_tokens(num: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(num)]


def test_keep_accepted_path_equals_plain_decoding(target):
    prefix = random_tokens(13, seed=1)
    cache, _ = prefill(target, prefix)
    tokens_1N, positions_1N, mask_NN = tree_inputs(len(prefix))
    target(tokens_1N, positions_1N, cache, mask=mask_NN)
    assert cache.lengths == [len(prefix) + len(TREE_TOKENS)]
    cache.keep(ACCEPTED)

    reference, _ = prefill(target, prefix)
    for node in ACCEPTED:
        decode(target, reference, TREE_TOKENS[node])
    length = len(prefix) + len(ACCEPTED)
    assert cache.lengths == reference.lengths == [length]
    torch.testing.assert_close(cache.k_LBHSD[:, :, :, :length], reference.k_LBHSD[:, :, :, :length], atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(cache.v_LBHSD[:, :, :, :length], reference.v_LBHSD[:, :, :, :length], atol=1e-5,
                               rtol=1e-5)
    # a rejected branch leaves nothing behind: the next steps see exactly the plain-decoding context
    for token in (7, 8, 9):
        torch.testing.assert_close(decode(target, cache, token), decode(target, reference, token), atol=1e-5,
                                   rtol=1e-5)


def test_repeated_tree_cycles_match_plain_decoding(target):
    """Several verify cycles in a row, each keeping a different path (the generation loop's cache traffic)."""
    prefix = random_tokens(9, seed=2)
    cache, _ = prefill(target, prefix)
    reference, _ = prefill(target, prefix)
    for accepted in ([0, 2, 5], [0], [0, 1, 4, 8], [0, 1, 3, 7]):
        tokens_1N, positions_1N, mask_NN = tree_inputs(cache.lengths[0])
        tree_logits_1NV, _ = target(tokens_1N, positions_1N, cache, mask=mask_NN)
        cache.keep(accepted)
        for node in accepted:
            plain_V = decode(target, reference, TREE_TOKENS[node])
            torch.testing.assert_close(tree_logits_1NV[0, node], plain_V, atol=1e-5, rtol=1e-5)
    assert cache.lengths == reference.lengths


def test_keep_nothing_and_keep_a_tensor(target):
    prefix = random_tokens(6, seed=3)
    cache, _ = prefill(target, prefix)
    tokens_1N, positions_1N, mask_NN = tree_inputs(len(prefix))
    target(tokens_1N, positions_1N, cache, mask=mask_NN)
    cache.keep([])  # every draft rejected and no root kept: back to the prefix
    assert cache.lengths == [len(prefix)]
    target(tokens_1N, positions_1N, cache, mask=mask_NN)
    cache.keep(torch.tensor(ACCEPTED))
    assert cache.lengths == [len(prefix) + len(ACCEPTED)]


def test_keep_rejects_bad_nodes(target):
    cache, _ = prefill(target, random_tokens(4, seed=4))
    with pytest.raises(ValueError, match="new tokens"):
        cache.keep([0, 4])  # only 4 new tokens (indices 0..3) in the last forward
    with pytest.raises(ValueError, match="rows"):
        cache.keep([[0], [1]])  # two rows for a one-row cache


def test_full_cache_is_a_clear_error(target):
    cache, _ = prefill(target, random_tokens(6, seed=5), max_len=8)
    with pytest.raises(ValueError, match="KV cache full"):
        target(torch.tensor([[1, 2, 3]]), torch.tensor([[6, 7, 8]]), cache)


def test_batched_rows_at_different_lengths_match_single_rows(target):
    """Two rows (lengths 7 and 12) decoded and tree-verified together give each row's B=1 logits."""
    rows = [random_tokens(7, seed=6), random_tokens(12, seed=7)]
    width = max(len(r) for r in rows)
    padded_BT = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    cache = target.new_cache(2, 64)
    target(padded_BT, torch.arange(width).expand(2, width), cache)
    cache.keep([list(range(len(r))) for r in rows])  # drop row 0's padding: rows now differ in length
    assert cache.lengths == [7, 12]

    singles = [prefill(target, r)[0] for r in rows]
    for token_pair in ([3, 4], [50, 51]):  # plain decode steps, batched vs alone
        positions_B1 = torch.tensor([[length] for length in cache.lengths])
        logits_B1V, _ = target(torch.tensor([[t] for t in token_pair]), positions_B1, cache)
        for b in range(2):
            torch.testing.assert_close(logits_B1V[b, 0], decode(target, singles[b], token_pair[b]), atol=1e-5,
                                       rtol=1e-5)

    tokens_1N, _, mask_NN = tree_inputs(0)
    depth_N = mask_NN.sum(-1) - 1
    positions_BN = torch.stack([depth_N + length for length in cache.lengths])
    tree_logits_BNV, _ = target(tokens_1N.expand(2, -1), positions_BN, cache, mask=mask_NN)
    accepted = [[0, 2, 5], [0, 1, 4, 8]]
    cache.keep(accepted)
    for b in range(2):
        for node in accepted[b]:
            plain_V = decode(target, singles[b], TREE_TOKENS[node])
            torch.testing.assert_close(tree_logits_BNV[b, node], plain_V, atol=1e-5, rtol=1e-5)
    assert cache.lengths == [s.lengths[0] for s in singles]
    positions_B1 = torch.tensor([[length] for length in cache.lengths])
    logits_B1V, _ = target(torch.tensor([[11], [12]]), positions_B1, cache)
    for b in range(2):
        torch.testing.assert_close(logits_B1V[b, 0], decode(target, singles[b], 11 + b), atol=1e-5, rtol=1e-5)


# ---- the cache owns its rows: views, moves, growth, whole-forward appends


def filled_cache(batch_size: int = 3, max_len: int = 8, lengths: tuple[int, ...] = (5, 3, 6)) -> KVCache:
    cache = KVCache(2, batch_size, 1, max_len, 2)
    for b, length in enumerate(lengths):
        cache.k_LBHSD[:, b, :, :length] = torch.arange(length, dtype=torch.float32)[:, None] + 10 * b
        cache.v_LBHSD[:, b, :, :length] = -(torch.arange(length, dtype=torch.float32)[:, None] + 10 * b)
        cache.lengths[b] = length
    return cache


def test_rows_view_writes_land_in_the_parent():
    cache = filled_cache()
    view = cache.rows(1, 3, [3, 6])
    assert view.batch_size == 2 and view.lengths == [3, 6] and view.max_len == 8
    view.begin(1)
    view.write(0, torch.full((2, 1, 1, 2), 7.0), torch.full((2, 1, 1, 2), -7.0))
    view.finish(1)
    assert view.lengths == [4, 7]
    assert cache.k_LBHSD[0, 1, 0, 3].tolist() == [7.0, 7.0] and cache.k_LBHSD[0, 2, 0, 6].tolist() == [7.0, 7.0]
    assert cache.k_LBHSD[0, 0, 0, 5].tolist() == [0.0, 0.0]  # row 0 untouched
    with pytest.raises(ValueError, match="rows"):
        cache.rows(2, 4, [0, 0])


def test_move_row_copies_the_valid_slots():
    cache = filled_cache()
    cache.move_row(2, 0, 6)
    assert torch.equal(cache.k_LBHSD[:, 0, :, :6], cache.k_LBHSD[:, 2, :, :6])
    assert torch.equal(cache.v_LBHSD[:, 0, :, :6], cache.v_LBHSD[:, 2, :, :6])


def test_grow_and_ensure_room_keep_the_contents():
    cache = filled_cache(batch_size=1, max_len=6, lengths=(5,))
    before = cache.k_LBHSD[..., :5, :].clone()
    cache.ensure_room(1)
    assert cache.max_len == 6  # fits: nothing to do
    cache.ensure_room(2)
    assert cache.max_len == 12 and torch.equal(cache.k_LBHSD[..., :5, :], before)  # doubled
    cache.ensure_room(30, limit=20)
    assert cache.max_len == 20  # doubling stops at the limit
    with pytest.raises(ValueError, match="cannot shrink"):
        cache.grow(4)


def test_extend_appends_every_layer_at_once():
    cache = KVCache(2, 1, 1, 4, 2)
    kv = [(torch.full((1, 1, 3, 2), float(layer)), torch.full((1, 1, 3, 2), -float(layer))) for layer in range(2)]
    cache.extend(kv)
    assert cache.lengths == [3]
    views = cache.layer_views(3)
    assert [float(k.mean()) for k, _ in views] == [0.0, 1.0] and [float(v.mean()) for _, v in views] == [0.0, -1.0]
    with pytest.raises(ValueError, match="KV cache full"):
        cache.extend(kv)
