"""DFlash2: config, the dynamic convolution (vs brute force), equality with DFlash at init, the selector's training
path against its walk, training, greedy identity, sampling that follows the target, checkpoints."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from block_testing import MASK_ID, regenerated_batch, target, train, trained, vanilla_runs  # noqa: F401 (fixtures)
from drafter_testing import assert_greedy_identity, sampled_two_token_pvalue
from eyas.config import ConfigError
from eyas.drafters.dflash import DFlashConfig, DFlashDrafter, DFlashModel
from eyas.drafters.dflash2 import DFlash2Config, DFlash2Drafter, DFlash2Model, DynamicConv, convolve
from eyas.drafters.dflash_train import block_states
from eyas.drafters.registry import build_model, load_model, save_drafter
from eyas.drafters.trees import TreeSpec
from eyas.decoding.generate import generate
from eyas.methods import load_drafter
from eyas.models.features import target_features

TINY = DFlash2Config(num_layers=2, block_size=4, num_taps=3, num_anchors=16, mask_token_id=MASK_ID,
                     selector_rank=16, selector_top_k=8)
MODEL = DFlash2Model  # what block_testing's `trained` fixture builds from TINY


# ---- configuration


def test_defaults_follow_the_reference():
    config = DFlash2Config()
    assert (config.block_size, config.conv_kernel_size, config.conv_group_size, config.selector_rank,
            config.selector_top_k, config.selector_loss_alpha) == (8, 2, 16, 256, 16, 1.0)


@pytest.mark.parametrize("field, value", [("conv_kernel_size", 0), ("conv_group_size", 0), ("selector_rank", 0),
                                          ("selector_top_k", 0), ("selector_loss_alpha", -1.0), ("block_size", 1)])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        DFlash2Config(**{field: value})


def test_model_rejects_sizes_the_target_cannot_take(target):
    with pytest.raises(ValueError, match="conv_group_size=12 must divide the target's hidden size 32"):
        DFlash2Model(replace(TINY, conv_group_size=12), target)
    with pytest.raises(ConfigError, match="selector_top_k"):
        DFlash2Model(replace(TINY, selector_top_k=65), target)


def test_weights_carry_the_reference_names(target):
    names = set(DFlash2Model(TINY, target).state_dict())
    assert {"layers.0.attention_conv.base_kernel", "layers.0.attention_conv.kernel_projection.weight",
            "layers.1.mlp_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
            "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.self_attn.q_proj.weight"} <= names
    model = DFlash2Model(TINY, target)
    conv = model.layers[0].attention_conv
    assert conv.base_kernel.shape == (2, 2, 32) and conv.kernel_projection.weight.shape == (2 * 2 * 32 // 16, 32)
    assert model.candidate_selector.successor_codebook.shape == (64, 16)


# ---- the dynamic convolution and equality with DFlash at init


def brute_force_convolve(x_BQE, kernel_BQWE, block_size):
    out = torch.zeros_like(x_BQE)
    for i in range(x_BQE.shape[1]):
        for t in range(kernel_BQWE.shape[2]):
            if i % block_size >= t:  # x[i - t] lies in the same block
                out[:, i] += kernel_BQWE[:, i, t] * x_BQE[:, i - t]
    return out


@pytest.mark.parametrize("block_size, width", [(4, 2), (3, 3), (5, 1)])
def test_convolve_equals_brute_force(block_size, width):
    g = torch.Generator().manual_seed(block_size)
    x_BQE, kernel_BQWE = torch.randn(2, 3 * block_size, 8, generator=g), torch.randn(2, 3 * block_size, width, 8,
                                                                                      generator=g)
    torch.testing.assert_close(convolve(x_BQE, kernel_BQWE, block_size),
                               brute_force_convolve(x_BQE, kernel_BQWE, block_size))


def test_kernels_start_at_the_identity_and_share_offsets_per_group():
    conv = DynamicConv(32, 2, 16)
    h_BQE = torch.randn(1, 4, 32)
    k_in, k_out = conv.kernels(h_BQE)
    assert torch.equal(convolve(h_BQE, k_in, 4), h_BQE) and torch.equal(convolve(h_BQE, k_out, 4), h_BQE)
    with torch.no_grad():
        conv.kernel_projection.weight.normal_()
    k_in, _ = conv.kernels(h_BQE)
    assert torch.equal(k_in[..., :16], k_in[..., :1].expand_as(k_in[..., :16]))  # one offset per 16 channels
    assert not torch.equal(k_in[..., 0], k_in[..., 16])


def test_at_init_dflash2_equals_dflash(target):
    """Identity kernels, zero kernel projections and a zero successor codebook: with DFlash's weights a fresh
    DFlash2 computes DFlash's block states exactly, drafts its tokens, and with alpha = 0 has its loss."""
    dflash_config = DFlashConfig(num_layers=2, block_size=4, num_taps=3, loss_decay=4.0, num_anchors=16,
                                 mask_token_id=MASK_ID)
    torch.manual_seed(3)
    dflash = DFlashModel(dflash_config, target).eval()
    dflash2 = DFlash2Model(replace(TINY, selector_loss_alpha=0.0), target).eval()
    missing, unexpected = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and all(name.startswith(("candidate_selector.", "layers.")) and "_conv." in name
                                  or name.startswith("candidate_selector.") for name in missing)
    batch = regenerated_batch(target, num_rows=2, seed=4)
    features = target_features(target, batch.input_ids_BT, dflash.target_taps)
    anchors_BA = torch.tensor([[3, 8, 12], [5, 9, 14]])
    with torch.no_grad():
        assert torch.equal(block_states(dflash2, batch.input_ids_BT, batch.valid_BT, features.taps, anchors_BA),
                           block_states(dflash, batch.input_ids_BT, batch.valid_BT, features.taps, anchors_BA))
    assert torch.equal(dflash2.training_loss(batch, features)[0], dflash.training_loss(batch, features)[0])
    taps = {t: h[0, :10] for t, h in features.taps.items()}
    drafters = DFlashDrafter(dflash), DFlash2Drafter(dflash2)
    for drafter in drafters:
        drafter.begin([], taps)
    ids = batch.input_ids_BT[0, :11].tolist()
    assert drafters[0].propose(ids[-1], ids, 0.0, None).tokens_list == drafters[1].propose(ids[-1], ids, 0.0,
                                                                                            None).tokens_list


