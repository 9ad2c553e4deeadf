"""Medusa: heads start as the target's readout, the loss falls, greedy speculative output equals plain greedy output
(static tree from the heads' top-k products, and a chain), a sampled run completes."""
import pytest
import torch
from drafter_testing import assert_greedy_identity, random_prompts, regenerated_batch, tiny_target, train

from eyas.config import ConfigError
from eyas.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaModel
from eyas.drafters.trees import TreeSpec
from eyas.decoding.generate import SamplingParams, generate
from eyas.decoding.builders import EAGLE_DEFAULT


@pytest.fixture(scope="module")
def setup():
    target = tiny_target()
    torch.manual_seed(2)
    model = MedusaModel(MedusaConfig(num_heads=3), target)
    history = train(model, regenerated_batch(target), target)
    prompts = random_prompts()
    vanilla = [generate(target, prompt, 40).token_ids for prompt in prompts]
    return {"target": target, "model": model, "history": history, "prompts": prompts, "vanilla": vanilla}


def test_untrained_heads_read_like_the_target():
    target = tiny_target()
    model = MedusaModel(MedusaConfig(num_heads=2), target)
    hidden_E = torch.randn(32)
    expected_V = target.lm_head(hidden_E)
    torch.testing.assert_close(model.head_logits(hidden_E), torch.stack([expected_V, expected_V]))
    assert not any(name.startswith("lm_head") for name in model.state_dict())  # shared, frozen, not saved


def test_loss_falls(setup):
    first, last = setup["history"][0], setup["history"][-1]
    assert last["loss"] < 0.8 * first["loss"], (first, last)


@pytest.mark.parametrize("tree", [TreeSpec(mode="static"), TreeSpec(mode="chain", depth=3)],
                         ids=["static", "chain"])
def test_greedy_identity(setup, tree):
    drafter = MedusaDrafter(setup["model"], tree)
    accepted = assert_greedy_identity(setup["target"], drafter, setup["prompts"], setup["vanilla"])
    assert accepted > 0


def test_static_tree_takes_depth_d_candidates_from_head_d(setup):
    drafter = MedusaDrafter(setup["model"], TreeSpec(mode="static"))
    assert drafter.tree.shape == tuple(r for r in EAGLE_DEFAULT if len(r) <= 3)
    drafter.begin([1, 2, 3], {4: torch.randn(3, 32)})
    tree = drafter.propose(5, [1, 2, 3, 5])
    probs_KV = setup["model"].head_logits(drafter._last_state_E).softmax(-1)
    tokens, depth = tree.tokens_N.tolist(), tree.depth_N.tolist()
    for node in range(1, tree.num_nodes):
        top_tokens = probs_KV[depth[node] - 1].topk(4).indices.tolist()
        assert tokens[node] in top_tokens  # whatever the parent, a depth-d node is one of head d's top-k


def test_a_shallow_tree_reads_only_the_heads_it_reaches(setup):
    """Each head is one pass of the target's LM head: a depth-1 chain over a 3-head model runs head 1 only."""
    model = setup["model"]
    calls = []
    hooks = [head.register_forward_hook(lambda *_, k=k: calls.append(k)) for k, head in enumerate(model.heads)]
    try:
        drafter = MedusaDrafter(model, TreeSpec(mode="chain", depth=1))
        drafter.begin([1, 2, 3], {4: torch.randn(3, 32)})
        assert drafter.propose(5, [1, 2, 3, 5]).num_nodes == 2
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == [0]


def test_sampled_run_completes(setup):
    drafter = MedusaDrafter(setup["model"], TreeSpec(mode="static"))
    result = generate(setup["target"], setup["prompts"][0], 40, drafter=drafter,
                      sampling=SamplingParams(temperature=0.8, seed=0))
    assert len(result.token_ids) == 40


def test_validation(setup):
    with pytest.raises(ConfigError, match="num_heads"):
        MedusaConfig(num_heads=0)
    with pytest.raises(ConfigError, match="tree.depth"):
        MedusaDrafter(setup["model"], TreeSpec(mode="dynamic", depth=5))
