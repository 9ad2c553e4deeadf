"""DFlash: taps, anchors, the anchor/block mask (vs brute force), training, greedy identity, sampling, checkpoints."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from block_testing import (MASK_ID, VOCAB, regenerated_batch, target, tiny_target, train, trained,  # noqa: F401
                           vanilla_runs)  # the fixtures: target, trained, vanilla_runs
from eyas.config import ConfigError
from eyas.drafters.dflash import DFlashConfig, DFlashDrafter, DFlashModel, dflash_taps
from eyas.drafters.dflash_train import anchor_block_mask, block_logits, draw_anchors, position_weights
from eyas.drafters.registry import build_model, load_model, save_drafter
from eyas.drafters.trees import TreeSpec
from eyas.methods import load_drafter
from eyas.models.config import CheckpointError
from eyas.decoding.generate import SamplingParams, generate
from eyas.models.features import TrainBatch, target_features

TINY = DFlashConfig(num_layers=2, block_size=4, num_taps=3, loss_decay=4.0, num_anchors=16, mask_token_id=MASK_ID)
MODEL = DFlashModel  # what block_testing's `trained` fixture builds from TINY


# ---- configuration


def test_taps_follow_the_reference_spacing():
    assert dflash_taps(36, 5) == (2, 10, 18, 26, 34)  # 2nd layer .. 3rd-from-last
    assert dflash_taps(6, 3) == (2, 3, 4)
    assert dflash_taps(6, 1) == (4,)
    with pytest.raises(ValueError, match="num_taps=5"):
        dflash_taps(6, 5)


@pytest.mark.parametrize("field, value", [("num_layers", 0), ("block_size", 1), ("loss_decay", 0.0),
                                          ("num_anchors", 0), ("mask_token_id", -1)])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        DFlashConfig(**{field: value})


def test_model_rejects_mask_outside_vocab(target):
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashModel(DFlashConfig(num_taps=3, mask_token_id=VOCAB), target)


def test_target_embedding_and_head_are_not_parameters(target):
    model = DFlashModel(TINY, target)
    names = set(model.state_dict())
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
    assert all(p is not target.embed_tokens.weight and p is not target.lm_head.weight for p in model.parameters())


def test_init_from_target_copies_the_last_layers_and_passes_the_last_tap(target):
    model = build_model("dflash", replace(TINY, init_from_target=True), target)
    copied = target.layers[len(target.layers) - TINY.num_layers:]
    for layer, source in zip(model.layers, copied):
        theirs = source.state_dict()
        assert set(layer.state_dict()) == set(theirs)
        assert all(torch.equal(w, theirs[name]) for name, w in layer.state_dict().items())
        assert all(p.requires_grad for p in layer.parameters())  # copies that train, not the target's frozen ones
    taps = {t: torch.randn(5, 32) for t in model.target_taps}
    assert torch.allclose(model.fuse(taps), copied[0].input_layernorm(taps[model.target_taps[-1]]), atol=1e-6)
    assert not torch.equal(DFlashModel(TINY, target).layers[0].mlp.up_proj.weight, copied[0].mlp.up_proj.weight)


def test_init_from_target_trains_and_stays_lossless(target, vanilla_runs):
    torch.manual_seed(1)
    model = build_model("dflash", replace(TINY, init_from_target=True), target)
    losses = train(model, target, regenerated_batch(target), steps=10)
    assert losses[-1] < losses[0]
    for prompt, expected in vanilla_runs[:5]:
        assert generate(target, prompt, 40, drafter=DFlashDrafter(model.requires_grad_(False))).token_ids == expected


def test_a_checkpoint_started_from_the_target_loads_its_own_weights(tmp_path, target, monkeypatch):
    """Loading never copies the target's layers again (a tensor-parallel serving target could not give them)."""
    model = build_model("dflash", replace(TINY, init_from_target=True), target)
    train(model, target, regenerated_batch(target), steps=2)
    path = save_drafter(model, tmp_path / "ckpt", "tiny-target")
    monkeypatch.setattr(DFlashModel, "copy_target_layers", lambda self, target: pytest.fail("copied on load"))
    loaded = load_model(path, target)
    assert all(torch.equal(w, model.state_dict()[name]) for name, w in loaded.state_dict().items())


def test_init_from_target_needs_enough_target_layers(target):
    with pytest.raises(ValueError, match="init_from_target"):
        build_model("dflash", replace(TINY, num_layers=7, init_from_target=True), target)


# ---- anchors and the block mask


