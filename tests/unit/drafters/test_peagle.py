"""P-EAGLE: the loss falls on regenerated data; training entries compute exactly what one inference pass computes;
COD sampling and its attention mask; greedy speculative output equals plain greedy output for both trees it drafts
(the chain, and a best-first tree over its K positions); sampled output follows the target's distribution;
config validation; a checkpoint round trip through the registry."""
import functools
from collections import Counter

import pytest
import torch
from drafter_testing import TARGET_CONFIG, assert_greedy_identity, random_prompts, regenerated_batch, tiny_target, train
from scipy.stats import chisquare

from eyas.config import ConfigError
from eyas.decoding.generate import SamplingParams, generate
from eyas.drafters import registry
from eyas.drafters.peagle import PEagleConfig, PEagleDrafter, PEagleModel, cod_attention_mask, cod_entries
from eyas.drafters.trees import TreeSpec
from eyas.drafters.vocab import build_draft_vocab
from eyas.models import Decoder
from eyas.models.features import target_features

TREES = {
    "block": TreeSpec(mode="block", depth=4),
    "block-whole": TreeSpec(mode="block"),
    "ddtree": TreeSpec(mode="ddtree", depth=4, top_k=3, num_nodes=10),
}


@pytest.fixture(scope="module")
def setup():
    target = tiny_target()
    batch = regenerated_batch(target)
    torch.manual_seed(2)
    counts_V = torch.bincount(batch.input_ids_BT.flatten(), minlength=64)  # a reduced vocabulary: 48 of 64
    model = PEagleModel(PEagleConfig(num_depths=5, num_layers=2, draft_vocab_size=48), target,
                        build_draft_vocab(counts_V, 48))
    history = train(model, batch, target)
    prompts = random_prompts()
    vanilla = [generate(target, prompt, 40).token_ids for prompt in prompts]
    return {"target": target, "model": model, "history": history, "prompts": prompts, "vanilla": vanilla,
            "batch": batch}


def test_loss_falls(setup):
    first, last = setup["history"][0], setup["history"][-1]
    assert last["loss"] < 0.5 * first["loss"], (first, last)
    assert all(last[f"acc_{d}"] > first[f"acc_{d}"] + 0.2 for d in range(1, 6)), (first, last)


@pytest.mark.parametrize("mode", list(TREES))
def test_greedy_identity(setup, mode):
    drafter = PEagleDrafter(setup["model"], TREES[mode])
    accepted = assert_greedy_identity(setup["target"], drafter, setup["prompts"], setup["vanilla"])
    assert accepted > 0  # the trained drafter is right sometimes: multi-token commits are exercised


def test_training_entries_compute_what_inference_drafts(setup):
    """The depth-d entry of anchor a, run among the depth-0 entries with cod_attention_mask, gives the logits one
    inference pass gives draft position d after the prefix ending at a (root = t_{a+1})."""
    model, target, ids = setup["model"], setup["target"], setup["batch"].input_ids_BT[:1]
    T, K, a = ids.shape[1], 4, 20
    features = target_features(target, ids, model.target_taps)
    taps = {layer: features.taps[layer] for layer in model.target_taps}
    anchor_1Q = torch.cat([torch.arange(T), torch.full((K - 1,), a)])[None]
    depth_1Q = torch.cat([torch.zeros(T, dtype=torch.long), torch.arange(1, K)])[None]
    mask_1QQ = cod_attention_mask(anchor_1Q, depth_1Q, torch.ones_like(anchor_1Q, dtype=torch.bool))
    tokens_1Q = torch.cat([ids[0, 1:], ids.new_zeros(1), torch.full((K - 1,), model.config.mask_token_id)])[None]
    hidden_1QE = torch.cat([model.initial_hidden(taps)[0], model.mask_state().expand(K - 1, -1)])[None]
    with torch.no_grad():
        out_1QE, _ = model.forward_pass(tokens_1Q, hidden_1QE, anchor_1Q + depth_1Q, None, mask_1QQ[:, None])
        trained_KX = model.lm_head(out_1QE[0, [a] + list(range(T, T + K - 1))])
    drafter = PEagleDrafter(model, TreeSpec(mode="block", depth=K))
    drafter.begin(ids[0, :a + 1].tolist(), {layer: h[0, :a + 1] for layer, h in taps.items()})
    torch.testing.assert_close(drafter.draft_logits(int(ids[0, a + 1])), trained_KX, atol=1e-5, rtol=1e-5)


def test_cod_keeps_the_share_of_the_previous_survivors(setup):
    batch, config = setup["batch"], PEagleConfig(num_depths=6, cod_ratio=0.7, cod_min_ratio=0.3)
    anchor_BQ, depth_BQ, real_BQ = cod_entries(batch, config, torch.Generator().manual_seed(0))
    T = batch.input_ids_BT.shape[1]
    learn_BT = batch.loss_mask_BT * batch.valid_BT
    for b in range(anchor_BQ.shape[0]):
        assert anchor_BQ[b, :T].tolist() == list(range(T)) and bool(real_BQ[b, :T].all())
        previous = {a for a in range(T) if a + 2 < T and learn_BT[b, a + 2] > 0}
        num_valid = len(previous)
        for d in range(1, 6):
            kept = set(anchor_BQ[b][(depth_BQ[b] == d) & real_BQ[b]].tolist())
            candidates = {a for a in previous if a + 2 + d < T and learn_BT[b, a + 2 + d] > 0}
            assert kept <= candidates
            assert len(kept) == min(int((num_valid - d) * max(0.7 ** d, 0.3)), len(candidates))
            previous = kept


