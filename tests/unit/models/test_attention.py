"""eyas.models.attention: the kernel computes attention (against torch's SDPA), a query gets the same bits alone
and among others whatever is hidden between its keys, and with it a target's verify forward gives every token the
logits of a plain decode step, in float32 and in bfloat16: so greedy speculative output is vanilla's in both
(every drafter family: tests/unit/models/test_packing.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas.models import Decoder, ModelConfig, attention, panels
from eyas.models.decoder import attend

pytestmark = pytest.mark.skipif(not attention.available(), reason="no C compiler here: torch's attention")
bf16_panels = pytest.mark.skipif(not panels.available(torch.bfloat16), reason="no AVX512_BF16 here")


def reference(q_BHTD, k_BGSD, v_BGSD, mask_B1TS, causal):
    T, S = q_BHTD.shape[2], k_BGSD.shape[2]
    if causal:
        mask_B1TS = torch.ones(T, S, dtype=torch.bool).tril(S - T)[None, None]
    return F.scaled_dot_product_attention(q_BHTD, k_BGSD, v_BGSD, attn_mask=mask_B1TS, enable_gqa=True)


@pytest.mark.parametrize("head_dim", [8, 16, 64, 72, 128])
@pytest.mark.parametrize("num_new", [1, 5, 20])  # 3 x 1 and 3 x 5 queries a kv head: keys read in rows; 60: transposed
@pytest.mark.parametrize("masking", ["mask", "none", "causal"])
def test_kernel_equals_sdpa(head_dim, num_new, masking):
    generator = torch.Generator().manual_seed(head_dim * 100 + num_new)
    B, H, G, T, S = 2, 6, 2, num_new, 37 + num_new
    q_BHTD = torch.randn(B, T, H, head_dim, generator=generator).transpose(1, 2)  # the decoder's strided view
    k_BGSD, v_BGSD = torch.randn(2, B, G, S, head_dim, generator=generator)
    mask_B1TS = None
    if masking == "mask":
        mask_B1TS = torch.rand(B, 1, T, S, generator=generator) > 0.4
        mask_B1TS[..., S - T:] |= torch.eye(T, dtype=torch.bool)  # every query sees itself
    causal = masking == "causal"
    ours = attention.attend(q_BHTD, k_BGSD, v_BGSD, mask_B1TS, causal)
    assert ours.shape == (B, H, T, head_dim)
    torch.testing.assert_close(ours, reference(q_BHTD, k_BGSD, v_BGSD, mask_B1TS, causal), atol=2e-6, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), prefix=st.integers(1, 70), parents=st.lists(st.integers(0, 30), min_size=1,
                                                                               max_size=30),
       head_dim=st.sampled_from([16, 64, 40]))
def test_a_tree_node_gets_the_bits_of_its_path_decoded_alone(seed, prefix, parents, head_dim):
    """Verify a random tree (node i's parent: an earlier node or the root) over a cached prefix, then attend each
    node alone over exactly the keys it sees (prefix, ancestors, itself: contiguous, no mask): equal bit for bit."""
    generator = torch.Generator().manual_seed(seed)
    parent = [-1] + [p % (i + 1) - 1 if i else -1 for i, p in enumerate(parents)]  # node 0 is the root
    T, H, G = len(parent), 6, 2
    S = prefix + T
    q_1HTD = torch.randn(1, H, T, head_dim, generator=generator)
    k_1GSD, v_1GSD = torch.randn(2, 1, G, S, head_dim, generator=generator)
    mask_11TS = torch.zeros(1, 1, T, S, dtype=torch.bool)
    mask_11TS[..., :prefix] = True
    paths = []
    for node in range(T):
        path, at = [], node
        while at != -1:
            path.append(at)
            at = parent[at]
        paths.append(path[::-1])
        mask_11TS[0, 0, node, [prefix + i for i in path]] = True
    together = attention.attend(q_1HTD, k_1GSD, v_1GSD, mask_11TS, False)
    for node, path in enumerate(paths):
        slots = list(range(prefix)) + [prefix + i for i in path]
        alone = attention.attend(q_1HTD[:, :, node:node + 1], k_1GSD[:, :, slots], v_1GSD[:, :, slots], None, False)
        assert torch.equal(alone[:, :, 0], together[:, :, node]), (node, path)


def test_the_decoder_uses_it_where_it_applies_and_torch_elsewhere():
    q_BHTD, k_BGSD = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 9, 16)
    assert attention.applies(q_BHTD, k_BGSD)
    assert not attention.applies(q_BHTD.requires_grad_(), k_BGSD)  # training: torch's ops have a backward
    assert not attention.applies(torch.randn(1, 4, attention.MAX_QUERIES + 1, 16), k_BGSD)  # long prefill: SDPA
    assert not attention.applies(q_BHTD.detach().double(), k_BGSD.double())
    assert not attention.supports(256) and attention.supports(128)
    v_BGSD = torch.randn(1, 2, 9, 16)
    with torch.no_grad():
        torch.testing.assert_close(attend(q_BHTD.detach(), k_BGSD, v_BGSD, None, True),
                                   reference(q_BHTD.detach(), k_BGSD, v_BGSD, None, True), atol=2e-6, rtol=1e-5)


def tree_target(dtype: torch.dtype) -> Decoder:
    config = ModelConfig(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128)
    torch.manual_seed(0)
    return Decoder(config).eval().requires_grad_(False).to(dtype).fuse()


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=bf16_panels)])
def test_a_verify_forward_gives_each_token_the_logits_of_a_decode_step(dtype):
    """Prefill, then decode a chain a, b, c one token at a time; in another cache verify a tree holding that chain
    with siblings between its nodes (root a; b and a sibling under it; c under b): the chain's logits are equal bit
    for bit. Before eyas's attention kernel the float32 logits differed in the last bits (torch's batched matmuls
    block by shape), and in bfloat16 such bits flip roundings and then greedy tokens."""
    torch.set_num_threads(1)
    target = tree_target(dtype)
    prompt_1P = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    chain = [5, 17, 33]
    with torch.no_grad():
        cache = target.new_cache(1, 64)
        target(prompt_1P, torch.arange(20)[None], cache)
        decoded = [target(torch.tensor([[token]]), torch.tensor([[20 + i]]), cache)[0][0, 0]
                   for i, token in enumerate(chain)]
        tokens = [5, 60, 17, 70, 33]  # a, sibling of b, b, a sibling of c, c
        parents = [-1, 0, 0, 2, 2]
        depth = [0, 1, 1, 2, 2]
        mask_TT = torch.eye(5, dtype=torch.bool)
        for node, parent in enumerate(parents):
            while parent != -1:
                mask_TT[node, parent] = True
                parent = parents[parent]
        cache = target.new_cache(1, 64)
        target(prompt_1P, torch.arange(20)[None], cache)
        verified, _ = target(torch.tensor([tokens]), torch.tensor([[20 + d for d in depth]]), cache, mask=mask_TT)
    assert target.verify_is_exact(len(tokens))
    for logits_V, node in zip(decoded, [0, 2, 4]):
        assert torch.equal(logits_V, verified[0, node]), node