# ---- training


def test_loss_falls(trained):
    _, losses = trained
    assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[:3]) / 3, losses


def test_metrics(target, trained):
    model, _ = trained
    batch = regenerated_batch(target, num_rows=2, seed=5)
    features = target_features(target, batch.input_ids_BT, model.target_taps)
    loss, metrics = model.training_loss(batch, features, torch.Generator().manual_seed(0))
    assert {f"acc_{k}" for k in range(1, TINY.block_size)} <= set(metrics)
    assert float(loss) == pytest.approx(metrics["dflash_loss"] + TINY.selector_loss_alpha * metrics["selector_ce"],
                                        rel=1e-5)
    assert metrics["selector_acc"] > 0.3


def test_the_selector_walk_equals_the_training_scores(target, trained):
    """The walk's q_k (inference, predecessors drafted) = softmax of the training-path scores over the same top-C
    candidates when the sequence holds the drafted tokens after the anchor."""
    model, _ = trained
    batch = regenerated_batch(target, num_rows=1, seed=3)
    for anchor in (4, 9, 15):
        ids = batch.input_ids_BT[0, :anchor + 1].tolist()
        taps = target_features(target, torch.tensor([ids]), model.target_taps).taps
        drafter = DFlash2Drafter(model)
        drafter.begin([], {t: h[0, :anchor] for t, h in taps.items()})
        tokens, probs_KV = drafter.walk(ids[-1], 0.0, None)
        full_1T = torch.tensor([ids + tokens])
        taps = target_features(target, full_1T, model.target_taps).taps
        with torch.no_grad():
            hidden_KE = block_states(model, full_1T, torch.ones_like(full_1T), taps, torch.tensor([[anchor]]))[0, 0, 1:]
            unary_KC, index_KC = model.logits(hidden_KE).topk(TINY.selector_top_k, dim=-1)
            prev_K = full_1T[0, anchor:anchor + TINY.block_size - 1]
            scores_KC = unary_KC + model.candidate_selector.pair_scores(hidden_KE, prev_K, index_KC)
        expected_KV = torch.zeros_like(probs_KV).scatter(1, index_KC, scores_KC.float().softmax(-1))
        torch.testing.assert_close(probs_KV, expected_KV, rtol=1e-4, atol=1e-5)
        assert tokens == index_KC.gather(1, scores_KC.argmax(-1, keepdim=True))[:, 0].tolist()