def brute_force_mask(anchors_BA: torch.Tensor, valid_BT: torch.Tensor, K: int) -> torch.Tensor:
    B, A = anchors_BA.shape
    T = valid_BT.shape[1]
    mask = torch.zeros(B, A * K, T + A * K, dtype=torch.bool)
    for b in range(B):
        for a in range(A):
            for j in range(K):
                q = a * K + j
                for p in range(T):
                    mask[b, q, p] = p < int(anchors_BA[b, a]) and bool(valid_BT[b, p])
                for a2 in range(A):
                    for j2 in range(K):
                        mask[b, q, T + a2 * K + j2] = a2 == a
    return mask


@pytest.mark.parametrize("seed", range(4))
def test_anchor_block_mask_equals_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, K, A = 2, 11, 3, 4
    valid_BT = torch.ones(B, T, dtype=torch.long)
    valid_BT[1, 8:] = 0
    anchors_BA = torch.stack([torch.randperm(T, generator=g)[:A].sort().values for _ in range(B)])
    anchors_BA[1, -1] = 0  # a padding anchor: no context, only its own block
    got = anchor_block_mask(anchors_BA, valid_BT, K)
    assert torch.equal(got, brute_force_mask(anchors_BA, valid_BT, K))


def test_draw_anchors_are_distinct_response_positions_and_redrawn():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 1, 1, 1, 0]])
    valid = torch.tensor([[1] * 10, [1] * 9 + [0]])
    g = torch.Generator().manual_seed(0)
    draws = [draw_anchors(loss_mask, valid, 4, g) for _ in range(6)]
    for anchors, ok in draws:
        assert anchors.shape == (2, 4)
        for b in range(2):
            chosen = anchors[b][ok[b]].tolist()
            assert chosen == sorted(set(chosen))
            assert all(loss_mask[b, a] and loss_mask[b, a + 1] and valid[b, a + 1] for a in chosen)
        assert ok[0].all() and ok[1].sum() == 2  # row 1 has only anchors 6 and 7
    assert len({tuple(a[0].tolist()) for a, _ in draws}) > 1  # redrawn on every call
    again = [draw_anchors(loss_mask, valid, 4, torch.Generator().manual_seed(0)) for _ in range(1)]
    assert torch.equal(again[0][0], draws[0][0])  # seeded


def test_position_weights_decay():
    assert torch.allclose(position_weights(16, 7.0)[:3], torch.tensor([1.0, 0.8668, 0.7515]), atol=1e-4)


# ---- training


def test_loss_falls(trained):
    _, losses = trained
    assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[:3]) / 3, losses


def test_metrics_and_loss_mask(target, trained):
    model, _ = trained
    batch = regenerated_batch(target, num_rows=2, seed=5)
    features = target_features(target, batch.input_ids_BT, model.target_taps)
    loss, metrics = model.training_loss(batch, features, torch.Generator().manual_seed(0))
    assert set(f"acc_{k}" for k in range(1, TINY.block_size)) <= set(metrics)
    accs = [metrics[f"acc_{k}"] for k in range(1, TINY.block_size)]
    assert metrics["accept_len"] == pytest.approx(accs[0] + accs[0] * accs[1] + accs[0] * accs[1] * accs[2])
    again, _ = model.training_loss(batch, features)  # eval mode: anchors from a fixed seed
    assert torch.equal(model.training_loss(batch, features)[0], again)
    empty = TrainBatch(batch.input_ids_BT, torch.zeros_like(batch.loss_mask_BT), batch.valid_BT)
    loss, metrics = model.training_loss(empty, features)
    assert float(loss) == 0.0 and metrics["num_blocks"] == 0


def test_training_blocks_match_inference(target, trained):
    """A block anchored at a in the batched training forward = the drafter after committing positions < a."""
    model, _ = trained
    batch = regenerated_batch(target, num_rows=1, seed=3)
    taps = target_features(target, batch.input_ids_BT, model.target_taps).taps
    anchors = torch.tensor([[3, 7, 12, 20]])
    with torch.no_grad():
        logits_BAkV = block_logits(model, batch.input_ids_BT, batch.valid_BT, taps, anchors)
    for i, a in enumerate(anchors[0].tolist()):
        drafter = DFlashDrafter(model)
        drafter.begin([], {t: h[0, :a] for t, h in taps.items()})
        expected = drafter.draft_logits(int(batch.input_ids_BT[0, a]))
        torch.testing.assert_close(logits_BAkV[0, i], expected, rtol=1e-4, atol=1e-4)


# ---- the speculative loop


def block_tree(mode: str, depth: int | None = None, **ddtree_settings) -> TreeSpec:
    """A block tree takes only an optional depth (default: the checkpoint's whole block); a ddtree its budget too."""
    return TreeSpec(mode=mode, depth=depth, **(ddtree_settings if mode == "ddtree" else {}))


