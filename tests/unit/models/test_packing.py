"""Packed linear weights (eyas.models.packing): the packed target computes what the plain one does, and greedy
speculative output on it equals its greedy vanilla output for every drafter family, in float32 and bfloat16.

The small random targets of the test suite fall under PACK_MIN_ELEMENTS, so these tests pack every weight.
"""
from __future__ import annotations

import pytest
import torch

from eyas.decoding.generate import generate
from eyas.methods import SpecConfig, build_drafter
from eyas.models import load_target, load_tokenizer
from eyas.models import attention, packing, panels

PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n", "The quick brown fox"]


@pytest.fixture()
def packed_everywhere(monkeypatch):
    monkeypatch.setattr(packing, "PACK_MIN_ELEMENTS", 0)
    if not packing.packs(torch.ones(2, 2)):
        pytest.skip("this torch has no oneDNN: nothing is packed, F.linear runs as before")


def all_packed(target) -> list[bool]:
    return [p.packed for layer in target.layers
            for p in (layer.self_attn.fused_qkv, layer.self_attn.packed_o, layer.mlp.fused_gate_up,
                      layer.mlp.packed_down)] + [target.lm_head.packed.packed]


def test_small_weights_stay_plain_and_large_ones_pack(random_checkpoint):
    assert not any(all_packed(load_target(random_checkpoint)))  # hidden 48: every weight is small
    large = torch.zeros(packing.PACK_MIN_ELEMENTS + 1, 1)
    assert packing.packs(large) == torch.backends.mkldnn.is_available()
    assert not packing.packs(large.to(torch.float16))  # CPUs have no fast float16 product: plain F.linear


def test_packed_target_matches_the_plain_one(random_checkpoint, packed_everywhere):
    packed, plain = load_target(random_checkpoint), None
    assert all(all_packed(packed))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packing, "PACK_MIN_ELEMENTS", 1 << 40)
        plain = load_target(random_checkpoint)
    assert not any(all_packed(plain))
    tokens_BT = torch.tensor([[7, 3, 90, 12, 5, 8, 1, 44]])
    positions_BT = torch.arange(8)[None]
    with torch.no_grad():
        ours, _ = packed(tokens_BT, positions_BT, packed.new_cache(1, 16))
        theirs, _ = plain(tokens_BT, positions_BT, plain.new_cache(1, 16))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method, family", [("eagle2", "eagle1"), ("eagle3", "eagle3"), ("medusa", "medusa"),
                                            ("dflash", "dflash"), ("ngram", None)])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not panels.available(torch.bfloat16) or not attention.available(), reason="no AVX512_BF16 or C compiler here"))])
def test_greedy_speculative_equals_vanilla_on_the_packed_target(random_checkpoint, packed_everywhere,
                                                                 tmp_path, method, family, dtype):
    """In bfloat16 too: where the verify forward is exact (Decoder.verify_is_exact: the panel and attention
    kernels) greedy speculative output is vanilla's token for token."""
    from eyas.drafters.registry import build_model, save_drafter

    torch.set_num_threads(1)
    target = load_target(random_checkpoint, dtype=dtype)
    tokenizer = load_tokenizer(random_checkpoint)
    drafter_dir = None
    if family is not None:
        torch.manual_seed(0)
        model = build_model(family, {"num_taps": 1} if family == "dflash" else None, target,
                            token_counts_V=torch.ones(target.config.vocab_size))
        drafter_dir = str(save_drafter(model, tmp_path / family, random_checkpoint))
    spec = SpecConfig(method=method, drafter=drafter_dir)
    if dtype == torch.bfloat16:
        assert target.verify_is_exact(build_drafter(target, spec).max_draft_nodes + 1)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        vanilla = generate(target, ids, 24).token_ids
        assert generate(target, ids, 24, drafter=build_drafter(target, spec)).token_ids == vanilla


def test_float32_one_row_products_run_on_column_major_parameters(random_checkpoint, packed_everywhere):
    """fuse_linears: in float32 the tall and square parameters become views of one contiguous [I, O] buffer per
    fused weight (no copy beside the packed one), wide ones (down_proj) stay row-major, one-row inputs multiply
    through the parameters and more rows through the packed copy, the values and names never change, and a
    .to(bfloat16) lays them out row-major again."""
    target = load_target(random_checkpoint)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packing, "PACK_MIN_ELEMENTS", 1 << 40)
        plain = load_target(random_checkpoint)
    ours, theirs = target.state_dict(), plain.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    attn = target.layers[0].self_attn
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    assert q.stride(0) == k.stride(0) == v.stride(0) == 1  # column-major
    assert q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()  # one buffer: q, k and v side by side
    fused = attn.fused_qkv
    assert fused.one_row is not None and fused.one_row.shape == (q.shape[0] + k.shape[0] + v.shape[0], q.shape[1])
    weight_OI = torch.cat([theirs["layers.0.self_attn.q_proj.weight"], theirs["layers.0.self_attn.k_proj.weight"],
                           theirs["layers.0.self_attn.v_proj.weight"]])
    for rows in (1, 3):
        x_RI = torch.randn(1, rows, weight_OI.shape[1])
        torch.testing.assert_close(fused(x_RI), torch.nn.functional.linear(x_RI, weight_OI), atol=1e-5, rtol=1e-5)
    tokens_BT = torch.tensor([[7, 3, 90, 12, 5]])
    with torch.no_grad():  # a prefill (packed), then one decode step (column-major), against the plain target
        for model in (target, plain):
            cache = model.new_cache(1, 8)
            model(tokens_BT, torch.arange(5)[None], cache)
            step_11V, _ = model(torch.tensor([[9]]), torch.tensor([[5]]), cache)
            if model is target:
                ours_11V = step_11V
    torch.testing.assert_close(ours_11V, step_11V, atol=1e-4, rtol=1e-4)
    mlp = target.layers[0].mlp  # down_proj is wide (I > O): row-major, and its one-row products run on it
    assert mlp.down_proj.weight.is_contiguous()
    assert mlp.packed_down.one_row.data_ptr() == mlp.down_proj.weight.data_ptr()
    x_1I = torch.randn(1, 1, mlp.down_proj.in_features)
    torch.testing.assert_close(mlp.packed_down(x_1I), torch.nn.functional.linear(x_1I, mlp.down_proj.weight),
                               atol=1e-5, rtol=1e-5)
    target.to(torch.bfloat16)  # bfloat16's packed kernel wins at one row too: row-major, no one-row path
    attn = target.layers[0].self_attn
    assert attn.q_proj.weight.is_contiguous() and target.lm_head.weight.is_contiguous()
    assert attn.fused_qkv.one_row is None and target.lm_head.packed.one_row is None
    assert target.layers[0].mlp.packed_down.one_row is None
    target.to(torch.float32)
    assert target.layers[0].mlp.gate_proj.weight.stride(0) == 1 and target.lm_head.packed.one_row is not None


def test_plain_layout_packs_nothing_and_parity_reports_both(random_checkpoint, packed_everywhere):
    from eyas.models.parity import check_checkpoint

    with packing.plain_layout():
        assert not any(all_packed(load_target(random_checkpoint)))
    assert all(all_packed(load_target(random_checkpoint)))  # the switch ends with the block
    report = check_checkpoint(random_checkpoint, num_new_tokens=8)
    assert report.passed and report.max_logit_diff <= report.atol
    assert report.max_logit_diff_packed is not None and "with packed weights" in report.summary()
