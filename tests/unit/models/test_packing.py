"""Packed linear weights (eyas.models.packing): the packed target computes what the plain one does, and greedy
speculative output on it equals its greedy vanilla output for every drafter family.

The small random targets of the test suite fall under PACK_MIN_ELEMENTS, so these tests pack every weight.
"""
from __future__ import annotations

import pytest
import torch

from eyas.decoding.generate import generate
from eyas.methods import SpecConfig, build_drafter
from eyas.models import load_target, load_tokenizer
from eyas.models import packing

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
def test_greedy_speculative_equals_vanilla_on_the_packed_target(random_checkpoint, packed_everywhere,
                                                                 tmp_path, method, family):
    from eyas.drafters.registry import build_model, save_drafter

    torch.set_num_threads(1)
    target = load_target(random_checkpoint)
    tokenizer = load_tokenizer(random_checkpoint)
    drafter_dir = None
    if family is not None:
        torch.manual_seed(0)
        model = build_model(family, {"num_taps": 1} if family == "dflash" else None, target,
                            token_counts_V=torch.ones(target.config.vocab_size))
        drafter_dir = str(save_drafter(model, tmp_path / family, random_checkpoint))
    spec = SpecConfig(method=method, drafter=drafter_dir)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        vanilla = generate(target, ids, 24).token_ids
        assert generate(target, ids, 24, drafter=build_drafter(target, spec)).token_ids == vanilla


def test_plain_layout_packs_nothing_and_parity_reports_both(random_checkpoint, packed_everywhere):
    from eyas.models.parity import check_checkpoint

    with packing.plain_layout():
        assert not any(all_packed(load_target(random_checkpoint)))
    assert all(all_packed(load_target(random_checkpoint)))  # the switch ends with the block
    report = check_checkpoint(random_checkpoint, num_new_tokens=8)
    assert report.passed and report.max_logit_diff <= report.atol
    assert report.max_logit_diff_packed is not None and "with packed weights" in report.summary()