@pytest.mark.parametrize("tree, depth", [("block", None), ("block", 2), ("ddtree", None), ("ddtree", 3)])
def test_greedy_identity(target, trained, vanilla_runs, tree, depth):
    model, _ = trained
    accepted = 0
    for prompt, expected in vanilla_runs:
        drafter = DFlashDrafter(model, block_tree(tree, depth, num_nodes=12, top_k=3))
        spec = generate(target, prompt, 40, drafter=drafter)
        assert spec.token_ids == expected
        accepted += sum(spec.stats.accepted_per_cycle)
    assert accepted > 0, "the trained drafter never got a token accepted: the accept path is untested"


def test_a_shallow_block_drafts_its_first_positions(trained):
    """tree.depth cuts the block's chain (and a ddtree's positions) to the first positions of the same forward."""
    model, _ = trained
    taps = {t: torch.zeros(2, 32) for t in model.target_taps}
    whole, short = DFlashDrafter(model), DFlashDrafter(model, block_tree("block", 2))
    ddtree = DFlashDrafter(model, block_tree("ddtree", 2, num_nodes=6, top_k=3))
    for drafter in (whole, short, ddtree):
        drafter.begin([1, 2], taps)
    logits_KV = whole.draft_logits(5)
    assert logits_KV.shape[0] == model.block_size - 1 and short.max_draft_nodes == 2
    torch.testing.assert_close(short.draft_logits(5), logits_KV[:2])
    assert short.propose(5, [1, 2, 5], 0.0, None).tokens_N.tolist() == [5, *logits_KV[:2].argmax(-1).tolist()]
    assert int(ddtree.propose(5, [1, 2, 5], 0.0, None).depth_N.max()) <= 2
    with pytest.raises(ConfigError, match="tree.depth=9: a block of block_size=4 drafts at most 3 positions"):
        DFlashDrafter(model, block_tree("block", 9))


@pytest.mark.parametrize("tree", ["block", "ddtree"])
def test_sampled_run_completes(target, trained, tree):
    model, _ = trained
    drafter = DFlashDrafter(model, block_tree(tree, num_nodes=10))
    out = generate(target, [1, 2, 3, 4], 30, drafter=drafter, sampling=SamplingParams(temperature=0.8, seed=0))
    assert len(out.token_ids) == 30 and all(0 <= t < VOCAB for t in out.token_ids)
    drafter = DFlashDrafter(model, block_tree(tree, num_nodes=10))
    drafter.begin([1, 2], {t: torch.zeros(2, 32) for t in model.target_taps})
    tree_ = drafter.propose(5, [1, 2, 5], 0.8, torch.Generator().manual_seed(0))
    assert tree_.sampled == (tree == "block") and tree_.draft_probs_NV is not None


def test_float32_drafter_on_bfloat16_target():
    target = tiny_target().to(torch.bfloat16)
    drafter = DFlashDrafter(DFlashModel(TINY, target).float(), TreeSpec(mode="ddtree", num_nodes=6))
    assert generate(target, [1, 2, 3], 12, drafter=drafter).token_ids == generate(target, [1, 2, 3], 12).token_ids


def test_propose_requires_commits(trained):
    model, _ = trained
    drafter = DFlashDrafter(model)
    drafter.begin([1, 2], {t: torch.zeros(2, 32) for t in model.target_taps})
    with pytest.raises(RuntimeError, match="commit"):
        drafter.propose(5, [1, 2, 3, 5], 0.0, None)


# ---- checkpoints


