"""Draft LM: a chain of the small model's argmax tokens; its cache keeps the common prefix with the next context
(the rollback), and a draft LM equal to the target gets every drafted token accepted."""
from __future__ import annotations

import pytest
import torch

from eyas.decoding.generate import SamplingParams, generate
from eyas.drafters.draft_lm import DraftLMConfig, DraftLMDrafter
from eyas.models import Decoder, ModelConfig


@pytest.fixture(scope="module")
def target() -> Decoder:
    torch.manual_seed(0)
    model = Decoder(ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                                max_position_embeddings=128)).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def test_the_target_as_its_own_draft_lm_is_always_right(target):
    prompt = [3, 1, 4, 1, 5]
    plain = generate(target, prompt, 21).token_ids
    result = generate(target, prompt, 21, drafter=DraftLMDrafter(target, DraftLMConfig(num_draft=4)))
    assert result.token_ids == plain
    assert result.stats.accepted_per_cycle == [4] * 4 and result.stats.tau == 5.0  # 1 + 4 cycles of 5 tokens


def test_chain_is_the_draft_models_greedy_continuation(target):
    drafter = DraftLMDrafter(target, DraftLMConfig(num_draft=3))
    context = [3, 1, 4]
    tree = drafter.propose(4, context, 0.0, None)
    assert tree.tokens_list == [4] + generate(target, context, 3).token_ids and not tree.sampled
    assert drafter.fed == context + tree.tokens_list[1:3]  # the last drafted token is never fed
    drafter.propose(9, [3, 1, 9], 0.0, None)
    assert drafter.fed[:2] == [3, 1] and drafter.cache.lengths[0] == len(drafter.fed)  # common prefix kept


def test_sampled_chain_carries_q_and_room_runs_out(target):
    drafter = DraftLMDrafter(target, DraftLMConfig(num_draft=3), max_len=8)
    tree = drafter.propose(2, [1, 2], 0.7, torch.Generator().manual_seed(0))
    assert tree.sampled and tree.draft_probs_NV.shape == (4, 64)
    assert torch.allclose(tree.draft_probs_NV[1:].sum(-1), torch.ones(3))
    assert drafter.propose(2, [1] * 7, 0.0, None).tokens_list == [2]  # no room left in the context: no draft
    out = generate(target, [1, 2], 10, drafter=DraftLMDrafter(target), sampling=SamplingParams(0.7, seed=1))
    assert out.token_ids == generate(target, [1, 2], 10, drafter=DraftLMDrafter(target),
                                     sampling=SamplingParams(0.7, seed=1)).token_ids  # seeded: reproducible


def test_config_errors():
    with pytest.raises(ValueError, match="num_draft=0"):
        DraftLMConfig(num_draft=0)