# ---- the speculative loop


@pytest.mark.parametrize("depth", [None, 2])
def test_greedy_identity(target, trained, vanilla_runs, depth):
    model, _ = trained
    drafter = DFlash2Drafter(model, TreeSpec(mode="block", depth=depth))
    assert drafter.max_draft_nodes == (depth or TINY.block_size - 1)
    prompts, expected = zip(*vanilla_runs)
    assert assert_greedy_identity(target, drafter, prompts, expected) > 0


def test_tree_modes_other_than_block_are_refused(trained):
    with pytest.raises(ConfigError, match="DFlash2 drafter drafts one of"):
        DFlash2Drafter(trained[0], TreeSpec(mode="ddtree"))


def test_sampled_chain_rows_live_on_the_candidates(trained):
    model, _ = trained
    drafter = DFlash2Drafter(model)
    drafter.begin([1, 2], {t: torch.zeros(2, 32) for t in model.target_taps})
    tree = drafter.propose(5, [1, 2, 5], 0.8, torch.Generator().manual_seed(0))
    rows_KV = tree.draft_probs_NV[1:]
    assert tree.sampled and tree.num_nodes == TINY.block_size
    torch.testing.assert_close(rows_KV.sum(-1), torch.ones(TINY.block_size - 1))
    assert ((rows_KV > 0).sum(-1) <= TINY.selector_top_k).all()
    assert all(rows_KV[k, t] > 0 for k, t in enumerate(tree.tokens_list[1:]))


def test_sampled_output_follows_the_target(target, trained):
    """Lossless at T > 0 (inverse-CDF draws over the candidates, q kept); a drafter reporting other rows fails."""
    model, _ = trained
    prompt = [3, 17, 40]
    assert sampled_two_token_pvalue(target, lambda: DFlash2Drafter(model), prompt, 300) > 1e-3

    class WrongRows(DFlash2Drafter):
        def walk(self, root_token, temperature, generator):
            tokens, probs_KV = super().walk(root_token, temperature, generator)
            return tokens, probs_KV ** 4 / (probs_KV ** 4).sum(-1, keepdim=True)  # sharper than what it drew from

    assert sampled_two_token_pvalue(target, lambda: WrongRows(model), prompt, 300) < 1e-3


# ---- checkpoints


def test_save_load_roundtrip(tmp_path, target, trained):
    model, _ = trained
    directory = save_drafter(model, tmp_path / "ckpt", "tiny-target")
    loaded = load_model(directory, target)
    assert isinstance(loaded, DFlash2Model) and loaded.config == model.config
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    drafter = load_drafter(directory, target)
    assert drafter.name == "dflash2" and drafter.max_draft_nodes == TINY.block_size - 1


def test_init_from_target_keeps_the_identity_convolutions(target):
    model = build_model("dflash2", replace(TINY, init_from_target=True), target)
    source = target.layers[-1]
    assert torch.equal(model.layers[-1].mlp.up_proj.weight, source.mlp.up_proj.weight)
    assert torch.equal(model.layers[-1].mlp_conv.base_kernel[:, 0], torch.ones(2, 32))