@pytest.mark.parametrize("mask_token_id", [MASK_ID, None])
def test_save_load_roundtrip(tmp_path, target, mask_token_id):
    torch.manual_seed(2)
    config = {"num_layers": 1, "block_size": 5, "num_taps": 3, "mask_token_id": mask_token_id}
    model = build_model("dflash", config, target).eval()
    directory = save_drafter(model, tmp_path / "ckpt", "tiny-target")
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in model.state_dict())
    loaded = load_model(directory, target)
    assert isinstance(loaded, DFlashModel) and loaded.config == model.config
    assert loaded.target_taps == model.target_taps
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    taps = {t: torch.randn(6, 32) for t in model.target_taps}
    a, b = DFlashDrafter(model), DFlashDrafter(loaded)
    a.begin([], taps)
    b.begin([], taps)
    assert torch.equal(a.draft_logits(3), b.draft_logits(3))

    drafter = load_drafter(directory, target, method="dflash-ddtree", tree={"top_k": 3, "num_nodes": 12})
    assert drafter.name == "dflash-ddtree" and drafter.tree == TreeSpec("ddtree", top_k=3, num_nodes=12)
    assert drafter.max_draft_nodes == 12
    block = load_drafter(directory, target)
    assert block.tree.mode == "block" and block.max_draft_nodes == 4  # block_size 5: the root + 4 drafted
    with pytest.raises(ConfigError, match="tree.mode='dynamic': a DFlash drafter drafts one of"):
        load_drafter(directory, target, tree={"mode": "dynamic"})
    with pytest.raises(ConfigError, match="measure.tree.top_k=5: does not apply to a block tree"):
        load_drafter(directory, target, tree={"top_k": 5}, where="measure.tree.")
    assert load_drafter(directory, target, tree={"depth": 3}).max_draft_nodes == 3
    (directory / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(directory, target)


# ---- a draft vocabulary


@pytest.fixture(scope="module")
def vocab_trained(target) -> DFlashModel:
    """DFlash over a 40-token draft vocabulary (of 64): the tokens the training batch predicts most."""
    from eyas.drafters.vocab import build_draft_vocab

    batch = regenerated_batch(target)
    counts_V = torch.bincount(batch.input_ids_BT[batch.loss_mask_BT.bool()], minlength=VOCAB)
    torch.manual_seed(1)
    model = DFlashModel(replace(TINY, draft_vocab_size=40), target, build_draft_vocab(counts_V, 40).tolist())
    train(model, target, batch, steps=30)
    return model.requires_grad_(False)


def test_a_draft_vocabulary_reads_those_rows_and_counts_outside_tokens_as_misses(target, vocab_trained):
    model = vocab_trained
    hidden_E = torch.randn(32)
    torch.testing.assert_close(model.logits(hidden_E), target.lm_head(hidden_E)[model.draft_vocab])
    batch = regenerated_batch(target)
    features = target_features(target, batch.input_ids_BT, model.target_taps)
    _, metrics = model.training_loss(batch, features, torch.Generator().manual_seed(0))
    assert metrics["acc_1"] > 0 and metrics["loss"] > 0
    outside = torch.tensor([t for t in range(VOCAB) if t not in model.draft_vocab])
    response_BT = batch.loss_mask_BT.bool()
    batch.input_ids_BT[response_BT] = outside[torch.arange(int(response_BT.sum())) % len(outside)]
    loss, metrics = model.training_loss(batch, features, torch.Generator().manual_seed(0))
    # every label lies outside: no slot learns one, and every slot misses
    assert float(loss) == 0.0 and metrics["num_blocks"] > 0
    assert all(metrics[f"acc_{k}"] == 0.0 for k in range(1, model.block_size))
    with pytest.raises(ValueError, match="needs a draft vocabulary"):
        DFlashModel(replace(TINY, draft_vocab_size=40), target)


@pytest.mark.parametrize("tree, depth", [("block", None), ("ddtree", None)])
def test_greedy_identity_with_a_draft_vocabulary(target, vocab_trained, vanilla_runs, tree, depth):
    accepted = 0
    for prompt, expected in vanilla_runs:
        drafter = DFlashDrafter(vocab_trained, block_tree(tree, depth, num_nodes=12, top_k=3))
        spec = generate(target, prompt, 40, drafter=drafter)
        assert spec.token_ids == expected
        accepted += sum(spec.stats.accepted_per_cycle)
    assert accepted > 0
    drafter = DFlashDrafter(vocab_trained)
    drafter.begin([1, 2], {t: torch.zeros(2, 32) for t in vocab_trained.target_taps})
    assert set(drafter.propose(5, [1, 2, 5], 0.0, None).tokens_N.tolist()[1:]) <= set(vocab_trained.draft_vocab)
    sampled = drafter.propose(5, [1, 2, 5], 0.8, torch.Generator().manual_seed(0))
    outside = [t for t in range(VOCAB) if t not in vocab_trained.draft_vocab]
    assert float(sampled.draft_probs_NV[:, outside].abs().sum()) == 0.0  # q is 0 where it can never draft


def test_a_draft_vocabulary_survives_a_checkpoint_and_is_not_exported(tmp_path, target, vocab_trained):
    from eyas.interop import dflash as dflash_interop

    loaded = load_model(save_drafter(vocab_trained, tmp_path / "ckpt", "tiny-target"), target)
    assert loaded.draft_vocab == vocab_trained.draft_vocab
    hidden_E = torch.randn(32)
    torch.testing.assert_close(loaded.logits(hidden_E), vocab_trained.logits(hidden_E))
    with pytest.raises(CheckpointError, match="draft vocabulary"):
        dflash_interop.check_exportable(vocab_trained)