def test_cod_attention_mask_equals_the_rule():
    anchor_1Q = torch.tensor([[0, 1, 2, 3, 1, 2, 1, 0]])
    depth_1Q = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 1]])
    real_1Q = torch.tensor([[True] * 7 + [False]])
    mask_QQ = cod_attention_mask(anchor_1Q, depth_1Q, real_1Q)[0]
    for q in range(8):
        for k in range(8):
            aq, dq, ak, dk = anchor_1Q[0, q], depth_1Q[0, q], anchor_1Q[0, k], depth_1Q[0, k]
            rule = bool(real_1Q[0, q] and real_1Q[0, k] and ((dk == 0 and ak <= aq) or (ak == aq and dk <= dq)))
            assert bool(mask_QQ[q, k]) == (rule or q == k), (q, k)


# ---- sampled output follows the target: chi-square on the first committed tokens of seeded runs -----------------

PROMPT, NUM_NEW, NUM_TRIALS = [5, 9, 2], 3, 800


@pytest.fixture(scope="module")
def soft_target():
    """A target with spread-out next-token distributions (tiny_target's are nearly one-hot), and its exact p."""
    torch.manual_seed(0)
    target = Decoder(TARGET_CONFIG).eval().requires_grad_(False)
    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)

    @functools.lru_cache(maxsize=None)
    def probs(context: tuple[int, ...]) -> torch.Tensor:
        return generate_probs(target, list(context))
    return target, probs


def generate_probs(target: Decoder, context: list[int]) -> torch.Tensor:
    cache = target.new_cache(1, len(context))
    with torch.no_grad():
        logits_1TV, _ = target(torch.tensor([context]), torch.arange(len(context))[None], cache)
    return logits_1TV[0, -1].double().softmax(-1)


@pytest.mark.parametrize("mode", ["block", "ddtree"])
def test_sampled_output_follows_the_target(soft_target, mode):
    target, probs = soft_target
    torch.manual_seed(3)
    tree = TreeSpec(mode="ddtree", depth=3, top_k=3, num_nodes=8) if mode == "ddtree" else TreeSpec(mode="block")
    drafter = PEagleDrafter(PEagleModel(PEagleConfig(num_depths=3), target), tree)
    counts: Counter = Counter()
    accepted = 0
    for seed in range(NUM_TRIALS):
        result = generate(target, PROMPT, NUM_NEW, drafter=drafter, sampling=SamplingParams(temperature=1.0, seed=seed))
        counts[tuple(result.token_ids[1:])] += 1  # the first comes from the prefill; the rest from verification
        accepted += sum(result.stats.accepted_per_cycle)
    assert accepted > 0  # some drafted tokens were accepted: the p/q path is exercised, not only the residual
    # the second token's and the third token's marginals (the first comes from the prefill); contexts under 1e-6 are
    # left out, and what they hold must not move an expected count; 64 cells each, so every cell is tested
    second_V, third_V = torch.zeros(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
    for first, p_first in enumerate(probs(tuple(PROMPT)).tolist()):
        after_V = probs(tuple(PROMPT) + (first,))
        second_V += p_first * after_V
        for second, p_second in enumerate(after_V.tolist()):
            if p_first * p_second > 1e-6:
                third_V += p_first * p_second * probs(tuple(PROMPT) + (first, second))
    assert 1 - float(third_V.sum()) < 1e-3
    for position, exact_V in ((0, second_V), (1, third_V)):
        seen = Counter(pair[position] for pair in counts.elements())
        big = [x for x in range(64) if exact_V[x] * NUM_TRIALS >= 5]
        assert len(big) >= 5, "too few testable cells: the test would have no power"
        observed = [seen[x] for x in big] + [NUM_TRIALS - sum(seen[x] for x in big)]
        wanted = [float(exact_V[x]) * NUM_TRIALS for x in big] + [NUM_TRIALS * (1 - float(exact_V[big].sum()))]
        assert chisquare(observed, wanted).pvalue > 1e-3, (position, observed, wanted)


# ---- config, vocabulary, checkpoint ---------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("num_layers", 0), ("num_depths", 0), ("cod_ratio", 0.0),
                                          ("cod_ratio", 1.5), ("cod_min_ratio", 0.0), ("mask_token_id", -1),
                                          ("noise_scale", -0.1), ("draft_vocab_size", 0)])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ConfigError, match=field):
        PEagleConfig(**{field: value})


def test_model_and_drafter_reject_what_they_cannot_run(setup):
    with pytest.raises(ConfigError, match="mask_token_id"):
        PEagleModel(PEagleConfig(mask_token_id=64), setup["target"])
    with pytest.raises(ConfigError, match="tree.depth"):
        PEagleDrafter(setup["model"], TreeSpec(mode="block", depth=6))
    with pytest.raises(ConfigError, match="tree.mode"):
        PEagleDrafter(setup["model"], TreeSpec(mode="dynamic"))


def test_embedding_is_the_targets_and_mask_hidden_is_saved(setup):
    state = setup["model"].state_dict()
    assert state["mask_hidden"].shape == (1, 1, 3 * TARGET_CONFIG.hidden_size)
    assert not any("embed" in name for name in state)
    assert "later_layers.0.self_attn.q_proj.weight" in state


def test_checkpoint_round_trip(tmp_path, setup):
    target, model = setup["target"], setup["model"]
    directory = registry.save_drafter(model, tmp_path / "peagle", "tiny")
    loaded = registry.load_model(directory, target)
    assert loaded.drafter_type == "peagle" and loaded.config == model.config and loaded.draft_vocab == model.draft_vocab
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    loaded.pack_linears()  # what eyas.methods does to a checkpoint's drafter
    drafter = PEagleDrafter(loaded, TREES["block"])
    assert assert_greedy_identity(target, drafter, setup["prompts"][:5], setup["vanilla"][:5]) > 0
